"""Throughput per rank vs sequence length (Ulysses Fig. 3) and attention share of one kernel call
(ring-flash-attn). ``measure_step`` gives the step times of one method for other code (a cost model)."""

from experiments.throughput.measure import (
    ATTENTION_BACKENDS,
    MEGATRON_SP,
    METHODS,
    ModelShape,
    Timing,
    build_training_step,
    measure_step,
    time_alternating,
)

__all__ = ["ATTENTION_BACKENDS", "MEGATRON_SP", "METHODS", "ModelShape", "Timing", "build_training_step",
           "measure_step", "time_alternating"]
