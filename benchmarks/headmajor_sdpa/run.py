"""CPU SDPA flash kernel: q/k/v/dout in head-major memory vs seq-major memory (same [B, S, H, D] shapes).

One process, the call block_attention makes (``make_kernel("auto")``), causal fp32, forward + backward,
the two layouts alternating per rep; prints medians and the head-major / seq-major ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m benchmarks.headmajor_sdpa.run --seqs 4096 8192 --heads 4
"""
import argparse
import statistics
import time

import torch

from lightning_sp.ops.kernels import make_kernel
from lightning_sp.ops.plan import MaskKind


def make(b, s, h, d, head_major: bool) -> torch.Tensor:
    """``[B, S, H, D]`` random, memory ``[B, H, S, D]`` (head-major) or ``[B, S, H, D]`` (seq-major)."""
    if head_major:
        return torch.randn(b, h, s, d).transpose(1, 2)
    return torch.randn(b, s, h, d)


def one_call(kernel, tensors, scale):
    q, k, v, dout = tensors
    t0 = time.perf_counter()
    out, lse = kernel.forward(q, k, v, scale=scale, kind=MaskKind.CAUSAL, mask=None)
    t1 = time.perf_counter()
    kernel.backward(dout, q, k, v, out, lse, scale=scale, kind=MaskKind.CAUSAL, mask=None)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=int, nargs="+", default=[4])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    kernel, d = make_kernel("auto"), args.head_dim
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, kernel {type(kernel).__name__}")
    for s in args.seqs:
        for h in args.heads:
            torch.manual_seed(0)
            sides = {hm: [make(1, s, h, d, hm) for _ in range(4)] for hm in (False, True)}
            for hm in (False, True):  # same values in both layouts
                for t_hm, t_sm in zip(sides[True], sides[False]):
                    t_hm.copy_(t_sm)
            times = {hm: [] for hm in (False, True)}
            for _ in range(1):  # warm-up
                for hm in (False, True):
                    one_call(kernel, sides[hm], d ** -0.5)
            for r in range(args.reps):
                order = (False, True) if r % 2 == 0 else (True, False)
                for hm in order:
                    times[hm].append(one_call(kernel, sides[hm], d ** -0.5))
            med = {hm: [statistics.median(t[i] for t in times[hm]) * 1e3 for i in (0, 1)] for hm in times}
            tot = {hm: sum(med[hm]) for hm in med}
            print(f"S={s} H={h} D={d}: seq-major fwd {med[False][0]:.1f} bwd {med[False][1]:.1f} ms | "
                  f"head-major fwd {med[True][0]:.1f} bwd {med[True][1]:.1f} ms | "
                  f"ratio head/seq fwd {med[True][0] / med[False][0]:.3f} bwd {med[True][1] / med[False][1]:.3f} "
                  f"fwd+bwd {tot[True] / tot[False]:.3f}", flush=True)


if __name__ == "__main__":
    main()
