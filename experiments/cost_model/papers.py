"""The papers' setups, as the cost model sees them, and their published numbers (REFERENCES.md).

Every ``predict_*`` returns rows ``{study, setting, metric, model_prediction, paper_value, diff_pct,
assumptions}``: ``model_prediction`` is cost-model output (never measured), ``paper_value`` the
paper's figure, ``diff_pct = 100 (model - paper) / paper``. Where the paper does not say a detail
the model needs, the assumption is written in the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_sp.cost_model import AttentionShape, HardwareProfile, predict_attention, preset
from lightning_sp.flops import causal_attention_flops_saved, megatron_flops_per_iteration


# ------------------------------------------------------------------------------------------------
# Whole transformer layer / step, as the cost model prices it (the papers' TFLOPs and max-context setups)
# ------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A GPT-style decoder for step-level predictions."""

    num_layers: int
    hidden: int
    num_heads: int
    vocab: int = 50257
    num_kv_heads: int | None = None
    ffn_mult: int = 4

    @property
    def params(self) -> float:
        return 12.0 * self.num_layers * self.hidden ** 2 + self.vocab * self.hidden


def layer_time(model: ModelShape, seq_len: int, batch: int, backend: str, world: int, hw: HardwareProfile, *,
               ulysses_degree: int | None = None, dtype_bytes: int = 2) -> dict[str, float]:
    """fwd+bwd seconds of one transformer layer per rank: linear layers (``24 b s h^2`` fwd FLOPs,
    split over ``world``) at ``hw.matmul_flops`` + the attention of ``predict_attention``; Megatron TP+SP
    (``megatron_sp``) also pays its all-gather/reduce-scatter around the MLP (not overlapped)."""
    h = model.hidden
    shape = AttentionShape(seq_len=seq_len, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads or model.num_heads,
                           head_dim=h // model.num_heads, batch=batch, dtype_bytes=dtype_bytes, causal=True)
    attn = predict_attention(backend, shape, world, hw, ulysses_degree=ulysses_degree)
    linear = 3 * 24.0 * batch * seq_len * h * h / world / hw.matmul_flops * hw.compute_stretch(world)
    mlp_comm = 0.0
    if backend == "megatron_sp" and world > 1:
        bw, lat = hw.link(world)
        mlp_comm = 4 * (world - 1) * (lat + seq_len / world * h * batch * dtype_bytes / bw)
    return {"attention_s": attn.total_s, "linear_s": linear, "comm_s": attn.comm_s + mlp_comm,
            "exposed_comm_s": attn.exposed_comm_s + mlp_comm, "total_s": attn.total_s + linear + mlp_comm,
            "activation_bytes": attn.activation_bytes}


def model_flops(model: ModelShape, seq_len: int, batch: int, *, causal: bool = True) -> float:
    """Model FLOPs of one fwd+bwd: Megatron's ``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``
    (``lightning_sp.flops``), whose attention term counts the whole score matrix; ``causal=True``
    counts the half a causal kernel computes (``s/(12h)``), so TFLOP/s stays below peak."""
    full = megatron_flops_per_iteration(batch=batch, seq_len=seq_len, num_layers=model.num_layers,
                                        hidden=model.hidden, vocab=model.vocab)
    if not causal:
        return full
    return full - causal_attention_flops_saved(batch=batch, seq_len=seq_len, num_layers=model.num_layers,
                                               hidden=model.hidden)


def tflops_per_rank(model: ModelShape, seq_len: int, batch: int, backend: str, world: int, hw: HardwareProfile, **kw) -> float:
    """Predicted model TFLOP/s per rank: model FLOPs of the group's batch over ``world`` ranks x step time."""
    t = layer_time(model, seq_len, batch, backend, world, hw, **kw)["total_s"] * model.num_layers
    return model_flops(model, seq_len, batch) / world / t / 1e12


def step_memory_bytes(model: ModelShape, seq_len: int, batch: int, backend: str, world: int, *,
                      shard_states_over: int, checkpoint_layers: bool = True, dtype_bytes: int = 2,
                      attention: str = "flash") -> float:
    """Per-rank peak memory of one training step: mixed-precision Adam states (16 bytes/param, ZeRO-3
    over ``shard_states_over`` ranks) + stored activations (each layer's input ``2sbh/P`` with full
    recompute, else every layer's activations) + one layer's full activations during its backward.
    ``attention``: ``"flash"`` (scores never stored), ``"vanilla"`` (``5as/h`` term kept) for the
    Ring Attention Table 3 baselines."""
    s, b, h, a = seq_len, batch, model.hidden, model.num_heads
    states = 16.0 * model.params / shard_states_over
    scores = 5 * a * s / h if attention == "vanilla" or backend == "colossal" else 4 * a / h
    one_layer = s * b * h * (34 * dtype_bytes / 2 + scores) / world
    stored = (2 * s * b * h / world * model.num_layers) if checkpoint_layers else one_layer * model.num_layers
    logits = s * b * model.vocab * 4 / world  # fp32 logits of this rank's tokens
    return states + stored + one_layer + logits


def max_context(model: ModelShape, budget_bytes: float, backend: str, world: int, *, shard_states_over: int,
                batch: int = 1, attention: str = "flash", checkpoint_layers: bool = True, grid: int = 1024) -> int:
    """Largest sequence (multiple of ``grid``) whose ``step_memory_bytes`` fits ``budget_bytes`` (model)."""
    if step_memory_bytes(model, grid, batch, backend, world, shard_states_over=shard_states_over,
                         attention=attention, checkpoint_layers=checkpoint_layers) > budget_bytes:
        return 0
    lo, hi = 1, 2
    fits = lambda k: step_memory_bytes(model, k * grid, batch, backend, world, shard_states_over=shard_states_over,  # noqa: E731
                                       attention=attention, checkpoint_layers=checkpoint_layers) <= budget_bytes
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * grid


GPT_7B = ModelShape(num_layers=32, hidden=4096, num_heads=32, vocab=50257)
GPT_30B = ModelShape(num_layers=48, hidden=7168, num_heads=56, vocab=50257)  # 12 L h^2 = 29.6B
LLAMA_3B = ModelShape(num_layers=26, hidden=3200, num_heads=32, vocab=32000)  # OpenLLaMA-3B shapes
LLAMA_7B = ModelShape(num_layers=32, hidden=4096, num_heads=32, vocab=32000)
LLAMA_13B = ModelShape(num_layers=40, hidden=5120, num_heads=40, vocab=32000)
GPT_22B = ModelShape(num_layers=48, hidden=6144, num_heads=64, vocab=51200)  # Korthikanti Table 3

ULYSSES_SEQ = (8192, 16384, 32768, 65536, 131072, 262144)
ULYSSES_7B = {"ulysses": (159, 175, 178, 181, 176, 174), "megatron_sp": (106, 143, 164, 165, 158, None)}  # None: OOM
ULYSSES_30B = {"ulysses": (165, 157, 152, 147, 140, 134), "megatron_sp": (45, 68, 86, 105, None, None)}  # "~": chart
RING_TABLE3 = {  # 8xA100 NVLink, max context (K tokens): vanilla / memory-efficient / +FFN / ring
    "3B": (LLAMA_3B, (4, 32, 64, 512)), "7B": (LLAMA_7B, (2, 16, 32, 256)), "13B": (LLAMA_13B, (2, 4, 16, 128)),
}
RING_FLASH_SHARE = {"zigzag_ring": 90.2, "ring": 53.9}  # % of one flash-attn call, fwd+bwd, 8xH800


def _row(study, setting, metric, model, paper, assumptions):
    diff = None if paper in (None, 0) or model is None else round(100.0 * (model - paper) / paper, 1)
    return {"study": study, "setting": setting, "metric": metric, "model_prediction": model, "paper_value": paper,
            "diff_pct": diff, "assumptions": assumptions}


def predict_ulysses_fig(hw: HardwareProfile | None = None) -> list[dict]:
    """Ulysses (arXiv 2309.14509) TFLOPs/GPU vs sequence length, Ulysses vs Megatron-SP, 7B (32 A100)
    and 30B (64 A100). A prediction over the memory budget is reported as OOM (``None``)."""
    hw = hw or preset("a100-80gb")
    assumptions = ("model: SP/TP degree 8 inside a node (DGX A100), batch 1 sequence per group, the other "
                   "GPUs data parallel (their gradient all-reduce and ZeRO traffic not modelled), no activation "
                   "recompute in the time; Ulysses: ZeRO-3 states over all GPUs; Megatron-SP: states over t=8; "
                   "TFLOPs = 72BLsh^2(1+s/12h+V/12hL) (Megatron's count with the causal half of attention) / time; A100 80 GB. "
                   "unknown: the paper's batch per group, ZeRO stage of the Megatron-SP runs, kernel versions and "
                   "data-parallel traffic; the model is not tuned to them")
    rows = []
    for name, model, gpus, paper in (("7B", GPT_7B, 32, ULYSSES_7B), ("30B", GPT_30B, 64, ULYSSES_30B)):
        for backend in ("ulysses", "megatron_sp"):
            for i, s in enumerate(ULYSSES_SEQ):
                shard = gpus if backend == "ulysses" else 8
                mem = step_memory_bytes(model, s, 1, backend, 8, shard_states_over=shard, checkpoint_layers=True)
                tf = None if mem > hw.memory_bytes else round(tflops_per_rank(model, s, 1, backend, 8, hw), 1)
                pv = paper[backend][i]
                row = _row("Ulysses Fig. 2/3", f"{name} GPT, {gpus} A100, {backend}, N={s // 1024}K",
                           "TFLOPs/GPU", tf, pv, assumptions)
                row["model_memory_gb"] = round(mem / 1e9, 1)
                row["paper_oom"] = pv is None
                rows.append(row)
    return rows


def predict_ring_table3(hw: HardwareProfile | None = None) -> list[dict]:
    """Ring Attention (arXiv 2310.01889) Table 3: max context on 8xA100 80 GB, vanilla / memory-efficient
    attention / ring (over 8). The +chunked-FFN column is not modelled."""
    hw = hw or preset("a100-80gb")
    assumptions = ("model: bf16 params + fp32 Adam (16 B/param) sharded over 8 (FSDP), every layer recomputed "
                   "(its 2sbh input stored), one layer's full activations live in its backward, fp32 logits; "
                   "vanilla = scores stored (5as/h term), memory-efficient = flash-style; ring = same over 8 ranks. "
                   "unknown: the JAX allocator/compiler workspace, the sharding of the runs and the grid the paper "
                   "searched (it reports powers of two); the model counts stored bytes only")
    rows = []
    for name, (model, paper) in RING_TABLE3.items():
        for method, world, attn, pv in (("vanilla", 1, "vanilla", paper[0]), ("memory-efficient attn", 1, "flash", paper[1]),
                                        ("ring attention", 8, "flash", paper[3])):
            n = max_context(model, hw.memory_bytes, "zigzag_ring", world, shard_states_over=8, attention=attn)
            rows.append(_row("Ring Attention Table 3", f"{name}, 8xA100 80GB, {method}", "max context (K tokens)",
                             round(n / 1024, 1), pv, assumptions))
    return rows


def predict_ring_flash_share(hw: HardwareProfile | None = None) -> list[dict]:
    """ring-flash-attn README: fwd+bwd time of one flash-attn call on the same per-GPU work, as a share
    of the ring's (8xH800, the ``h800-80gb`` preset). Model: 8 ranks, N = 8 x 8K tokens, 32 heads of
    128, causal, bf16."""
    hw = hw or preset("h800-80gb")
    shape = AttentionShape(seq_len=65536, num_heads=32, num_kv_heads=32, head_dim=128, causal=True)
    ideal = predict_attention("ulysses", shape, 1, hw).compute_s / 8  # the whole work in one call, / P
    assumptions = ("model: h800-80gb preset, N = 64K over 8 GPUs, 32x128 heads, causal; one call = the whole "
                   "causal work / 8 at the large-block rate. unknown: the README's head count, kernel version "
                   "and whether its timing includes the ring's first-step setup")
    rows = []
    for backend, pv in RING_FLASH_SHARE.items():
        p = predict_attention(backend, shape, 8, hw)
        rows.append(_row("ring-flash-attn README", f"{backend}, 8xH800, N=64K", "% of one flash-attn call",
                         round(100 * ideal / p.total_s, 1), pv, assumptions))
    return rows


def predict_megatron_table4(hw: HardwareProfile | None = None) -> list[dict]:
    """Korthikanti et al. Table 4: one 22B layer fwd+bwd (t=8, s=2048, b=4), baseline TP vs TP+SP (ms).
    The model has flash-style attention (the paper's 2022 kernels stored the scores): expect it fast."""
    hw = hw or preset("a100-80gb")
    t = layer_time(GPT_22B, 2048, 4, "megatron_sp", 8, hw)["total_s"] * 1e3
    return [_row("Megatron-SP Table 4", "22B layer, t=8, s=2048, b=4, TP+SP, 8xA100", "fwd+bwd ms per layer",
                 round(t, 2), 19.0, "model: flash-style attention, no recompute, comm not overlapped. unknown: "
                 "the paper's kernel efficiencies (2022 kernels stored the scores)")]


def predict_all() -> list[dict]:
    return predict_ulysses_fig() + predict_ring_table3() + predict_ring_flash_share() + predict_megatron_table4()


def presets_used() -> dict[str, HardwareProfile]:
    return {name: preset(name) for name in ("a100-80gb", "h800-80gb")}
