"""Tables of the planner for the docs (generated blocks, ``python -m experiments.common.generated``): its
recommendations for the setups users ask about (predictions, recomputed from the code), and its validation
against measured CPU peaks and step times (from the committed results file), and its figures for the
papers' setups beside the papers' own (``papers``)."""

from __future__ import annotations

import math
from dataclasses import replace

from lightning_sp.flops import megatron_flops_per_iteration
from lightning_sp.planner import (USABLE_MEMORY_SHARE, Candidate, ModelSpec, _max_seq_len, hardware_profile,
                                  memory_bytes, plan, step_time)

ESM2_650M = {"architectures": ["EsmForMaskedLM"], "model_type": "esm", "hidden_size": 1280, "num_hidden_layers": 33,
             "num_attention_heads": 20, "intermediate_size": 5120, "vocab_size": 33, "hidden_act": "gelu"}
ESM2_3B = {"architectures": ["EsmForMaskedLM"], "model_type": "esm", "hidden_size": 2560, "num_hidden_layers": 36,
           "num_attention_heads": 40, "intermediate_size": 10240, "vocab_size": 33, "hidden_act": "gelu"}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "hidden_act": "silu", "tie_word_embeddings": False}

SETUPS = [  # (label, config, N, devices per node, nodes)
    ("ESM-2 650M", ESM2_650M, 65536, 8, 1),
    ("ESM-2 650M", ESM2_650M, 262144, 8, 1),
    ("ESM-2 650M", ESM2_650M, 1048576, 8, 8),
    ("ESM-2 3B", ESM2_3B, 65536, 8, 1),
    ("ESM-2 3B", ESM2_3B, 1048576, 8, 8),
    ("Llama-3-8B-like", LLAMA3_8B, 131072, 8, 1),
]


def _layout(c) -> str:
    name = f"usp(ulysses={c.ulysses_degree})" if c.backend == "usp" else c.backend
    extras = [f"kv_pieces={c.kv_pieces}"] if c.kv_pieces > 1 else []
    extras += ["checkpointing"] if c.activation_checkpointing else []
    extras += ["tiled loss"] if c.tiled_loss else []
    return f"sp={c.sequence_parallel_size} dp={c.data_parallel_size} tp={c.tensor_parallel_size} `{name}`" + (
        f" + {', '.join(extras)}" if extras else "")


def setups(data=None, path=None, hardware: str = "h100") -> str:
    """The planner's recommendation for each of ``SETUPS`` (bf16-mixed, DDP, batch 1): a prediction from
    datasheet parameters."""
    rows = ["| model | GPUs | N | recommended (predicted) | GiB per GPU | step s | tokens/s per GPU | longest N that fits |",
            "|---|---|---|---|---|---|---|---|"]
    for label, cfg, n, devices, nodes in SETUPS:
        p = plan(cfg, seq_len=n, devices=devices, nodes=nodes, hardware=hardware)
        c = p.recommended
        fits = "" if c.fits else " (does not fit)"
        rows.append(f"| {label} | {devices * nodes} x {p.hardware} | {n:,} | {_layout(c)}{fits} | "
                    f"{c.peak_bytes_per_rank / 2**30:.1f} | {c.step_time_s:.2f} | {c.tokens_per_s_per_device:,.0f} | "
                    f"{c.max_seq_len:,} |")
    return "\n".join(rows)


def validation(data, path) -> str:
    """Predicted against measured (CPU gloo ranks, float32) per row, and the summary."""
    s = data["summary"]
    timed = "time_mean_abs_error" in s
    how = f"`{data['command']}`" + (" (the grid in parts by world size)" if "--worlds" in data["command"] else "")
    if "repredicted" in data:
        how += f"; predictions recomputed from the measured rows by `{data['repredicted']['command']}`"
    head = (f"Measured {data['date'][:10]} on {data['hardware']['device']}, float32, gloo, {how}: {s['rows']} rows; "
            f"peak memory mean error **{100 * s['memory_mean_abs_error']:.1f}%**, worst "
            f"{100 * s['memory_max_abs_error']:.1f}%")
    if timed:
        head += (f"; step time mean error **{100 * s['time_mean_abs_error']:.1f}%**, worst "
                 f"{100 * s['time_max_abs_error']:.1f}%")
    cols = "| model | P | backend | data parallel | checkpointing | N | measured MiB | predicted MiB | error |"
    if timed:
        cols += " measured step s | predicted step s | error |"
    rows = [head + ".", "", cols, "|" + "---|" * (cols.count("|") - 1)]
    for r in data["rows"]:
        line = (f"| {r['model']} | {r['world']} | `{r['backend']}` | {r['data_parallel']} | "
                f"{'on' if r['activation_checkpointing'] else 'off'} | {r['seq_len']} | "
                f"{r['measured']['peak_bytes'] / 2**20:.1f} | {r['predicted']['peak_bytes'] / 2**20:.1f} | "
                f"{100 * r['memory_error']:+.1f}% |")
        if timed:
            line += (f" {r['measured']['step_s']:.3f} | {r['predicted']['step_s']:.3f} | "
                     f"{100 * r['time_error']:+.1f}% |")
        rows.append(line)
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ the papers

GPT_7B = ModelSpec(name="GPT 7B", num_layers=32, hidden=4096, num_heads=32, vocab=50257, biases=True)
GPT_30B = ModelSpec(name="GPT 30B", num_layers=48, hidden=7168, num_heads=56, vocab=50257, biases=True)
LLAMA_3B = ModelSpec(name="LLaMA 3B", num_layers=26, hidden=3200, num_heads=32, ffn_hidden=8640, gated_mlp=True,
                     tied_embeddings=False)  # OpenLLaMA-3B
LLAMA_7B = ModelSpec(name="LLaMA 7B", num_layers=32, hidden=4096, num_heads=32, ffn_hidden=11008, gated_mlp=True,
                     tied_embeddings=False)
LLAMA_13B = ModelSpec(name="LLaMA 13B", num_layers=40, hidden=5120, num_heads=40, ffn_hidden=13824, gated_mlp=True,
                      tied_embeddings=False)

ULYSSES_SEQ = (8192, 16384, 32768, 65536, 131072, 262144)
ULYSSES_TFLOPS = {  # arXiv 2309.14509, TFLOPs per GPU at ULYSSES_SEQ (30B read off a chart)
    "7B": (GPT_7B, 32, (159, 175, 178, 181, 176, 174)),
    "30B": (GPT_30B, 64, (165, 157, 152, 147, 140, 134)),
}
RING_TABLE3 = (  # arXiv 2310.01889 Table 3, the ring column: (model, GPUs, network, max context in K tokens)
    (LLAMA_3B, 8, "NVLink", 512), (LLAMA_7B, 8, "NVLink", 256), (LLAMA_13B, 8, "NVLink", 128),
    (LLAMA_7B, 32, "InfiniBand", 4096), (LLAMA_13B, 32, "InfiniBand", 2048),
)
ALST = ((1, 500_000), (8, 3_700_000), (32, 15_000_000))  # arXiv 2506.13996: H100s, longest Llama-8B sequence


def _candidate(backend: str, sp: int, dp: int, *, ckpt: bool, tiled: bool) -> Candidate:
    return Candidate(backend=backend, sequence_parallel_size=sp, data_parallel_size=dp, tensor_parallel_size=1,
                     ulysses_degree=None, kv_pieces=1, activation_checkpointing=ckpt, tiled_loss=tiled)


def _ulysses_rows(hw) -> list[tuple]:
    """TFLOPs/GPU: Megatron's model FLOPs of the step (every replica's sequence) / the predicted step time / GPUs.
    Fixed layout: ``ulysses`` at sp=8 (one node), the other GPUs data parallel, FSDP (ZeRO-3) over all, batch 1
    per replica, bf16-mixed; checkpointing only where the layer's activations do not fit without it."""
    budget = hw.memory_bytes * USABLE_MEMORY_SHARE
    rows = []
    for name, (m, gpus, paper) in ULYSSES_TFLOPS.items():
        for n, figure in zip(ULYSSES_SEQ, paper):
            kw = dict(seq_len=n, batch=1, precision="bf16-mixed", data_parallel="fsdp", hw=hw)
            c = _candidate("ulysses", 8, gpus // 8, ckpt=False, tiled=False)
            if sum(memory_bytes(m, c, **kw).values()) > budget:
                c = replace(c, activation_checkpointing=True)
            peak = sum(memory_bytes(m, c, **kw).values())
            parts = step_time(m, c, **kw)
            seconds = sum(parts.values())
            flops = megatron_flops_per_iteration(batch=c.data_parallel_size, seq_len=n, num_layers=m.num_layers,
                                                 hidden=m.hidden, vocab=m.vocab)
            layout = (f"`ulysses` sp=8 dp={gpus // 8}, FSDP, checkpointing {'on' if c.activation_checkpointing else 'off'}; "
                      f"exposed comm. {100 * parts['exposed_comm_s'] / seconds:.0f}% of the step; "
                      f"{peak / 2**30:.0f} GiB per GPU" + ("" if peak <= budget else " (**predicted not to fit**)"))
            paper_figure = f"~{figure}" if name == "30B" else f"{figure}"
            rows.append((f"Ulysses {name} GPT, {gpus} x A100, N={n // 1024}K", "TFLOPs/GPU", paper_figure, figure,
                         flops / seconds / gpus / 1e12, layout, "[a]"))
    return rows


def _longest(m, backend, devices, hw, *, data_parallel="fsdp") -> tuple[int, Candidate]:
    """The planner's longest sequence for ``backend`` at sp = ``devices`` with checkpointing, the better of the
    tiled loss on/off."""
    budget = hw.memory_bytes * USABLE_MEMORY_SHARE
    kw = dict(batch=1, precision="bf16-mixed", data_parallel=data_parallel, hw=hw)
    found = []
    for tiled in (False, True):
        c = _candidate(backend, devices, 1, ckpt=True, tiled=tiled)
        found.append((_max_seq_len(m, c, budget, 128 * devices, **kw), c))
    return max(found, key=lambda t: t[0])


PAPER_NOTES = {
    "[a]": "DeepSpeed-Ulysses (arXiv 2309.14509, Fig. 2/3; the 30B figures read off a chart). The paper's batch, "
           "ZeRO stage, sequence-parallel degree and recompute are **unknown** here (not stated with the figures): "
           "assumed batch 1 per replica, ZeRO-3 (FSDP) over all GPUs, sp=8 inside a node, checkpointing only "
           "where the layer's activations do not fit without it. The 30B shape is **assumed** (48 layers, width "
           "7168, 56 heads, GPT-style: 29.6B); the 7B is 32 layers, width 4096, 32 heads. TFLOPs = Megatron's "
           "model FLOPs `72BLsh^2(1 + s/6h + V/12hL)` of every replica's sequence (`lightning_sp.flops`; it "
           "counts the whole score matrix, the half a causal kernel skips included, so it can exceed what the "
           "GPU computes) / the predicted step time / GPUs. At short N a batch-1 step is dominated by the "
           "gradient synchronisation over InfiniBand (the exposed share in the layout column); the paper's "
           "batch, unknown, amortizes it. The planner's `bf16-mixed` keeps a bfloat16 copy of every weight "
           "unsharded (`weight_copies`), which is what puts the 30B over 80 GB.",
    "[b]": "Ring Attention (arXiv 2310.01889) Table 3, the `ring` column (full sharding, blockwise attention and "
           "FFN, JAX). The planner: `ring` at sp = every GPU, FSDP, activation checkpointing, `bf16-mixed`, the "
           "better of the tiled loss on/off; OpenLLaMA-3B / LLaMA-7B / LLaMA-13B shapes. **Not modelled**: the "
           "blockwise (chunked) FFN (the planner holds one layer's whole MLP activations in its backward), JAX's "
           "allocator and compiler workspace. **Unknown**: the paper's precision, loss and search grid (its "
           "figures are powers of two).",
    "[c]": "DeepSpeed ALST (arXiv 2506.13996): Llama-8B, Ulysses + tiled MLP + tiled loss + activation-checkpoint "
           "offload to CPU memory. The planner: Llama-3-8B, one GPU without SP (`local`) or `ulysses` at sp = "
           "every GPU, FSDP, checkpointing, the better of the tiled loss on/off. **Not modelled**: the offload of "
           "the checkpoints (and of optimizer states) to CPU memory and the tiled MLP, which is where ALST's "
           "length comes from; the planner keeps every checkpoint and all states on the GPU, so on one H100 the "
           "8B's parameters, gradients, AdamW states and bfloat16 weight copies alone (18 bytes per parameter) do "
           "not fit and its "
           "longest sequence is 0.",
}


def papers(data=None, path=None) -> str:
    """The planner's figures for the papers' setups beside the papers' published figures: the
    planner's column is a PREDICTION from datasheet parameters (``a100``/``h100`` presets), the paper's column its
    measurement. Nothing in the planner is fitted to these rows."""
    a100, h100 = hardware_profile("a100"), hardware_profile("h100")
    rows = _ulysses_rows(a100)  # (setup, figure, paper as printed, paper, planner, layout, note)
    for m, gpus, network, figure in RING_TABLE3:
        n, c = _longest(m, "ring", gpus, a100)
        rows.append((f"Ring Attention, {m.name}, {gpus} x A100 {network}", "max context (K tokens)", f"{figure:,}",
                     figure, n / 1024, f"`ring` sp={gpus}, FSDP, checkpointing, tiled loss "
                     f"{'on' if c.tiled_loss else 'off'}", "[b]"))
    llama = ModelSpec.from_hf_config(LLAMA3_8B, name="Llama-3-8B")
    for gpus, figure in ALST:
        backend = "local" if gpus == 1 else "ulysses"
        n, c = _longest(llama, backend, gpus, h100)
        rows.append((f"ALST, Llama-3-8B, {gpus} x H100", "longest sequence (K tokens)", f"{figure // 1000:,}",
                     figure / 1000, n / 1000, f"`{backend}` sp={gpus}, FSDP, checkpointing, tiled loss "
                     f"{'on' if c.tiled_loss else 'off'}", "[c]"))
    out = ["The planner's column is a **prediction** from datasheet parameters (the `a100`/`h100` presets, never "
           "calibrated on a GPU); the paper's column is the paper's measurement. Nothing in the planner is fitted "
           "to these rows. Ratio = planner / paper.", "",
           "| setup | figure | paper (measured) | planner (predicted) | planner / paper | planner's layout | notes |",
           "|---|---|---|---|---|---|---|"]
    for setup, metric, printed, paper, pred, layout, note in rows:
        out.append(f"| {setup} | {metric} | {printed} | {pred:,.0f} | {pred / paper:.2f} | {layout} | {note} |")
    notes = "\n\n".join(f"{key} {text}" for key, text in PAPER_NOTES.items())
    return "\n".join(out) + "\n\n" + notes


# ------------------------------------------------------------------------------------------------ one H200

H200_MODEL = ModelSpec(name="ProteinEncoder, ESM-2 650M shape", num_layers=33, hidden=1280, num_heads=20, vocab=31,
                       causal=False, biases=True, implementation="project")
"""``benchmarks/gpu/run.py``'s ``protein_encoder``: 33 layers, d_model 1280, 20 heads of 64, MLP 4x, 31 tokens."""


def _h200_predict(n: int, hardware: str, mlp_chunk: int) -> tuple[dict, dict]:
    hw = hardware_profile(hardware)
    c = Candidate(backend="local", sequence_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1,
                  ulysses_degree=None, kv_pieces=1, activation_checkpointing=True, tiled_loss=False,
                  mlp_chunk_tokens=mlp_chunk)
    kw = dict(seq_len=n, batch=1, precision="bf16-true", data_parallel="ddp", hw=hw)
    return memory_bytes(H200_MODEL, c, **kw), step_time(H200_MODEL, c, **kw)


def gpu_h200(data, path) -> str:
    """The planner (``h200-141gb``: datasheet; ``h200-measured``: the attention kernel's measured rates from
    ``perf.json``, which are not these rows) against the measured steps of ``bench_longest_mfu.json``."""
    meta, res = data["meta"], data["results"]
    chunk = meta["args"]["mlp_chunk"]
    gib = 2.0 ** 30
    rows, errors = [], {}

    def add(run, n, figure, measured, unit, pick):
        cells = []
        for hardware in ("h200-141gb", "h200-measured"):
            pred = pick(*_h200_predict(n, hardware, chunk))
            err = pred / measured - 1
            errors.setdefault((figure, hardware), []).append(abs(err))
            cells.append(f"{pred:.2f} | {100 * err:+.1f}%")
        rows.append(f"| {run} | {n // 1024}K | {figure} | {measured:.2f} {unit} | " + " | ".join(cells) + " |")

    for r in res["longest"]:
        if r["world"] != 1 or not isinstance(r["peak_bytes"], int):
            continue
        # one step from a fresh optimizer: AdamW's moments appear in opt.step(), after the activations are freed
        add("one step, no Lightning", r["seq_len"], "peak allocated (first step)", r["peak_bytes"] / gib, "GiB",
            lambda mem, t: max(sum(mem.values()) - mem["optimizer"],
                               mem["parameters"] + mem["gradients"] + mem["optimizer"]) / gib)
    for r in res["mfu"]:
        add(f"Lightning, {r['steps']} steps", r["seq_len"], "peak allocated", r["peak_memory_gib"], "GiB",
            lambda mem, t: sum(mem.values()) / gib)
        add(f"Lightning, {r['steps']} steps", r["seq_len"], "step time", r["step_s"], "s",
            lambda mem, t: sum(t.values()))
    out = [f"Measured {meta['date_utc'][:10]} on one {meta['device_name']} (torch {meta['torch']}), "
           f"`{meta['command']}` (`benchmarks/gpu/run.py`, sections `longest` and `mfu`): the protein encoder at "
           "ESM-2 650M shape (33 layers, width 1280, 20 heads of 64), parameters, gradients and AdamW's moments all "
           f"bfloat16 (`bf16-true`), full activation checkpointing, the sequence-tiled MLP ({chunk} tokens), the "
           "chunked loss, one GPU (`local`), batch 1. Measured: `torch.cuda.max_memory_allocated` (tensors only: "
           "not the caching allocator's reserve, the CUDA context or cuDNN/cuBLAS workspaces outside it) over one "
           "step after the model is built (`longest`), or over each step of a Lightning fit, the last step's "
           "(`mfu`, `SequenceParallelMonitor`); step time: the monitor's, the last of the steps. Predicted: "
           "`lightning_sp.planner` with `precision=\"bf16-true\"`, `mlp_chunk_tokens`, checkpointing; the first-step "
           "rows take the larger of the step without AdamW's moments and the optimizer step's states (the "
           "moments do not exist before the first `opt.step()`).", "",
           "| run | N | figure | measured | predicted, `h200` (datasheet) | error | predicted, `h200-measured` | error |",
           "|---|---|---|---|---|---|---|---|"] + rows
    summary = "; ".join(f"{figure} on `{hw}`: mean {100 * sum(e) / len(e):.1f}%, worst {100 * max(e):.1f}%"
                        for (figure, hw), e in errors.items())
    out += ["", f"Errors: {summary}. `h200-measured` takes the attention kernel's rate from the kernel benchmark "
            "(causal, head dim 128): the model's kernel calls are bidirectional with head dim 64, whose rate was "
            "not measured (**unknown**); its matmul rate is the datasheet assumption (70% of 989 TFLOP/s; the "
            "monitor measured 669 TFLOP/s for a dense bf16 matmul on this GPU). Not modelled: the caching "
            "allocator's fragmentation, kernel launch gaps, Lightning's own time per step."]
    return "\n".join(out)


def time_validation(data, path) -> str:
    """Measured against predicted step times (CPU gloo ranks), and the planner's pick against the measured
    fastest of its candidates (``run.py --time`` / ``--recommend``)."""
    out = [f"Measured {data['date'][:10]} on {data['hardware']['device']}, float32, gloo, `{data['command']}`; "
           f"predicted with the attention kernel's table of `{path.parent}/cpu_kernel_table.json` (re-measured just "
           "before, head dims 8-128; Note [Kernel table below the smallest head dim]), the layer rates of "
           f"`{path.parent}/cpu_layer_rates.json` (micro-benchmarks: the linear layers at their shapes, norms and "
           "activations, transformers' decoder layer's small ops, the loss per vocabulary, AdamW; Note [Layer rates]), "
           f"the wait for the slowest rank per synchronization of `{path.parent}/cpu_sync_wait.json` (2 and 4 ranks "
           "computing then all-reducing; Note [Rank skew]) and the fixed "
           f"time per step of `{path.parent}/cpu_step_overhead.json` (calibrated on tiny encoders and tiny "
           "transformers Llamas), none of them on these rows."]
    if "allocator" in data:
        out[0] += f" Allocator: {data['allocator']} (Note [Fresh pages] in `experiments/cost_model/NOTES.md`)."
    if "repredicted" in data:
        out[0] += f" Predictions recomputed by `{data['repredicted']['command']}` ({data['repredicted']['date'][:10]})."
    if "summary" in data:
        s = data["summary"]
        before = ""
        if "previous" in data:
            p = data["previous"]["summary"]
            before = (f" The run before ({data['previous']['date'][:16].replace('T', ' ')}, commit "
                      f"{data['previous'].get('git_commit', '?')}): mean {100 * p['mean_abs_error']:.1f}%, worst "
                      f"{100 * p['max_abs_error']:.1f}%.")
        out += ["", f"{s['rows']} rows: step time mean error **{100 * s['mean_abs_error']:.1f}%**, worst "
                    f"{100 * s['max_abs_error']:.1f}%.{before}", "",
                "| model | P | backend | data parallel | checkpointing | N | measured step s | predicted step s | "
                "of which attention | of which other compute | of which rank skew | of which fixed | error |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            out.append(f"| {r['model']} | {r['world']} | `{r['backend']}` | {r['data_parallel']} | "
                       f"{'on' if r['activation_checkpointing'] else 'off'} | {r['seq_len']} | "
                       f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                       f"{r['predicted_time']['attention_compute_s']:.3f} | {r['predicted_time']['other_compute_s']:.3f} | "
                       f"{r['predicted_time'].get('sync_wait_s', 0.0):.3f} | "
                       f"{r['predicted_time'].get('fixed_s', 0.0):.3f} | {100 * r['error']:+.1f}% |")
    for setup, rec in data.get("recommendations", {}).items():
        pick = rec["planner_pick"]
        fastest = min(rec["candidates"], key=lambda c: c["measured_step_s"])
        out += ["", f"**{setup}**: the planner picks `{pick['backend']}` checkpointing "
                    f"{'on' if pick['activation_checkpointing'] else 'off'}, measured **{100 * rec['pick_over_fastest']:+.1f}%** "
                    f"over the measured fastest (`{fastest['backend']}` checkpointing "
                    f"{'on' if fastest['activation_checkpointing'] else 'off'}).", "",
                "| backend | checkpointing | measured step s | predicted step s |", "|---|---|---|---|"]
        for c in sorted(rec["candidates"], key=lambda c: c["measured_step_s"]):
            out.append(f"| `{c['backend']}` | {'on' if c['activation_checkpointing'] else 'off'} | "
                       f"{c['measured_step_s']:.3f} | {c['predicted_step_s']:.3f} |")
    return "\n".join(out)


def time_summary(data, path) -> str:
    """One line: a step-time run's command, date, allocator and errors (a repeat of ``time_validation``'s rows)."""
    s = data["summary"]
    allocator = "; glibc keeps freed memory" if "allocator" in data else ""
    if "repredicted" in data:
        allocator += f"; predictions recomputed by `{data['repredicted']['command']}`"
    return (f"`{data['command']}` ({data['date'][:16].replace('T', ' ')} UTC{allocator}): {s['rows']} rows, step time "
            f"mean error **{100 * s['mean_abs_error']:.1f}%**, worst {100 * s['max_abs_error']:.1f}%, "
            + (f"{sum(r['error'] < 0 for r in data['rows'])} of {s['rows']} rows predicted short."))
