"""The choices the library makes for users who do not benchmark: which backend ``"auto"`` runs, and how
many pieces each K/V block travels in (``kv_pieces="auto"``).

Note [auto measures its candidates]
-----------------------------------
The cost model (``cost_model.choose_backend``) names the candidates exact on ``auto``'s zigzag layout
and excludes the rest (heads that do not split, usp sub-groups that cannot be built). Which candidate is
fastest is then **measured**, not predicted: on the first call of a shape bucket every rank times each
candidate's fwd+bwd on random tensors of the call's shapes (one warm-up round, then ``ROUNDS`` rounds in
rotated order), the per-candidate medians are all-reduced with MAX (the slowest rank decides a step's
time); the candidates within ``CLOSE`` of the fastest (a close call, where one noisy round could flip the
choice) get ``EXTRA_ROUNDS`` more rounds, and every rank takes the same argmin of the agreed medians. The
decision is cached in memory per bucket and on disk per machine (``auto_cache_path()``), so the next process
pays nothing::

    first call of a bucket:  [cache lookup, agreed] -> hit:  use it
                                                    -> miss: time every candidate (all ranks, same order)
                                                             -> MAX over ranks -> close calls: more rounds
                                                             -> argmin -> write cache

Every step that picks a collective is agreed: the cache lookup is an all-reduce of the candidate index
(ranks whose disks disagree all measure), and the trials run on every rank in the same order. A bucket is
the call's shapes with the length rounded up to a power of two, so lengths that change every batch
measure at most once per octave. Cost at a bucket's first call: ``(1 + ROUNDS) x candidates + EXTRA_ROUNDS x
close candidates`` fwd+bwd of one attention layer (4 to 8 per candidate; 3.4-23 s on the 2-core CPU grid of
``benchmarks/auto/run.py``). ``SequenceParallelContext.auto_policy="model"`` (or a ``hardware`` profile, or
``LIGHTNING_SP_AUTO=model``) keeps the cost model's choice instead. Close calls exist because the fastest
exact backends often lie within a few percent of each other; one noisy round (another process, the
scheduler) then decides which wins.

Note [kv_pieces from a memory budget]
-------------------------------------
K/V in pieces lowers the peak memory per rank and costs time (more, smaller messages and kernel calls).
``kv_pieces="auto"`` therefore runs whole blocks (1) unless a memory budget binds: the fewest pieces in
``1, 2, 4, 8, 16`` whose predicted peak (``predicted_peak_bytes``) fits the budget, else the most pieces.
The budget is the module's ``memory_budget``, else the context's (the strategy's), else on CUDA a
quarter of the device's free memory at the first call (the rest is for the other layers' activations),
the minimum over the ranks; on CPU with no budget, whole blocks. ``ulysses`` is the exception (next Note).

Note [Ulysses' head groups by default]
--------------------------------------
For ``ulysses`` ``kv_pieces`` is the number of head groups (Note [Heads in groups] in ``ops/backends.py``): the
same all-to-alls (q, k, v gathered whole), one kernel call per group. Where the kernel reads head-major memory
(the CPU flash op, Note [Head-major gather]) the gather copies each group apart anyway, so two groups cost two
kernel calls of half the heads and one copy of ``dout, dq, dk, dv``; they lower the peak per rank
below DeepSpeed's Ulysses, which runs whole heads. So where memory does not bind (no budget, or whole heads fit
it) and the gather copies anyway, ``"auto"`` runs ``ulysses`` in ``ULYSSES_GROUPS_WHEN_FREE`` groups when the
cost model predicts at most ``GROUPS_MAX_PREDICTED_COST`` times whole heads' time on the bound hardware profile
and the shard holds at least ``GROUPS_MIN_SHARD_TOKENS`` tokens, else whole heads. Measured on CPU gloo at P = 2
(benchmarks/README.md, section 8, "Ulysses: groups after the gather"). On CUDA (seq-major gathers) each group
would cost one more copy of q, k, v and launches the model does not price, so there it stays whole heads unless
a budget binds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_sp.comm.device import group_device
from lightning_sp.comm.release import collective

log = logging.getLogger(__name__)

ROUNDS = 3
"""Timed rounds per candidate after one warm-up round (median taken)."""

CLOSE = 1.15
"""Candidates whose agreed median is within this factor of the fastest after ``ROUNDS`` are a close call ..."""

EXTRA_ROUNDS = 4
"""... and get this many more timed rounds (median over all ``ROUNDS + EXTRA_ROUNDS``) before auto decides."""

PIECE_CHOICES = (1, 2, 4, 8, 16)
"""``kv_pieces="auto"`` picks the fewest of these that fits the budget."""

CUDA_FREE_MEMORY_SHARE = 0.25
"""Without a budget on CUDA: the share of the device's free memory one attention call may peak at."""

PEAK_MARGIN = 1.5
"""The predicted peak is the fitted one times this, so that it bounds the measured peak from above: the fit is
within 4.2% on its calibration rows but 20% low at two shapes it never saw ((N, H, H_kv, D) = (2048, 8, 8, 64)
and (2048, 16, 4, 32), measured 2026-11-23), so its terms miss something (per-head or per-call buffers).
Pessimistic by design: an overestimate costs more pieces (time), an underestimate an out-of-memory."""

# Peak per rank of one fwd+bwd, inputs (q, k, v, dout) included, from the rank's q shard bytes ``u`` and K/V shard
# bytes ``u_kv`` (after Ulysses' K/V head replication): whole blocks ``w_u * u + w_kv * u_kv``; in ``m > 1``
# pieces ``f_u * u + f_kv * u_kv + (m_u * u + m_kv * u_kv) / m``. Non-negative least squares on allocator peaks
# (``experiments.common.memory.AllocatorPeak``) at P = 4, fp32, causal, shapes (N, H, H_kv, D) = (4096, 16, 16, 32)
# and (2048, 8, 2, 64), kv_pieces 1, 2, 4, 8 (``benchmarks/kv_pieces/calibrate_peak_memory.py``, 2026-11-23; max error on
# those rows 4.2%). ``tests/distributed/test_choices.py`` checks the prediction at other shapes. ``ulysses``
# re-fitted 2026-11-24 (Note [Heads in groups]: groups after the gather; its groups are head-group counts, so
# only the first shape has rows with groups). The rings' rows are kept from 2026-11-23 on purpose: a rerun
# without a budget fits their whole blocks higher (the head-major copies of Note [Head-major blocks]), which a
# budget in force turns off.
#                  (w_u,   w_kv,   f_u,   f_kv,  m_u,   m_kv)
_PEAK_MODEL: dict[str, tuple[float, float, float, float, float, float]] = {
    "ring":         (2.375, 13.188, 3.836, 1.669, 0.0,   8.192),
    "zigzag_ring":  (3.985, 7.687,  3.836, 1.669, 0.0,   8.192),
    "allgather_kv": (4.188, 6.375,  4.834, 3.166, 0.0,   0.0),    # + its gathered K/V, 2 P u_kv
    "ulysses":      (6.501, 6.03,   9.532, 0.0,   3.0,   0.0),    # 2026-11-24: groups after the gather
    "usp":          (7.189, 7.374,  5.939, 3.87,  1.085, 0.0),
}


ULYSSES_GROUPS_WHEN_FREE = 2
"""Head groups ``kv_pieces="auto"`` runs ``ulysses`` in where memory does not bind (Note [Ulysses' head groups by
default]); ``head_group_count`` lowers it where the K/V heads per rank do not divide."""

GROUPS_MAX_PREDICTED_COST = 1.01
"""... when the cost model predicts the groups at most this times whole heads' fwd+bwd time ..."""

GROUPS_MIN_SHARD_TOKENS = 2048
"""... and the shard holds at least this many tokens: the shortest shard measured at P = 2 on CPU (N = 4096);
shorter shards are not trusted to the model, which prices no per-call overhead for the groups' kernel calls."""


def ulysses_groups_when_memory_is_free(*, batch: int, shard_len: int, num_heads: int, num_kv_heads: int,
                                       head_dim: int, element_size: int, world: int, causal: bool, hardware,
                                       gather_copies: bool) -> int:
    """``kv_pieces`` for ``ulysses`` where memory does not bind: ``ULYSSES_GROUPS_WHEN_FREE`` or 1 (Note
    [Ulysses' head groups by default]). ``hardware``: the cost model's ``HardwareProfile``; ``gather_copies``:
    the all-to-all copies its result anyway (the kernel prefers head-major memory). A function of the shapes,
    the kernel, the device type and the profile only, so every rank decides the same (the shapes are checked
    across ranks)."""
    from lightning_sp import cost_model

    if not gather_copies or shard_len < GROUPS_MIN_SHARD_TOKENS or num_heads % world:
        return 1
    shape = cost_model.AttentionShape(seq_len=shard_len * world, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, batch=batch, dtype_bytes=element_size, causal=causal)
    whole = cost_model.predict_attention("ulysses", shape, world, hardware, kv_pieces=1).total_s
    groups = cost_model.predict_attention("ulysses", shape, world, hardware,
                                          kv_pieces=ULYSSES_GROUPS_WHEN_FREE).total_s
    return ULYSSES_GROUPS_WHEN_FREE if groups <= GROUPS_MAX_PREDICTED_COST * whole else 1


def piece_candidates(max_pieces: int | None = None) -> tuple[int, ...]:
    return tuple(p for p in PIECE_CHOICES if max_pieces is None or p <= max_pieces)


def predicted_peak_bytes(backend: str, *, batch: int, shard_len: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, element_size: int, world: int, pieces: int,
                         ulysses_degree: int | None = None) -> int:
    """Predicted peak bytes per rank of one attention fwd+bwd on a shard of ``shard_len`` tokens, its inputs
    ``q, k, v, dout`` included (``_PEAK_MODEL`` times ``PEAK_MARGIN``; backends outside it: the ring's).
    ``ulysses_degree``: ``usp``'s inner degree (default 2)."""
    from lightning_sp.ops.backends import head_group_count
    from lightning_sp.ops.ring_attention import piece_count

    kv_heads = num_kv_heads
    split = world if backend == "ulysses" else (ulysses_degree or 2) if backend == "usp" else 1
    if split > num_kv_heads and split % num_kv_heads == 0:  # Ulysses replicates K/V heads up to its degree
        kv_heads = split
    u = batch * shard_len * num_heads * head_dim * element_size
    u_kv = batch * shard_len * kv_heads * head_dim * element_size
    w_u, w_kv, f_u, f_kv, m_u, m_kv = _PEAK_MODEL.get(backend, _PEAK_MODEL["ring"])
    if backend == "ulysses":  # what runs: head groups dividing the K/V heads per rank
        m = head_group_count(pieces, kv_heads // split, shard_len)
    else:  # pieces never shorter than MIN_PIECE_TOKENS
        m = piece_count(pieces, shard_len)
    peak = w_u * u + w_kv * u_kv if m == 1 else f_u * u + f_kv * u_kv + (m_u * u + m_kv * u_kv) / m
    if backend == "allgather_kv":  # the gathered K/V of the whole sequence: kept by design
        peak += 2 * world * batch * shard_len * num_kv_heads * head_dim * element_size
    return int(PEAK_MARGIN * peak)


def fewest_pieces_that_fit(peak_for: Callable[[int], int], budget: int | None) -> tuple[int, int]:
    """``(pieces, predicted peak)``: whole blocks without a budget, else the fewest of ``PIECE_CHOICES`` that
    fit, else the most (with a warning: the call may run out of memory)."""
    if budget is None:
        return 1, peak_for(1)
    for pieces in PIECE_CHOICES:
        peak = peak_for(pieces)
        if peak <= budget:
            return pieces, peak
    log.warning("lightning_sp: no kv_pieces in %s keeps one attention call under the memory budget of %.3g GiB "
                "(%.3g GiB predicted with %d pieces); running with %d. Lower the sequence length per rank or "
                "raise the sequence-parallel degree", PIECE_CHOICES, budget / 2**30, peak / 2**30, pieces, pieces)
    return pieces, peak


def agreed_min(value: int, group, device: torch.device) -> int:
    """The minimum of ``value`` over the ranks of ``group`` (every rank must call)."""
    t = torch.tensor([value], dtype=torch.int64, device=group_device(group, device))
    collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# -- auto: measured -----------------------------------------------------------------------------------


def auto_policy(policy: str | None, hardware) -> str:
    """``"measure"`` or ``"model"`` (Note [auto measures its candidates])."""
    if policy is None:
        policy = os.environ.get("LIGHTNING_SP_AUTO") or ("model" if hardware is not None else "measure")
    if policy not in ("measure", "model"):
        raise ValueError(f"auto_policy must be 'measure' or 'model', got {policy!r}")
    if torch.compiler.is_compiling():
        return "model"
    return policy


def length_bucket(n: int) -> int:
    """The power of two at or above ``n``: lengths in one octave share ``auto``'s decision."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def machine_key(device: torch.device) -> str:
    """What the timings depend on beyond the shapes: device, torch version, threads, host CPU."""
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = f"cpu:{platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"
    return f"{dev}|torch {torch.__version__}"


def auto_cache_path() -> Path:
    """``$LIGHTNING_SP_CACHE_DIR/auto_backend.json``, default ``~/.cache/lightning_sp/``."""
    root = os.environ.get("LIGHTNING_SP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_sp")
    return Path(root) / "auto_backend.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, label: str) -> None:
    """Merge ``key -> label`` into the cache file, atomically (temp file + rename); never fails a step."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = label
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("lightning_sp: could not write auto's decision cache %s: %s", path, e)


def cached_label(key: str, labels: Sequence[str], group, device: torch.device) -> str | None:
    """The label cached for ``key`` if every rank's cache holds the same one, else ``None`` (agreed)."""
    label = _read_cache(auto_cache_path()).get(key)
    index = labels.index(label) if label in labels else -1
    t = torch.tensor([index, -index], dtype=torch.int64, device=group_device(group, device))
    collective(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(t[0]), -int(t[1])
    return labels[hi] if hi == lo and hi >= 0 else None


def measure_candidates(run: Callable[[str], None], labels: Sequence[str], group, device: torch.device,
                       rounds: int = ROUNDS, close: float = CLOSE,
                       extra_rounds: int = EXTRA_ROUNDS) -> dict[str, float]:
    """Median seconds of ``run(label)`` (one fwd+bwd) per label, the MAX over the ranks (identical everywhere).
    One warm-up round, then ``rounds`` rounds, each in an order rotated by one, ranks aligned by a barrier; then
    the labels within ``close`` of the fastest get ``extra_rounds`` more rounds (which ones is decided from the
    agreed medians, so every rank runs the same trials) and their medians are taken over all their rounds."""
    labels = list(labels)
    times: dict[str, list[float]] = {label: [] for label in labels}

    def timed_rounds(which: list[str], count: int, warmup: int) -> None:
        for r in range(warmup + count):
            order = which[r % len(which):] + which[: r % len(which)]
            for label in order:
                dist.barrier(group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                run(label)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r >= warmup:
                    times[label].append(time.perf_counter() - start)

    def agreed_medians() -> dict[str, float]:
        medians = torch.tensor([statistics.median(times[label]) for label in labels], dtype=torch.float64,
                               device=group_device(group, device))
        collective(dist.all_reduce, medians, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(labels, medians.tolist()))

    timed_rounds(labels, rounds, warmup=1)
    measured = agreed_medians()
    best = min(measured.values())
    contenders = [label for label in labels if measured[label] <= close * best]
    if len(contenders) > 1 and extra_rounds > 0:  # a close call: more samples where the choice is made
        timed_rounds(contenders, extra_rounds, warmup=0)
        measured = agreed_medians()
    return measured


def agreed_fastest(key: str, labels: Sequence[str], run: Callable[[str], None], group,
                   device: torch.device) -> tuple[str, dict[str, float] | None]:
    """``(label, measured seconds or None if cached)``: the same on every rank of ``group``."""
    if len(labels) == 1:
        return labels[0], None
    cached = cached_label(key, labels, group, device)
    if cached is not None:
        return cached, None
    measured = measure_candidates(run, labels, group, device)
    best = min(labels, key=lambda label: (measured[label], labels.index(label)))
    if dist.get_rank(group) == 0 or os.environ.get("LOCAL_RANK") == "0":  # one writer per node
        _write_cache(auto_cache_path(), key, best)
    return best, measured
