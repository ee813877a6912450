"""Korthikanti et al. 2022, Table 2, measured: bytes autograd saves for backward per GPT layer.

Every configuration runs one forward pass of ``gpt_layer.GPTLayer`` in bfloat16 under
``torch.autograd.graph.saved_tensors_hooks``; the measured value is the sum of the distinct storages
the hooks see (parameters excluded), i.e. exactly what the layer keeps alive for its backward. It is
compared with the paper's formula for that row. Tensor / context parallelism at degree ``t`` runs as
rank 0 of a ``t``-rank *fake* process group (``torch.testing._internal.distributed.fake_pg``): the
collectives move no data, but every tensor has the shape rank 0 of a real ``t``-rank job has, and
the library's byte counters record what each collective would send.

    python -m experiments.activation_memory.run [--quick] [--publish | --out DIR]   # default runs/activation_memory/
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.activation_memory.gpt_layer import GPTLayer

from experiments.common.results import add_output_arguments, output_dir, run_metadata  # noqa: E402

DTYPE = torch.bfloat16
BYTES = 2  # per activation element (the paper's 16-bit activations)

# (row name, formula text, formula(s, b, h, a, t) in bytes, layer kwargs, tensor-parallel SP flag)
ROWS = [
    ("no parallelism", "sbh(34 + 5as/h)", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
     dict(attention="materialized", recompute="none"), None),
    ("TP", "sbh(10 + 24/t + 5as/(ht))", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
     dict(attention="materialized", recompute="none"), False),
    ("TP+SP", "sbh(34/t + 5as/(ht))", lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
     dict(attention="materialized", recompute="none"), True),
    ("TP + selective recompute", "sbh(10 + 24/t)", lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
     dict(attention="materialized", recompute="selective"), False),
    ("TP+SP + selective recompute", "34sbh/t", lambda s, b, h, a, t: 34 * s * b * h / t,
     dict(attention="materialized", recompute="selective"), True),
    ("full recompute", "2sbh", lambda s, b, h, a, t: 2 * s * b * h,
     dict(attention="materialized", recompute="full"), False),
    # beyond the paper: flash-style attention (no scores; a float32 log-sum-exp per head and token)
    ("TP+SP, flash attention", "sbh(34/t + 4a/(ht))", lambda s, b, h, a, t: s * b * h * (34 / t + 4 * a / (h * t)),
     dict(attention="flash", recompute="none"), True),
]
# context parallelism at degree P = t: replicated weights, the sequence split s/P, flash-style kernel
# Ulysses keeps the attention output twice (head-split for its kernel's backward, and sequence-split
# after the second all-to-all as the projection's input): 2 more sbh/P than the ring, whose kernel
# output is itself the projection's input.
CP_ROWS = [
    ("CP ulysses", "sbh(36 + 4a/h)/P", lambda s, b, h, a, t: s * b * h * (36 + 4 * a / h) / t, "ulysses"),
    ("CP ring", "sbh(34 + 4a/h)/P", lambda s, b, h, a, t: s * b * h * (34 + 4 * a / h) / t, "ring"),
]
SHAPES_FULL = [(512, 1024, 16), (1024, 1024, 16), (2048, 512, 8), (256, 2048, 32)]  # (s, h, a)
SHAPES_QUICK = [(64, 256, 8)]
DEGREES = (1, 2, 4, 8)
BATCH = 1
DROPOUT = 0.1


@dataclass(kw_only=True)
class Result:
    row: str
    formula: str
    s: int
    h: int
    a: int
    b: int
    t: int
    measured_bytes: int
    formula_bytes: float
    ratio: float
    comm_fwd_bytes: int
    comm_analytic_bytes: float


def saved_bytes(run, params) -> tuple[int, object]:
    """Bytes of the distinct storages saved for backward while ``run()`` executes (parameters excluded).
    The result of ``run`` is returned too: it keeps the graph, hence the storages, alive."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


def _fake_world(t: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if t > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)


def _tp_row(name, text, formula, kwargs, sp, s, h, a, t) -> Result | None:
    from lightning_sp.comm.volume import tensor_parallel_elements
    from lightning_sp.tensor_parallel import TensorParallelContext

    if name in ("no parallelism",) and t != 1:
        return None
    torch.manual_seed(0)
    layer = GPTLayer(hidden=h, heads=a, dropout=DROPOUT, **kwargs).to(DTYPE)
    ctx = TensorParallelContext(group=dist.group.WORLD if t > 1 else None, sequence_parallel=bool(sp))
    layer.bind(ctx)
    s_local = -(-s // t) if (sp and t > 1) else s
    x = torch.randn(BATCH, s_local, h, dtype=DTYPE, requires_grad=True)  # [b, s/t or s, h]
    measured, out = saved_bytes(lambda: layer(x, s), list(layer.parameters()))
    f = formula(s, BATCH, h, a, t)
    del out
    return Result(row=name, formula=text, s=s, h=h, a=a, b=BATCH, t=t, measured_bytes=measured, formula_bytes=f,
                  ratio=measured / f, comm_fwd_bytes=ctx.comm.total_bytes,
                  comm_analytic_bytes=tensor_parallel_elements(tokens=BATCH * s, hidden=h, world=t) * BYTES)


def _cp_row(name, text, formula, backend, s, h, a, t) -> Result | None:
    from lightning_sp import SequenceParallelAttention
    from lightning_sp.comm.volume import forward_elements

    if t == 1:
        return None
    torch.manual_seed(0)
    attn = SequenceParallelAttention(backend=backend, group=dist.group.WORLD, validate_inputs=False)
    layer = GPTLayer(hidden=h, heads=a, dropout=DROPOUT, attention="flash", attention_module=attn).to(DTYPE)
    x = torch.randn(BATCH, s // t, h, dtype=DTYPE, requires_grad=True)  # [b, s/P, h]
    measured, out = saved_bytes(lambda: layer(x, s // t, s), list(layer.parameters()))
    f = formula(s, BATCH, h, a, t)
    del out
    analytic = forward_elements(backend, seq_len=BATCH * s, world=t, num_heads=a, num_kv_heads=a, head_dim=h // a)
    return Result(row=name, formula=text, s=s, h=h, a=a, b=BATCH, t=t, measured_bytes=measured, formula_bytes=f,
                  ratio=measured / f, comm_fwd_bytes=attn.comm_stats.total_bytes, comm_analytic_bytes=analytic * BYTES)


def measure(shapes, degrees=DEGREES, cp: bool = True) -> list[Result]:
    results = []
    for t in degrees:
        _fake_world(t)
        for s, h, a in shapes:
            for name, text, formula, kwargs, sp in ROWS:
                r = _tp_row(name, text, formula, kwargs, sp, s, h, a, t)
                if r is not None:
                    results.append(r)
            if cp:
                for name, text, formula, backend in CP_ROWS:
                    r = _cp_row(name, text, formula, backend, s, h, a, t)
                    if r is not None:
                        results.append(r)
    _fake_world(1)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape (tests)")
    add_output_arguments(parser, "activation_memory")
    parser.add_argument("--no-cp", action="store_true", help="skip the context-parallel rows")
    args = parser.parse_args(argv)
    args.out = output_dir(args, "activation_memory")
    torch.set_num_threads(1)
    meta = run_metadata(  # provenance taken before measuring: the commit the numbers come from
        __file__, argv, kind="measured",
        what="bytes saved for backward per GPT layer (saved-tensor hooks) vs Korthikanti et al. 2022 Table 2",
        device=f"CPU ({platform.processor() or platform.machine()}), fake process group for t > 1",
        dtype=str(DTYPE), dropout=DROPOUT, batch=BATCH, torch=torch.__version__, quick=args.quick)
    results = measure(SHAPES_QUICK if args.quick else SHAPES_FULL, degrees=(1, 2, 4) if args.quick else DEGREES,
                      cp=not args.no_cp)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in results]
    with open(args.out / "activation_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta["rows"] = rows
    (args.out / "activation_memory.json").write_text(json.dumps(meta, indent=1))
    worst = max(abs(r.ratio - 1) for r in results)
    for r in results:
        print(f"{r.row:32s} s={r.s:5d} h={r.h:5d} a={r.a:3d} t={r.t}  measured/formula = {r.ratio:.4f}  "
              f"comm fwd {r.comm_fwd_bytes} B (analytic {r.comm_analytic_bytes:.0f})")
    print(f"max |ratio - 1| = {worst:.4f} over {len(results)} rows -> {args.out / 'activation_memory.csv'}")


if __name__ == "__main__":
    main()
