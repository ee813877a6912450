"""The planner against measurement: predicted vs measured peak memory per rank and step time of whole training
steps (forward, backward, optimizer step) under ``SequenceParallelStrategy``, on CPU gloo ranks.

    OMP_NUM_THREADS=1 python -m experiments.planner.run                 # the grid (P = 2 and 4), to runs/planner/
    OMP_NUM_THREADS=1 python -m experiments.planner.run --memory-only --publish --worlds 2   # the committed peaks,
    OMP_NUM_THREADS=1 python -m experiments.planner.run --memory-only --publish --worlds 4   # in two parts
    OMP_NUM_THREADS=1 python -m experiments.planner.run --repredict --publish   # after a change to the planner
    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.run --publish --calibrate-kernel
    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.run --publish --calibrate-layer
    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.run --publish --calibrate-sync
    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.run --publish --calibrate-overhead
    OMP_NUM_THREADS=1 python -m experiments.planner.run --publish --calibrate-overhead --repredict   # refit
    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.run --publish --time   # (--recommend 0, 1)
    OMP_NUM_THREADS=1 python -m experiments.planner.run --publish --time --repredict   # (--recommend 0, 1)
    OMP_NUM_THREADS=1 python -m experiments.planner.run --smoke         # two rows, a few seconds

Measured peak: PyTorch's CPU allocator peak (``AllocatorPeak``) over building the model and two optimizer
steps of ``Trainer.fit`` on one rank (the max over ranks), the previous row collected before: parameters,
gradients, DDP's buckets or FSDP's gathered blocks (each transformer block its own unit), AdamW's state,
activations and every temporary the allocator served; not gloo's own buffers nor Python objects. Measured
step time: the median over steps 3-8 of a separate, unprofiled fit (``on_train_batch_start`` to
``on_train_batch_end``, the optimizer step included), max over ranks. Predicted: ``lightning_sp.planner``'s
``memory_bytes`` / ``step_time`` for the same layout, ``32-true``, the committed CPU calibration of the cost
model, and for step times, measured just before the rows (this VM's speed drifts by tens of percent over hours):
the attention kernel's table at head dims 8-128 (``--calibrate-kernel``), the layer's non-attention costs measured
by micro-benchmarks (``--calibrate-layer``: matmul rates at the layers' shapes, norms and activations, transformers'
decoder layer's small ops, the loss per vocabulary, AdamW; Note [Layer rates]), the wait for the slowest rank
at a synchronization (``--calibrate-sync``, 2 and 4 ranks; Note [Rank skew]) and the training loop's fixed time per step
calibrated on tiny models (``CALIBRATION_MODELS``: the project's encoders, transformers' Llamas). Nothing in the
planner is fitted to these rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "planner_validation.json"
CPU_PROFILE = HERE.parents[0] / "cost_model" / "results" / "new_machine" / "cost_model_cpu_profile.json"

# (name, how to build, its planner spec source)
MODELS = {
    "protein_encoder": dict(kind="project", cls="ProteinEncoder", init=dict(d_model=128, n_layers=2, n_heads=4)),
    "multimodal_decoder": dict(kind="project", cls="MultimodalDecoder",
                               init=dict(d_model=128, n_layers=2, n_heads=8, n_kv_heads=2)),
    "llama_gqa": dict(kind="hf", model_type="llama", task="causal_lm",
                      config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                  intermediate_size=256, vocab_size=4096, tie_word_embeddings=False)),
    "qwen3": dict(kind="hf", model_type="qwen3", task="causal_lm",
                  config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, intermediate_size=256, vocab_size=4096)),
    "esm": dict(kind="hf", model_type="esm", task="masked_lm",
                config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                            vocab_size=33, position_embedding_type="rotary", pad_token_id=1, mask_token_id=32,
                            attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)),
    "deepseek_mla": dict(kind="hf", model_type="deepseek_v3", task="causal_lm",
                         config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                     intermediate_size=256, moe_intermediate_size=64, vocab_size=4096,
                                     n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                     first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                                     qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1)),
}

# the training loop's fixed time per step is calibrated on these (not on any validation row): tiny encoders
# whose step is almost all overhead, at two depths (a fixed part and a per-layer part)
CALIBRATION_MODELS = {
    f"calibration_{layers}": dict(kind="project", cls="ProteinEncoder", init=dict(d_model=32, n_layers=layers, n_heads=2))
    for layers in (1, 3)
}
# and transformers' own modules (Python per module, the integration's checks per attention call) on tiny Llamas: the
# fixed time of the models that ``ModelSpec.implementation == "hf"`` describes
CALIBRATION_MODELS.update({
    f"calibration_hf_{layers}": dict(kind="hf", model_type="llama", task="causal_lm",
                                     config=dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                                 num_key_value_heads=2, intermediate_size=64, vocab_size=64))
    for layers in (2, 4)  # FSDP wraps the repeated blocks: two at least
})
MODELS.update(CALIBRATION_MODELS)

BACKENDS = ("ring", "zigzag_ring", "allgather_kv", "ulysses", "usp")
TIMED_STEPS = 8
"""Steps of the timed fit; the measured step time is the median of steps 3 to 8."""
OVERHEAD = HERE / "results" / "cpu_step_overhead.json"
TIME_RESULTS = HERE / "results" / "planner_time_validation.json"
LAYER_RATES = HERE / "results" / "cpu_layer_rates.json"
"""The layer's non-attention costs on this CPU (Note [Layer rates]), from ``--calibrate-layer``'s micro-benchmarks."""
KERNEL_TABLE = HERE / "results" / "cpu_kernel_table.json"
SYNC_WAIT = HERE / "results" / "cpu_sync_wait.json"
SYNC_CHUNK_MATMULS = (1, 4, 16, 64, 256)
"""Compute between two synchronizations in the sync-wait micro-benchmark: this many ``[128, 128] x [128, 512]``
products (about 0.25 ms each on one core of this VM): from a tiny model's layer to a validated row's."""
"""The attention kernel's table on this CPU re-measured with the step times (``--calibrate-kernel``), at head dims
``KERNEL_DIMS`` (Note [Kernel table below the smallest head dim] in ``lightning_sp/cost_model.py``)."""
KERNEL_DIMS = (8, 16, 32, 64, 128)
LAYER_TOKENS = (64, 256, 1024, 4096)
LAYER_WIDTHS = (32, 64, 128, 256)
RECOMMEND_SETUPS = (("protein_encoder", 4, 4096, "ddp"), ("llama_gqa", 4, 4096, "ddp"))
"""(model, P, N, data parallel): every backend x checkpointing at sp = P, measured and predicted."""


def grid(smoke: bool = False) -> list[dict]:
    """Rows: every model at P = 2 and 4, DDP and FSDP, checkpointing on and off, the backends in rotation."""
    rows, i = [], 0
    for world in (2, 4):
        for model in (m for m in MODELS if m not in CALIBRATION_MODELS):
            for dp in ("ddp", "fsdp"):
                for ckpt in (False, True):
                    backend = BACKENDS[i % len(BACKENDS)]
                    i += 1
                    if backend == "usp" and world == 2:
                        backend = "ulysses"
                    if backend == "zigzag_ring" and model in ("protein_encoder", "esm"):
                        backend = "ring"
                    rows.append(dict(model=model, world=world, backend=backend, data_parallel=dp,
                                     activation_checkpointing=ckpt, seq_len=2048 if world == 2 else 4096))
    if smoke:
        return [dict(rows[0], seq_len=256), dict(rows[3], seq_len=256)]
    return rows


def time_rows() -> list[dict]:
    """Every third row of the grid (16 rows): timed, under both CPU slots."""
    return grid()[::3]


def calibration_rows() -> list[dict]:
    return [dict(model=model, world=world, backend="ring", data_parallel=dp, activation_checkpointing=False,
                 seq_len=64 * world)
            for world in (2, 4) for dp in ("ddp", "fsdp") for model in CALIBRATION_MODELS]


def recommend_rows(setup: tuple) -> list[dict]:
    name, world, seq_len, dp = setup
    spec = planner_spec(name)
    heads = spec.num_heads
    backends = [b for b in BACKENDS if not (b == "zigzag_ring" and not spec.causal)
                and not (b == "ulysses" and (heads % world or spec.kv_heads % world))
                and not (b == "usp" and (world < 4 or heads % 2))]
    return [dict(model=name, world=world, backend=b, data_parallel=dp, activation_checkpointing=ckpt, seq_len=seq_len)
            for b in backends for ckpt in (False, True)]


def planner_spec(name: str):
    from lightning_sp.planner import ModelSpec

    m = MODELS[name]
    if m["kind"] == "hf":
        cfg = {"model_type": m["model_type"], **m["config"]}
        if m["task"] == "masked_lm":
            cfg["architectures"] = ["MaskedLM"]
        return ModelSpec.from_hf_config(cfg, name=name)
    init = m["init"]
    encoder = m["cls"] == "ProteinEncoder"
    return ModelSpec(name=name, num_layers=init["n_layers"], hidden=init["d_model"], num_heads=init["n_heads"],
                     num_kv_heads=init.get("n_kv_heads"), vocab=31 if encoder else 279, causal=not encoder, biases=True,
                     implementation="project")


def _build(name: str, ckpt: bool):
    m = MODELS[name]
    if m["kind"] == "project":
        import lightning_sp.models as models

        return getattr(models, m["cls"])(**m["init"], activation_checkpointing=ckpt, warmup_steps=0)
    from lightning_sp.integrations.hf_module import HFSequenceParallelModule

    module = HFSequenceParallelModule(model_type=m["model_type"], task=m["task"], config=m["config"])
    if ckpt:
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return module


def _blocks(module) -> tuple[type, ...]:
    """The transformer block classes of a built module (the project's ``Block``, transformers'
    ``_no_split_modules``)."""
    from lightning_sp.models.layers import Block

    import collections

    names = set(getattr(getattr(module, "model", None), "_no_split_modules", None) or ())
    # the repeated ones (the layers; not ESM's embeddings, whose weight the output head shares)
    counts = collections.Counter(type(m) for m in module.modules() if type(m).__name__ in names)
    found = {type(m) for m in module.modules() if isinstance(m, Block)} | {t for t, n in counts.items() if n > 1}
    if not found:
        raise ValueError(f"no transformer block found in {type(module).__name__}")
    return tuple(found)


def _batches(name: str, seq_len: int, steps: int) -> list[dict]:
    import torch

    m = MODELS[name]
    vocab = m["config"]["vocab_size"] if m["kind"] == "hf" else (31 if m["cls"] == "ProteinEncoder" else 279)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(4, vocab, (seq_len + 1,), generator=g)
        if m["kind"] == "hf":
            out.append({"input_ids": tokens[:-1], "labels": tokens[:-1].clone() if m["task"] == "masked_lm" else tokens[:-1]})
        elif m["cls"] == "ProteinEncoder":
            out.append({"input_ids": tokens[:-1], "labels": tokens[:-1]})
        else:
            out.append({"input_ids": tokens[:-1], "labels": tokens[1:]})
    return out


def _fit(row: dict, steps: int, callbacks=()):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_sp.strategy import SequenceParallelStrategy

    # HF's ESM carries a contact head the loss never uses, and an MoE step may leave an expert idle
    unused = {"find_unused_parameters": True} if MODELS[row["model"]]["kind"] == "hf" and row["data_parallel"] == "ddp" else {}
    model = _build(row["model"], row["activation_checkpointing"])
    # FSDP: each transformer block its own unit, as the planner assumes (Note [Step model])
    units = {"fsdp_shard_modules": _blocks(model)} if row["data_parallel"] == "fsdp" else {}
    strategy = SequenceParallelStrategy(row["world"], backend=row["backend"], data_parallel=row["data_parallel"],
                                        process_group_timeout=120, shuffle=False, **unused, **units)
    trainer = L.Trainer(accelerator="cpu", devices=row["world"], strategy=strategy, precision="32-true",
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=list(callbacks))
    trainer.fit(model, DataLoader(_batches(row["model"], row["seq_len"], steps), batch_size=1))


class _StepTimer:
    def __init__(self):
        import lightning as L

        class Timer(L.Callback):
            def __init__(self):
                self.times, self._t = [], 0.0

            def on_train_batch_start(self, *a):
                self._t = time.perf_counter()

            def on_train_batch_end(self, *a):
                self.times.append(time.perf_counter() - self._t)

        self.callback = Timer()


def _worker(rank: int, world: int, rows: list[dict], timed: bool, memory: bool = True) -> list[dict]:
    import gc
    import os

    import torch

    from experiments.common.memory import AllocatorPeak

    torch.set_num_threads(1)
    out = []
    for row in rows:
        if row["world"] != world:
            continue
        os.environ["WORLD_SIZE"] = str(world)
        # the previous row's model and trainer must be gone before the window opens: the allocator events
        # count a free of memory allocated before the window against it (a collection inside the window once
        # lowered a row's peak from 17.4 to 9.5 MiB)
        gc.collect()
        got = {}
        if memory:
            with AllocatorPeak() as peak:
                _fit(row, steps=2)
            got["peak_bytes"] = peak.peak_bytes
        if timed:
            os.environ["WORLD_SIZE"] = str(world)
            timer = _StepTimer()
            _fit(row, steps=TIMED_STEPS, callbacks=[timer.callback])
            got["step_s"] = statistics.median(timer.callback.times[2:])
        out.append(got)
    return out


def cpu_profile():
    """The committed CPU calibration of the cost model, with the kernel table of ``--calibrate-kernel``, the layer
    rates of ``--calibrate-layer`` and the rank-skew waits of ``--calibrate-sync`` when present (Note [Layer rates],
    Note [Rank skew])."""
    from lightning_sp.planner import hardware_profile, with_layer_rates

    hw = hardware_profile(CPU_PROFILE)
    if KERNEL_TABLE.is_file():  # re-measured with the step times, down to D = 8 (``--calibrate-kernel``)
        kernel = json.loads(KERNEL_TABLE.read_text())
        hw = replace(hw, kernel_table=tuple((str(k), int(d), int(q), int(kl), float(f), float(b))
                                            for k, d, q, kl, f, b in kernel["kernel_table"]),
                     kernel_call_s=tuple(float(t) for t in kernel["kernel_call_s"]))
    if LAYER_RATES.is_file():
        rates = dict(json.loads(LAYER_RATES.read_text())["layer_rates"])
        if SYNC_WAIT.is_file():  # Note [Rank skew]
            rates["sync_wait"] = json.loads(SYNC_WAIT.read_text())["sync_wait"]
        hw = with_layer_rates(hw, rates)
    return hw


def cpu_predict_step_s(row: dict, overhead: dict) -> float:
    """The planner's step time of a row on the committed CPU calibrations (``cpu_profile``, ``overhead``)."""
    return predict(row, cpu_profile(), overhead)["step_s"]


def _median_time(fn, reps: int) -> float:
    from experiments.common.timing import median_seconds  # here: the module loads torch.distributed

    return median_seconds(fn, reps, warmup=2)  # warm: allocator, first-call dispatch, AdamW's state


def calibrate_layer() -> dict:
    """Micro-benchmarks of a layer's non-attention pieces on one thread, float32 (Note [Layer rates]); no model,
    no training step, none of the validated rows."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def fwd_bwd(outs_fn, inputs, params):
        def run():
            for t in (*inputs, *params):
                t.grad = None
            outs = outs_fn()
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return run

    matmul = []
    for tokens in LAYER_TOKENS:
        for width in LAYER_WIDTHS:
            # a layer's linear layers: q/k/v in one, the output projection, the MLP's two (with biases)
            lins = [torch.nn.Linear(width, k * width) for k in (3, 1, 4)] + [torch.nn.Linear(4 * width, width)]
            x = torch.randn(tokens, width, requires_grad=True)
            h = torch.randn(tokens, 4 * width, requires_grad=True)
            run = fwd_bwd(lambda: [lin(x) for lin in lins[:3]] + [lins[3](h)], (x, h),
                          [p for lin in lins for p in lin.parameters()])
            flops = 3 * 2.0 * tokens * 12 * width * width  # forward + the two backward products
            t = _median_time(run, reps=max(3, min(30, int(2e9 / flops))))
            matmul.append((tokens, width, flops / t))

    def elementwise_time(tokens: int, width: int) -> float:
        # a layer without its matmuls and attention: two residual adds, two norms, the activation over [T, 4C]
        ln1, ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        x = torch.randn(tokens, width, requires_grad=True)
        h = torch.randn(tokens, 4 * width, requires_grad=True)

        def outs():
            y = x + ln1(x)
            return [y + ln2(y), F.gelu(h)]
        return _median_time(fwd_bwd(outs, (x, h), [*ln1.parameters(), *ln2.parameters()]), reps=20)

    # per element per pass, the planner's count (Note [Saved tensors]): the norms' inputs and outputs (4 C) and the
    # activation's (2 x 4C), three passes; the slope between 256 and 1024 tokens (the per-call part is the fixed
    # time per step's, --calibrate-overhead)
    elementwise = {}
    for width in (64, 128, 256):
        slope = (elementwise_time(1024, width) - elementwise_time(256, width)) / (1024 - 256)
        elementwise[width] = slope / (3 * 12 * width)

    from lightning_sp.loss import sequence_parallel_cross_entropy

    def loss_time(tokens: int, vocab: int) -> float:  # the models' loss, on one rank (no group)
        logits = torch.randn(1, tokens, vocab, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        return _median_time(fwd_bwd(lambda: [sequence_parallel_cross_entropy(logits, labels)], (logits,), []), reps=10)

    loss = {vocab: (loss_time(1024, vocab) - loss_time(256, vocab)) / (768 * vocab) for vocab in (32, 256, 1024, 4096)}

    def adamw_time(width: int) -> tuple[int, float]:
        # AdamW as the models build it (two groups, PyTorch's CPU default), on four layers' worth of tensors
        mats = [torch.randn(a, b) for _ in range(4) for a, b in ((3 * width, width), (width, width),
                                                                  (4 * width, width), (width, 4 * width))]
        vecs = [torch.randn(n) for _ in range(4) for n in (3 * width, width, 4 * width, width, width, width)]
        params = [torch.nn.Parameter(t) for t in mats + vecs]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([{"params": params[:len(mats)], "weight_decay": 0.01},
                                 {"params": params[len(mats):], "weight_decay": 0.0}], lr=1e-4)
        return sum(p.numel() for p in params), _median_time(opt.step, reps=10)

    # per parameter: the slope between two sizes with the same tensors (the per-tensor part is the fixed time's)
    (n0, t0), (n1, t1) = adamw_time(128), adamw_time(256)
    hf = {width: hf_small_ops_s(width) for width in (64, 128, 256)}
    rates = {"matmul_table": matmul, "elementwise_s": statistics.mean(elementwise.values()),
             "loss_s": statistics.mean((loss[1024], loss[4096])), "loss_by_vocab": [[v, t] for v, t in loss.items()],
             "optimizer_s": (t1 - t0) / (n1 - n0),
             "implementation_elementwise_s": [["hf", statistics.mean(hf.values())]]}
    return {"layer_rates": rates,
            "points": {"elementwise_s_by_width": elementwise, "loss_s_by_vocab": loss,
                       "adamw": [[n0, t0], [n1, t1]], "hf_elementwise_s_by_width": hf}}


def _sync_worker(rank: int, world: int, repeats: int = 3) -> dict:
    """One rank of the sync-wait micro-benchmark (Note [Rank skew] in ``lightning_sp/planner.py``): a chunk of
    matmuls then a one-float all-reduce, ``rounds`` times (``synced``); the same chunks with no collective
    (``free``: the ranks compute at once, so the cores' sharing is in both); the all-reduces alone (``collective``).
    Interleaved ``repeats`` times; seconds per round, the median over repeats."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    a, b = torch.randn(128, 128), torch.randn(128, 512)
    one = torch.zeros(1)
    out = {}
    for matmuls in SYNC_CHUNK_MATMULS:
        rounds = max(4, 512 // matmuls)

        def chunk():
            for _ in range(matmuls):
                torch.mm(a, b)

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(rounds):
                fn()
            return (time.perf_counter() - t0) / rounds

        chunk()
        got = {"free": [], "synced": [], "collective": []}
        for _ in range(repeats):
            got["free"].append(timed(chunk))
            got["synced"].append(timed(lambda: (chunk(), dist.all_reduce(one))))
            got["collective"].append(timed(lambda: dist.all_reduce(one)))
        out[matmuls] = {k: statistics.median(v) for k, v in got.items()}
    return out


def calibrate_sync(worlds: tuple[int, ...] = (2, 4)) -> dict:
    """The wait for the slowest rank at one synchronization after ``c`` seconds of compute, per world size (Note
    [Rank skew]): ``(ranks, c, wait)`` points, ``c`` = the free rounds' time (the ranks' mean), ``wait`` = the synced
    rounds' (the slowest rank's) less the collective alone and ``c``."""
    from experiments.common.launch import run_on_ranks

    points, wait = {}, []
    for world in worlds:
        per_rank = run_on_ranks(_sync_worker, world, (), timeout_s=300)
        fractions = {}
        for matmuls in SYNC_CHUNK_MATMULS:
            free = statistics.mean(r[matmuls]["free"] for r in per_rank)
            synced = max(r[matmuls]["synced"] for r in per_rank)
            collective = max(r[matmuls]["collective"] for r in per_rank)
            fractions[matmuls] = {"free_s": free, "synced_s": synced, "collective_s": collective}
            wait.append([world, free, max(1e-6, synced - collective - free)])
        points[world] = fractions
    return {"sync_wait": wait, "points": points}


HF_STUB_ATTENTION = "planner_stub"


def hf_small_ops_s(width: int) -> float:
    """Seconds per element per pass of transformers' small ops in one decoder layer (Note [Layer rates]): a
    ``LlamaDecoderLayer`` (RMSNorms with their float32 casts, rotary, the head reshapes and transposes, SiLU(gate) x
    up, the residual adds; 4 heads, 2 K/V heads, MLP 2 x width) forward + backward with its attention stubbed (q
    returned as the output) less its own linear layers run alone, the slope between 256 and 1024 tokens, per element
    of the planner's ``saved_per_token`` count of that layer per pass (3). One thread, float32, no training step."""
    import torch
    from transformers import AttentionInterface, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from lightning_sp.planner import ModelSpec

    AttentionInterface.register(HF_STUB_ATTENTION, lambda module, q, k, v, mask, **kw: (q.transpose(1, 2), None))
    cfg = LlamaConfig(hidden_size=width, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * width,
                      num_hidden_layers=1, vocab_size=128)
    cfg._attn_implementation = HF_STUB_ATTENTION
    layer = LlamaDecoderLayer(cfg, 0)
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]

    def times(tokens: int) -> tuple[float, float]:
        x = torch.randn(1, tokens, width, requires_grad=True)
        pos = torch.arange(tokens)[None]
        with torch.no_grad():
            cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)  # once per model forward, not per layer

        def whole():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x, position_ids=pos, position_embeddings=cos_sin).sum().backward()
        inputs = [torch.randn(1, tokens, lin.in_features, requires_grad=True) for lin in linears]

        def alone():
            for t in inputs:
                t.grad = None
            layer.zero_grad(set_to_none=True)
            torch.autograd.backward([lin(t).sum() for lin, t in zip(linears, inputs)])
        return _median_time(whole, reps=31), _median_time(alone, reps=31)

    (w0, l0), (w1, l1) = times(256), times(1024)
    spec = ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": width, "num_hidden_layers": 1,
                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "intermediate_size": 2 * width, "hidden_act": "silu"})
    per_token = ((w1 - l1) - (w0 - l0)) / (1024 - 256)
    return per_token / (3 * sum(spec.saved_per_token(tp=1, act_bytes=4)))


def calibrate_kernel(rounds: int = 3, reps: int = 3) -> dict:
    """The attention kernel's table (``HardwareProfile.kernel_table``) at ``KERNEL_DIMS``, measured as the cost
    model's calibration measures it (``experiments.cost_model.calibrate.measure_kernel_table``), with head dims
    below 32 added. One thread, float32, no training step."""
    from experiments.cost_model.calibrate import CAUSAL_EXTRA_SIDES, KERNEL_SIDES, measure_kernel_table

    kernel = measure_kernel_table(reps, KERNEL_SIDES, KERNEL_DIMS, CAUSAL_EXTRA_SIDES, rounds)
    del kernel["per_round"]
    kernel["kernel_table"] = [list(row) for row in kernel["kernel_table"]]
    return kernel


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ("model", "world", "backend", "data_parallel", "activation_checkpointing", "seq_len"))


def step_overhead(row: dict, overhead: dict | None) -> float:
    """The calibrated fixed time per step for a row's world size, data parallelism and depth."""
    if not overhead:
        return 0.0
    fits = overhead["fits"]
    key = _overhead_key(row["world"], row["data_parallel"], MODELS[row["model"]]["kind"])
    fixed, per_layer = fits.get(key) or fits[_overhead_key(row["world"], row["data_parallel"], "project")]
    return fixed + per_layer * planner_spec(row["model"]).num_layers


def fit_overhead(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed, per_layer)`` seconds through two ``(layers, residual)`` points, neither negative: a layer and the
    loop cannot take negative time. Where the deeper model's residual is the smaller (the machine's noise, or the
    tiny models' compute modelled long, exceeds a tiny layer's overhead), no per-layer part and the residuals' mean;
    a negative fixed part is 0 (the tiny models' compute modelled long does not carry to larger models)."""
    (l0, o0), (l1, o1) = sorted(points)
    per_layer = (o1 - o0) / (l1 - l0)
    if per_layer < 0:
        return max(0.0, (o0 + o1) / 2), 0.0
    return max(0.0, o0 - per_layer * l0), per_layer


def _overhead_key(world: int, data_parallel: str, kind: str) -> str:
    """The fit of the tiny models of ``kind`` (``"project"``: the project's models; ``"hf"``: transformers')."""
    return f"{world}/{data_parallel}" + ("/hf" if kind == "hf" else "")


def predict(row: dict, hw, overhead: dict | None = None) -> dict:
    from lightning_sp.planner import Candidate, memory_bytes, step_time

    spec = planner_spec(row["model"])
    cand = Candidate(backend=row["backend"], sequence_parallel_size=row["world"], data_parallel_size=1,
                     tensor_parallel_size=1, ulysses_degree=2 if row["backend"] == "usp" else None, kv_pieces=1,
                     activation_checkpointing=row["activation_checkpointing"], tiled_loss=False)
    kw = dict(seq_len=row["seq_len"], batch=1, precision="32-true", data_parallel=row["data_parallel"], hw=hw)
    mem = memory_bytes(spec, cand, **kw)
    t = step_time(spec, cand, step_overhead_s=step_overhead(row, overhead), **kw)
    return {"memory": mem, "peak_bytes": sum(mem.values()), "time": t, "step_s": sum(t.values())}


def main(argv: list[str] | None = None) -> int:
    from experiments.common.launch import run_on_ranks
    from experiments.common.results import RUNS, run_metadata

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--publish", action="store_true",
                       help=f"write the committed results ({RESULTS.relative_to(HERE.parents[1])}) instead of runs/planner/")
    where.add_argument("--out", type=Path, default=None, help="the results file (default: runs/planner/)")
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="measure only the rows of these world sizes; the other rows are kept from the results file "
                         "(a long grid in parts)")
    timing = ap.add_mutually_exclusive_group()
    timing.add_argument("--calibrate-layer", action="store_true",
                        help=f"micro-benchmark a layer's non-attention pieces (matmul rates at the layers' shapes, "
                             f"norms and activations, the loss, AdamW) into {LAYER_RATES.name}; run under both CPU "
                             "slots, before --calibrate-overhead")
    timing.add_argument("--calibrate-kernel", action="store_true",
                        help=f"re-measure the attention kernel's table at head dims {KERNEL_DIMS} into "
                             f"{KERNEL_TABLE.name}; run under both CPU slots, first")
    timing.add_argument("--calibrate-sync", action="store_true",
                        help=f"measure the wait for the slowest rank at a synchronization with 2 and 4 ranks "
                             f"({SYNC_WAIT.name}, Note [Rank skew]); run under both CPU slots, before --calibrate-overhead")
    timing.add_argument("--calibrate-overhead", action="store_true",
                        help=f"measure the training loop's fixed time per step on tiny models ({OVERHEAD.name}); run "
                             "under both CPU slots")
    timing.add_argument("--time", action="store_true",
                        help=f"step times of every third row against the planner's, with the calibrated overhead "
                             f"({TIME_RESULTS.name}); run under both CPU slots")
    timing.add_argument("--recommend", type=int, choices=range(len(RECOMMEND_SETUPS)), default=None,
                        help="time every backend x checkpointing of one setup of RECOMMEND_SETUPS and compare the "
                             f"planner's pick with the measured fastest (into {TIME_RESULTS.name})")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="time the rows with glibc keeping freed memory for reuse (experiments.common.launch."
                         "keep_freed_memory): by default it returns some to the system and every step faults those "
                         "pages in again (Note [Fresh pages] in experiments/cost_model/NOTES.md); with --out")
    ap.add_argument("--repredict", action="store_true",
                    help="measure nothing: recompute the predictions of the results file's measured rows (after a "
                         "change to the planner)")
    ap.add_argument("--memory-only", action="store_true",
                    help="measure the peaks only (they do not depend on the machine's load; step times do)")
    args = ap.parse_args(argv)
    if args.calibrate_kernel or args.calibrate_layer or args.calibrate_sync or args.calibrate_overhead or args.time or args.recommend is not None:
        return _timing(args, argv)
    args.out = args.out or (RESULTS if args.publish else RUNS / "planner" / RESULTS.name)
    rows = grid(args.smoke)
    hw = cpu_profile()
    kept: dict[tuple, dict] = {}
    if args.repredict:
        previous = json.loads(args.out.read_text())
        kept = {_key(r): r["measured"] for r in previous["rows"]}
        rows = [r for r in rows if _key(r) in kept]
        args.worlds = sorted({r["world"] for r in rows} | {0})  # measure no world
    elif args.worlds:
        old = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []
        kept = {_key(r): r["measured"] for r in old if r["world"] not in args.worlds}
        missing = [r for r in rows if r["world"] not in args.worlds and _key(r) not in kept]
        if missing:
            raise SystemExit(f"{args.out} lacks {len(missing)} rows of worlds outside --worlds {args.worlds}: "
                             "measure them first (or drop --worlds)")
    measured: dict[int, list[dict]] = {}
    for world in sorted({r["world"] for r in rows if _key(r) not in kept} & set(args.worlds or [r["world"] for r in rows])):
        per_rank = run_on_ranks(_worker, world, (rows, not args.memory_only), timeout_s=3000)
        measured[world] = [{key: max(r[i][key] for r in per_rank) for key in per_rank[0][i]}
                           for i in range(len(per_rank[0]))]
    results = []
    index = dict.fromkeys(measured, 0)
    for row in rows:
        if _key(row) in kept:
            got = kept[_key(row)]
        else:
            got = measured[row["world"]][index[row["world"]]]
            index[row["world"]] += 1
        pred = predict(row, hw)
        result = {**row, "measured": got, "predicted": pred, "memory_error": pred["peak_bytes"] / got["peak_bytes"] - 1}
        if "step_s" in got:
            result["time_error"] = pred["step_s"] / got["step_s"] - 1
        results.append(result)
    mem_err = [abs(r["memory_error"]) for r in results]
    summary = {"rows": len(results), "memory_mean_abs_error": statistics.mean(mem_err),
               "memory_max_abs_error": max(mem_err)}
    if all("step_s" in r["measured"] for r in results):
        time_err = [abs(r["time_error"]) for r in results]
        summary.update(time_mean_abs_error=statistics.mean(time_err), time_max_abs_error=max(time_err))
    doc = {**run_metadata(__file__, argv), "method": __doc__.split("\n\n", 2)[2].strip(), "summary": summary, "rows": results}
    if args.repredict:  # the measurement's provenance stays the run's
        doc.update({k: previous[k] for k in ("command", "date", "hardware", "git_commit", "git_dirty") if k in previous},
                   repredicted={"command": doc.get("command"), "git_commit": run_metadata(__file__, argv).get("git_commit")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in results:
        line = (f"{r['model']:<19} P={r['world']} {r['backend']:<12} {r['data_parallel']:<4} "
                f"ckpt={int(r['activation_checkpointing'])} mem {r['measured']['peak_bytes'] / 2**20:8.1f} MiB pred "
                f"{r['predicted']['peak_bytes'] / 2**20:8.1f} ({100 * r['memory_error']:+6.1f}%)")
        if "time_error" in r:
            line += (f"  step {r['measured']['step_s']:6.3f} s pred {r['predicted']['step_s']:6.3f} "
                     f"({100 * r['time_error']:+6.1f}%)")
        print(line)
    print(json.dumps(summary, indent=1))
    return 0


def _measure_times(rows: list[dict]) -> list[float]:
    """Median step time of each row (max over ranks), the rows of each world in one spawn."""
    from experiments.common.launch import run_on_ranks

    out: dict[int, float] = {}
    for world in sorted({r["world"] for r in rows}):
        mine = [i for i, r in enumerate(rows) if r["world"] == world]
        per_rank = run_on_ranks(_worker, world, ([rows[i] for i in mine], True, False), timeout_s=600)
        for j, i in enumerate(mine):
            out[i] = max(r[j]["step_s"] for r in per_rank)
    return [out[i] for i in range(len(rows))]


def _kept_times(kept: list[dict], rows: list[dict]) -> list[float]:
    """``--repredict``: the committed measured step time of each row (the same rows, in order)."""
    fields = ("backend", "activation_checkpointing") + (("model", "world", "data_parallel", "seq_len") if kept and "model" in kept[0] else ())
    if len(kept) != len(rows) or any(any(k[f] != r[f] for f in fields) for k, r in zip(kept, rows)):
        raise SystemExit("the results file's measured rows are not this grid's: measure them (drop --repredict)")
    return [k["measured_step_s"] for k in kept]


def _timing(args, argv) -> int:
    """``--calibrate-overhead``, ``--time``, ``--recommend``: step times (Note [Step model]'s fixed part and its
    validation)."""
    from experiments.common.results import RUNS, run_metadata

    meta = run_metadata(__file__, argv)
    where = (lambda p: p) if args.publish else (lambda p: args.out or RUNS / "planner" / p.name)
    if args.keep_freed_memory:
        from experiments.common.launch import MALLOC_KEEP_FREED, keep_freed_memory

        if args.publish or not (args.time or args.recommend is not None):
            raise SystemExit("--keep-freed-memory times a variant of the rows: with --time or --recommend and --out")
        if not args.repredict and not keep_freed_memory():
            raise SystemExit("--keep-freed-memory needs Linux with glibc")
        meta["allocator"] = ("glibc keeps freed memory for reuse in every rank (" + ", ".join(
            f"{k}={v}" for k, v in MALLOC_KEEP_FREED.items()) + ")")
    if args.calibrate_kernel:
        got = calibrate_kernel()
        doc = {**meta, "method": "the cost model's kernel-table micro-benchmark (experiments/cost_model/calibrate.py: "
               "one LocalKernel call, SDPA's CPU flash op, forward and backward, per point of FULL rectangles and "
               f"CAUSAL squares, {got['kernel_heads']} heads, the tiny call's time removed, the median over 3 rounds in "
               f"rotated order) at head dims {list(KERNEL_DIMS)}, one thread, float32; re-measured with the step "
               "times (the cost model's table was measured hours before, when this VM ran the kernel faster) and "
               "below D = 32 (Note [Kernel table below the smallest head dim]). None of the validated training steps",
               **got}
        path = where(KERNEL_TABLE)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps({k: v for k, v in doc.items() if k != "kernel_table"}, indent=1))
        return 0
    if args.calibrate_layer:
        got = calibrate_layer()
        got["layer_rates"]["source"] = (f"measured: {LAYER_RATES.name} ({meta['date']}), micro-benchmarks on one "
                                        "thread, float32; none of the validated training steps")
        doc = {**meta, "method": "micro-benchmarks on one thread, float32, torch's CPU kernels (Note [Layer rates] in "
               "lightning_sp/planner.py); the median of repeated calls after two warm-up calls. matmul_table: a "
               "layer's linear layers (C->3C, C->C, C->4C, 4C->C with biases) forward + backward at T tokens and "
               "width C, FLOP/s; elementwise_s: two residual adds, two LayerNorms over [T, C] and GELU over [T, 4C], "
               "forward + backward, per element of their saved inputs and outputs (12 C per token) per pass (3), "
               "the slope between T=256 and T=1024, averaged over C=64, 128, 256; loss_s: lightning_sp.loss.sequence_parallel_cross_entropy (the models' loss) forward + "
               "backward per logit, the slope between T=256 and 1024, averaged over V=1024, 4096 (loss_by_vocab: "
               "at V=32, 256, 1024, 4096); optimizer_s: one "
               "torch.optim.AdamW step (two groups), the slope per parameter between four layers' tensors at C=128 "
               "and C=256; implementation_elementwise_s hf: transformers' LlamaDecoderLayer (4 heads, 2 K/V heads, MLP 2 C) "
               "forward + backward with its attention stubbed, less its linear layers alone, per element of the "
               "planner's saved_per_token of that layer per pass (3), the slope between T=256 and 1024, averaged over "
               "C=64, 128, 256 (hf_small_ops_s). Calibrated on these micro-benchmarks only, none of the validated training steps "
               f"({TIME_RESULTS.name})", **got}
        path = where(LAYER_RATES)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["layer_rates"], indent=1))
        return 0
    if args.calibrate_sync:
        got = calibrate_sync()
        doc = {**meta, "method": "micro-benchmark with 2 and 4 gloo ranks on one thread each (Note [Rank skew] in "
               "lightning_sp/planner.py): rounds of a chunk of [128, 128] x [128, 512] matmuls (1, 4, 16, 64, 256 of them) then "
               "a one-float all-reduce, against the same chunks with no collective (all ranks computing at once) and "
               "the all-reduces alone, interleaved 3 times, medians; sync_wait: (ranks, compute c = free rounds' "
               "time (mean rank), wait = synced (slowest rank) - collective - c) per round. None of the validated "
               "training steps", **got}
        path = where(SYNC_WAIT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(got, indent=1))
        return 0
    hw = cpu_profile()
    if args.calibrate_overhead:
        rows = calibration_rows()
        if args.repredict:  # refit the committed measurements with the current planner's modelled compute
            kept = json.loads(OVERHEAD.read_text())
            times = _kept_times([{**k, "measured_step_s": k["step_s"]} for k in kept["rows"]], rows)
            meta = {**{k: kept[k] for k in ("command", "date", "hardware", "git_commit", "git_dirty", "kind")},
                    "repredicted": {"command": meta["command"], "date": meta["date"], "git_commit": meta.get("git_commit")}}
        else:
            times = _measure_times(rows)
        fits, table = {}, []
        for world, dp, kind in ((w, d, k) for w in (2, 4) for d in ("ddp", "fsdp") for k in ("project", "hf")):
            pts = []
            for row, t in zip(rows, times):
                if row["world"] == world and row["data_parallel"] == dp and MODELS[row["model"]]["kind"] == kind:
                    compute = predict(row, hw)["step_s"]  # no overhead yet: the modelled compute
                    layers = planner_spec(row["model"]).num_layers
                    pts.append((layers, t - compute))
                    table.append({**row, "step_s": t, "modelled_compute_s": compute})
            fits[_overhead_key(world, dp, kind)] = fit_overhead(pts)
        doc = {**meta, "method": "median of steps 3-8 of a Trainer.fit (on_train_batch_start to on_train_batch_end), "
               "max over ranks, minus the planner's modelled compute; fixed + per_layer x layers from two depths (1 and 3; 2 and 4 for the Llamas; "
               "neither part negative: a residual falling with depth gives no per-layer part and the two residuals' mean, a negative fixed part 0; fit_overhead), "
               "per world size, data parallelism and kind of model (the project's tiny encoders; transformers' tiny "
               "Llamas for ModelSpec.implementation 'hf')",
               "fits": fits, "rows": table}
        path = where(OVERHEAD)
    else:
        overhead = json.loads(OVERHEAD.read_text())
        path = where(TIME_RESULTS)
        doc = json.loads(path.read_text()) if path.is_file() else {}
        previous = {k: doc[k] for k in ("date", "git_commit", "summary") if k in doc}
        if args.repredict:  # the measurements' provenance stays the runs'
            doc["repredicted"] = {"command": meta["command"], "date": meta["date"], "git_commit": meta.get("git_commit")}
        elif args.time or "command" not in doc:  # the file's provenance is the --time run's
            doc.pop("repredicted", None)
            doc.update(meta)
        doc.update(method="measured: median of steps 3-8 of a Trainer.fit (on_train_batch_start to on_train_batch_end, "
                          "the optimizer step included), max over ranks, both CPU slots held; predicted: "
                          "planner.step_time with the cpu-calibrated profile, the kernel table of "
                          f"{KERNEL_TABLE.name}, the layer rates of {LAYER_RATES.name}, the rank-skew waits of "
                          f"{SYNC_WAIT.name} and the fixed time per step of "
                          f"{OVERHEAD.name} (micro-benchmarks and tiny models measured just before, none of these rows)")
        if args.time:
            rows = time_rows()
            times = _kept_times(doc.get("rows", []), rows) if args.repredict else _measure_times(rows)
            out = []
            for row, t in zip(rows, times):
                pred = predict(row, hw, overhead)
                out.append({**row, "measured_step_s": t, "predicted_step_s": pred["step_s"],
                            "predicted_time": pred["time"], "error": pred["step_s"] / t - 1})
            errs = [abs(r["error"]) for r in out]
            if not args.repredict and "summary" in previous:  # the figures this run replaces, for the record
                doc["previous"] = previous
            doc["rows"] = out
            doc["summary"] = {"rows": len(out), "mean_abs_error": statistics.mean(errs), "max_abs_error": max(errs)}
        else:
            setup = RECOMMEND_SETUPS[args.recommend]
            rows = recommend_rows(setup)
            key = f"{setup[0]} P={setup[1]} N={setup[2]} {setup[3]}"
            if args.repredict:
                kept = [{**row, **c} for row, c in zip(rows, doc["recommendations"][key]["candidates"])]
                times = _kept_times(kept, rows)
            else:
                times = _measure_times(rows)
            cands = []
            for row, t in zip(rows, times):
                cands.append({"backend": row["backend"], "activation_checkpointing": row["activation_checkpointing"],
                              "measured_step_s": t, "predicted_step_s": predict(row, hw, overhead)["step_s"]})
            picked = min(cands, key=lambda c: c["predicted_step_s"])
            fastest = min(c["measured_step_s"] for c in cands)
            previous = doc.get("recommendations", {}).get(key, {}) if args.repredict else meta
            doc.setdefault("recommendations", {})[key] = {
                "command": previous["command"], "date": previous["date"],
                "candidates": cands, "planner_pick": {k: picked[k] for k in ("backend", "activation_checkpointing")},
                "pick_over_fastest": picked["measured_step_s"] / fastest - 1}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("fits", "summary", "recommendations") if k in doc}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
