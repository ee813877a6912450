"""The multimodal decoder with each image one bidirectional span (``image_attention="bidirectional"``), sharded
as the strategy shards it, against one process whose attention is dense float64 attention with the same spans
(``tests.reference.dense_attention``, independent of ``lightning_sp.masks``): loss and every parameter's gradient.

Run inside ``tests/distributed/test_masks.py``'s spawn (``span_cases`` on every rank); its test asserts.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.reference import dense_attention

BACKENDS = ("zigzag_ring", "allgather_kv")
N_IMAGES = 2  # 21 * 2 + 9 = 51 tokens: no degree divides it, so the sharder pads
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "answer_mask")


class DenseReferenceAttention(torch.nn.Module):
    """Stands in for a block's ``SequenceParallelAttention`` in the one-process reference: causal dense float64
    attention on the whole sequence, with the call's spans (``honour_spans``) or without them (the control)."""

    def __init__(self, honour_spans: bool) -> None:
        super().__init__()
        self.honour_spans = honour_spans

    def forward(self, q, k, v, *, cu_seqlens=None, mask=None):  # [B, S, H(_kv), D] -> [B, S, H, D]
        return dense_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, mask=mask if self.honour_spans else None)


@functools.cache
def _samples() -> tuple[dict, dict]:
    from lightning_sp.data.multimodal import DigitSequenceDataset, MultimodalDataConfig

    ds = DigitSequenceDataset(MultimodalDataConfig(n_images=N_IMAGES, samples_per_epoch=2), split="train")
    return ds[0], ds[1]


def _batch() -> dict:
    from lightning_sp.data.multimodal import collate_stack

    return collate_stack(list(_samples()))  # [B=2, S=51], image_spans [2, 2, 2]; new tensors every call


def _model(image_attention: str):
    from lightning_sp.models import MultimodalDecoder

    torch.manual_seed(0)  # the same weights on every rank and in the reference
    model = MultimodalDecoder(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, image_attention=image_attention).double()
    model.log = lambda *args, **kwargs: None  # no Trainer here: _step's logging is not under test
    return model


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model._step(batch, "train")
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(image_attention: str, honour_spans: bool):
    model = _model(image_attention)
    for block in model.net.blocks:
        block.attn = DenseReferenceAttention(honour_spans)
    return _loss_and_grads(model, _batch())


def _sharded(group, world, backend: str, image_attention: str, batch=None):
    """Loss and gradient (mean over the group, as the strategy's gradient sync takes it) of the model sharded
    by the strategy's own ``BatchSharder`` and attention binding."""
    from lightning_sp.batch_sharding import BatchSharder
    from lightning_sp.binding import bind_attention_modules
    from lightning_sp.context import SequenceParallelContext
    from lightning_sp.topology import ParallelDims

    model = _model(image_attention)
    context = SequenceParallelContext(group=group, backend=backend)
    layout = bind_attention_modules(model, context, backend=backend, sequence_parallel_size=world)
    source = SimpleNamespace(context=context, layout=layout,
                             parallel_dims=ParallelDims(world_size=world, sequence_parallel_size=world))
    sharded = BatchSharder(source, sequence_keys=SEQUENCE_KEYS).shard_batch(batch if batch is not None else _batch())
    loss, grads = _loss_and_grads(model, sharded)
    for g in grads.values():
        dist.all_reduce(g, group=group)
        g /= world
    return loss, grads


def _errors(got, ref) -> tuple[float, float]:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    return float((loss - ref_loss).abs()), max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)


def _leaking_batch():
    """Patch tokens supervised with the next patch: a position that sees its own target."""
    batch = _batch()
    s, e = batch["image_spans"][0, 0].tolist()
    batch["labels"][:, s:e - 1] = batch["input_ids"][:, s + 1:e]
    return batch


def span_cases(group, world) -> dict:
    """``{case: (loss error, max gradient error, control)}`` and the leak guard's message per rank."""
    ref = {(image, honour): _reference(image, honour) for image, honour in
           (("bidirectional", True), ("bidirectional", False), ("causal", False))}
    out = {}
    for backend in BACKENDS:
        got = _sharded(group, world, backend, "bidirectional")
        # control: the same sharded run against the reference with the spans ignored must miss
        out[(backend, "bidirectional")] = (*_errors(got, ref[("bidirectional", True)]),
                                           max(_errors(got, ref[("bidirectional", False)])))
    causal = _sharded(group, world, "zigzag_ring", "causal")
    # causal images: the plain causal reference; control: the bidirectional one must miss
    out[("zigzag_ring", "causal")] = (*_errors(causal, ref[("causal", False)]),
                                      max(_errors(causal, ref[("bidirectional", True)])))
    try:
        _sharded(group, world, "zigzag_ring", "bidirectional", batch=_leaking_batch())
        leak = None
    except ValueError as e:
        leak = str(e)
    return {"cases": out, "leak": leak}
