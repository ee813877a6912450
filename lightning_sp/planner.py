"""Plan a training run before it runs: which layout and backend, the memory per rank, the step time and the
longest sequence that fits (``lightning-sp plan``, ``lightning_sp.plan``).

    plan = lightning_sp.plan("config.json", seq_len=65536, devices=8, hardware="h100")
    print(plan.summary())              # the candidates, the recommendation and why
    plan.to_dict()["recommended"]      # backend, degrees, kv_pieces, checkpointing, bytes, seconds, max_seq_len

Every figure is a **prediction** (Note [Step model]) from the hardware's parameters: datasheet ones for the GPU
presets, measured ones for ``h200-measured`` and calibrated CPU profiles. The model is validated against
measured peaks and step times of whole training steps on CPU and on one H200 (``experiments/planner``,
``docs/guides/planning.md``); the attention's time is ``cost_model.predict_attention``'s.

Note [Step model]
    Per rank, for one optimizer step on ``B`` sequences of ``N`` tokens, ``T = B N / sp`` tokens per rank:

    memory = states + max(loss, MLP backward, attention backward)       (``memory_phases``)
      states       parameters, gradients and AdamW's two moments (4 + 4 + 8 bytes per parameter under
                   ``32-true`` and the mixed precisions, whose master weights are float32; 2 + 2 + 4 under
                   ``bf16-true``), divided by ``tp`` for the layers' weights and the vocabulary; FSDP (each
                   transformer block its own unit) shards them over ``dp x sp`` and holds two blocks' and the
                   root's parameters gathered; DDP keeps a second copy of the gradients in its buckets;
                   ``bf16-mixed`` keeps a bfloat16 copy of every weight a matmul saved for backward
    The activations peak at one of three moments; each counts what is alive then:
      loss         every layer's stored activations (the block's input only with activation checkpointing,
                   else every tensor the layer saves, Note [Saved tensors]) + the head's (the final norm's
                   input and output, a masked-LM head's transform) + the ``[T, V]`` logits and their
                   gradient and the loss's float32 chunks (a few float32 tiles with the tiled loss,
                   ``sequence_parallel_cross_entropy(hidden, labels, weight=...)``)
      MLP backward the last layer's backward begins: stored + its recomputed tensors (checkpointing) + the
                   gradients flowing (three ``[T, C]``) + the activation's backward (one more ``[T, ffn]``, three
                   for the erf GELU; with the tiled MLP, one tile's four ``[tile, ffn]``)
      attention    a little later: its MLP's tensors are freed and the attention call's own peak beyond its
      backward     inputs and output is added: the backend's K/V buffers in flight (the rings' blocks,
                   all-gather's whole K/V, Ulysses' gathered heads); on CPU the blockwise kernel's fitted peak
                   (``choices``)

    time = L x (attention fwd+bwd + the linear layers' FLOPs at ``matmul_flops`` + elementwise passes at the
           profile's per-element cost) + the output head + TP's all-gathers/reduce-scatters + the part of the
           gradient all-reduce not hidden by backward + the waits for the slowest rank at each synchronization
           (calibrated profiles only, Note [Rank skew]) + a fixed time per step (the training loop; calibrated,
           0 unless given),
    with one more forward of every layer under activation checkpointing and of the MLP with the tiled MLP;
    ranks that share a CPU's cores compute proportionally slower. A profile with measured layer rates (Note
    [Layer rates]: the CPU's calibration) prices the linear layers at the rate of their own shapes, the elementwise
    passes at the measured cost of the code that runs the layer (``ModelSpec.implementation``), and adds the loss's
    (at the model's vocabulary) and AdamW's update's measured costs and the rank-skew waits; its kernel table prices the attention's calls at their own head dim (Note
    [Kernel table below the smallest head dim] in ``cost_model``). Not modelled: the data loader, kernel launch gaps
    (on GPU, the optimizer's update), and on CPU the pages glibc's allocator hands back to the system and faults in
    again every step (3-17% of four of the validated steps; Note [Fresh pages] in ``experiments/cost_model/NOTES.md``).

Note [Saved tensors]
    What one layer keeps for backward per token, in activation elements (``ModelSpec.saved_per_token``): the
    two norms' inputs and outputs (``4 C``), q, k, v, the attention's output and its float32 log-sum-exp, and
    the MLP's inner activations (two ``ffn`` for GELU: fc1's output and the activation; four for gated
    MLPs). Autograd keeps only what a backward formula reads: ``x * cos`` keeps ``cos``, not ``x``, so rotary
    adds nothing. What the code adds (``ModelSpec.implementation``): this project's layer projects q, k, v
    in one matmul and ``v`` is a view of it, which keeps q's and k's pre-rotation part alive (``+ q + k``);
    transformers' per-head q/k RMSNorm (Qwen3) keeps its inputs and outputs (``+ 2 (q + k)``); transformers'
    ESM writes GELU as ``x * 0.5 * (1 + erf(x / sqrt 2))``, which keeps four ``ffn`` tensors, two more than a
    fused GELU. MoE: the experts a token visits and the shared ones, plus the router's scores. The
    sequence-tiled MLP keeps only its input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from lightning_sp import cost_model

PRECISIONS = {"bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "32-true": 4}
"""Activation bytes per element of each Lightning precision the planner knows."""

STATE_BYTES = {"bf16-mixed": (4, 4, 8), "16-mixed": (4, 4, 8), "bf16-true": (2, 2, 4), "32-true": (4, 4, 8)}
"""Bytes per parameter of (the parameter, its gradient, AdamW's two moments) under each precision: the mixed
ones keep float32 master weights; ``bf16-true`` (pure bfloat16) keeps all three in bfloat16."""

IMPLEMENTATIONS = ("fused", "project", "hf")
"""What a layer saves for backward beyond its fused minimum (``ModelSpec.implementation``)."""

DATA_PARALLEL = ("ddp", "fsdp")

USABLE_MEMORY_SHARE = 0.92
"""Share of a device's memory a plan may fill (assumption: the CUDA context, the caching allocator's
fragmentation and NCCL's buffers take the rest)."""

LOSS_CHUNK_ELEMENTS = 1 << 24
"""Logits the loss upcasts at a time (``lightning_sp.loss``'s chunk; a test keeps the two equal)."""

NEAR_TIE = 0.97
"""Layouts predicted within 3% of the fastest count as tied (the cost model's own error is larger); among them
the recommendation takes the one that leaves the most memory room."""

HARDWARE_ALIASES = {"cpu": "cpu-default", "a100": "a100-80gb", "h100": "h100-80gb", "h800": "h800-80gb",
                    "h200": "h200-141gb", "b200": "b200-180gb"}

_GATED_ACTIVATIONS = ("silu", "swiglu", "swish")
_ENCODER_TYPES = ("esm", "bert", "roberta", "modernbert", "deberta", "deberta-v2", "distilbert", "electra")
_T5_TYPES = ("t5", "mt5", "umt5")


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The sizes a plan needs. Dense, GQA/MQA, MLA (DeepSeek) and MoE transformers, encoder or decoder."""

    num_layers: int
    hidden: int
    """Model width ``C``."""
    num_heads: int
    num_kv_heads: int | None = None
    """``None``: ``num_heads`` (MHA)."""
    head_dim: int | None = None
    """``None``: ``hidden // num_heads``."""
    ffn_hidden: int | None = None
    """The MLP's inner width; ``None``: ``4 x hidden``."""
    gated_mlp: bool = False
    """SwiGLU/GeGLU (three matrices) rather than two."""
    vocab: int = 32000
    tied_embeddings: bool = True
    causal: bool = True
    """Decoder (causal) or encoder (bidirectional)."""
    sliding_windows: tuple = ()
    """Per layer, its attention's window ``(left, right)`` (flash-attn's convention, ``-1``: unbounded; Hugging Face's
    ``sliding_window=W`` is ``(W - 1, 0)``) or ``None`` (full attention); empty: every layer full. Priced per layer
    (``attention_per_layer``)."""
    chunk_sizes: tuple = ()
    """Per layer, its attention's chunk (Llama 4's ``chunked_attention`` layers: a query sees only the keys of its own
    ``attention_chunk_size`` chunk) or ``None``; empty: no chunked layer."""
    attention_softcap: float | None = None
    """Soft-capping of every layer's attention scores (Gemma-2's ``attn_logit_softcapping``)."""
    attention_alibi: bool = False
    """ALiBi biases on every layer's scores."""
    relative_bias: bool = False
    """A learned relative-position bias on every layer's scores (T5's buckets; its table gets a gradient)."""
    attention_sinks: bool = False
    """One learned sink logit per head on every layer (gpt-oss)."""
    bidirectional_spans: tuple = ()
    """``(start, end)`` spans of global positions every layer's causal attention sees whole (a prefix-LM's prefix,
    ``AttentionMask(bidirectional_spans=)``; ``plan(mask=)``, ``--bidirectional-span``): priced on zigzag and on the
    chunk table balanced for them (Note [Layouts for bidirectional spans])."""
    num_experts: int = 0
    """MoE: routed experts per layer (0: dense)."""
    experts_per_token: int = 0
    moe_ffn_hidden: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    """MoE: the first layers that keep a dense MLP (DeepSeek's ``first_k_dense_replace``)."""
    kv_lora_rank: int = 0
    """MLA: the compressed K/V width (0: not MLA)."""
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None
    biases: bool = False
    """Linear layers and norms with biases (BERT/ESM style)."""
    lm_head_transform: bool = False
    """A dense + norm before the output projection (BERT/ESM masked-LM heads)."""
    implementation: str = "fused"
    """Which code runs the layer, for the tensors it saves for backward (Note [Saved tensors]): ``"fused"``
    (fused rotary/norm/activation kernels: the minimum), ``"project"`` (``lightning_sp.models``) or ``"hf"``
    (transformers' eager modules)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3)."""
    python_gelu: bool = False
    """The MLP's GELU written as ``x * 0.5 * (1 + erf(x / sqrt 2))`` (transformers' ESM)."""
    name: str = "model"

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "num_heads", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelSpec.{f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}")
        if self.num_experts and not self.experts_per_token:
            raise ValueError("an MoE model needs experts_per_token (num_experts_per_tok) >= 1")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"ModelSpec.implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")

    # ---- derived sizes
    def layer_attention(self) -> tuple["LayerAttention", ...]:
        """How each layer attends (Note [Attention under per-layer masks])."""
        for name in ("sliding_windows", "chunk_sizes"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"ModelSpec.{name} has {len(getattr(self, name))} entries for {self.num_layers} "
                                 "layers: one per layer ((left, right) or None for a window, an int or None for a chunk)")
        windows = self.sliding_windows or (None,) * self.num_layers
        chunks = self.chunk_sizes or (None,) * self.num_layers
        spans = tuple(tuple(int(x) for x in span) for span in self.bidirectional_spans)
        return tuple(LayerAttention(window=None if w is None else tuple(w), chunk_size=c, softcap=self.attention_softcap,
                                    alibi=self.attention_alibi, relative_bias=self.relative_bias,
                                    sinks=self.attention_sinks, spans=spans) for w, c in zip(windows, chunks))

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.kv_lora_rank else (self.num_kv_heads or self.num_heads)

    @property
    def qk_dim(self) -> int:
        """Query/key head dim (MLA: nope + rope parts)."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.qk_dim

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def attention_params(self) -> int:
        c, h, hkv, d, dv = self.hidden, self.num_heads, self.kv_heads, self.qk_dim, self.v_dim
        if self.kv_lora_rank:  # MLA: down-projections to latents, up-projections to heads
            q = c * self.q_lora_rank + self.q_lora_rank * h * d if self.q_lora_rank else c * h * d
            kv = c * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (d - self.qk_rope_head_dim + dv)
            return q + kv + h * dv * c
        return c * h * d + 2 * c * hkv * d + h * d * c

    def mlp_params(self, *, active: bool, moe_layer: bool = True) -> int:
        mats = 3 if self.gated_mlp else 2
        if not (self.num_experts and moe_layer):
            return mats * self.hidden * self.ffn
        per_expert = mats * self.hidden * (self.moe_ffn_hidden or self.ffn)
        experts = (self.experts_per_token if active else self.num_experts) + self.shared_experts
        return experts * per_expert + self.hidden * self.num_experts  # + the router

    def layer_params(self, *, active: bool = False) -> float:
        moe = self.num_layers - self.dense_layers if self.num_experts else 0
        dense = self.num_layers - moe
        c = self.hidden
        per = self.attention_params() + 2 * c  # + the two norms' weights
        if self.biases:  # q, k, v, o, the MLP's two, the norms'
            per += (self.num_heads + 2 * self.kv_heads) * self.qk_dim + c + self.ffn + c + 2 * c
        return (self.num_layers * per + dense * self.mlp_params(active=active, moe_layer=False)
                + moe * self.mlp_params(active=active))

    def embedding_params(self) -> int:
        """The embedding, the output projection (unless tied), the final norm and a masked-LM head's transform."""
        c = self.hidden
        extra = c * (2 if self.biases else 1)
        if self.lm_head_transform:
            extra += c * c + c + 2 * c + self.vocab  # dense, its bias, a norm, the output bias
        return self.vocab * c * (1 if self.tied_embeddings else 2) + extra

    @property
    def params(self) -> float:
        return self.layer_params() + self.embedding_params()

    def mlp_width(self) -> float:
        """The MLP's inner width per token, averaged over the layers (MoE: the routed experts a token visits
        and the shared ones; DeepSeek's first dense layers their own)."""
        if not self.num_experts:
            return self.ffn
        moe_layers = self.num_layers - self.dense_layers
        routed = (self.moe_ffn_hidden or self.ffn) * (self.experts_per_token + self.shared_experts)
        return (moe_layers * routed + self.dense_layers * self.ffn) / self.num_layers

    def saved_per_token(self, *, tp: int = 1, act_bytes: int = 2, mlp_tiled: bool = False) -> tuple[float, float]:
        """Elements (of ``act_bytes`` each) one layer saves for backward per token without checkpointing, per
        rank under ``tp``, as ``(attention and norms, MLP)`` (Note [Saved tensors]). ``mlp_tiled``: the
        sequence-tiled MLP, which saves only its input (the second norm's output, counted with the norms)."""
        c, h, hkv, d, dv = self.hidden, self.num_heads, self.kv_heads, self.qk_dim, self.v_dim
        q, k = h * d, hkv * d
        attn = (q + k + hkv * dv + h * dv) / tp + h / tp * max(1, 4 // act_bytes)  # + the float32 log-sum-exp
        if self.kv_lora_rank:  # MLA: the latents and their norms' inputs
            attn += (2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim) / tp
        if self.implementation == "project":  # one q/k/v projection: v's view keeps q's and k's part alive
            attn += (q + k) / tp
        elif self.implementation == "hf" and self.qk_norm:  # the per-head RMSNorms' inputs and outputs
            attn += 2 * (q + k) / tp
        width = self.mlp_width() / tp
        if mlp_tiled:
            mlp = 0.0
        else:  # GELU: fc1's output and the activation; gated: gate, its activation, up, their product
            mlp = (4 if self.gated_mlp else 2) * width
            if self.implementation == "hf" and self.python_gelu:
                mlp += 2 * width  # x / sqrt 2 for erf, x * 0.5 and 1 + erf for the product (fc1's output is not kept)
            if self.num_experts:  # the router's scores and the tokens gathered per expert
                mlp += self.num_experts / tp + self.experts_per_token * c / tp
        return 4 * c + attn, mlp

    # ---- constructors
    @classmethod
    def from_hf_config(cls, cfg: dict, *, name: str | None = None) -> "ModelSpec":
        """From a transformers ``config.json`` (as a dict): Llama/Qwen/Mistral/Gemma-style decoders, ESM/BERT-style
        encoders, Mixtral/Qwen-MoE/DeepSeek MoE and MLA."""
        if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers: plan the language model
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        t5 = str(cfg.get("model_type", "")) in _T5_TYPES  # the encoder (what sequence parallelism runs), T5's names
        if t5:
            cfg = {"hidden_size": cfg.get("d_model"), "num_hidden_layers": cfg.get("num_layers"),
                   "head_dim": cfg.get("d_kv"), "intermediate_size": cfg.get("d_ff"), **cfg,
                   "num_attention_heads": cfg.get("num_heads"), "tie_word_embeddings": False,
                   "hidden_act": "silu" if str(cfg.get("feed_forward_proj", "")).startswith("gated") else "relu"}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"the config has no {missing}: pass a transformers config.json of a transformer model, "
                             "or the sizes explicitly (--layers/--hidden/--heads)")
        model_type = str(cfg.get("model_type", ""))
        archs = " ".join(cfg.get("architectures") or [])
        encoder = t5 or model_type in _ENCODER_TYPES or "MaskedLM" in archs or cfg.get("is_decoder") is False and not archs
        act = str(cfg.get("hidden_act", cfg.get("hidden_activation", "")))
        experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
        return cls(
            name=name or model_type or "hf-model",
            num_layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=(int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0))
                      if cfg.get("kv_lora_rank") else cfg.get("head_dim")),
            ffn_hidden=int(cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"])),
            gated_mlp=act in _GATED_ACTIVATIONS or model_type.startswith("gemma"),
            vocab=int(cfg.get("vocab_size", 32000)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", encoder)),
            causal=not encoder,
            sliding_windows=hf_sliding_windows(cfg, int(cfg["num_hidden_layers"]), model_type),
            chunk_sizes=hf_chunk_sizes(cfg, int(cfg["num_hidden_layers"])),
            attention_softcap=(float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping") else None),
            relative_bias=t5, attention_sinks=model_type == "gpt_oss",
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn_hidden=cfg.get("moe_intermediate_size"),
            shared_experts=int(cfg.get("n_shared_experts") or 0),
            dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0), v_head_dim=cfg.get("v_head_dim"),
            biases=encoder and not t5, lm_head_transform=encoder and not t5,
            implementation="hf",
            qk_norm=model_type.startswith("qwen3"),
            python_gelu=model_type == "esm",
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelSpec":
        """A transformers ``config.json``, or a ``lightning-sp fit`` YAML of this project's models
        (``lightning_sp.models.*`` or ``HFSequenceParallelModule`` with an inline config)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no model file {path}: pass a transformers config.json, a lightning-sp YAML "
                                    "config, or explicit sizes (--layers/--hidden/--heads)")
        text = path.read_text()
        if path.suffix == ".json":
            return cls.from_hf_config(json.loads(text), name=path.parent.name or path.stem)
        import yaml

        doc = yaml.safe_load(text) or {}
        model = doc.get("model", doc)
        init = model.get("init_args", model)
        class_path = str(model.get("class_path", ""))
        if "config" in init and isinstance(init["config"], dict):  # HFSequenceParallelModule
            cfg = {"model_type": init.get("model_type", ""), **init["config"]}
            if init.get("task") == "masked_lm":
                cfg.setdefault("architectures", ["MaskedLM"])
            return cls.from_hf_config(cfg, name=path.stem)
        if "d_model" not in init:
            raise ValueError(f"{path}: no model sizes found (expected model.init_args.d_model/n_layers/n_heads "
                             "or model.init_args.config)")
        encoder = class_path.endswith("ProteinEncoder")
        vocab = init.get("vocab_size") or (31 if encoder else 279)  # the models' default vocabularies
        return cls(name=path.parent.name or path.stem, num_layers=int(init.get("n_layers", 4)),
                   hidden=int(init["d_model"]), num_heads=int(init.get("n_heads", 4)),
                   num_kv_heads=init.get("n_kv_heads"), ffn_hidden=int(float(init.get("mlp_ratio", 4.0)) * int(init["d_model"])),
                   vocab=int(vocab), tied_embeddings=True, causal=not encoder, biases=True, implementation="project")


@dataclass(kw_only=True)
class Candidate:
    """One layout and its predictions (per rank; seconds per optimizer step)."""

    backend: str
    sequence_parallel_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    ulysses_degree: int | None
    kv_pieces: int
    activation_checkpointing: bool
    tiled_loss: bool
    mlp_chunk_tokens: int = 0
    """The sequence-tiled MLP's tile (``TransformerConfig.mlp_chunk_size``); 0: the whole MLP."""
    memory: dict[str, float] = field(default_factory=dict)
    """Bytes per rank by part alive at the predicted peak (Note [Step model]); ``peak_bytes_per_rank`` is
    their sum."""
    peak_bytes_per_rank: float = 0.0
    fits: bool = False
    time: dict[str, float] = field(default_factory=dict)
    """Seconds per step by part (attention compute, exposed communication, the rest, the waits for the slowest rank,
    the fixed time)."""
    step_time_s: float = 0.0
    tokens_per_s_per_device: float = 0.0
    max_seq_len: int = 0
    layout: str = ""
    """The sequence layout it shards for (``str(SequenceLayout)``: ``"contiguous"``, ``"zigzag"``,
    ``"zigzag(ulysses=2)"``, or a chunk table ``"chunks(0 1 1 0 ...)"``, Note [Layouts for bidirectional spans])."""
    chunk_ranks: tuple | None = None
    """A chunk table's ``chunk_ranks`` (``SequenceLayout.from_chunks(chunk_ranks, ulysses_degree=...)``); ``None``:
    the backend's own layout."""
    layout_prices: dict = field(default_factory=dict)
    """Layout -> ``{"attention_s": one layer's attention fwd+bwd (compute + exposed), "busiest_rank_pairs": its
    busiest rank's query-key pairs}``, for each layout priced (zigzag and the balanced table; empty when only the
    backend's own layout was)."""

    @property
    def label(self) -> str:
        name = f"usp(ulysses={self.ulysses_degree})" if self.backend == "usp" else self.backend
        return (f"sp={self.sequence_parallel_size} dp={self.data_parallel_size} tp={self.tensor_parallel_size} "
                f"{name} kv_pieces={self.kv_pieces} ckpt={'on' if self.activation_checkpointing else 'off'} "
                f"loss={'tiled' if self.tiled_loss else 'whole'}"
                + (f" mlp_chunk={self.mlp_chunk_tokens}" if self.mlp_chunk_tokens else "")
                + (" layout=balanced" if self.chunk_ranks is not None else ""))

    def sequence_layout(self):
        """The ``SequenceLayout`` to give ``SequenceParallelAttention(layout=)`` / ``apply_sequence_parallel(layout=)``
        (``None``: the backend's own)."""
        if self.chunk_ranks is None:
            return None
        from lightning_sp.layout import SequenceLayout

        return SequenceLayout.from_chunks(self.chunk_ranks, ulysses_degree=self.ulysses_degree or 1)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class Plan:
    model: ModelSpec
    seq_len: int
    devices: int
    nodes: int
    hardware: str
    hardware_source: str
    precision: str
    data_parallel: str
    batch: int
    memory_budget_bytes: float
    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    cheapest_change: str

    def to_dict(self) -> dict:
        rec = self.recommended
        return {
            "kind": "prediction (Note [Step model] in lightning_sp.planner; not a measurement)",
            "model": {**asdict(self.model), "params": self.model.params},
            "request": {"seq_len": self.seq_len, "devices": self.devices, "nodes": self.nodes, "batch": self.batch,
                        "hardware": self.hardware, "hardware_source": self.hardware_source,
                        "precision": self.precision, "data_parallel": self.data_parallel,
                        "memory_budget_bytes": self.memory_budget_bytes},
            "recommended": None if rec is None else {
                "backend": rec.backend, "sequence_parallel_size": rec.sequence_parallel_size,
                "data_parallel_size": rec.data_parallel_size, "tensor_parallel_size": rec.tensor_parallel_size,
                "ulysses_degree": rec.ulysses_degree, "kv_pieces": rec.kv_pieces,
                "activation_checkpointing": rec.activation_checkpointing, "tiled_loss": rec.tiled_loss,
                "peak_bytes_per_rank": rec.peak_bytes_per_rank, "step_time_s": rec.step_time_s,
                "tokens_per_s_per_device": rec.tokens_per_s_per_device, "max_seq_len": rec.max_seq_len,
                "layout": rec.layout, "chunk_ranks": None if rec.chunk_ranks is None else list(rec.chunk_ranks),
            },
            "attention_layers": attention_layers(self.model),
            "reason": self.reason,
            "cheapest_change": self.cheapest_change,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def summary(self, top: int = 12) -> str:
        gib = 2.0 ** 30
        m = self.model
        lines = [
            f"Plan for {m.name} ({m.params / 1e9:.2f} B parameters, {m.num_layers} layers, {m.num_heads} heads / "
            f"{m.kv_heads} K/V, {'decoder' if m.causal else 'encoder'}) at N={self.seq_len} x batch {self.batch} on "
            f"{self.nodes} x {self.devices // self.nodes} {self.hardware}, {self.precision}, {self.data_parallel}",
            f"PREDICTED from {self.hardware_source.split(':')[0]} parameters (not measured); memory budget "
            f"{self.memory_budget_bytes / gib:.1f} GiB per device",
            "",
            f"{'layout':<78} {'GiB/rank':>9} {'fits':>4} {'step s':>8} {'tok/s/dev':>10} {'max N':>9}",
        ]
        groups = attention_layers(m)  # Note [Attention under per-layer masks]
        if len(groups) > 1 or groups[0]["attention"] != LayerAttention().describe():
            per = "; ".join(f"layer{'s' if len(g['layers']) > 1 else ''} {_layer_ranges(g['layers'])} "
                            f"({len(g['layers'])} of {m.num_layers}): {g['attention']}" for g in groups)
            lines.insert(2, f"attention per layer (priced per layer): {per}")
        for c in self.candidates[:top]:
            lines.append(f"{c.label:<78} {c.peak_bytes_per_rank / gib:9.2f} {'yes' if c.fits else 'no':>4} "
                         f"{c.step_time_s:8.3f} {c.tokens_per_s_per_device:10.0f} {c.max_seq_len:9d}")
        if len(self.candidates) > top:
            lines.append(f"... {len(self.candidates) - top} more (--json lists all)")
        rec = self.recommended
        lines.append("")
        if rec is not None:
            lines.append(f"Recommended: {rec.label}")
            parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in rec.memory.items() if v)
            lines.append(f"  memory per rank (GiB): {parts}")
            tparts = ", ".join(f"{k} {v:.3f}" for k, v in rec.time.items())
            lines.append(f"  step time (s): {tparts}")
        lines.append(f"Why: {self.reason}")
        lines.append(f"Longer sequences: {self.cheapest_change}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ hardware

def _gpu_preset(name, peak, source, *, memory, intra, inter, efficiency=0.55, half_block=2048, matmul=0.70):
    return cost_model.HardwareProfile(
        name=name, source=source, attention_curve=cost_model.saturating_curve(peak, efficiency, half_block),
        matmul_flops=matmul * peak, intra_bandwidth=intra, intra_latency=10e-6, inter_bandwidth=inter,
        inter_latency=20e-6, ranks_per_node=8, memory_bytes=memory)


_EXTRA_PRESETS = {
    "h200-141gb": _gpu_preset(
        "h200-141gb", 989e12, "datasheet: H200 SXM 989 TFLOP/s bf16 dense, 141 GB HBM3e, NVLink4 900 GB/s total; "
        "8 GPUs/node, 400 Gb/s NDR per GPU. assumption: as h100-80gb (attention 55% of peak, matmuls 70%)",
        memory=141e9, intra=450e9, inter=50e9),
    "b200-180gb": _gpu_preset(
        "b200-180gb", 2250e12, "datasheet: DGX B200, 2.25 PFLOP/s bf16 dense per GPU, 180 GB HBM3e, NVLink5 1.8 TB/s "
        "total; 8 GPUs/node, 400 Gb/s per GPU. assumption: attention 55% of peak, matmuls 70% (no B200 measurement)",
        memory=180e9, intra=900e9, inter=50e9),
    "h200-measured": cost_model.HardwareProfile(
        name="h200-measured",
        source="measured: one H200 (2026-11-28, torch 2.11+cu130): SDPA (flash) forward+backward, causal bf16, 32/8 "
               "heads of 128, 243/319/328 TFLOP/s at 4K/16K/64K tokens (benchmarks/gpu/results/2026-11-28_h200/"
               "perf.json), 139.8 GiB of device memory; assumption: matmuls, links and nodes as h200-141gb (not "
               "measured there)",
        attention_curve=((4096, 243.44e12), (16384, 318.69e12), (65536, 327.77e12)),
        matmul_flops=0.70 * 989e12, intra_bandwidth=450e9, intra_latency=10e-6, inter_bandwidth=50e9,
        inter_latency=20e-6, ranks_per_node=8, memory_bytes=139.8 * 2**30),
}


# Note [Layer rates]
#     On a CPU the layer's non-attention work does not run at one matmul rate and one per-element cost measured on
#     other shapes: a ``[T, C] x [C, k C]`` product at C = 64..256 runs far below the rate of a large one, a norm or an
#     activation over ``[T, ffn]`` costs a few nanoseconds per element (not an in-place add's tenth of one), and the
#     loss and AdamW's update have their own costs. ``LayerRates`` carries what micro-benchmarks of exactly these
#     pieces measured (``experiments/planner/run.py --calibrate-layer``, none of the validated training steps):
#       matmul_table  ``(tokens, width, FLOP/s)``: a layer's linear layers (C -> 3C, C -> C, C -> 4C, 4C -> C, with
#                     biases) forward + backward at ``T`` tokens and width ``C``; log-log interpolated, clamped outside.
#                     The layer's and the output head's FLOPs run at the rate of ``(T, C)``.
#       elementwise_s seconds per element per pass of a layer's norms, activation and residual adds (forward +
#                     backward of LayerNorm, GELU, add over ``[T, C]`` and ``[T, 4C]``, divided by 3 passes of their
#                     outputs); applied to ``saved_per_token`` elements, 3 passes (4 with checkpointing)
#       implementation_elementwise_s  the same per element and pass for the code a ``ModelSpec.implementation`` runs,
#                     where it was measured apart: ``"hf"``, a transformers ``LlamaDecoderLayer`` (RMSNorms with their
#                     float32 casts, rotary, the head reshapes and transposes, SiLU(gate) x up, residual adds) forward +
#                     backward with its attention stubbed, less its linear layers run alone, per ``saved_per_token``
#                     element of that layer and pass, the slope between 256 and 1024 tokens (the per-call part is
#                     Python's, priced with the fixed time per step); the other implementations pay ``elementwise_s``
#       loss_s        seconds per logit of the cross-entropy's forward + backward
#       loss_by_vocab ``(vocab, seconds per logit)``: ``loss_s`` at each measured vocabulary (the per-logit cost grows
#                     with ``V``: 3.4 ns at 1024, 5.2 at 4096 on this VM), log-interpolated in ``V`` and clamped; used
#                     in place of ``loss_s`` when present
#       optimizer_s   seconds per parameter of one AdamW step (PyTorch's default on CPU), on the rank's share of the
#                     parameters (FSDP: ``1 / (dp sp)``)
#       sync_wait     ``(ranks, compute between synchronizations s, wait s)``: Note [Rank skew]
#     A profile carries them as ``PlannerProfile.layer_rates`` (``with_layer_rates``; a profile file's ``"layer_rates"``
#     key); without them ``step_time`` uses ``matmul_flops`` and ``elementwise_s`` as before (the GPU presets).


# Note [Rank skew]
#     Ranks that run the same work do not finish it at the same moment (the cores' other work, the scheduler, caches),
#     and every collective waits for the slowest: a step pays, at each synchronization, the spread of the ranks'
#     clocks accumulated since the previous one. The spread grows with the compute between two synchronizations, but
#     slower than it (on this VM, two ranks: 0.34 ms after 1.4 ms of compute, 0.82 after 5.4, 1.3 after 22), so the
#     wait is priced per synchronization, ``wait(P, c)`` at ``c`` = the step's compute / its synchronizations, log-log
#     interpolated over a micro-benchmark's points (below the smallest ``c`` in proportion to it: a tiny model's
#     synchronizations, a fraction of a millisecond apart, wait little) (``experiments/planner/run.py --calibrate-sync``: rounds of a
#     chunk of matmuls then a one-float all-reduce, against the same chunks with no collective, all ranks computing
#     at once, and the all-reduces alone; none of the validated steps), the nearest measured world size at or below
#     ``P``. The synchronizations of a step (``sync_points``), per layer and pass (forward, backward, the recomputed
#     forward): the ring's ``P_ring - 1`` exchanges, all-gather's one, Ulysses' two (before and after the kernel;
#     the inputs' all-to-alls run back to back), USP's both, FSDP's block all-gather; and DDP's gradient all-reduce
#     once per step. Only calibrated profiles carry it (``LayerRates.sync_wait``): the GPU presets have no CPU
#     terms, and a GPU's ranks are not time-shared.


def sync_points(m: "ModelSpec", c: "Candidate", data_parallel: str) -> int:
    """The synchronizations of one rank's step that wait for the other ranks (Note [Rank skew])."""
    sp, dp = c.sequence_parallel_size, c.data_parallel_size
    passes = 3 if c.activation_checkpointing else 2
    ulysses = c.ulysses_degree if c.backend == "usp" else (sp if c.backend == "ulysses" else 1)
    ring = sp // ulysses
    per_layer_pass = 0
    if sp > 1:
        if c.backend == "allgather_kv":
            per_layer_pass = 1
        else:
            per_layer_pass = (ring - 1) + (2 if ulysses > 1 else 0)
    if dp * sp > 1 and data_parallel == "fsdp":
        per_layer_pass += 1
    return m.num_layers * passes * per_layer_pass + (1 if dp * sp > 1 and data_parallel == "ddp" else 0)


@dataclass(kw_only=True, frozen=True)
class LayerRates:
    """Measured costs of a layer's non-attention work on one rank (Note [Layer rates])."""

    matmul_table: tuple[tuple[int, int, float], ...]
    """``(tokens, width, FLOP/s)`` of a layer's linear layers forward + backward."""
    elementwise_s: float
    """Seconds per element per pass of the norms, activations and residual adds."""
    loss_s: float
    """Seconds per logit of the cross-entropy's forward + backward."""
    optimizer_s: float
    """Seconds per parameter of one AdamW step."""
    implementation_elementwise_s: tuple[tuple[str, float], ...] = ()
    """``(ModelSpec.implementation, seconds)``: ``elementwise_s`` of the code that runs the layer where it was measured
    apart (``"hf"``: transformers' decoder layer's small ops); the others pay ``elementwise_s``."""
    loss_by_vocab: tuple[tuple[int, float], ...] = ()
    """``(vocab, seconds per logit)`` of the loss; in place of ``loss_s`` when given."""
    sync_wait: tuple[tuple[int, float, float], ...] = ()
    """``(ranks, compute between synchronizations s, wait per synchronization s)`` (Note [Rank skew])."""
    source: str = ""

    def __post_init__(self) -> None:
        if not self.matmul_table or any(t < 1 or c < 1 or r <= 0 for t, c, r in self.matmul_table):
            raise ValueError(f"LayerRates.matmul_table needs (tokens >= 1, width >= 1, FLOP/s > 0) points, got "
                             f"{self.matmul_table}")
        for name in ("elementwise_s", "loss_s", "optimizer_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerRates.{name} must be >= 0, got {getattr(self, name)}")
        if any(v < 1 or t <= 0 for v, t in self.loss_by_vocab):
            raise ValueError(f"LayerRates.loss_by_vocab needs (vocab >= 1, seconds > 0) pairs, got {self.loss_by_vocab}")
        if any(w < 2 or cs <= 0 or t <= 0 for w, cs, t in self.sync_wait):
            raise ValueError(f"LayerRates.sync_wait needs (ranks >= 2, compute s > 0, wait s > 0) points, got "
                             f"{self.sync_wait}")
        for impl, seconds in self.implementation_elementwise_s:
            if impl not in IMPLEMENTATIONS or seconds < 0:
                raise ValueError(f"LayerRates.implementation_elementwise_s needs (one of {IMPLEMENTATIONS}, seconds >= 0) "
                                 f"pairs, got {(impl, seconds)}")

    def loss_per_logit(self, vocab: int) -> float:
        """Seconds per logit of the loss at ``vocab`` (Note [Layer rates]): ``loss_by_vocab`` log-interpolated in
        ``vocab`` and clamped, else ``loss_s``."""
        if not self.loss_by_vocab:
            return self.loss_s
        return _log_interp(sorted(self.loss_by_vocab), vocab)

    def wait_per_sync(self, ranks: int, compute_s: float) -> float:
        """Seconds one synchronization of ``ranks`` waits for the slowest after ``compute_s`` of compute (Note [Rank
        skew]): the nearest measured world at or below ``ranks`` (else the smallest), log-log interpolated in the
        compute; below the smallest measured compute in proportion to it (no compute, no spread), above the largest
        clamped; 0 without a measurement or with one rank."""
        if ranks < 2 or not self.sync_wait or compute_s <= 0:
            return 0.0
        worlds = sorted({w for w, _, _ in self.sync_wait})
        world = max([w for w in worlds if w <= ranks], default=worlds[0])
        points = sorted((c, t) for w, c, t in self.sync_wait if w == world)
        if compute_s < points[0][0]:
            return points[0][1] * compute_s / points[0][0]
        return _log_interp(points, compute_s)

    def elementwise_for(self, implementation: str) -> float:
        """Seconds per element per pass of the small ops of the layers ``implementation`` runs (Note [Layer rates])."""
        return dict(self.implementation_elementwise_s).get(implementation, self.elementwise_s)

    def matmul_rate(self, tokens: float, width: float) -> float:
        """FLOP/s of the linear layers at ``tokens`` per rank and model width ``width``: bilinear in log tokens and
        log width over the table's grid, clamped outside it."""
        ts = sorted({t for t, _, _ in self.matmul_table})
        cs = sorted({c for _, c, _ in self.matmul_table})
        rate = {(t, c): r for t, c, r in self.matmul_table}
        if len(rate) != len(ts) * len(cs):
            raise ValueError("LayerRates.matmul_table must be a full grid of tokens x widths")

        def bracket(grid: list[int], x: float) -> tuple[int, int, float]:
            x = min(max(x, grid[0]), grid[-1])
            for a, b in zip(grid, grid[1:]):
                if a <= x <= b:
                    return a, b, math.log(x / a) / math.log(b / a)
            return grid[0], grid[0], 0.0  # a one-point grid

        t0, t1, wt = bracket(ts, tokens)
        c0, c1, wc = bracket(cs, width)
        log = lambda t, c: math.log(rate[(t, c)])  # noqa: E731
        return math.exp((1 - wt) * ((1 - wc) * log(t0, c0) + wc * log(t0, c1))
                        + wt * ((1 - wc) * log(t1, c0) + wc * log(t1, c1)))

    @classmethod
    def from_dict(cls, d: dict) -> "LayerRates":
        return cls(matmul_table=tuple((int(t), int(c), float(r)) for t, c, r in d["matmul_table"]),
                   elementwise_s=float(d["elementwise_s"]), loss_s=float(d["loss_s"]),
                   optimizer_s=float(d["optimizer_s"]), source=str(d.get("source", "")),
                   loss_by_vocab=tuple((int(v), float(t)) for v, t in d.get("loss_by_vocab", ())),
                   sync_wait=tuple((int(w), float(c), float(t)) for w, c, t in d.get("sync_wait", ())),
                   implementation_elementwise_s=tuple((str(i), float(t)) for i, t in d.get("implementation_elementwise_s", ())))


def _log_interp(points: list[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` over sorted ``(x, y > 0)`` points, linear in log x and log y, clamped outside them."""
    x = min(max(x, points[0][0]), points[-1][0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1 and x1 > x0:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    return points[0][1]


@dataclass(kw_only=True, frozen=True)
class PlannerProfile(cost_model.HardwareProfile):
    """A hardware profile with the measured costs of a layer's non-attention work (Note [Layer rates])."""

    layer_rates: LayerRates | None = None


def with_layer_rates(hw: cost_model.HardwareProfile, rates: LayerRates | dict) -> PlannerProfile:
    """``hw`` with ``rates`` (a ``LayerRates`` or its dict, as ``run.py --calibrate-layer`` writes) for the layer's
    non-attention work (Note [Layer rates])."""
    from dataclasses import fields

    rates = rates if isinstance(rates, LayerRates) else LayerRates.from_dict(rates)
    base = {f.name: getattr(hw, f.name) for f in fields(cost_model.HardwareProfile)}
    return PlannerProfile(**base, layer_rates=rates)


# calls with score modifiers and sinks on these GPUs: the cost model's assumption (Note [Cost model of score modifiers]);
# datasheets: fp32 (CUDA cores) FLOP/s and HBM bytes/s (H200: H100's compute, 4.8 TB/s HBM3e; B200: 8 TB/s HBM3e,
# ~75 TFLOP/s fp32 assumed)
for _name, (_fp32, _hbm) in {"h200-141gb": (67e12, 4.8e12), "h200-measured": (67e12, 4.8e12),
                             "b200-180gb": (75e12, 8e12)}.items():
    _EXTRA_PRESETS[_name] = cost_model.with_assumed_cuda_score_mods(_EXTRA_PRESETS[_name], fp32_flops=_fp32,
                                                                     memory_bandwidth=_hbm)


def hardware_profile(name_or_path: str | Path) -> cost_model.HardwareProfile:
    """A preset by name (``cpu``, ``a100``, ``h100``, ``h800``, ``h200``, ``b200`` or the cost model's full
    names) or a calibrated profile file (the JSON of ``HardwareProfile.to_dict``, as the cost-model
    calibration writes; a top-level ``"profile"`` key is accepted, and a ``"layer_rates"`` key, Note [Layer rates])."""
    key = str(name_or_path)
    key = HARDWARE_ALIASES.get(key, key)
    if key in _EXTRA_PRESETS:
        return _EXTRA_PRESETS[key]
    if key in cost_model.PRESETS:
        return cost_model.PRESETS[key]
    path = Path(name_or_path)
    if path.is_file():
        data = json.loads(path.read_text())
        profile = dict(data.get("profile", data))
        rates = profile.pop("layer_rates", None) or data.get("layer_rates")
        hw = cost_model.HardwareProfile.from_dict(profile)
        return with_layer_rates(hw, rates) if rates else hw
    names = sorted(set(HARDWARE_ALIASES) | set(cost_model.PRESETS) | set(_EXTRA_PRESETS))
    raise ValueError(f"unknown hardware {name_or_path!r}: a preset ({', '.join(names)}) or a calibrated profile file")


# ------------------------------------------------------------------------------------------------ the model

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _attention_shape(m: ModelSpec, seq_len: int, batch: int, tp: int, act_bytes: int) -> cost_model.AttentionShape:
    return cost_model.AttentionShape(seq_len=seq_len, num_heads=m.num_heads // tp, num_kv_heads=max(1, m.kv_heads // tp),
                                     head_dim=max(m.qk_dim, m.v_dim), batch=batch, dtype_bytes=act_bytes, causal=m.causal)


# Note [Attention under per-layer masks]
#     A model's layers may attend differently: Mistral (every layer) and Qwen2 (``use_sliding_window``, the layers from
#     ``max_window_layers`` on) slide a window, Gemma-2 every other layer, Gemma-3 five of six, ModernBERT every layer
#     but each third with a bidirectional window (``hf_sliding_windows``; transformers' ``layer_types`` when the config
#     lists them). ``attention_per_layer`` prices each distinct window once with ``cost_model.predict_attention(mask=)``
#     (Note [Cost model under a mask]: the visible blocks' calls; the rings' K/V rows follow the window, Ulysses'
#     all-to-alls do not) and returns the mean over the layers, so a step is ``L x`` that mean, as without windows.
#     ``plan(mask=AttentionMask(window=...))`` and ``lightning-sp plan --sliding-window W`` put one window on every layer.
#     Llama 4's chunked layers (``layer_types``' ``chunked_attention``, else its ``no_rope_layers`` rule;
#     ``hf_chunk_sizes``) are priced as the Hugging Face integration runs them, documents cut at every multiple of
#     ``attention_chunk_size`` (``cu_seqlens``): their pairs and the rings' rows exact, as for documents. Score
#     modifiers on every layer (Gemma-2's ``attn_logit_softcapping``, T5's learned relative bias) and gpt-oss's sinks
#     are priced as Note [Cost model of score modifiers] in ``cost_model.py`` (the score-modifying kernel's factor,
#     the sinks' per-row term). ``ModelSpec.layer_attention`` is each layer's ``LayerAttention``; each distinct one is
#     priced once, and the plan's summary and ``to_dict()["attention_layers"]`` say which layers run which kernel.
#     Not modelled: a window's effect on memory (the rings hold whole K/V blocks either way).


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, as the planner prices it (Note [Attention under per-layer masks])."""

    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    alibi: bool = False
    relative_bias: bool = False
    sinks: bool = False
    spans: tuple = ()
    """Bidirectional spans ``((start, end), ...)`` (``ModelSpec.bidirectional_spans``)."""

    def mask(self, num_heads: int):
        """The ``AttentionMask`` of the layer's window and score modifiers (``None``: none), for ``num_heads`` heads
        (the ALiBi slopes and the relative bias's table are stand-ins: only their presence is priced)."""
        from lightning_sp.masks import AttentionMask, RelativePositionBias

        kw = {}
        if self.window is not None:
            kw["window"] = tuple(self.window)
        if self.spans:
            kw["bidirectional_spans"] = tuple(self.spans)
        if self.softcap is not None:
            kw["softcap"] = float(self.softcap)
        if self.alibi:
            kw["alibi_slopes"] = (1.0,) * num_heads
        if self.relative_bias:
            import torch

            kw["relative_bias"] = RelativePositionBias(torch.zeros(32, num_heads, requires_grad=True))
        return AttentionMask(**kw) if kw else None

    def cu_seqlens(self, seq_len: int) -> tuple[int, ...] | None:
        """A chunked layer's documents as the Hugging Face integration cuts them (``[0, C, 2C, ..., N]``)."""
        if self.chunk_size is None:
            return None
        return tuple(range(0, seq_len, self.chunk_size)) + (seq_len,)

    def describe(self) -> str:
        """``"window (511, 0), score-modifying kernel (softcap) + sinks"``: what the layer attends to and runs."""
        what = (f"window {tuple(self.window)}" if self.window is not None else "")
        what += (", " if what and self.chunk_size else "") + (f"chunks of {self.chunk_size}" if self.chunk_size else "")
        if self.spans:
            what += (", " if what else "") + "bidirectional " + " ".join(f"[{s}, {e})" for s, e in self.spans)
        mods = [m for m, on in (("softcap", self.softcap is not None), ("alibi", self.alibi),
                                ("relative_bias", self.relative_bias)) if on]
        kernel = f"score-modifying kernel ({'+'.join(mods)})" if mods else "plain kernel"
        return f"{what or 'full'}, {kernel}" + (" + sinks" if self.sinks else "")


def hf_chunk_sizes(cfg: dict, layers: int) -> tuple:
    """``ModelSpec.chunk_sizes`` from a transformers config (Llama 4, Note [Attention under per-layer masks]): its
    ``layer_types``' ``chunked_attention`` layers when listed, else the ``no_rope_layers`` (the NoPE-less layers are
    chunked), else every layer but each ``no_rope_layer_interval``-th, as ``Llama4TextConfig`` derives them."""
    chunk = cfg.get("attention_chunk_size")
    if not chunk:
        return ()
    if cfg.get("layer_types"):
        kinds = list(cfg["layer_types"])[:layers]
    elif "no_rope_layers" in cfg or "no_rope_layer_interval" in cfg:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        kinds = ["chunked_attention" if r else "full_attention" for r in list(no_rope)[:layers]]
    else:
        return ()
    got = tuple(int(chunk) if kind == "chunked_attention" else None for kind in kinds)
    return got if any(got) else ()


def hf_sliding_windows(cfg: dict, layers: int, model_type: str) -> tuple:
    """``ModelSpec.sliding_windows`` from a transformers config (Note [Attention under per-layer masks]): its
    ``layer_types`` when listed, else the rule of its model type, as transformers' configs derive them."""
    if model_type == "modernbert":  # local_attention: the whole window, half of it each side
        half = int(cfg.get("local_attention", 128)) // 2
        window, every = (half, half), int(cfg.get("global_attn_every_n_layers", 3))
        rule = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    else:
        w = cfg.get("sliding_window")
        if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
            w = None  # Qwen configs carry a sliding_window they do not use
        if not w:
            return ()
        window = (int(w) - 1, 0)
        if model_type.startswith("qwen"):  # the layers from max_window_layers on
            rule = ["sliding_attention" if i >= int(cfg.get("max_window_layers", 0)) else "full_attention"
                    for i in range(layers)]
        elif model_type in ("gemma2", "gpt_oss"):  # local, global, local, ...
            rule = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        elif cfg.get("sliding_window_pattern"):  # Gemma-3, Cohere2: every pattern-th layer global
            pattern = int(cfg["sliding_window_pattern"])
            rule = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:  # Mistral, Mixtral, Phi-3, Starcoder2: every layer
            rule = ["sliding_attention"] * layers
    kinds = list(cfg.get("layer_types") or rule)[:layers]
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def attention_per_layer(m: ModelSpec, c: "Candidate", seq_len: int, batch: int, act_bytes: int,
                        hw: cost_model.HardwareProfile) -> tuple[float, float]:
    """``(compute, exposed communication)`` seconds of one attention layer fwd+bwd, the mean over the model's layers
    and how each attends: window, chunks, score modifiers, sinks (Note [Attention under per-layer masks])."""
    layers = m.layer_attention()
    shape = _attention_shape(m, seq_len, batch, c.tensor_parallel_size, act_bytes)
    compute = exposed = 0.0
    for kind in sorted(set(layers), key=repr):
        share = layers.count(kind) / len(layers)
        layer = _predicted_attention(c.backend, shape, c.sequence_parallel_size, hw, c.ulysses_degree, c.kv_pieces,
                                     kind, c.sequence_layout())
        compute, exposed = compute + share * layer[0], exposed + share * layer[1]
    return compute, exposed


def attention_pairs_per_layer(m: ModelSpec, c: "Candidate", seq_len: int, batch: int, act_bytes: int,
                              hw: cost_model.HardwareProfile) -> float:
    """Query-key pairs the busiest rank's forward computes in one attention layer on ``c``'s layout
    (``Prediction.attention_pairs``), the mean over the model's layers as ``attention_per_layer``."""
    layers = m.layer_attention()
    shape = _attention_shape(m, seq_len, batch, c.tensor_parallel_size, act_bytes)
    return sum(layers.count(kind) / len(layers)
               * _predicted_attention(c.backend, shape, c.sequence_parallel_size, hw, c.ulysses_degree, c.kv_pieces,
                                      kind, c.sequence_layout())[2] for kind in set(layers))


@lru_cache(maxsize=4096)
def _predicted_attention(backend, shape, sp, hw, ulysses_degree, kv_pieces, layer: LayerAttention,
                         layout=None) -> tuple[float, float, float]:
    """``(compute, exposed communication, busiest rank's pairs)`` of one layer on ``layout`` (``None``: the
    backend's own)."""
    masking = dict(mask=layer.mask(shape.num_heads), cu_seqlens=layer.cu_seqlens(shape.seq_len), sinks=layer.sinks)
    if sp > 1:
        pred = cost_model.predict_attention(backend, shape, sp, hw, ulysses_degree=ulysses_degree, kv_pieces=kv_pieces,
                                            layout=layout, **masking)
        return pred.compute_s, pred.exposed_comm_s, pred.attention_pairs
    pred = cost_model.predict_attention("ring", shape, 1, hw, **masking)
    return pred.total_s, 0.0, pred.attention_pairs


def attention_layers(m: ModelSpec) -> list[dict]:
    """Which layers attend how and run which kernel (Note [Attention under per-layer masks]): one entry per distinct
    ``LayerAttention``, in the order of its first layer: ``{"layers": [...], "attention": describe()}``."""
    groups: dict[LayerAttention, list[int]] = {}
    for i, kind in enumerate(m.layer_attention()):
        groups.setdefault(kind, []).append(i)
    return [{"layers": idx, "attention": kind.describe()} for kind, idx in groups.items()]


def _layer_ranges(idx: list[int]) -> str:
    """``[0, 1, 2, 5, 7]`` -> ``"0-2, 5, 7"``."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)


def attention_temporary_bytes(m: ModelSpec, c: Candidate, seq_len: int, batch: int, act_bytes: int,
                              hw: cost_model.HardwareProfile) -> float:
    """One attention call's peak beyond its inputs q, k, v and the output's gradient, per rank."""
    sp, tp = c.sequence_parallel_size, c.tensor_parallel_size
    if sp == 1 and hw.memory_bytes is not None:  # a GPU kernel: flash-style, the log-sum-exp only
        return 0.0
    heads, kv_heads, d = m.num_heads // tp, max(1, m.kv_heads // tp), max(m.qk_dim, m.v_dim)
    shard = math.ceil(seq_len / sp)
    if hw.memory_bytes is None:  # CPU: the blockwise kernel's fitted peak, less the inputs it includes
        from lightning_sp.choices import PEAK_MARGIN, predicted_peak_bytes

        backend = "ring" if c.backend in ("local", "colossal") else c.backend
        peak = predicted_peak_bytes(backend, batch=batch, shard_len=shard, num_heads=heads, num_kv_heads=kv_heads,
                                    head_dim=d, element_size=act_bytes, world=max(sp, 2), pieces=c.kv_pieces,
                                    ulysses_degree=c.ulysses_degree) / PEAK_MARGIN
        inputs = batch * shard * (2 * heads + 2 * kv_heads) * d * act_bytes
        return max(0.0, peak - inputs)
    shape = _attention_shape(m, seq_len, batch, tp, act_bytes)
    buffers = cost_model.attention_transient_bytes(c.backend, shape, sp, ulysses_degree=c.ulysses_degree)
    return buffers / c.kv_pieces if c.backend == "allgather_kv" else buffers  # pieces: K/V gathered piece by piece


def memory_bytes(m: ModelSpec, c: Candidate, *, seq_len: int, batch: int, precision: str, data_parallel: str,
                 hw: cost_model.HardwareProfile) -> dict[str, float]:
    """Per-rank bytes by part, those alive at the predicted peak (Note [Step model]): the states, and the
    largest of ``memory_phases``' moments."""
    states, phases = memory_phases(m, c, seq_len=seq_len, batch=batch, precision=precision,
                                   data_parallel=data_parallel, hw=hw)
    parts = {**states, "stored_activations": 0.0, "layer_in_backward": 0.0, "attention": 0.0, "head": 0.0,
             "logits": 0.0}
    parts.update(max(phases.values(), key=lambda phase: sum(phase.values())))
    return parts


def memory_phases(m: ModelSpec, c: Candidate, *, seq_len: int, batch: int, precision: str, data_parallel: str,
                  hw: cost_model.HardwareProfile) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Per-rank bytes: ``(states by part, {moment: activations by part})`` for the three moments that can hold
    a step's peak (Note [Step model])."""
    act = PRECISIONS[precision]
    param_b, grad_b, optim_b = STATE_BYTES[precision]
    tp, sp, dp = c.tensor_parallel_size, c.sequence_parallel_size, c.data_parallel_size
    params = m.layer_params() / tp + m.embedding_params() / tp
    shard_over = dp * sp if data_parallel == "fsdp" else 1
    tokens = batch * math.ceil(seq_len / sp)  # T: this rank's tokens
    tiled_mlp = 0 < c.mlp_chunk_tokens < tokens
    attn_saved, mlp_saved = (e * tokens * act for e in m.saved_per_token(tp=tp, act_bytes=act, mlp_tiled=tiled_mlp))
    layer_input = tokens * m.hidden * act
    # the gradient flowing through a layer: the block's output gradient, the residual's and one in the making
    flowing = 3 * layer_input
    width = m.mlp_width() / tp
    if tiled_mlp:  # one tile recomputed with its graph: fc1's output, the activation, and their gradients
        mlp_grads = 4 * min(c.mlp_chunk_tokens, tokens) * width * act
    else:  # the activation's backward: its gradient in and out, less fc2's input (freed by fc2's backward); the
        # erf GELU's: its two products' gradients and x^2, -x^2, exp(-x^2), less what the product had saved
        mlp_grads = (3 if m.python_gelu else 1) * tokens * width * act
    if c.activation_checkpointing:
        stored = m.num_layers * layer_input
        recompute_attn, recompute_mlp = attn_saved, mlp_saved
    else:
        stored = m.num_layers * (attn_saved + mlp_saved)
        recompute_attn = recompute_mlp = 0.0
    vocab_rank = m.vocab / tp
    chunk = min(tokens * vocab_rank, LOSS_CHUNK_ELEMENTS) * max(act, 4)  # one float32 chunk of the loss
    if c.tiled_loss:  # one tile's logits, their float32 copy, and the backward's softmax and its gradient
        logits = 4 * chunk
    else:  # the logits and their gradient, and two float32 chunks of the loss's exp(logits - lse) in backward
        logits = 2 * tokens * vocab_rank * act + 2 * chunk
    # the attention call's peak beyond its inputs, less its output (which the layer's saved tensors count)
    attention = max(0.0, attention_temporary_bytes(m, c, seq_len, batch, act, hw)
                    - tokens * m.num_heads / tp * m.v_dim * act)
    # the final norm's input and output, and a masked-LM head's transform (dense, activation, norm) before the
    # output projection: alive from the end of the forward until the head's backward
    head = tokens * m.hidden * act * (2 + ((5 if m.python_gelu else 3) if m.lm_head_transform else 0))
    # Note [Step model]: three moments can hold the peak; each is what is alive then beyond the states
    phases = {
        "loss": {"stored_activations": stored, "head": head, "logits": logits},
        "mlp_backward": {"stored_activations": stored,
                         "layer_in_backward": recompute_attn + recompute_mlp + flowing + mlp_grads},
        # the last layer's MLP tensors are freed by then (its MLP backward ran)
        "attention_backward": {"stored_activations": stored - (0.0 if c.activation_checkpointing else mlp_saved),
                               "layer_in_backward": recompute_attn + flowing, "attention": attention},
    }
    fsdp = data_parallel == "fsdp" and shard_over > 1
    states = {
        "parameters": param_b * params / shard_over,
        "gradients": grad_b * params / shard_over,
        "optimizer": optim_b * params / shard_over,
        "ddp_buckets": grad_b * params if data_parallel == "ddp" and dp * sp > 1 else 0.0,
        # bf16-mixed: autocast's bfloat16 copy of each weight, kept for backward by the matmuls that used it
        "weight_copies": 2 * m.layer_params() / tp if param_b == 4 and act == 2 else 0.0,
        # FSDP: two layers' parameters gathered (the one running, the one prefetched), and the root's (embedding,
        # head, final norm) gathered with their whole gradients until the backward ends
        "fsdp_gathered": (2 * param_b * m.layer_params() / m.num_layers / tp
                          + (param_b + grad_b) * m.embedding_params() / tp) if fsdp else 0.0,
    }
    return states, phases


def step_time(m: ModelSpec, c: Candidate, *, seq_len: int, batch: int, precision: str, data_parallel: str,
              hw: cost_model.HardwareProfile, step_overhead_s: float = 0.0) -> dict[str, float]:
    """Seconds per optimizer step on one rank, by part (Note [Step model]). ``step_overhead_s``: the training
    loop's fixed time per step (a calibrated figure: ``experiments/planner/run.py --calibrate-overhead``)."""
    act = PRECISIONS[precision]
    tp, sp, dp = c.tensor_parallel_size, c.sequence_parallel_size, c.data_parallel_size
    tokens = batch * math.ceil(seq_len / sp)
    recompute = 1.0 if c.activation_checkpointing else 0.0
    # one layer's attention, the mean over the layers' windows (Note [Attention under per-layer masks])
    attn_compute, attn_exposed = attention_per_layer(m, c, seq_len, batch, act, hw)
    fwd_share = 1.0 / cost_model.FWD_BWD_FACTOR
    attention = m.num_layers * attn_compute * (1 + recompute * fwd_share)
    exposed = m.num_layers * attn_exposed * (1 + recompute * fwd_share)
    linear_flops = 2.0 * tokens * m.layer_params(active=True) / tp * (3 + recompute)
    if 0 < c.mlp_chunk_tokens < tokens:  # the sequence-tiled MLP runs its forward again in backward
        mlp_params = m.layer_params(active=True) - m.num_layers * m.attention_params()
        linear_flops += 2.0 * tokens * mlp_params / tp
    head_flops = 2.0 * tokens * m.hidden * m.vocab / tp * (4 if c.tiled_loss else 3)
    rates: LayerRates | None = getattr(hw, "layer_rates", None)  # Note [Layer rates]
    # elementwise work (norms, activations, residuals, rotary): about one pass per saved element in forward and two
    # in backward, one more forward to recompute
    saved = sum(m.saved_per_token(tp=tp, act_bytes=act, mlp_tiled=0 < c.mlp_chunk_tokens < tokens))
    passes = m.num_layers * tokens * saved * (3 + recompute)
    if rates is None:  # the profile's matmul rate and per-element cost (0 on the GPU presets)
        rest = (linear_flops + head_flops) / hw.matmul_flops + hw.elementwise_s[1] * passes
    else:  # measured at the layer's own shapes, with the loss and AdamW's update
        rest = (linear_flops + head_flops) / rates.matmul_rate(tokens, m.hidden)
        rest += rates.elementwise_for(m.implementation) * passes
        rest += rates.loss_per_logit(m.vocab) * tokens * m.vocab / tp
        shard_over = dp * sp if data_parallel == "fsdp" else 1
        rest += rates.optimizer_s * (m.layer_params() + m.embedding_params()) / tp / shard_over
    rest *= hw.compute_stretch(sp * dp * tp)  # ranks sharing a CPU's cores
    if tp > 1:  # Megatron-SP: all-gather before and reduce-scatter after attention and MLP, fwd and bwd
        bw, lat = hw.link(tp)
        one = (tp - 1) * (lat + tokens * m.hidden * act / tp / bw)
        exposed += m.num_layers * 8 * one * (1 + recompute / 2)
    ranks = dp * sp
    if ranks > 1:  # the gradient all-reduce (DDP) / reduce-scatter + all-gathers (FSDP) over dp x sp
        bw, lat = hw.link(ranks)
        grad_bytes = STATE_BYTES[precision][1] * (m.layer_params() + m.embedding_params()) / tp
        sync = 2 * (ranks - 1) / ranks * grad_bytes / bw + 2 * (ranks - 1) * lat
        if data_parallel == "fsdp":
            sync *= 1.5  # + the parameters' all-gather in forward (and again in backward)
        backward = (attention + rest) * 2 / 3
        exposed += max(0.0, sync - backward)  # overlapped with the backward's compute
    wait = 0.0
    syncs = sync_points(m, c, data_parallel)
    if rates is not None and syncs:  # Note [Rank skew]: each synchronization waits for the slowest rank
        wait = syncs * rates.wait_per_sync(ranks * tp, (attention + rest) / syncs)
    return {"attention_compute_s": attention, "exposed_comm_s": exposed, "other_compute_s": rest,
            "sync_wait_s": wait, "fixed_s": step_overhead_s}


def _candidates(m: ModelSpec, world: int, hw: cost_model.HardwareProfile, *, tensor_parallel: int | None,
                sequence_parallel: int | None) -> list[Candidate]:
    out = []
    tps = [tensor_parallel] if tensor_parallel else [t for t in _divisors(world) if t <= hw.ranks_per_node
                                                     and m.num_heads % t == 0 and m.kv_heads % t == 0]
    for tp in tps:
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the {world} devices")
        sps = [sequence_parallel] if sequence_parallel else _divisors(world // tp)
        for sp in sps:
            if (world // tp) % sp:
                raise ValueError(f"sequence_parallel_size={sp} does not divide {world} devices / tp={tp}")
            dp = world // tp // sp
            heads = m.num_heads // tp
            layouts: list[tuple[str, int | None]] = []
            if sp == 1:
                layouts.append(("local", None))
            else:
                if heads % sp == 0:
                    layouts.append(("ulysses", None))
                layouts += [("zigzag_ring" if m.causal else "ring", None), ("allgather_kv", None)]
                layouts += [("usp", u) for u in _divisors(sp) if 1 < u < sp and heads % u == 0 and u <= hw.ranks_per_node]
            for backend, u in layouts:
                pieces = (1,) if backend in ("local", "ulysses") else (1, 4)
                for kv_pieces in pieces:
                    for ckpt in (False, True):
                        for tiled in (False, True):
                            out.append(Candidate(backend=backend, sequence_parallel_size=sp, data_parallel_size=dp,
                                                 tensor_parallel_size=tp, ulysses_degree=u, kv_pieces=kv_pieces,
                                                 activation_checkpointing=ckpt, tiled_loss=tiled))
    return out


def _max_seq_len(m, c, budget, grid, **kw) -> int:
    fits = lambda n: sum(memory_bytes(m, c, seq_len=n, **kw).values()) <= budget  # noqa: E731
    if not fits(grid):
        return 0
    lo, hi = 1, 2
    while fits(hi * grid):
        lo, hi = hi, hi * 2
        if hi > 1 << 22:
            return lo * grid
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * grid) else (lo, mid)
    return lo * grid


def plan(model: ModelSpec | dict | str | Path, *, seq_len: int, devices: int, nodes: int = 1,
         hardware: str | Path = "h100", precision: str = "bf16-mixed", data_parallel: str = "ddp", mask=None,
         tensor_parallel: int | None = None, sequence_parallel: int | None = None, batch: int = 1,
         memory_budget_bytes: float | None = None, step_overhead_s: float = 0.0) -> Plan:
    """Predict every candidate layout for ``model`` on ``nodes x devices`` and recommend one (Note [Step model]).

    ``model``: a ``ModelSpec``, a transformers config dict, or a path (``config.json`` or a lightning-sp YAML).
    ``mask``: an ``AttentionMask`` every layer uses: its ``window`` replaces the config's per-layer windows, its
    ``chunk_size`` (when set) the config's chunks, its score modifiers (softcap, ALiBi, relative bias) join the
    config's (``None``: the config's; Note [Attention under per-layer masks]); its ``bidirectional_spans`` (a
    prefix-LM's prefix; a causal model, ends within ``seq_len``) go on every layer and each candidate that can shard
    for them is priced on zigzag and on the chunk table balanced for them (Note [Layouts for bidirectional spans]); a
    mask of spans alone keeps the config's windows, chunks and modifiers.
    ``devices``: devices per node. ``hardware``: a preset name or a calibrated profile file
    (``hardware_profile``). ``tensor_parallel`` / ``sequence_parallel``: fix a degree (``None``: every divisor).
    ``memory_budget_bytes``: per device (default: the preset's memory x ``USABLE_MEMORY_SHARE``; needed for a
    profile without memory, e.g. CPU). ``step_overhead_s``: the training loop's fixed time per step, added to
    every candidate (0: not modelled)."""
    if isinstance(model, dict):
        model = ModelSpec.from_hf_config(model)
    elif not isinstance(model, ModelSpec):
        model = ModelSpec.from_file(model)
    if mask is not None:  # one mask on every layer (Note [Attention under per-layer masks])
        model = _every_layer(model, mask)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    for name, value in (("seq_len", seq_len), ("devices", devices), ("nodes", nodes), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    hw = hardware_profile(hardware)
    hw = replace(hw, ranks_per_node=devices) if hw.memory_bytes is not None else hw
    if memory_budget_bytes is None:
        if hw.memory_bytes is None:
            raise ValueError(f"hardware {hw.name!r} has no memory size: pass memory_budget_bytes (--memory-gib)")
        memory_budget_bytes = hw.memory_bytes * USABLE_MEMORY_SHARE
    for start, end in model.bidirectional_spans:
        if end > seq_len:
            raise ValueError(f"bidirectional span ({start}, {end}) reaches past the sequence (seq_len={seq_len}): spans "
                             f"are [start, end) global positions with end <= seq_len")
    world = devices * nodes
    kw = dict(batch=batch, precision=precision, data_parallel=data_parallel, hw=hw)
    cands = _candidates(model, world, hw, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    for c in cands:  # Note [Layouts for bidirectional spans]
        choose_layout(model, c, seq_len=seq_len, batch=batch, act_bytes=PRECISIONS[precision], hw=hw)
    for c in cands:
        c.memory = memory_bytes(model, c, seq_len=seq_len, **kw)
        c.peak_bytes_per_rank = sum(c.memory.values())
        c.fits = c.peak_bytes_per_rank <= memory_budget_bytes
        c.time = step_time(model, c, seq_len=seq_len, step_overhead_s=step_overhead_s, **kw)
        c.step_time_s = sum(c.time.values())
        c.tokens_per_s_per_device = batch * seq_len * c.data_parallel_size / c.step_time_s / world
        c.max_seq_len = _max_seq_len(model, c, memory_budget_bytes, 128 * c.sequence_parallel_size, **kw)
    cands.sort(key=lambda c: (not c.fits, -c.tokens_per_s_per_device if c.fits else -c.max_seq_len))
    fitting = [c for c in cands if c.fits]
    if fitting:
        # the fastest, and among layouts within NEAR_TIE of it, the one with the most room (longest sequence)
        best = fitting[0].tokens_per_s_per_device
        near = [c for c in fitting if c.tokens_per_s_per_device >= NEAR_TIE * best]
        rec = max(near, key=lambda c: (c.max_seq_len, -c.peak_bytes_per_rank))
        reason = (f"the fastest predicted layout that fits ({rec.peak_bytes_per_rank / 2**30:.1f} of "
                  f"{memory_budget_bytes / 2**30:.1f} GiB per rank)")
        if len(near) > 1:
            reason += (f"; {len(near) - 1} other layouts are within {100 * (1 - NEAR_TIE):.0f}% of its tokens/s "
                       f"(below the model's resolution), and this one leaves the most room (N up to {rec.max_seq_len})")
        slower = next((c for c in fitting if c.tokens_per_s_per_device < NEAR_TIE * best), None)
        if slower is not None:
            reason += (f"; the next slower: {slower.label} at "
                       f"{slower.tokens_per_s_per_device / rec.tokens_per_s_per_device:.2f}x its tokens/s")
        reason += _layout_reason(rec, seq_len)
    else:
        rec = cands[0] if cands else None
        reason = (f"no layout fits N={seq_len} in {memory_budget_bytes / 2**30:.1f} GiB per device; shown: the one "
                  f"that reaches the longest sequence ({rec.max_seq_len if rec else 0} tokens)")
    return Plan(model=model, seq_len=seq_len, devices=world, nodes=nodes, hardware=hw.name, hardware_source=hw.source,
                precision=precision, data_parallel=data_parallel, batch=batch,
                memory_budget_bytes=memory_budget_bytes, candidates=cands, recommended=rec, reason=reason,
                cheapest_change=_cheapest_change(model, rec, memory_budget_bytes, data_parallel, kw) if rec else "")


# Note [Layouts for bidirectional spans]
#     A bidirectional span (a prefix-LM's prefix) gives its rows the span's whole width, which unbalances zigzag (Note
#     [Balancing a mask's work] in ``layout.py``). For a model with ``bidirectional_spans``, every candidate whose
#     backend runs on a given layout (``cost_model.LAYOUT_BACKENDS``: ``zigzag_ring``, ``allgather_kv``, ``usp``) is
#     priced on its own layout (zigzag) and on ``SequenceLayout.balanced_for(N, sp, AttentionMask(
#     bidirectional_spans=...), ulysses_degree=U)`` (balanced for the spans and causality; windows, chunks and score
#     modifiers are priced, not balanced for), both with ``cost_model.predict_attention(layout=)`` (Note [Cost model on
#     a given layout]: the pairs and bytes the backends compute on it), and keeps the layout whose one layer's
#     attention (compute + exposed communication) is predicted faster; ties keep zigzag. The candidate records it
#     (``layout``, ``chunk_ranks``, ``Candidate.sequence_layout()`` for ``layout=``) and both prices
#     (``layout_prices``), and the recommendation says which layout and why. A table equal to zigzag's (plain causal
#     work) is not priced twice. ``ulysses`` and one rank shard their own way.


def _own_layout_name(backend: str, sp: int, ulysses_degree: int | None) -> str:
    """``str`` of the layout ``backend`` shards for on its own (``attention.layout_for_backend``)."""
    if sp == 1 or backend in ("local", "ulysses", "ring", "colossal"):
        return "contiguous"
    return "zigzag" if backend != "usp" else f"zigzag(ulysses={ulysses_degree})"


@lru_cache(maxsize=256)
def _balanced_layout(seq_len: int, sp: int, spans: tuple, ulysses_degree: int):
    """``SequenceLayout.balanced_for`` the spans (Note [Layouts for bidirectional spans]); cached: candidates share it."""
    from lightning_sp.layout import SequenceLayout
    from lightning_sp.masks import AttentionMask

    return SequenceLayout.balanced_for(seq_len, sp, AttentionMask(bidirectional_spans=spans), causal=True,
                                       ulysses_degree=ulysses_degree)


def choose_layout(m: ModelSpec, c: Candidate, *, seq_len: int, batch: int, act_bytes: int,
                  hw: cost_model.HardwareProfile) -> Candidate:
    """Set ``c``'s layout (Note [Layouts for bidirectional spans]): its backend's own, or the chunk table balanced for
    ``m``'s bidirectional spans when that is predicted faster; ``c.layout_prices`` records both. Returns ``c``."""
    sp, u = c.sequence_parallel_size, c.ulysses_degree
    c.layout, c.chunk_ranks, c.layout_prices = _own_layout_name(c.backend, sp, u), None, {}
    if not (m.bidirectional_spans and m.causal and sp > 1 and c.backend in cost_model.LAYOUT_BACKENDS):
        return c
    table = _balanced_layout(seq_len, sp, tuple(tuple(x) for x in m.bidirectional_spans), u or 1)
    ring = sp // (u or 1)
    if table.chunk_ranks == tuple(range(ring)) + tuple(reversed(range(ring))):
        return c  # zigzag's own table
    args = (m, c, seq_len, batch, act_bytes, hw)
    own = {"attention_s": sum(attention_per_layer(*args)), "busiest_rank_pairs": attention_pairs_per_layer(*args)}
    c.chunk_ranks = table.chunk_ranks
    balanced = {"attention_s": sum(attention_per_layer(*args)), "busiest_rank_pairs": attention_pairs_per_layer(*args)}
    c.layout_prices = {c.layout: own, str(table): balanced}
    if balanced["attention_s"] < own["attention_s"]:
        c.layout = str(table)
    else:
        c.chunk_ranks = None
    return c


def _layout_reason(rec: Candidate, seq_len: int) -> str:
    """What the recommendation says about its layout (Note [Layouts for bidirectional spans])."""
    if len(rec.layout_prices) < 2:
        return ""
    (own_name, own), (table_name, table) = rec.layout_prices.items()
    u = f", ulysses_degree={rec.ulysses_degree}" if rec.backend == "usp" else ""
    how = (f"SequenceLayout.balanced_for({seq_len}, {rec.sequence_parallel_size}, "
           f"AttentionMask(bidirectional_spans=...){u})")
    figures = (f"busiest rank {table['busiest_rank_pairs']:.4g} query-key pairs per layer against {own_name}'s "
               f"{own['busiest_rank_pairs']:.4g}, attention {table['attention_s'] * 1e3:.4g} against "
               f"{own['attention_s'] * 1e3:.4g} ms per layer")
    if rec.chunk_ranks is not None:
        return (f"; layout: the chunk table balanced for the bidirectional spans, {table_name} ({how}; pass it as "
                f"layout=): {figures}")
    return (f"; layout: {own_name}, the backend's own: the chunk table balanced for the bidirectional spans "
            f"({table_name}) is predicted slower: {figures}")


def _every_layer(model: ModelSpec, mask) -> ModelSpec:
    """``model`` with ``mask`` on every layer: its window replaces the model's windows (none: no window), its chunk
    the model's chunks (when set), its score modifiers join the model's."""
    from lightning_sp.masks import AttentionMask

    if not isinstance(mask, AttentionMask):
        raise ValueError(f"mask must be a lightning_sp.AttentionMask, got {type(mask).__name__}")
    if mask.mask_mod is not None or mask.score_mod is not None or mask.key_padding:
        raise ValueError("the planner prices a sliding window, chunks, bidirectional spans and softcap/ALiBi/"
                         "relative-bias score modifiers (mask=AttentionMask(window=(left, right), chunk_size=C, "
                         "bidirectional_spans=((start, end),), softcap=...)); key padding, mask_mod and score_mod "
                         "callables are not planned: leave them out")
    if mask.bidirectional_spans and not model.causal:
        raise ValueError(f"bidirectional_spans={mask.bidirectional_spans} need a causal model (a decoder): "
                         f"{model.name} is an encoder, which attends bidirectionally everywhere; leave them out")
    if mask.signature() == AttentionMask(bidirectional_spans=mask.bidirectional_spans).signature():
        return replace(model, bidirectional_spans=mask.bidirectional_spans)  # spans alone: the config's attention + them
    layers = model.num_layers
    return replace(model, sliding_windows=() if mask.window is None else (tuple(mask.window),) * layers,
                   bidirectional_spans=mask.bidirectional_spans,
                   chunk_sizes=model.chunk_sizes if mask.chunk_size is None else (mask.chunk_size,) * layers,
                   attention_softcap=model.attention_softcap if mask.softcap is None else float(mask.softcap),
                   attention_alibi=model.attention_alibi or mask.alibi_slopes is not None,
                   relative_bias=model.relative_bias or mask.relative_bias is not None)


def _cheapest_change(m: ModelSpec, rec: Candidate, budget: float, data_parallel: str, kw: dict) -> str:
    """The first change, cheapest first, that raises the recommended layout's longest sequence."""
    base = rec.max_seq_len
    grid = 128 * rec.sequence_parallel_size
    changes = [("the tiled loss (sequence_parallel_cross_entropy(hidden, labels, weight=...))", {"tiled_loss": True}, {}),
               ("kv_pieces=4", {"kv_pieces": 4}, {}) if rec.backend not in ("local", "ulysses") else None,
               ("activation checkpointing (one more forward per step)", {"activation_checkpointing": True}, {}),
               ("FSDP (data_parallel='fsdp')", {}, {"data_parallel": "fsdp"}) if data_parallel == "ddp" else None]
    for text, cand_change, kw_change in filter(None, changes):
        if all(getattr(rec, k) == v for k, v in cand_change.items()) and not kw_change:
            continue
        longer = _max_seq_len(m, replace(rec, **cand_change), budget, grid, **{**kw, **kw_change})
        if longer > base:
            return f"{text}: up to N={longer} (from {base})"
    # a recommended `local` (no sequence parallelism) has no degree to double: split over two ranks with a ring
    twice = replace(rec, sequence_parallel_size=2 * rec.sequence_parallel_size,
                    backend="zigzag_ring" if rec.backend == "local" else rec.backend)
    longer = _max_seq_len(m, twice, budget, 2 * grid, **kw)
    how = f", backend={twice.backend!r}" if twice.backend != rec.backend else ""
    return (f"twice the sequence-parallel degree (sp={twice.sequence_parallel_size}{how}, twice the devices): up to "
            f"N={longer} (from {base})")


# ------------------------------------------------------------------------------------------------ command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-sp plan",
        description="Predict the memory per rank, the step time and the longest sequence of every layout for a "
                    "model on a cluster, and recommend one. Figures are predictions from hardware parameters "
                    "(datasheets for GPUs), not measurements.")
    p.add_argument("--model", help="a transformers config.json or a lightning-sp YAML config")
    p.add_argument("--layers", type=int, help="explicit sizes instead of --model: transformer layers")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA/MQA; default: --heads)")
    p.add_argument("--ffn", type=int, help="MLP inner width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--encoder", action="store_true", help="bidirectional encoder (default: causal decoder)")
    p.add_argument("--sliding-window", type=int, metavar="W",
                   help="every layer attends to a window of W tokens (a decoder: the W - 1 before each token, as "
                        "Hugging Face's sliding_window; an encoder: W // 2 each side); default: the config's windows")
    p.add_argument("--bidirectional-span", action="append", default=[], metavar="START:END",
                   help="global positions [START, END) every layer's causal attention sees whole (a prefix-LM's "
                        "prefix, AttentionMask(bidirectional_spans=)); repeatable. Layouts are priced on zigzag and on "
                        "the chunk table balanced for the spans")
    p.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence")
    p.add_argument("--devices", type=int, required=True, help="devices per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--hardware", default="h100",
                   help="cpu, a100, h100, h800, h200, b200, h200-measured, or a calibrated profile file")
    p.add_argument("--memory-gib", type=float, help="memory per device to plan for (default: the preset's x 0.92)")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    p.add_argument("--data-parallel", default="ddp", choices=DATA_PARALLEL)
    p.add_argument("--tensor-parallel", type=int, help="fix the tensor-parallel degree (default: try each)")
    p.add_argument("--sequence-parallel", type=int, help="fix the sequence-parallel degree (default: try each)")
    p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel replica per step")
    p.add_argument("--top", type=int, default=12, help="candidates to print")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _window_mask(args, model):
    """``--sliding-window W`` as an ``AttentionMask`` for ``model`` (a decoder: HF's ``(W - 1, 0)``)."""
    if args.sliding_window is None:
        return None
    from lightning_sp.masks import AttentionMask

    if args.sliding_window < 1:
        raise ValueError(f"--sliding-window must be >= 1 tokens, got {args.sliding_window}")
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_file(model)
    w = args.sliding_window
    return AttentionMask(window=(w - 1, 0) if spec.causal else (w // 2, w // 2))


def _merged(first, second):
    return second if first is None else first.merged(second)


def _span_mask(args):
    """``--bidirectional-span START:END`` (repeated) as an ``AttentionMask`` (``None``: none given)."""
    if not args.bidirectional_span:
        return None
    from lightning_sp.masks import AttentionMask

    spans = []
    for text in args.bidirectional_span:
        try:
            start, end = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--bidirectional-span takes START:END (global positions, END exclusive), got {text!r}") \
                from None
        spans.append((start, end))
    return AttentionMask(bidirectional_spans=tuple(sorted(spans)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.model:
            model: ModelSpec | str = args.model
        elif args.layers and args.hidden and args.heads:
            model = ModelSpec(name="explicit", num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                              num_kv_heads=args.kv_heads, ffn_hidden=args.ffn, vocab=args.vocab, causal=not args.encoder)
        else:
            raise ValueError("pass --model PATH, or --layers, --hidden and --heads")
        result = plan(model, seq_len=args.seq_len, devices=args.devices, nodes=args.nodes, hardware=args.hardware,
                      precision=args.precision, data_parallel=args.data_parallel, tensor_parallel=args.tensor_parallel,
                      sequence_parallel=args.sequence_parallel, batch=args.batch,
                      mask=_merged(_window_mask(args, model), _span_mask(args)),
                      memory_budget_bytes=args.memory_gib * 2**30 if args.memory_gib else None)
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-sp plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.summary(args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
