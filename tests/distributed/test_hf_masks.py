"""Hugging Face mask kwargs under sequence parallelism vs the unsharded HF model (its own eager attention), float64.

One spawn per world size (2 and 4) runs tiny registry models whose attention layers pass HF's per-layer mask
kwargs: Mistral (``sliding_window`` on every layer), Qwen2, Qwen3, Cohere2 and Gemma-3 (a sliding-window layer
beside a global one; Gemma-3 also with bidirectional layers), Gemma-2 (``softcap`` and alternating local/global
layers), gpt-oss (``s_aux`` sinks and windows) and ModernBERT (bidirectional local attention,
``|q - k| <= local_attention // 2``), on every backend, at a global length (13) no degree divides, with windows
smaller than a shard and spanning shards (and, for Mistral, right-padded rows of different lengths packed into
documents). Logits, loss and every parameter gradient (gpt-oss's sinks included) must equal the reference to 1e-9
(HF's own float32 roundings kept in float64: ``tests.hf_tiny.KeepFloat64``). Negative controls, each on the same
run with one mapping broken, must miss: the window ignored, the window one token too wide, the soft-cap ignored,
the sinks ignored.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed.harness import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.distributed

TOL = 1e-9
MISS = 1e-6
N = 13
BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal")
_TWO_LAYERS = ["sliding_attention", "full_attention"]
# (case, model_type, config overrides, feature controls): windows 3-5 are smaller than a shard at P = 2 (7 tokens)
# and span shards at P = 4 (4 tokens); larger weights (initializer_range) make the soft-cap and the sinks matter
CASES = (
    ("mistral", "mistral", {"sliding_window": 4}, ("window_ignored", "window_too_wide")),
    ("qwen3", "qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0,
                        "layer_types": _TWO_LAYERS}, ("window_ignored", "window_too_wide")),
    ("qwen2", "qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0,
                        "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    ("cohere2", "cohere2", {"sliding_window": 5, "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    ("gemma2", "gemma2", {"sliding_window": 4, "attn_logit_softcapping": 0.5, "final_logit_softcapping": None,
                          "layer_types": _TWO_LAYERS}, ("window_ignored", "softcap_ignored")),
    ("gemma3_text", "gemma3_text", {"sliding_window": 4, "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    # EmbeddingGemma-style: bidirectional layers, the local ones |q - k| < sliding_window
    ("gemma3_bidirectional", "gemma3_text", {"sliding_window": 4, "layer_types": _TWO_LAYERS,
                                             "use_bidirectional_attention": True}, ("window_ignored", "window_too_wide")),
    ("gpt_oss", "gpt_oss", {"sliding_window": 4, "layer_types": _TWO_LAYERS}, ("window_ignored", "sinks_ignored")),
    ("modernbert", "modernbert", {"local_attention": 6, "global_attn_every_n_layers": 2},
     ("window_ignored", "window_too_wide")),
)


def _broken(control: str):
    """A ``_mask_and_sinks`` with one mapping broken (a negative control)."""
    from lightning_sp.integrations import transformers as integration

    right = integration._mask_and_sinks

    def broken(query, causal, kwargs):
        kwargs = dict(kwargs)
        if control == "window_ignored":
            kwargs.pop("sliding_window", None)
        elif control == "window_too_wide" and kwargs.get("sliding_window") is not None:
            kwargs["sliding_window"] += 1
        elif control == "softcap_ignored":
            kwargs.pop("softcap", None)
        elif control == "sinks_ignored":
            kwargs.pop("s_aux", None)
        return right(query, causal, kwargs)

    return broken


def _case(model_type: str, overrides: dict, controls: tuple, group) -> dict:
    import torch.nn.functional as F

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff, registry_model, sweep_batch

    base, masked = registry_model(model_type, {"initializer_range": 0.5, **overrides})
    base.set_attn_implementation("eager")  # the reference: HF's plain softmax with its soft-cap, sinks and masks
    batch = sweep_batch(masked, n=N)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"]).logits  # [1, N, V]
    shift = 0 if masked else 1
    loss_ref = F.cross_entropy(logits_ref[:, : N - shift].flatten(0, 1), batch["labels"][:, shift:].flatten())
    loss_ref.backward()

    def sharded(backend: str, grads: bool):
        model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
        shard = integration.shard_inputs(batch, model)
        labels = shard.pop("labels")
        logits = model(**shard).logits  # [1, S_local, V]
        full = gather_sequence(logits.detach(), group, layout=integration._sp_modules(model)[0].layout, seq_len=N)
        if not grads:
            return float((full - logits_ref.detach()).abs().max())
        loss = sequence_parallel_cross_entropy(logits, labels, group=group)
        loss.backward()
        grad_diff = max_grad_diff(model, ref, group)
        return {"logits": float((full - logits_ref.detach()).abs().max()),
                "loss": abs(float(loss.detach() - loss_ref.detach())), "grads": grad_diff}

    out: dict = {backend: sharded(backend, grads=True) for backend in BACKENDS}
    if model_type == "gpt_oss":  # the sinks' own gradient, by name (it must reach the module's parameter)
        out["sinks_grad_norm"] = float(ref.model.layers[0].self_attn.sinks.grad.abs().max())
    if model_type == "mistral":  # rows of different lengths (right padding) -> packed documents, windowed
        out["packed_rows"] = {backend: _packed_rows(base, backend, group) for backend in ("zigzag_ring", "ulysses")}
    right = integration._mask_and_sinks
    out["controls"] = {}
    for control in controls:
        integration._mask_and_sinks = _broken(control)
        try:
            out["controls"][control] = sharded("zigzag_ring", grads=False)
        finally:
            integration._mask_and_sinks = right
    return out


def _packed_rows(base, backend: str, group) -> dict:
    """Two right-padded rows (9 and 13 tokens) through ``shard_inputs`` (packed into 22 tokens, two documents) vs
    the padded batch through HF's eager attention: max differences of the real tokens' logits, the loss and the
    gradients."""
    import torch.nn.functional as F

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff, tiny_rows

    lengths = (9, N)
    batch = tiny_rows("llama", lengths, pad_to=N)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [2, N, V]
    real = torch.cat([logits_ref[i, :n] for i, n in enumerate(lengths)])  # [22, V]
    loss_ref = F.cross_entropy(torch.cat([logits_ref[i, : n - 1] for i, n in enumerate(lengths)]),
                               torch.cat([batch["input_ids"][i, 1:n] for i, n in enumerate(lengths)]))
    loss_ref.backward()
    model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
    shard = integration.shard_inputs(batch, model)
    labels = shard.pop("labels")
    logits = model(**shard).logits
    loss = sequence_parallel_cross_entropy(logits, labels, group=group)
    loss.backward()
    grad_diff = max_grad_diff(model, ref, group)
    full = gather_sequence(logits.detach(), group, layout=integration._sp_modules(model)[0].layout, seq_len=sum(lengths))
    return {"logits": float((full[0] - real.detach()).abs().max()), "loss": abs(float(loss.detach() - loss_ref.detach())),
            "grads": grad_diff}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tests.hf_tiny import KeepFloat64

    torch.manual_seed(0)
    with KeepFloat64():
        return {name: _case(mt, ov, controls, dist.group.WORLD) for name, mt, ov, controls in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def results(request):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return request.param, run_on_ranks(_worker, request.param, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_exact_on_every_backend(results, case):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for backend in BACKENDS:
            r = res[case][backend]
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, (world, rank, case, backend, r)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_each_mapping_broken_misses(results, case):
    world, per_rank = results
    controls = dict((c[0], c[3]) for c in CASES)[case]
    for rank, res in enumerate(per_rank):
        assert set(res[case]["controls"]) == set(controls)
        for control, diff in res[case]["controls"].items():
            assert diff > MISS, f"P={world} rank {rank} {case}: {control} only differs by {diff:.3e}"


def test_sinks_have_a_gradient(results):
    """gpt-oss's sinks are compared with the reference's gradient above; that gradient is not zero."""
    _, per_rank = results
    assert all(res["gpt_oss"]["sinks_grad_norm"] > 1e-6 for res in per_rank)


def test_window_over_packed_rows_is_exact(results):
    """Right-padded rows of different lengths become packed documents; the window stays inside each."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for backend, r in res["mistral"]["packed_rows"].items():
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, (world, rank, backend, r)
