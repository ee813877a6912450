"""Throughput per rank: one training step of a small transformer under every sequence-parallel backend and
Megatron TP+SP (Ulysses Fig. 3), and each backend's attention fwd+bwd as a share of one local kernel call
doing the same per-rank work (ring-flash-attn's table). Measured on whatever device the ranks run on (CPU
and gloo here); nothing in this module predicts anything.

Timing rules (Note [Honest timing on a shared machine]):

- one intra-op thread per rank (the spawner sets it); ranks are processes;
- the implementations compared at one length are built first, then timed *alternating* rep by rep
  (the order rotates every rep), so a change in machine load hits all of them alike;
- a barrier before and after every timed call; a rep's time is the slowest rank's (max over ranks);
  the reported time is the median over reps, after ``warmup`` untimed reps;
- each rank also records its CPU time (``time.process_time``) per rep: ``cpu/wall`` near 1 means the
  rank had a core to itself, near ``cores/P`` that ``P`` ranks shared ``cores`` cores (oversubscribed);
- the 1-minute load average (``os.getloadavg``) is recorded around every group of measurements.

Model FLOPs are Megatron's (``lightning_sp.callbacks.megatron_flops_per_iteration``:
``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``, full non-causal attention, MLP ratio 4, MHA), the formula
DeepSpeed-Ulysses and Megatron report TFLOPs with. ``measure_step`` is the entry point for other code
(e.g. a cost model) that needs step times of one method.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from experiments.common.timing import Timing, _barrier, time_alternating  # noqa: F401  (re-exported)

ATTENTION_BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal")
MEGATRON_SP = "megatron_sp"  # Megatron tensor + sequence parallelism over all P ranks (tensor_parallel_size=P)
LOCAL = "local"  # one process, no parallelism
METHODS = (*ATTENTION_BACKENDS, MEGATRON_SP)

# Note [Honest timing on a shared machine]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The machine is shared and has fewer cores than we would like. A method timed in a block of reps
# after another method's block can look faster or slower only because another job started in between.
# Alternating the methods rep by rep (rotating which goes first) spreads such drift over all of them;
# the median over reps drops the reps that a burst of load hit. The barriers make a rep's time the
# time of the slowest rank, which is what a synchronous training step costs. What no rotation can fix:
# P ranks on fewer than P cores time-share them, so per-rank throughput at P > cores is what
# oversubscription gives, not what P devices would; rows say so (``oversubscribed``, ``cpu_over_wall``).


@dataclass(kw_only=True)
class ModelShape:
    """The transformer trained in the step (``lightning_sp.models.Transformer``)."""

    d_model: int = 256
    """Hidden width ``h``."""
    n_layers: int = 2
    """Transformer blocks ``L``."""
    n_heads: int = 8
    """Attention heads (MHA); Ulysses and TP need ``P`` to divide them."""
    vocab_size: int = 31
    """31: the protein alphabet of ``ProteinEncoder``."""
    causal: bool = False
    """``False``: a bidirectional protein encoder; ``True``: a GPT-like decoder."""
    batch: int = 1
    """Sequences per step."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must be n_heads={self.n_heads} times an even head dim")

    def flops_per_step(self, seq_len: int) -> float:
        """Megatron model FLOPs of one forward + backward over ``batch x seq_len`` tokens."""
        from lightning_sp.callbacks import megatron_flops_per_iteration

        return megatron_flops_per_iteration(batch=self.batch, seq_len=seq_len, num_layers=self.n_layers,
                                            hidden=self.d_model, vocab=self.vocab_size)


# ------------------------------------------------------------------------------------------ training step


@dataclass(kw_only=True)
class TrainingStep:
    """One method's model, this rank's shard of the batch and an optimizer; ``step()`` runs
    forward, loss, backward, the gradient reduction the strategy would do, and AdamW."""

    method: str
    model: torch.nn.Module
    inputs: tuple
    labels: torch.Tensor
    optimizer: torch.optim.Optimizer
    reduce_gradients: Callable[[], None]
    comm: list = field(default_factory=list)
    """``CommStats`` of the library's collectives (attention or TP layers; not the gradient reduction)."""
    last_loss: float | None = None

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(*self.inputs)  # [B, S_local, V] (CP) or [B, S, V/t] (TP)
        loss = self.model.cross_entropy(logits, self.labels)
        loss.backward()
        self.reduce_gradients()
        self.optimizer.step()
        self.last_loss = float(loss.detach())

    def comm_bytes(self) -> int:
        return sum(c.total_bytes for c in self.comm)

    def reset_comm(self) -> None:
        for c in self.comm:
            c.reset()


def _global_batch(shape: ModelShape, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels ``[B, N]`` (the same on every rank: same seed)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(shape.vocab_size, (shape.batch, seq_len), generator=g)
    labels = torch.randint(shape.vocab_size, (shape.batch, seq_len), generator=g)
    return ids, labels


def _all_reduce_mean(params: list[torch.nn.Parameter], group) -> Callable[[], None]:
    """What DDP does over the ``sp`` ranks, as one bucket after backward: average every gradient."""
    world = dist.get_world_size(group)

    def reduce() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # [numel]: one bucket
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    return reduce


def build_training_step(method: str, *, seq_len: int, shape: ModelShape, group=None, kernel: str = "sdpa",
                        seed: int = 0, lr: float = 1e-4) -> TrainingStep:
    """``method``: one of ``ATTENTION_BACKENDS`` (context parallel over ``group``, weights replicated,
    gradients averaged over it), ``"megatron_sp"`` (TP+SP over ``group``) or ``"local"`` (one process).
    Every method builds the same model from ``seed`` and trains on the same global batch."""
    from lightning_sp import SequenceParallelAttention, SequenceParallelContext, sequence_positions, shard_sequence
    from lightning_sp.models.layers import Transformer, TransformerConfig

    if method not in (*METHODS, LOCAL):
        raise ValueError(f"method must be one of {(*METHODS, LOCAL)}, got {method!r}")
    world = 1 if group is None else dist.get_world_size(group)
    if (method == LOCAL) != (world == 1):
        raise ValueError(f"method {method!r} with a group of {world} rank(s): 'local' runs on one rank, the others on > 1")
    if method in ("ulysses", MEGATRON_SP) and shape.n_heads % world:
        raise ValueError(f"{method} over P={world} ranks needs P to divide n_heads={shape.n_heads}")
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=shape.vocab_size, d_model=shape.d_model, n_layers=shape.n_layers,
                            n_heads=shape.n_heads, causal=shape.causal)
    model = Transformer(cfg)
    ids, labels = _global_batch(shape, seq_len, seed + 1)
    attn_backend = method if method in ATTENTION_BACKENDS else LOCAL
    ctx = SequenceParallelContext(group=group if method in ATTENTION_BACKENDS else None, backend=attn_backend,
                                  kernel=kernel, global_seq_len=seq_len)
    attns = [m for m in model.modules() if isinstance(m, SequenceParallelAttention)]
    for m in attns:
        m.bind(ctx)
        m.validate_inputs = False  # the inputs are the same on every rank by construction
        m.kv_pieces = 8  # as the committed results were measured (then the default)
    comm = [ctx.comm]
    if method == MEGATRON_SP:
        from lightning_sp.tensor_parallel import TensorParallelContext, bind_tensor_parallel
        from lightning_sp.tensor_parallel.grads import reduce_replicated_gradients

        tp = TensorParallelContext(group=group, sequence_parallel=True)
        sharded = set(bind_tensor_parallel(model, tp))
        comm.append(tp.comm)
        inputs = (ids,)  # the whole sequence; the embedding keeps this rank's S/t rows
        reduce = lambda: reduce_replicated_gradients(model, sharded, group)  # noqa: E731 - as the strategy does
    elif method == LOCAL:
        inputs, reduce = (ids,), (lambda: None)
    else:
        layout = attns[0].layout
        pos = sequence_positions(seq_len, group, layout=layout).expand(shape.batch, -1)  # [B, N/P] global positions
        ids, labels = (shard_sequence(t, group, layout=layout) for t in (ids, labels))  # [B, N/P]
        inputs = (ids, pos)
        reduce = _all_reduce_mean(list(model.parameters()), group)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return TrainingStep(method=method, model=model, inputs=inputs, labels=labels, optimizer=opt,
                        reduce_gradients=reduce, comm=comm)


def measure_step(method: str, *, seq_len: int, shape: ModelShape | None = None, group=None, warmup: int = 1,
                 reps: int = 5, kernel: str = "sdpa") -> Timing:
    """Step times of ``method`` on this rank (call it on every rank of ``group``; ``group=None`` and
    ``method="local"`` for one process). Returns this rank's ``Timing`` (wall and CPU seconds per rep)."""
    step = build_training_step(method, seq_len=seq_len, shape=shape or ModelShape(), group=group, kernel=kernel)
    return time_alternating({method: step.step}, warmup=warmup, reps=reps, group=group)[method]


# ------------------------------------------------------------------------------------ attention share


def _attention_call(backend: str, *, seq_len: int, heads: int, head_dim: int, causal: bool, group, kernel: str,
                    seed: int = 0) -> Callable[[], None]:
    """fwd+bwd of ``backend`` on this rank's shard of a global ``[1, N, H, D]`` q, k, v; ``"local"``:
    one local kernel call on this rank's ``N/P`` contiguous tokens only (no communication)."""
    from lightning_sp import SequenceParallelAttention, shard_sequence

    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, seq_len, heads, head_dim, generator=g) for _ in range(4))
    if backend == LOCAL:
        attn = SequenceParallelAttention(causal=causal, backend="local", kernel=kernel)
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        s = seq_len // world
        q, k, v, dout = (t[:, rank * s: (rank + 1) * s].clone() for t in (q, k, v, dout))  # [1, N/P, H, D]
        seq = None
    else:
        attn = SequenceParallelAttention(causal=causal, backend=backend, group=group, kernel=kernel, validate_inputs=False,
                                         kv_pieces=8)  # as the committed results were measured (then the default)
        q, k, v, dout = (shard_sequence(t, group, layout=attn.layout).clone() for t in (q, k, v, dout))
        seq = seq_len
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call() -> None:
        for t in (q, k, v):
            t.grad = None
        attn(q, k, v, seq_len=seq).backward(dout)

    return call


# ------------------------------------------------------------------------------------------- rank workers


@dataclass(kw_only=True)
class GridSpec:
    """What one spawn measures (the same object on every rank)."""

    shape: ModelShape
    seq_lens: Sequence[int]
    methods: Sequence[str]
    attention_seq_lens: Sequence[int] = ()
    attention_causal: bool = True
    warmup: int = 1
    reps: int = 5
    kernel: str = "sdpa"


def rank_worker(rank: int, world: int, spec: GridSpec) -> dict:
    """Runs on every rank (``experiments.common.run_on_ranks``): training steps at every length,
    then the attention shares. Returns this rank's per-rep times (the parent takes max over ranks)."""
    group = dist.group.WORLD if world > 1 else None
    out: dict = {"training": [], "attention": []}
    for n in spec.seq_lens:
        load0 = os.getloadavg()[0]
        steps = {m: build_training_step(m, seq_len=n, shape=spec.shape, group=group, kernel=spec.kernel)
                 for m in spec.methods}
        losses: dict[str, float] = {}
        comm: dict[str, int] = {}
        for m, st in steps.items():  # one untimed step each: the loss from the same initial weights, the bytes of one step
            st.reset_comm()
            st.step()
            losses[m], comm[m] = st.last_loss, st.comm_bytes()
        timings = time_alternating({m: st.step for m, st in steps.items()}, warmup=spec.warmup, reps=spec.reps, group=group)
        load1 = os.getloadavg()[0]
        for m, t in timings.items():
            out["training"].append({"method": m, "seq_len": n, "wall_s": t.wall_s, "cpu_s": t.cpu_s,
                                    "loss_step0": losses[m], "lib_comm_bytes": comm[m], "load_1m": [load0, load1]})
        del steps
    if world > 1:
        for n in spec.attention_seq_lens:
            load0 = os.getloadavg()[0]
            calls = {b: _attention_call(b, seq_len=n, heads=spec.shape.n_heads, head_dim=spec.shape.d_model // spec.shape.n_heads,
                                        causal=spec.attention_causal, group=group, kernel=spec.kernel)
                     for b in (LOCAL, *ATTENTION_BACKENDS)}
            timings = time_alternating(calls, warmup=spec.warmup, reps=spec.reps, group=group)
            load1 = os.getloadavg()[0]
            for b, t in timings.items():
                out["attention"].append({"backend": b, "seq_len": n, "wall_s": t.wall_s, "cpu_s": t.cpu_s,
                                         "load_1m": [load0, load1]})
            del calls
    return out


def _max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank)]


def collect_rows(per_rank: list[dict], world: int, spec: GridSpec, cores: int) -> list[dict]:
    """Result rows from every rank's ``rank_worker`` output: per rep the slowest rank, median over reps."""
    rows = []
    shape = spec.shape
    oversubscribed = world > cores
    for i, r0 in enumerate(per_rank[0]["training"]):
        walls = _max_over_ranks([pr["training"][i]["wall_s"] for pr in per_rank])
        cpu_over_wall = statistics.mean(statistics.median(pr["training"][i]["cpu_s"]) / statistics.median(pr["training"][i]["wall_s"])
                                        for pr in per_rank)
        n, step_s = r0["seq_len"], statistics.median(walls)
        flops = shape.flops_per_step(n)
        rows.append({
            "section": "training_step", "method": r0["method"], "world": world, "seq_len": n, "batch": shape.batch,
            "d_model": shape.d_model, "n_layers": shape.n_layers, "n_heads": shape.n_heads, "vocab_size": shape.vocab_size,
            "causal": shape.causal, "step_s": step_s, "step_s_min": min(walls),
            "tokens_per_s_per_rank": shape.batch * n / step_s / world,
            "model_tflops_per_rank": flops / step_s / world / 1e12, "megatron_flops_per_step": flops,
            "cpu_over_wall": cpu_over_wall, "oversubscribed": oversubscribed,
            "loss_step0": r0["loss_step0"], "lib_comm_mib_per_step_rank0": r0["lib_comm_bytes"] / 2**20,
            "load_1m_before": r0["load_1m"][0], "load_1m_after": r0["load_1m"][1],
            "reps": spec.reps, "warmup": spec.warmup, "step_s_all": walls,
        })
    by_n: dict[int, dict[str, list[float]]] = {}
    for i, r0 in enumerate(per_rank[0]["attention"]):
        walls = _max_over_ranks([pr["attention"][i]["wall_s"] for pr in per_rank])
        by_n.setdefault(r0["seq_len"], {})[r0["backend"]] = walls
    for i, r0 in enumerate(per_rank[0]["attention"]):
        if r0["backend"] == LOCAL:
            continue
        n = r0["seq_len"]
        walls, kernel_walls = by_n[n][r0["backend"]], by_n[n][LOCAL]
        cpu_over_wall = statistics.mean(statistics.median(pr["attention"][i]["cpu_s"]) / statistics.median(pr["attention"][i]["wall_s"])
                                        for pr in per_rank)
        backend_s, kernel_s = statistics.median(walls), statistics.median(kernel_walls)
        rows.append({
            "section": "attention_share", "method": r0["backend"], "world": world, "seq_len": n,
            "local_tokens": n // world, "n_heads": shape.n_heads, "head_dim": shape.d_model // shape.n_heads,
            "causal": spec.attention_causal, "kernel": spec.kernel,
            "attention_fwd_bwd_s": backend_s, "one_kernel_call_s": kernel_s,
            "share_of_kernel": world * kernel_s / backend_s,
            "cpu_over_wall": cpu_over_wall, "oversubscribed": oversubscribed,
            "load_1m_before": r0["load_1m"][0], "load_1m_after": r0["load_1m"][1],
            "reps": spec.reps, "warmup": spec.warmup, "attention_s_all": walls, "kernel_s_all": kernel_walls,
        })
    return rows


def spec_dict(spec: GridSpec) -> dict:
    return asdict(spec)
