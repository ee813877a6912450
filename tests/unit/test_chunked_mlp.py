"""The sequence-tiled MLP (``mlp_chunk_size``), vanilla attention (``dense_attention``) and full activation
checkpointing (``activation_checkpointing``) of the demo models: exact against the plain model, and the
tiled MLP and checkpointing keep less for backward."""

from __future__ import annotations

import pytest
import torch

from lightning_sp.models import MultimodalDecoder, ProteinEncoder, TransformerConfig


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids)  # [B, S, V]
    loss = (out * torch.linspace(-1, 1, out.size(-1), dtype=out.dtype)).sum()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids).sum()
    return sum(storages.values())


@pytest.mark.parametrize("model_cls", [ProteinEncoder, MultimodalDecoder])
@pytest.mark.parametrize("variant", [{"mlp_chunk_size": 7}, {"mlp_chunk_size": 64}, {"dense_attention": True},
                                     {"dense_attention": True, "mlp_chunk_size": 5}, {"activation_checkpointing": True},
                                     {"activation_checkpointing": True, "mlp_chunk_size": 7}])
def test_variants_are_exact(model_cls, variant):
    """Same outputs and gradients as the plain model (fp64: round-off only), tiles that do not divide S
    included; a perturbed model is the negative control."""
    torch.manual_seed(0)
    ids = torch.randint(0, 31, (2, 45))  # [B, S]
    kw = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    torch.manual_seed(1)
    plain = model_cls(**kw).double()
    torch.manual_seed(1)
    other = model_cls(**kw, **variant).double()
    out_a, grads_a = _loss_and_grads(plain, ids)
    out_b, grads_b = _loss_and_grads(other, ids)
    torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-10, atol=1e-12, msg=name)
    with torch.no_grad():
        fc1 = next(other.net.blocks[0].mlp.parameters())
        fc1.add_(1e-6 * torch.randn(fc1.shape, generator=torch.Generator().manual_seed(2), dtype=fc1.dtype))
    out_c, grads_c = _loss_and_grads(other, ids)
    assert not torch.allclose(out_c, out_a, rtol=1e-12, atol=1e-12)


def test_chunked_mlp_saves_less_and_dense_attention_saves_more():
    """Saved-for-backward bytes: the tiled MLP drops the two ``[B, S, 4C]`` hidden activations per layer;
    vanilla attention adds the ``[B, H, S, S]`` probabilities per layer."""
    torch.manual_seed(0)
    b, s, c, h, layers = 1, 256, 32, 4, 2
    ids = torch.randint(0, 31, (b, s))
    kw = dict(d_model=c, n_layers=layers, n_heads=h)
    plain = _saved_bytes(ProteinEncoder(**kw), ids)
    chunked = _saved_bytes(ProteinEncoder(**kw, mlp_chunk_size=32), ids)
    dense = _saved_bytes(ProteinEncoder(**kw, dense_attention=True), ids)
    recomputed = _saved_bytes(ProteinEncoder(**kw, activation_checkpointing=True), ids)
    hidden = 4 * c * b * s * 4  # one [B, S, 4C] fp32 activation
    # fc1's output and GELU's output (fc2's input) per layer; the tiles' input is LayerNorm's output, saved anyway
    assert plain - chunked >= layers * 2 * hidden * 0.95, (plain, chunked)
    assert dense - plain >= 0.9 * layers * h * s * s * 4, (dense, plain)  # less the kernel's lse and copies
    # checkpointing: each block keeps its input [B, S, C]; then the final norm and the head (logits [B, S, V])
    block_inputs = layers * b * s * c * 4
    assert recomputed <= block_inputs + 3 * b * s * c * 4 + b * s * 31 * 4, (recomputed, plain)
    assert recomputed < plain / 4, (recomputed, plain)


def test_config_errors():
    with pytest.raises(ValueError, match="mlp_chunk_size must be >= 1"):
        TransformerConfig(vocab_size=31, mlp_chunk_size=0)
    model = ProteinEncoder(d_model=32, n_layers=1, n_heads=4, dense_attention=True)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        model(torch.randint(0, 31, (1, 8)), cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    from lightning_sp import AttentionMask

    with pytest.raises(NotImplementedError, match="AttentionMask"):
        model.net(torch.randint(0, 31, (1, 8)), mask=AttentionMask(window=(2, 0)))
