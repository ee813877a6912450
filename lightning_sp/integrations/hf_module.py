"""``HFSequenceParallelModule``: train any transformers ``*ForCausalLM`` / ``*ForMaskedLM`` with Lightning,
sequence parallel under ``SequenceParallelStrategy``, plain without it.

    model = AutoModelForCausalLM.from_config(cfg)
    trainer = L.Trainer(strategy=SequenceParallelStrategy(4, backend="zigzag_ring"), devices=8)
    trainer.fit(HFSequenceParallelModule(model), datamodule)     # batches: global input_ids, labels, ...

Batches are GLOBAL HF batches (``input_ids``, ``labels``, optional ``attention_mask``, packed
``position_ids``/``cu_seqlens``), the same on every rank of a sequence-parallel group. See
Note [HF batches under the strategy].

Note [HF batches under the strategy]
    HF batches need global work before sharding: labels shifted over the whole row, positions by
    cumulative sums, ESM's mask ratio, padding turned into lengths or packed documents. So this module
    sets ``shards_its_own_batches = True``: ``SequenceParallelStrategy`` then moves the global batch
    unsharded (token ids: a few bytes per token) and ``on_after_batch_transfer`` shards it with
    ``shard_inputs`` (no strategy ``position_ids``: models that compute positions themselves, RoBERTa
    and ESM-1b, get theirs)::

        loader -> [B, N] ids -> device -> shard_inputs -> [B', S/P] (+ the global length for the context)
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_sp.integrations.transformers import (
    SHARD_INFO_KEY,
    _sequence_parallel_group,
    apply_sequence_parallel,
    shard_inputs,
)
from lightning_sp.loss import sequence_parallel_cross_entropy

TASKS = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM"}


def build_hf_model(*, model_type: str, task: str, config: dict | None = None, vocab_size: int | None = None) -> nn.Module:
    """A randomly initialised transformers model from a config (no download): ``AutoConfig.for_model``."""
    import transformers

    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    kwargs = dict(config or {})
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    return getattr(transformers, TASKS[task]).from_config(cfg)


def sequence_parallel_group(model: nn.Module):
    """The sp group the model's attention runs over, or ``None`` when it runs locally (unbound, or sp of 1)."""
    return _sequence_parallel_group(model)


class HFSequenceParallelModule(L.LightningModule):
    """Masked- or causal-LM training of a transformers model, exact under sequence parallelism.

    Args:
        model: a transformers ``PreTrainedModel`` (its attention is replaced by ``apply_sequence_parallel``).
            ``None``: built from ``model_type`` / ``task`` / ``config`` (random init; for LightningCLI).
        model_type: e.g. ``"esm"``, ``"llama"`` (``AutoConfig.for_model``).
        task: ``"masked_lm"`` or ``"causal_lm"``.
        config: config fields (``hidden_size``, ``num_hidden_layers``, ...).
        vocab_size: overrides ``config["vocab_size"]`` (LightningCLI links it from the data module).
        lr, weight_decay, warmup_steps: AdamW (no decay on biases/norms), linear warmup then constant.
        ignore_index: label value the loss ignores.
    """

    shards_its_own_batches = True
    """Tells ``SequenceParallelStrategy`` to leave the batch whole (Note [HF batches under the strategy])."""

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        model_type: str | None = None,
        task: str | None = None,
        config: dict | None = None,
        vocab_size: int | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        if model is None:
            if model_type is None or task is None:
                raise ValueError("pass a transformers model, or model_type= and task= ('masked_lm'/'causal_lm') to build one")
            model = build_hf_model(model_type=model_type, task=task, config=config, vocab_size=vocab_size)
        elif model_type is not None or config is not None:
            raise ValueError("pass either a model or model_type/config to build one, not both")
        self.model = apply_sequence_parallel(model)
        self.config = self.model.config  # for SequenceParallelMonitor's FLOPs formula

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict:
        shard = shard_inputs(batch, self.model, ignore_index=self.hparams.ignore_index)
        context = getattr(self.trainer.strategy, "_context", None) if self._trainer is not None else None
        if context is not None:
            context.global_seq_len = shard[SHARD_INFO_KEY].seq_len  # for SequenceParallelMonitor's token count
        return shard

    @override
    def forward(self, **shard: Any) -> torch.Tensor:
        return self.model(**shard).logits  # [B, S_local, V]

    def _loss(self, shard: dict) -> torch.Tensor:
        shard = dict(shard)
        labels = shard.pop("labels")
        logits = self(**shard)
        group = sequence_parallel_group(self.model)
        if group is None:
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.hparams.ignore_index)
        return sequence_parallel_cross_entropy(logits, labels, ignore_index=self.hparams.ignore_index, group=group)

    @override
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("Loss/train", loss, prog_bar=True, on_step=True, batch_size=1)
        return loss

    @override
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("Loss/val", self._loss(batch), prog_bar=True, sync_dist=True, batch_size=1)

    @override
    def configure_optimizers(self):
        from lightning_sp.models.base import make_optimizer

        return make_optimizer(self, self.hparams.lr, self.hparams.weight_decay, self.hparams.warmup_steps)
