"""No silently wrong results, without a process group: degree choices that stay inside a node, the chunked loss (exact,
and never a float32 copy of the whole logits), compile-friendly local attention, length checks of the
local path, the shard's recorded length, and the CLI's short names."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sp import SequenceParallelAttention, shard_sequence
from lightning_sp.attention import default_ulysses_degree, resolve_auto_backend
from lightning_sp.cli import expand_short_names
from lightning_sp.layout import global_seq_len_of
from lightning_sp.loss import cross_entropy_sum, sequence_parallel_cross_entropy
from lightning_sp.strategy import SequenceParallelStrategy
from tests.reference import dense_attention


def _qkv(n=23, h=4, h_kv=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, hh, d, generator=g, dtype=dtype) for hh in (h, h_kv, h_kv)]


# ------------------------------------------------------------------------------ degrees and auto


def test_usp_default_degree_stays_inside_a_node_and_splits_the_heads():
    assert default_ulysses_degree(8) == 4
    assert default_ulysses_degree(8, ranks_per_node=2) == 2  # never an all-to-all across nodes
    assert default_ulysses_degree(16, ranks_per_node=8) == 8
    assert default_ulysses_degree(8, num_heads=6) == 2
    assert default_ulysses_degree(1) == 1


def test_auto_prefers_ulysses_only_inside_a_node_with_divisible_heads():
    assert resolve_auto_backend(8, 4)[0] == "ulysses"
    assert resolve_auto_backend(6, 4)[0] == "zigzag_ring"
    assert resolve_auto_backend(16, 16, ranks_per_node=8)[0] == "zigzag_ring"
    assert resolve_auto_backend(16, 8, ranks_per_node=8)[0] == "ulysses"


def test_strategy_usp_default_degree_uses_devices_per_node():
    strategy = SequenceParallelStrategy(8, backend="usp")
    L.Trainer(accelerator="cpu", devices=2, num_nodes=4, strategy=strategy, logger=False,
              enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    assert (strategy.parallel_dims.ulysses, strategy.parallel_dims.ring) == (2, 4)  # was 4 x 2: a2a across nodes


# ------------------------------------------------------------------------------ chunked cross-entropy


@pytest.mark.parametrize("chunk_elements", [7, 50, 1 << 24])
def test_chunked_cross_entropy_equals_torch_fp64(chunk_elements):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 13, 11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 13), generator=g)
    labels[0, :4] = -100
    got = cross_entropy_sum(logits, labels, chunk_elements=chunk_elements)
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="sum")
    (g_got,) = torch.autograd.grad(2.5 * got, logits)
    (g_ref,) = torch.autograd.grad(2.5 * ref, logits)
    assert abs(float(got - ref)) < 1e-12
    assert float((g_got - g_ref).abs().max()) < 1e-14
    # negative control: counting the ignored tokens changes the value
    unmasked = F.cross_entropy(logits.reshape(-1, 11), labels.clamp_min(0).reshape(-1), reduction="sum")
    assert abs(float(got - unmasked)) > 1e-3
    mean = sequence_parallel_cross_entropy(logits, labels)
    assert abs(float(mean - ref / (labels != -100).sum())) < 1e-14


class _LargeFloat32Tensors(TorchDispatchMode):
    """Records every float32 tensor of at least ``numel`` elements an op produces."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_chunked_cross_entropy_never_upcasts_the_whole_logits():
    tokens, vocab = 512, 1000
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with _LargeFloat32Tensors(tokens * vocab // 2) as mode:
        cross_entropy_sum(logits, labels, chunk_elements=tokens * vocab // 8).backward()
    assert mode.seen == [], mode.seen
    assert logits.grad.dtype == torch.bfloat16
    with _LargeFloat32Tensors(tokens * vocab // 2) as control:  # the unchunked loss does upcast it whole
        F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1)).backward()
    assert control.seen


# ------------------------------------------------------------------------------ local attention


def test_local_attention_compiles_without_graph_breaks_and_matches_eager():
    q, k, v = _qkv()
    attn = SequenceParallelAttention(causal=True)
    cu = torch.tensor([0, 9, 10, 23], dtype=torch.int32)
    for kwargs in ({}, {"cu_seqlens": cu}, {"seq_len": 20}):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda a, b, c: attn(a, b, c, **kwargs))(q, k, v)
        assert explained.graph_break_count == 0, (kwargs, explained.break_reasons)
        compiled = torch.compile(lambda a, b, c: attn(a, b, c, **kwargs), backend="eager", fullgraph=True)
        assert float((compiled(q, k, v) - attn(q, k, v, **kwargs)).abs().max()) < 1e-12


def test_local_attention_checks_lengths_and_documents():
    q, k, v = _qkv()
    attn = SequenceParallelAttention()
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 20 but the global sequence has 23 tokens"):
        attn(q, k, v, cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_len=30 must be in \[1, 23\]"):
        attn(q, k, v, seq_len=30)
    out = attn(q, k, v, seq_len=20)  # explicit padding: real tokens never see it
    assert float((out[:, :20] - dense_attention(q[:, :20], k[:, :20], v[:, :20])).abs().max()) < 1e-12


def test_attention_output_keeps_the_input_dtype_under_autocast():
    q, k, v = (t.float() for t in _qkv())
    ref = dense_attention(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = SequenceParallelAttention(causal=True)(q, k, v)
    assert out.dtype == torch.float32 and float((out - ref).abs().max()) < 2e-5


def test_shard_sequence_records_the_global_length_on_a_new_tensor():
    x = torch.randn(2, 9, 3)
    shard = shard_sequence(x, None)
    assert global_seq_len_of(shard) == 9 and shard is not x and global_seq_len_of(x) is None
    assert global_seq_len_of(shard * 1.0) is None  # a computed tensor does not carry it: pass seq_len


def test_cli_accepts_short_model_names_in_help():
    assert expand_short_names(["fit", "--model.help", "ProteinEncoder"]) == [
        "fit", "--model.help", "lightning_sp.models.ProteinEncoder"]
    assert expand_short_names(["fit", "--data.help", "my.pkg.Data"]) == ["fit", "--data.help", "my.pkg.Data"]


def test_strategy_says_what_auto_resolved_to(caplog):
    from lightning_sp import SequenceParallelContext

    strategy = SequenceParallelStrategy(2, backend="auto")
    strategy._context = SequenceParallelContext(backend="auto")
    strategy._announce_auto_backend()  # nothing resolved yet: silent
    strategy._context.resolved_backend = "ulysses"
    with caplog.at_level("INFO"):
        strategy._announce_auto_backend()
        strategy._announce_auto_backend()  # once only
    said = [r.getMessage() for r in caplog.records if "backend='auto' runs" in r.getMessage()]
    assert said == ["SequenceParallelStrategy: backend='auto' runs ulysses"]
