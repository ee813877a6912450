"""4-D attention masks recognised as structured masks (or not), and their exactness on the unsharded model
against HF's eager attention given the same mask (float64). The sharded runs: tests/distributed/test_hf_masks.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_sp.integrations import transformers as integration  # noqa: E402
from tests.hf_tiny import KeepFloat64, clone, tiny_model  # noqa: E402

N = 11
Q, K = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
CAUSAL = K <= Q
REAL = torch.tensor([[0] * 3 + [1] * 8, [1] * 9 + [0] * 2]).bool()  # row 0 left-, row 1 right-padded


def _batched(visible):
    return visible.expand(2, 1, N, N) if visible.dim() == 2 else visible


# name -> (visible [B, 1, N, N] or [N, N], expected (causal, window, padded) or None: not recognised)
PATTERNS = {
    "causal": (CAUSAL, (True, None, False)),
    "bidirectional": (torch.ones(N, N, dtype=torch.bool), (False, None, False)),
    "causal_window_4": (CAUSAL & (Q - K < 4), (True, (3, 0), False)),
    "bidirectional_window": ((Q - K).abs() <= 2, (False, (2, 2), False)),
    "causal_padding": (CAUSAL[None, None] & REAL[:, None, None, :], (True, None, True)),
    "causal_padding_window": ((CAUSAL & (Q - K < 3))[None, None] & REAL[:, None, None, :], (True, (2, 0), True)),
    "bidirectional_padding": (REAL[:, None, :, None] & REAL[:, None, None, :], (False, None, True)),
    "documents": ((CAUSAL & ((Q < 5) == (K < 5))), None),
    "strided": (CAUSAL & ((Q - K) % 2 == 0), None),
    "heads_differ": (torch.stack([CAUSAL, torch.ones(N, N, dtype=torch.bool)])[None].expand(2, 2, N, N), None),
    "hole_in_padding": (CAUSAL[None, None] & torch.tensor([1] * 4 + [0] + [1] * 6).bool()[None, None, None, :], None),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_patterns_recognised_or_not(name):
    visible, expected = PATTERNS[name]
    got = integration._recognised_pattern(_batched(visible))
    if expected is None:
        assert got is None
        return
    causal, window, real = got
    assert (causal, window, not bool(real.all())) == expected


@pytest.mark.parametrize("name", ["causal_window_4", "bidirectional_window", "bidirectional_padding", "strided"])
def test_unsharded_model_with_a_4d_mask_matches_hf_eager(name):
    """The 4-D mask (recognised, or as rows) is the whole mask, as in HF's eager attention: the causal Llama turns
    bidirectional where the mask says so. Compared on the queries that see some key (zeros elsewhere: HF's
    eager averages the values there)."""
    visible = _batched(PATTERNS[name][0])
    additive = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    ids = torch.randint(4, 30, (2, N), generator=torch.Generator().manual_seed(0))
    with KeepFloat64():
        base = tiny_model("llama")
        base.set_attn_implementation("eager")
        ref = clone(base)(input_ids=ids, attention_mask=additive).logits
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        with pytest.warns(UserWarning, match="query rows") if name == "strided" else _no_warning():
            got = model(input_ids=ids, attention_mask=visible).logits
        ignored = model(input_ids=ids).logits  # negative control: the plain causal model
    seen = visible.any(-1).all(1)  # [B, N] queries that see some key
    assert (got - ref)[seen].abs().max() < 1e-9
    assert (ignored - ref)[seen].abs().max() > 1e-4


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)
