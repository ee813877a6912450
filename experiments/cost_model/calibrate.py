"""Microbenchmarks of the primitives the cost model counts (Note [Per-call terms] in
``lightning_sp/cost_model.py``): the validation rows are not used here, and a backend runs only with its
compute stubbed out (``colossal``'s messages, every backend's kernel at a tiny shape).

- ``kernel_table``: one ``LocalKernel`` (``make_kernel("auto")``: SDPA's CPU flash op) forward and
  backward call, per head, at ``q_len x k_len`` in ``KERNEL_SIDES`` (FULL) and CAUSAL squares (also at
  ``CAUSAL_EXTRA_SIDES``), for
  ``head_dim`` in ``KERNEL_DIMS``, ``KERNEL_HEADS`` heads; the tiny-call time removed; each point the median over
  ``KERNEL_ROUNDS`` rounds over the whole table;
- ``kernel_call_s``: a tiny call (8 x 8 tokens, one head, D = 8), forward and backward;
- ``merge_s``: ``ops.merge.merge_into`` vs elements; ``elementwise_s``: an in-place ``add_`` vs elements
  (both least squares in relative error, as the collectives: the 4 K-element call sets the per-call time);
- ``matmul_flops``: a batched ``[H, c, D] @ [H, D, c]`` (``colossal``'s score product);
- ``colossal_table``: ``ops/colossal.py``'s own fwd+bwd on one rank (messages stubbed) per score element, each
  point the median over ``COLOSSAL_ROUNDS`` rounds over the points;
- per world size, every rank computing (``busy_worker``): the fixed cost of a ``RingComm`` exchange,
  a tiny all-gather and a tiny all-to-all on top of a small kernel call (what the model uses);
- per world size, idle ranks: ``message_s`` (a ``RingComm`` exchange of one float, Python and wait included),
  ``all_to_all`` and ``all_gather`` latency + bandwidth (least squares over message sizes) on gloo,
  and the point-to-point bandwidth (ping-pong, ranks 0 and 1, at the smallest world);
- ``sync_delay_s``: per world size, synthetic steps of kernel calls each ended by a synchronisation, timed in
  rotated rounds as the validation rows are: how far the median round sits above the fastest, per
  synchronisation (``measure_sync_delay``; measured again at each grid's start, as the sharing);
- ``layer_latency_s``: per world size, each backend's fwd+bwd at ``LATENCY_SHAPE`` with its kernel stubbed
  (``split.SplitKernel``: zeros of the real calls' shapes) on idle ranks, less what the profile's other
  terms predict there.

One thread per process, as the backends run in the validation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.common.launch import run_on_ranks
from experiments.common.timing import median_seconds

if TYPE_CHECKING:
    from lightning_sp.cost_model import HardwareProfile

KERNEL_SIDES = (32, 128, 512, 2048)
CAUSAL_EXTRA_SIDES = (4096, 8192)
"""Causal squares beyond ``KERNEL_SIDES`` (one causal call over a whole sequence, as Ulysses makes):
per element, a causal square gets cheaper with its side (the masked half grows, the diagonal's share
shrinks), so holding the time per element constant beyond 2048 over-predicts it."""
KERNEL_DIMS = (32, 64, 128)
KERNEL_HEADS = 4
LINK_SIZES = tuple(1 << k for k in range(12, 23, 2))  # 4 KiB .. 4 MiB


def fit_line(xs, ys, *, relative: bool = False) -> tuple[float, float]:
    """Least squares ``y = a + b x``; ``(a, b)`` clamped to be >= 0. ``relative``: minimise the relative
    error ``sum ((y - a - b x) / y)^2``, so points 1000x apart in size weigh alike (else the largest
    message alone sets the line and the latency is whatever its intercept happens to be)."""
    ws = [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def _kernel_pair(kernel, kind, q_len, k_len, heads, d, reps):
    from lightning_sp.ops.plan import MaskKind

    g = torch.Generator().manual_seed(q_len * 7 + k_len)
    q = torch.randn(1, q_len, heads, d, generator=g)
    k, v = (torch.randn(1, k_len, heads, d, generator=g) for _ in range(2))
    dout = torch.randn(1, q_len, heads, d, generator=g)
    mk = MaskKind(kind)
    scale = d ** -0.5
    out, lse = kernel.forward(q, k, v, scale=scale, kind=mk, mask=None)
    t_f = median_seconds(lambda: kernel.forward(q, k, v, scale=scale, kind=mk, mask=None), reps)
    t_b = median_seconds(lambda: kernel.backward(dout, q, k, v, out, lse, scale=scale, kind=mk, mask=None), reps)
    return t_f, t_b


KERNEL_ROUNDS = 3
"""Rounds over the whole kernel table (each point once per round, the order rotated): a slow minute of the machine
lands on one round of every point instead of on every round of some points (Note [Kernel table in rounds])."""


def rotated(points: list, r: int, rounds: int) -> list:
    """``points`` in round ``r``'s order of ``rounds``: started ``r / rounds`` of the way in, so each round begins
    at another point (round 0 in the given order)."""
    start = r * len(points) // rounds
    return points[start:] + points[:start]


def kernel_table_points(sides=KERNEL_SIDES, dims=KERNEL_DIMS, causal_extra=CAUSAL_EXTRA_SIDES) -> list[tuple]:
    """``(kind, D, q_len, k_len)`` of every kernel-table point: FULL rectangles and CAUSAL squares over ``sides``,
    and CAUSAL squares at ``causal_extra``, for each D."""
    points = []
    for d in dims:
        for q_len in sides:
            points += [("full", d, q_len, k_len) for k_len in sides] + [("causal", d, q_len, q_len)]
        points += [("causal", d, side, side) for side in causal_extra]
    return points


def measure_kernel_table(reps: int = 3, sides=KERNEL_SIDES, dims=KERNEL_DIMS, causal_extra=CAUSAL_EXTRA_SIDES,
                         rounds: int = KERNEL_ROUNDS) -> dict:
    """The local kernel's table (``HardwareProfile.kernel_table``): each point (``kernel_table_points``) the median
    over ``rounds`` rounds, in an order rotated by one per round, of the median of ``reps`` calls (fewer for the
    large ones, one for ``causal_extra``), the tiny call's time removed, per head. One thread, float32.
    -> ``{"kernel_table", "kernel_call_s", "kernel_heads", "per_round"}``."""
    from lightning_sp.ops.kernels import make_kernel

    torch.set_num_threads(1)
    kernel = make_kernel("auto")
    tiny = _kernel_pair(kernel, "full", 8, 8, 1, 8, reps * 20)
    points = kernel_table_points(sides, dims, causal_extra)
    per_round = {p: [] for p in points}
    for r in range(rounds):
        for kind, d, q_len, k_len in rotated(points, r, rounds):
            long_call = kind == "causal" and q_len in causal_extra  # seconds long: warm-up + 1
            n = 1 if long_call else (reps if q_len * k_len < 1 << 20 else max(2, reps - 1))
            per_round[(kind, d, q_len, k_len)].append(_kernel_pair(kernel, kind, q_len, k_len, KERNEL_HEADS, d, n))
    table = []
    for (kind, d, q_len, k_len), times in per_round.items():
        t_f, t_b = (statistics.median(t[i] for t in times) for i in (0, 1))
        table.append((kind, d, q_len, k_len, max(t_f - tiny[0], 1e-9) / KERNEL_HEADS,
                      max(t_b - tiny[1], 1e-9) / KERNEL_HEADS))
    return {"kernel_table": table, "kernel_call_s": list(tiny), "kernel_heads": KERNEL_HEADS, "per_round": per_round}


def calibrate_local(reps: int = 3, sides=KERNEL_SIDES, dims=KERNEL_DIMS, causal_extra=CAUSAL_EXTRA_SIDES,
                    rounds: int = KERNEL_ROUNDS) -> dict:
    """Everything one process measures (kernel table: ``measure_kernel_table``; per-call terms, matmul rate)."""
    from lightning_sp.ops.merge import merge_into

    kernel = measure_kernel_table(reps, sides, dims, causal_extra, rounds)
    per_round = kernel.pop("per_round")
    sizes = (4096, 1 << 18, 1 << 22, 1 << 24)  # 16 KiB .. 64 MiB of fp32: cache-resident to memory-bound
    merge_t, add_t = [], []
    for e in sizes:
        out, blk = torch.zeros(1, e // 16, 1, 16), torch.randn(1, e // 16, 1, 16)
        lse, blse = torch.zeros(1, 1, e // 16), torch.randn(1, 1, e // 16)
        r = reps * 10 if e <= 1 << 18 else reps
        merge_t.append(median_seconds(lambda: merge_into(out, lse, blk, blse), r))
        add_t.append(median_seconds(lambda: out.add_(blk), r))
    h, c, d = 8, 256, 32
    a, b = torch.randn(h, c, d), torch.randn(h, d, c)
    t_mm = median_seconds(lambda: a @ b, reps * 10)
    return {
        **kernel, "kernel_table_rounds": [[*p, [list(t) for t in times]] for p, times in per_round.items()],
        "merge_s": list(fit_line(sizes, merge_t, relative=True)), "merge_points": list(zip(sizes, merge_t)),
        "elementwise_s": list(fit_line(sizes, add_t, relative=True)), "elementwise_points": list(zip(sizes, add_t)),
        "matmul_flops": 2.0 * h * c * c * d / t_mm,
    }


def links_worker(rank, world, sizes, reps):
    """Per world: a tiny ring exchange, all-to-all and all-gather vs size, and (ranks 0, 1) a ping-pong."""
    from lightning_sp.comm.collectives import _all_gather_single  # what all_gather_raw calls
    from lightning_sp.comm.ring import RingComm

    torch.set_num_threads(1)
    comm = RingComm(dist.group.WORLD)
    one = torch.zeros(1)

    def exchange():
        comm.start((one,)).wait()

    dist.barrier()
    msg = median_seconds(lambda: [exchange() for _ in range(20)], reps, warmup=2) / 20
    barrier = median_seconds(lambda: [dist.barrier() for _ in range(20)], reps, warmup=2) / 20
    rows = []
    for nbytes in sizes:
        n = max(nbytes // 4 // world, 1) * world
        send, recv = torch.zeros(n), torch.empty(n)
        gathered = torch.empty(n * world)

        def timed(fn):
            out = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i:
                    out.append(time.perf_counter() - t0)
            return statistics.median(out)

        a2a = timed(lambda: dist.all_to_all_single(recv, send))
        ag = timed(lambda: _all_gather_single(gathered, send))

        def pingpong():
            if rank == 0:
                dist.send(send, 1)
                dist.recv(send, 1)
            elif rank == 1:
                dist.recv(send, 0)
                dist.send(send, 0)

        pp = timed(pingpong) / 2
        rows.append({"bytes": n * 4, "all_to_all_s": a2a, "all_gather_s": ag, "one_way_s": pp})
    times = [None] * world
    dist.all_gather_object(times, msg)
    return {"message_s": max(times), "barrier_s": barrier, "points": rows} if rank == 0 else None


def calibrate_links(worlds, reps: int = 5, sizes=LINK_SIZES) -> dict:
    """``{world: {"message_s", "all_to_all": (lat, bw), "all_gather": (lat, bw), "one_way": (lat, bw), "points"}}``."""

    out = {}
    for world in worlds:
        got = run_on_ranks(links_worker, world, (list(sizes), reps), timeout_s=600, pg_timeout_s=300)[0]
        pts = got["points"]
        fits = {}
        for op in ("all_to_all", "all_gather", "one_way"):
            lat, slope = fit_line([p["bytes"] for p in pts], [p[f"{op}_s"] for p in pts], relative=True)
            fits[op] = (lat, 1.0 / slope if slope > 0 else math.inf)
        out[world] = {"message_s": got["message_s"], "barrier_s": got["barrier_s"], **fits, "points": pts}
    return out


COLOSSAL_POINTS = tuple((n, d) for n in (256, 512, 1024, 2048) for d in (32, 128))
COLOSSAL_HEADS = 2
COLOSSAL_WORLD = 2  # the stubbed ring's size: score rows of N/2 x N per rank, as on the validation's P ranks


class _NoRing:
    """A stand-in for ``RingComm`` inside ``ops/colossal.py``: rank 0 of a ring of ``world`` whose
    exchanges hand back what was sent (no process group, no message), so only the backend's local
    compute is timed, block for block as rank 0 of ``world`` ranks does it."""

    world = COLOSSAL_WORLD
    rank = 0

    def __init__(self, group=None, stats=None):
        pass

    def start(self, tensors, op: str = "ring_send", heads_major: bool = False):  # RingComm.start's signature
        class _Done:
            def wait(self_inner):
                return tuple(tensors)

        return _Done()


def colossal_local(q, k, v, dout):
    """``ops/colossal.py``'s fwd+bwd (``q [B, n, H, D]``, ``k, v [B, n, H_kv, D]``) as rank 0 of
    ``COLOSSAL_WORLD`` ranks whose blocks are all this one (``_NoRing``): score rows ``[H, n, world x
    n]`` built block by block, softmax over whole rows, its hand-written backward, no message. Causal,
    so the other ranks' blocks are masked: the result is causal attention over ``n`` tokens (tested)."""
    from unittest import mock

    from lightning_sp.ops import colossal

    n, d = q.size(1), q.size(-1)
    positions = [torch.arange(r * n, (r + 1) * n) for r in range(COLOSSAL_WORLD)]
    with mock.patch.object(colossal, "RingComm", _NoRing):
        out = colossal.colossal_attention(q, k, v, group=None, positions_by_rank=positions, causal=True,
                                          doc_bounds=None, scale=d ** -0.5, stats=None)
        out.backward(dout)
    return out


def _colossal_local_time(n: int, d: int, reps: int) -> float:
    """Seconds of ``colossal_local`` on ``n`` tokens, ``COLOSSAL_HEADS`` heads of ``d``: the backend's
    local compute per score element, without its messages."""
    g = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(1, n, COLOSSAL_HEADS, d, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, n, COLOSSAL_HEADS, d, generator=g)
    return median_seconds(lambda: colossal_local(q, k, v, dout), reps)


COLOSSAL_ROUNDS = 5
"""Rounds over the colossal points, as the kernel table's (Note [Kernel table in rounds]; Note [Colossal table in
rounds] in ``experiments/cost_model/NOTES.md``). Round 0 is the one pass timed until 2026-11-25."""


def colossal_table(points, times) -> list[list]:
    """``[E, D, seconds per score element]`` per ``(n, D)`` point timed ``times`` seconds: ``E = H n (world n)``,
    the score elements of the rank."""
    return [[COLOSSAL_HEADS * n * n * COLOSSAL_WORLD, d, t / (COLOSSAL_HEADS * n * n * COLOSSAL_WORLD)]
            for (n, d), t in zip(points, times)]


def calibrate_colossal(reps: int = 3, points=COLOSSAL_POINTS, rounds: int = COLOSSAL_ROUNDS) -> dict:
    """``ops/colossal.py``'s local compute per score element in one process (``_colossal_local_time``), each point
    the median over ``rounds`` rounds (order rotated) of the median of ``reps`` calls: ``colossal_table`` = seconds
    per score element at each point's score elements of the rank and D (what the model reads); the rounds'
    times as ``rounds``; also the least squares line ``t = a + E (b + c D)`` -> ``colossal_s = (a, b, c)`` for
    the record."""
    torch.set_num_threads(1)
    points = list(points)
    per_round = {p: [] for p in points}
    for r in range(rounds):
        for n, d in rotated(points, r, rounds):
            per_round[(n, d)].append(_colossal_local_time(n, d, reps))
    times = [statistics.median(per_round[p]) for p in points]
    # normal equations for t = a + b E + c E D
    rows = [(1.0, COLOSSAL_HEADS * n * n * COLOSSAL_WORLD, COLOSSAL_HEADS * n * n * COLOSSAL_WORLD * d) for n, d in points]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * t for r, t in zip(rows, times)) for i in range(3)]
    coef = torch.linalg.solve(torch.tensor(ata, dtype=torch.float64), torch.tensor(atb, dtype=torch.float64)).tolist()
    return {"colossal_s": [max(c, 0.0) for c in coef], "colossal_table": colossal_table(points, times),
            "points": [[n, d, t] for (n, d), t in zip(points, times)],
            "rounds": [[n, d, per_round[(n, d)]] for n, d in points],
            "primitive": f"ops/colossal.py fwd+bwd as rank 0 of {COLOSSAL_WORLD}, messages stubbed (_NoRing)"}


def colossal_table_of_round(colossal: dict, r: int = 0) -> list[list]:
    """The ``colossal_table`` that round ``r`` alone gives (round 0: what one pass over the points, the calibration
    until 2026-11-25, kept), from ``calibrate_colossal``'s record."""
    if "rounds" not in colossal:
        raise ValueError("this calibration timed the colossal table in one pass (no 'rounds'): the colossal rounds "
                         "study needs a calibration from 2026-11-25 on")
    return colossal_table([(n, d) for n, d, _ in colossal["rounds"]], [times[r] for _, _, times in colossal["rounds"]])


SHARING_CALL = (512, 512, 4, 64)  # q_len, k_len, heads, D of the kernel loop the sharing is measured with
SHARING_WINDOW_S = 1.5


def _kernel_seconds_per_call(window_s: float = SHARING_WINDOW_S) -> float:
    """Seconds per fwd+bwd call of ``SHARING_CALL`` (FULL), calling it for ``window_s`` in this
    process (a fixed window, so ranks running it at once compete for all of it)."""
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.plan import MaskKind

    torch.set_num_threads(1)
    kernel = make_kernel("auto")
    q_len, k_len, h, d = SHARING_CALL
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, q_len, h, d, generator=g), torch.randn(1, q_len, h, d, generator=g)
    k, v = torch.randn(1, k_len, h, d, generator=g), torch.randn(1, k_len, h, d, generator=g)

    def call():
        out, lse = kernel.forward(q, k, v, scale=d ** -0.5, kind=MaskKind.FULL, mask=None)
        kernel.backward(dout, q, k, v, out, lse, scale=d ** -0.5, kind=MaskKind.FULL, mask=None)

    call()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window_s:
        call()
        calls += 1
    return (time.perf_counter() - t0) / calls


SHARING_WINDOWS = 3


def shared_window(world: int, window_s: float) -> tuple[float, float]:
    """Every rank of the default group calls the kernel for the same window at once: ``(mean, slowest)`` seconds
    per call, the mean in throughput terms (``world`` over the sum of the ranks' calls per second: the cores'
    share each rank gets on average). Also the validation's in-round probe of the machine's speed
    (``measure.time_backends_worker``)."""
    dist.barrier()
    t = _kernel_seconds_per_call(window_s)
    times = [None] * world
    dist.all_gather_object(times, t)
    return world / sum(1.0 / x for x in times), max(times)


def sharing_worker(rank, world):
    """``shared_window`` over ``SHARING_WINDOWS`` windows: medians of the mean and of the slowest rank."""
    windows = [shared_window(world, SHARING_WINDOW_S / SHARING_WINDOWS * 2) for _ in range(SHARING_WINDOWS)]
    return (statistics.median(m for m, _ in windows), statistics.median(s for _, s in windows)) if rank == 0 else None


def measure_sharing(worlds, reps: int = 1) -> dict:
    """``{world: stretch}``: the ranks' mean seconds per kernel call (throughput of all ranks) when
    ``world`` ranks call it for the same window, over the time alone (``P`` ranks sharing the cores,
    memory bandwidth and whatever else runs on the machine now), measured with a primitive, never a
    backend. The mean, not the slowest rank: ranks of a layer wait for each other at every step, and
    a waiting rank leaves its core to the others. Also ``{"alone_s": ..., "slowest_<world>": ...}``."""

    alone = statistics.median(_kernel_seconds_per_call(SHARING_WINDOW_S / SHARING_WINDOWS * 2)
                              for _ in range(SHARING_WINDOWS))
    out = {"alone_s": alone}
    for world in worlds:
        mean, slowest = run_on_ranks(sharing_worker, world, (), timeout_s=600)[0]
        out[int(world)] = mean / alone
        out[f"slowest_{world}"] = slowest / alone  # for the record: the unfairness among ranks
    return out


def calibrated_profile(local: dict, links: dict, cores: int, sharing: dict | None = None,
                       busy: dict | None = None) -> HardwareProfile:
    """The ``HardwareProfile`` of this machine from ``calibrate_local``, ``calibrate_links`` and
    ``measure_busy`` (when given, its per-message and per-collective costs with every rank computing
    replace the idle ones): ``compute_slots`` = the cores this process may use (ranks beyond share them)."""
    from lightning_sp.cost_model import FWD_BWD_FACTOR, HardwareProfile

    links = {int(w): v for w, v in links.items()}  # JSON keys are strings
    busy = {int(w): v for w, v in busy.items()} if busy else None
    worlds = sorted(links)
    get = links.__getitem__
    lat, bw = get(worlds[0])["one_way"]
    d0 = min(r[1] for r in local["kernel_table"])
    curve = tuple((r[2], 4.0 * r[2] * r[3] * r[1] * FWD_BWD_FACTOR / (r[4] + r[5]))
                  for r in local["kernel_table"] if r[0] == "full" and r[1] == d0 and r[2] == r[3])
    fits = []
    for w in worlds:
        for op in ("all_to_all", "all_gather"):
            fits.append((op, w, float(get(w)[op][0]), float(get(w)[op][1])))
    return HardwareProfile(
        name="cpu-calibrated",
        source=f"measured here: {cores} cores, SDPA CPU kernel fp32, gloo loopback (experiments/cost_model/calibrate.py)",
        attention_curve=curve, matmul_flops=local["matmul_flops"],
        intra_bandwidth=bw, intra_latency=lat, inter_bandwidth=bw, inter_latency=lat,
        ranks_per_node=1 << 16, compute_slots=cores,
        kernel_table=tuple(tuple(r) for r in local["kernel_table"]), kernel_call_s=tuple(local["kernel_call_s"]),
        merge_s=tuple(local["merge_s"]), elementwise_s=tuple(local["elementwise_s"]),
        message_s=tuple((w, float((busy or links)[w]["message_s"])) for w in worlds), collective_fits=tuple(fits),
        collective_busy_s=tuple((op, w, float(busy[w][f"{op}_s"])) for w in worlds
                                for op in ("all_to_all", "all_gather")) if busy else (),
        colossal_s=tuple(local["colossal"]["colossal_s"]) if "colossal" in local else (0.0, 0.0, 0.0),
        colossal_table=tuple(tuple(r) for r in local.get("colossal", {}).get("colossal_table", ())),
        compute_sharing=tuple(sorted((int(w), float(x)) for w, x in (sharing or {}).items() if str(w).isdigit())),
    )


BUSY_CALL = (128, 128, 4, 32)  # q_len, k_len, heads, D: the small kernel call each rank does between messages
BUSY_ITERS = 150
BUSY_REPS = 5


def busy_worker(rank, world, iters, reps):
    """Per-message and per-collective fixed cost with every rank busy (Note [Per-call terms]): each
    rank loops ``iters`` times over one small kernel forward call (``BUSY_CALL``) with, per iteration,
    (a) nothing else, (b) a ``RingComm`` exchange of one float started before the call and waited after
    it (as the ring backends do), (c) a small all-gather after the call (the cross-rank check), (d) a
    small all-to-all after it. Each loop ends with a barrier and takes the slowest rank; the cost per
    message / collective is ``(loop with it - loop without) / iters``, median over ``reps`` rounds
    (loops rotated). Unlike ``links_worker`` (ranks waiting idle for the message), this sees a
    message waiting for its peer to get a core when more ranks than cores compute."""
    from lightning_sp.comm.ring import RingComm
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.plan import MaskKind

    torch.set_num_threads(1)
    comm = RingComm(dist.group.WORLD)
    kernel = make_kernel("auto")
    q_len, k_len, h, d = BUSY_CALL
    g = torch.Generator().manual_seed(rank)
    q, k, v = torch.randn(1, q_len, h, d, generator=g), torch.randn(1, k_len, h, d, generator=g), torch.randn(1, k_len, h, d, generator=g)
    one = torch.zeros(1)
    row = torch.zeros(4, dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(world)]
    a2a_send, a2a_recv = torch.zeros(64 * world), torch.empty(64 * world)

    def call():
        kernel.forward(q, k, v, scale=d ** -0.5, kind=MaskKind.FULL, mask=None)

    def plain():
        call()

    def message():
        pending = comm.start((one,))
        call()
        pending.wait()

    def gather():
        call()
        dist.all_gather(rows, row)

    def a2a():
        call()
        dist.all_to_all_single(a2a_recv, a2a_send)

    loops = {"plain": plain, "message": message, "all_gather": gather, "all_to_all": a2a}
    names = list(loops)
    got = {n: [] for n in names}
    for i in range(reps + 1):  # round 0 warms up
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                loops[name]()
            dist.barrier()
            t = time.perf_counter() - t0
            times = [None] * world
            dist.all_gather_object(times, t)
            if i:
                got[name].append(max(times) / iters)
    per_iter = {n: statistics.median(ts) for n, ts in got.items()}
    if rank:
        return None
    return {"plain_s": per_iter["plain"],
            **{f"{n}_s": max(per_iter[n] - per_iter["plain"], 0.0) for n in names if n != "plain"},
            "rounds": got}


def measure_busy(worlds, iters: int = BUSY_ITERS, reps: int = BUSY_REPS) -> dict:
    """``{world: {"message_s", "all_gather_s", "all_to_all_s", "plain_s", "rounds"}}`` (``busy_worker``)."""

    return {int(w): run_on_ranks(busy_worker, w, (iters, reps), timeout_s=600, pg_timeout_s=300)[0] for w in worlds}


SYNC_CALLS = 8
"""Kernel calls per synthetic step of ``sync_delay_worker``, each ended by a synchronisation."""
SYNC_STEPS = {  # name: (q_len, k_len, mask kind, backward, synchronisation after each call); 4 heads, D = 32
    "exchange_512_full_fwd": (512, 512, "full", False, "exchange"),
    "all_to_all_512_causal_fwd": (512, 512, "causal", False, "all_to_all"),
    "exchange_128x512_full_bwd": (128, 512, "full", True, "exchange"),
}
SYNC_ROUNDS = 15  # as grid 1's rows: the delay is how far a median of this many rounds sits above their fastest
SYNC_BLOCKS = 3


def sync_delay_worker(rank, world, rounds, blocks, late_s=0.0):
    """Synthetic steps timed as the validation rows are (``measure.time_backends_worker``: between barriers, the
    order rotated by one step per round), each ``SYNC_CALLS`` kernel-table calls with a synchronisation after every
    call: a ``RingComm`` exchange of one float started before the call and waited after it (the ring backends), or a
    tiny all-to-all after it (Ulysses, the collectives). Returns (rank 0) ``blocks`` lists of each step's ``rounds``
    times. ``late_s`` (the test's control): in even rounds the last rank sleeps that long before every
    synchronisation, a rank reaching it late."""
    from lightning_sp.comm.ring import RingComm
    from lightning_sp.ops.kernels import make_kernel
    from lightning_sp.ops.plan import MaskKind

    torch.set_num_threads(1)
    comm = RingComm(dist.group.WORLD)
    kernel = make_kernel("auto")
    heads, d = 4, 32
    one, a2a_send, a2a_recv = torch.zeros(1), torch.zeros(64 * world), torch.empty(64 * world)
    g = torch.Generator().manual_seed(rank)
    late = [False]

    def make_step(q_len, k_len, kind, backward, sync):
        q, dout = torch.randn(1, q_len, heads, d, generator=g), torch.randn(1, q_len, heads, d, generator=g)
        k, v = torch.randn(1, k_len, heads, d, generator=g), torch.randn(1, k_len, heads, d, generator=g)
        mk, scale = MaskKind(kind), d ** -0.5
        out, lse = kernel.forward(q, k, v, scale=scale, kind=mk, mask=None)

        def call():
            if backward:
                kernel.backward(dout, q, k, v, out, lse, scale=scale, kind=mk, mask=None)
            else:
                kernel.forward(q, k, v, scale=scale, kind=mk, mask=None)

        def step():
            dist.barrier()
            for _ in range(SYNC_CALLS):
                pending = comm.start((one,)) if sync == "exchange" else None
                call()
                if late[0] and rank == world - 1:
                    time.sleep(late_s)
                if pending is not None:
                    pending.wait()
                else:
                    dist.all_to_all_single(a2a_recv, a2a_send)
            dist.barrier()

        return step

    steps = [make_step(*spec) for spec in SYNC_STEPS.values()]
    for step in steps:  # warm-up
        step()
    out = []
    for _ in range(blocks):
        times = [[] for _ in steps]
        for r in range(rounds):
            late[0] = late_s > 0 and r % 2 == 0
            order = list(range(len(steps)))
            for i in order[r % len(order):] + order[:r % len(order)]:
                t0 = time.perf_counter()
                steps[i]()
                times[i].append(time.perf_counter() - t0)
        out.append(times)
    return out if rank == 0 else None


def sync_delay_from_rounds(blocks) -> float:
    """Seconds per synchronisation: per block, the median over the steps of (median round - fastest round) /
    ``SYNC_CALLS``; the median over blocks."""
    return statistics.median(
        statistics.median((statistics.median(ts) - min(ts)) / SYNC_CALLS for ts in block) for block in blocks)


def measure_sync_delay(worlds, rounds: int = SYNC_ROUNDS, blocks: int = SYNC_BLOCKS, late_s: float = 0.0) -> dict:
    """``{world: {"delay_s", "rounds"}}``: ``sync_delay_worker`` on ``world`` ranks (one spawn each)."""

    out = {}
    for world in worlds:
        got = run_on_ranks(sync_delay_worker, world, (rounds, blocks, late_s), timeout_s=600, pg_timeout_s=300)[0]
        out[int(world)] = {"delay_s": sync_delay_from_rounds(got), "rounds": got}
    return out


def with_sync_delay(hw: HardwareProfile, measured: dict) -> HardwareProfile:
    """``hw`` with ``sync_delay_s`` from ``measure_sync_delay`` (JSON keys may be strings)."""
    from dataclasses import replace

    return replace(hw, sync_delay_s=tuple(sorted((int(w), float(v["delay_s"])) for w, v in measured.items())))


def _read_calibration(out) -> dict:
    """``out/cost_model_calibration.json``, or an error that says what to run."""
    path = Path(out) / "cost_model_calibration.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run --part calibrate with the same --out first")
    return json.loads(path.read_text())


def load_profile(out) -> tuple[HardwareProfile, dict[int, float]]:
    """The calibrated profile in ``out/cost_model_calibration.json`` and the measured barrier time per world size."""
    from lightning_sp.cost_model import HardwareProfile  # noqa: F811  (at run time; above only for the types)

    data = _read_calibration(out)
    return HardwareProfile.from_dict(data["profile"]), {int(w): v["barrier_s"] for w, v in data["links"].items()}


def calibration_shared_seconds(out) -> dict[int, float]:
    """``{world: seconds}`` per ``SHARING_CALL`` with ``world`` ranks calling it at once, as the calibration in ``out``
    measured it (``measure_sharing``: its time alone times the stretch): what the validation's in-round probe is
    compared with."""
    sharing = _read_calibration(out)["sharing"]
    return {int(w): float(x) * float(sharing["alone_s"]) for w, x in sharing.items() if str(w).isdigit()}


def stretch_during_rows(probes: dict[int, list[float]], alone_s: float) -> dict[int, float]:
    """``{world: stretch}`` while the validation's rows ran: the median over rounds of the in-round probe
    (``measure.time_backends_worker``: ``shared_window`` on every rank at the start of each round, seconds per
    ``SHARING_CALL``) over a time of that call alone. Two are recorded in each grid file:
    - ``sharing_during_rows``: over the grid's time alone (``measure_sharing``'s ``alone_s`` at the grid's start),
      the same measure as ``measure_sharing``'s taken in every round; judged paired against the stretch at the
      grid's start, twice, by rules written before the runs: not kept (``experiments/cost_model/HISTORY.md``, "The
      stretch during the rows");
    - ``sharing_against_table``: over what the calibration's kernel table prices the call at alone
      (``probe_call_priced_s``), so the machine running slower than at calibration is in it too (Note [The stretch
      against the table])."""
    if alone_s <= 0:
        raise ValueError(f"alone_s must be positive, got {alone_s}")
    return {int(w): statistics.median(rounds) / alone_s for w, rounds in sorted(probes.items()) if rounds}


def probe_call_priced_s(hw: HardwareProfile) -> float:
    """Seconds the profile's kernel table prices one ``SHARING_CALL`` (FULL, forward and backward) at on one rank
    alone: the time the in-round probe would take on the machine the table was timed on."""
    from lightning_sp.ops.schedule import KernelCall

    q_len, k_len, heads, d = SHARING_CALL
    return sum(hw.kernel_time(KernelCall(q_len, k_len, "full", heads, heads, backward), d)
               for backward in (False, True))


LATENCY_SHAPE = (256, 8, 8, 8, 8)
"""``(N, H, H_kv, D, kv_pieces)`` of the layer whose kernel is stubbed for ``layer_latency_s``: tiny, so what is
left is the layer's fixed cost (Python, autograd, plans, hand-overs, the collectives' and messages' latency)."""
def with_layer_latency(hw: HardwareProfile, stubbed: dict, barriers: dict) -> HardwareProfile:
    """``hw`` with ``layer_latency_s``: for each measured ``(world, backend)``, the latency at which the model's
    prediction of the stubbed layer (the schedule's calls at ``LATENCY_SHAPE``, priced by ``hw``; plus the two
    barriers of the measured interval) equals the measurement (bisection: the prediction grows with it); 0 where
    the other terms already predict as much."""
    from dataclasses import replace

    from lightning_sp.cost_model import AttentionShape, predict_attention

    n, h, h_kv, d, pieces = LATENCY_SHAPE
    shape = AttentionShape(seq_len=n, num_heads=h, num_kv_heads=h_kv, head_dim=d, causal=True, batch=1, dtype_bytes=4)
    rows = []
    for world, measured in sorted((int(w), m) for w, m in stubbed.items()):
        for backend, seconds in sorted(measured.items()):
            u = 2 if backend == "usp" else None

            def predicted(latency, backend=backend, world=world, u=u):
                probe = replace(hw, layer_latency_s=((backend, world, latency),))
                return predict_attention(backend, shape, world, probe, ulysses_degree=u, kv_pieces=pieces).total_s \
                    + 2 * barriers[world]

            lo, hi = 0.0, seconds
            if predicted(lo) < seconds:
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if predicted(mid) < seconds else (lo, mid)
            rows.append((backend, world, lo))
    return replace(hw, layer_latency_s=tuple(rows))
