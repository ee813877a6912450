"""Model FLOP formulas, pure arithmetic (no torch, no Lightning): one home for the counts that
``SequenceParallelMonitor`` logs (``callbacks``) and the cost model predicts (``cost_model``).

Megatron (Korthikanti et al. 2022), per iteration (forward + backward) of a decoder with ``L`` layers,
hidden ``h``, vocabulary ``V``, batch ``B`` and sequence ``s``:
``72 * B * L * s * h^2 * (1 + s / (6h) + V / (12 h L))``. The ``s / (6h)`` term counts the whole score
matrix; a causal kernel computes half of it (``causal_attention_flops_saved``).
"""

from __future__ import annotations

__all__ = ["causal_attention_flops_saved", "megatron_flops_per_iteration"]


def megatron_flops_per_iteration(*, batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one forward + backward: ``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``."""
    b, s, n_l, h, v = batch, seq_len, num_layers, hidden, vocab
    return 72.0 * b * n_l * s * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * n_l))


def causal_attention_flops_saved(*, batch: int, seq_len: int, num_layers: int, hidden: int) -> float:
    """FLOPs a causal kernel skips of Megatron's count: half the score term, ``72 B L s h^2 * s/(12h)``."""
    b, s, n_l, h = batch, seq_len, num_layers, hidden
    return 72.0 * b * n_l * s * h * h * s / (12.0 * h)
