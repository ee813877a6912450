"""Tables of the planner for the docs (generated blocks, ``python -m experiments.common.generated``): its
recommendations for the setups users ask about (predictions, recomputed from the code), and its validation
against measured CPU peaks and step times (from the committed results file)."""

from __future__ import annotations

from lightning_sp.planner import plan

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
    head = (f"Measured {data['date'][:10]} on {data['hardware']['device']}, float32, gloo: {s['rows']} rows; peak "
            f"memory mean error **{100 * s['memory_mean_abs_error']:.1f}%**, worst {100 * s['memory_max_abs_error']:.1f}%")
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
