"""Megatron tensor + sequence parallelism (Korthikanti et al. 2022) as layers that are plain
``torch.nn`` layers until bound to a tensor-parallel group; see Note [Megatron tensor + sequence
parallelism] in ``layers.py``."""

from lightning_sp.tensor_parallel.context import TensorParallelContext, shard_range
from lightning_sp.tensor_parallel.cross_entropy import (
    tensor_parallel_cross_entropy,
    vocab_parallel_argmax,
    vocab_parallel_token_losses,
)
from lightning_sp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModule,
    VocabParallelEmbedding,
    bind_tensor_parallel,
    bind_tensor_parallel_layers,
    column_parallel_linear,
    gather_sequence_parallel_output,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelContext",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "bind_tensor_parallel",
    "bind_tensor_parallel_layers",
    "column_parallel_linear",
    "gather_sequence_parallel_output",
    "shard_range",
    "tensor_parallel_cross_entropy",
    "vocab_parallel_argmax",
    "vocab_parallel_token_losses",
]
