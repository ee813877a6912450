"""``HFSequenceParallelModule``: train any transformers ``*ForCausalLM`` / ``*ForMaskedLM`` with Lightning,
sequence parallel under ``SequenceParallelStrategy``, plain without it.

    model = AutoModelForCausalLM.from_config(cfg)
    trainer = L.Trainer(strategy=SequenceParallelStrategy(4, backend="zigzag_ring"), devices=8)
    trainer.fit(HFSequenceParallelModule(model), datamodule)     # batches: global input_ids, labels, ...

Batches are GLOBAL HF batches (``input_ids``, ``labels``, optional ``attention_mask``, packed
``position_ids``/``cu_seqlens``), the same on every rank of a sequence-parallel group. See
Note [HF batches under the strategy].

Note [HF batches under the strategy]
    ``SequenceParallelStrategy`` shards each batch's ``sequence_keys`` before any module hook runs, but
    HF batches need global work first: labels shifted over the whole row, positions by cumulative sums,
    ESM's mask ratio, padding turned into lengths or packed documents (``shard_inputs``). So
    ``on_after_batch_transfer`` reassembles the global batch from the strategy's shards with one
    all-gather of the token-id tensors (``[B, N]`` integers: bytes per token, against ``h`` floats per
    token per layer for attention) and calls ``shard_inputs`` on it::

        loader -> strategy.shard_batch -> [B, N/P] ids -> gather_sequence -> [B, N] -> shard_inputs -> [B', S/P]

    The strategy's own ``position_ids`` (added when the batch has none) are switched off for this
    module, so models that compute positions themselves (RoBERTa, ESM-1b) get theirs.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_sp.integrations.transformers import SHARD_INFO_KEY, _sp_modules, apply_sequence_parallel, shard_inputs
from lightning_sp.layout import gather_sequence, group_size_and_rank
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
    sps = _sp_modules(model)
    if not sps or sps[0].resolved_backend() == "local":
        return None
    group = sps[0].process_group
    return group if group_size_and_rank(group)[0] > 1 else None


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
    def setup(self, stage: str) -> None:
        from lightning_sp.strategy import SequenceParallelStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, SequenceParallelStrategy) and strategy.position_ids_key is not None:
            # shard_inputs makes global positions itself (cumulative sums for RoBERTa-style models)
            rank_zero_info("HFSequenceParallelModule: position_ids come from shard_inputs, not the strategy")
            strategy.position_ids_key = None

    def _global_batch(self, batch: Any) -> Any:
        """Undo the strategy's sharding (Note [HF batches under the strategy]); other batches unchanged."""
        from lightning_sp.strategy import SequenceParallelStrategy

        strategy = self.trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, SequenceParallelStrategy) or not isinstance(batch, dict):
            return batch
        context = strategy.context
        out = dict(batch)
        for key in strategy.sequence_keys:
            t = batch.get(key)
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                out[key] = gather_sequence(t, context.group, layout=strategy.layout, seq_len=context.global_seq_len)
        return out

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict:
        shard = shard_inputs(self._global_batch(batch), self.model, ignore_index=self.hparams.ignore_index)
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
        self.log("train/loss", loss, prog_bar=True, on_step=True, batch_size=1)
        return loss

    @override
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True, batch_size=1)

    @override
    def configure_optimizers(self):
        from lightning_sp.models.base import make_optimizer

        return make_optimizer(self, self.hparams.lr, self.hparams.weight_decay, self.hparams.warmup_steps)
