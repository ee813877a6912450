"""Online-softmax merge of partial results (the heart of every ring-style backend).

Two partial results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine into
the result over the union:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)  =  lerp(out_a, out_b, w),
    w   = sigmoid(lse_b - lse_a) = exp(lse_b - lse)

computed in the accumulation dtype (fp32, or fp64 for fp64 inputs). A row that saw no key has
``lse = -inf`` and ``out = 0`` and drops out of the merge.

Memory: the merge runs in place (``out.lerp_(block_out, w)``); the only temporaries are ``[B, H, S]``
rows (the weights), never a block-sized ``out - block_out``. ``block_out`` is converted to the
accumulation dtype only when it is in another dtype (a bf16/fp16 kernel result).
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types and fp32; fp64 stays fp64 (never downcast a float64 check)."""
    return torch.promote_types(dtype, torch.float32)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """In place: ``out [B, S, H, D]``, ``lse [B, H, S]`` (accumulation dtype) absorb a block's
    ``block_out [B, S, H, D]`` and ``block_lse [B, H, S]``."""
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)  # [B, H, S]
    # weight of the new block = sigmoid(block_lse - lse); 0 where the block saw no key (also when
    # neither side saw a key: -inf - -inf = nan)
    weight = torch.exp(block_lse - new_lse).nan_to_num_(nan=0.0)
    weight.masked_fill_(torch.isneginf(block_lse), 0.0)
    weight = weight.transpose(1, 2).unsqueeze(-1).to(out.dtype)  # [B, H, S] -> [B, S, H, 1]
    out.lerp_(block_out if block_out.dtype == out.dtype else block_out.to(out.dtype), weight)
    lse.copy_(new_lse)
