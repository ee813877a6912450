"""transformers models under sequence parallelism vs the unsharded HF model (its own sdpa), float64.

One spawn per world size (2 and 4) runs the grid: Llama (GQA 4/2), Qwen2 (MQA, qkv bias) and ESM
(rotary, token dropout on, bidirectional) x every backend x with/without a right-padding mask, at a
global length (13) no degree divides; and B = 2 rows of different lengths (packed by shard_inputs
into 23 tokens) on two backends. Logits (real positions), loss and every parameter gradient
must equal the reference to 1e-9 (HF's own float32 roundings kept in float64: ``tests.hf_tiny.KeepFloat64``).
Negative controls reproduce each trap the integration fixes (label shift inside the shard, local positions,
attention to padding, ESM token dropout over the shard) and must miss by far more. The P = 2 spawn also trains
``HFSequenceParallelModule`` through a real ``Trainer`` with ``SequenceParallelStrategy`` and compares parameters
with a one-process loop.

Fine-tuning patterns, in the same spawns: HF gradient checkpointing (reentrant and not) with a ``no_grad``
forward of another batch (another length, packed documents) between forward and backward, and two forwards
alive with backward in reverse order (control: one ShardInfo slot shared by the model, the old behaviour);
``model(**shard)`` with ``shard_inputs``' labels, padding and ``num_items_in_batch`` vs ``model(**batch)``
(control: HF's loss inside the shard); a PEFT-like LoRA model (``tests.hf_tiny.lora_like``; the real
``peft`` too where it is installed).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed.harness import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.distributed

TOL = 1e-9
MISS = 1e-6  # a negative control must differ by more than this
N, N_REAL_PADDED = 13, 10
BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal")
MODELS = ("llama", "qwen2", "esm")
ROW_LENGTHS = (N_REAL_PADDED, N)  # B = 2 rows of different lengths -> packed, 23 tokens
PACKED_BACKENDS = ("ulysses", "zigzag_ring")
TRAIN_STEPS, TRAIN_LR = 2, 0.5


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _sp_forward(model, batch, group, *, shard=None, labels_override=None, seq_len=None):
    """SP loss/logits on this rank: ``(logits_global [1, N, V], loss, grads_mean)``."""
    import torch.distributed as dist

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations.transformers import _sp_modules, shard_inputs

    shard = dict(shard if shard is not None else shard_inputs(batch, model))
    labels = shard.pop("labels")
    if labels_override is not None:
        labels = labels_override
    logits = model(**shard).logits  # [1, S_local, V]
    loss = sequence_parallel_cross_entropy(logits, labels, group=group)
    model.zero_grad(set_to_none=True)
    loss.backward()
    world = dist.get_world_size(group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[name] = g / world  # mean over ranks = the global gradient (Note [Gradient reduction over dp x sp])
    layout = _sp_modules(model)[0].layout
    full = gather_sequence(logits.detach(), group, layout=layout, seq_len=seq_len or batch["input_ids"].size(1))
    return full, loss.detach(), grads


def _grad_diff(grads, ref_model) -> float:
    return max(_max_diff(grads[n], p.grad) for n, p in ref_model.named_parameters() if p.grad is not None)


def _exactness_grid(world: int) -> dict:
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import ShardInfo, apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import clone, reference, tiny_batch, tiny_model, tiny_rows

    group = dist.group.WORLD
    out: dict = {}
    for name in MODELS:
        base = tiny_model(name)
        for padded in (False, True):
            batch = tiny_batch(name, N_REAL_PADDED if padded else N, pad_to=N if padded else None)
            real = N_REAL_PADDED if padded else N
            ref = clone(base)
            ref_logits, ref_loss = reference(ref, name, batch)
            ref_loss.backward()
            ref_logits = ref_logits.detach()
            for backend in BACKENDS:
                model = apply_sequence_parallel(clone(base), group=group, backend=backend)
                logits, loss, grads = _sp_forward(model, batch, group, seq_len=real)
                out[(name, padded, backend)] = {
                    "logits": _max_diff(logits, ref_logits[:, :real]),
                    "loss": abs(float(loss - ref_loss.detach())),
                    "grads": _grad_diff(grads, ref),
                }
            # negative controls, one backend: each reproduces one trap the integration fixes
            model = apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")
            shard = shard_inputs(batch, model)
            info = shard["sequence_parallel"]
            controls = {}
            if name != "esm":
                # HF's loss shifts labels inside each shard
                unshifted = shard_inputs(batch, model, causal_lm=False)["labels"]
                local_shift = torch.cat([unshifted[:, 1:], unshifted.new_full((1, 1), -100)], dim=1)
                _, loss_c, _ = _sp_forward(model, batch, group, shard=shard, labels_override=local_shift, seq_len=real)
                controls["label_shift_in_shard"] = abs(float(loss_c - ref_loss))
                # models default position_ids to local positions
                local_pos = dict(shard, position_ids=torch.arange(shard["input_ids"].size(1))[None])
                logits_c, _, _ = _sp_forward(model, batch, group, shard=local_pos, seq_len=real)
                controls["local_positions"] = _max_diff(logits_c, ref_logits[:, :real])
            else:
                # ESM token dropout rescaled by the mask ratio of the local shard (HF's own code path)
                local_ratio = dict(shard, sequence_parallel=ShardInfo(
                    seq_len=info.seq_len, padded_len=info.padded_len, cu_seqlens=None, token_dropout_ratio=None))
                logits_c, _, _ = _sp_forward(model, batch, group, shard=local_ratio, seq_len=real)
                controls["token_dropout_local_ratio"] = _max_diff(logits_c, ref_logits[:, :real])
                # bidirectional attention to the layout's padding when the global length does not reach it
                no_len = dict(shard, sequence_parallel=ShardInfo(
                    seq_len=info.padded_len, padded_len=info.padded_len, token_dropout_ratio=info.token_dropout_ratio))
                logits_c, _, _ = _sp_forward(model, batch, group, shard=no_len, seq_len=real)
                controls["attends_to_padding"] = _max_diff(logits_c, ref_logits[:, :real])
            out[(name, padded, "controls")] = controls
        # rows of different lengths (B = 2): packed into one row of documents by shard_inputs
        batch = tiny_rows(name, ROW_LENGTHS, pad_to=N)
        ref = clone(base)
        ref_logits, ref_loss = reference(ref, name, batch)
        ref_loss.backward()
        real = torch.cat([ref_logits[i, :n] for i, n in enumerate(ROW_LENGTHS)]).detach()[None]
        for backend in PACKED_BACKENDS:
            model = apply_sequence_parallel(clone(base), group=group, backend=backend)
            logits, loss, grads = _sp_forward(model, batch, group, seq_len=sum(ROW_LENGTHS))
            out[(name, "rows", backend)] = {
                "logits": _max_diff(logits, real), "loss": abs(float(loss - ref_loss)), "grads": _grad_diff(grads, ref),
            }
    return out


def _roberta_cumsum_positions(world: int) -> dict:
    """RoBERTa computes positions by a cumulative sum over the input_ids it sees (the shard)."""
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import clone, reference, tiny_batch, tiny_model

    base = tiny_model("roberta")
    batch = tiny_batch("roberta", N)
    ref = clone(base)
    ref_logits, ref_loss = reference(ref, "roberta", batch)
    ref_loss.backward()
    model = apply_sequence_parallel(clone(base), group=dist.group.WORLD, backend="ring")
    logits, loss, grads = _sp_forward(model, batch, dist.group.WORLD)
    shard = shard_inputs(batch, model)
    shard.pop("position_ids")  # HF's default: cumsum over the local shard
    logits_c, _, _ = _sp_forward(model, batch, dist.group.WORLD, shard=shard)
    return {"logits": _max_diff(logits, ref_logits.detach()), "loss": abs(float(loss - ref_loss)),
            "grads": _grad_diff(grads, ref), "control": _max_diff(logits_c, ref_logits.detach())}


def _train_with_trainer(world: int) -> dict:
    """HFSequenceParallelModule under Trainer(strategy=SequenceParallelStrategy(2)) vs a one-process loop."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from lightning_sp.integrations.hf_module import HFSequenceParallelModule
    from lightning_sp.strategy import SequenceParallelStrategy
    from tests.hf_tiny import clone, tiny_batch, tiny_model

    class SGDModule(HFSequenceParallelModule):  # plain SGD: Adam's first steps hide gradient errors
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=TRAIN_LR)

    base = tiny_model("llama")
    data = [{k: v[0] for k, v in tiny_batch("llama", N, seed=s).items()} for s in range(TRAIN_STEPS)]
    module = SGDModule(clone(base))
    os.environ["WORLD_SIZE"] = str(world)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=SequenceParallelStrategy(world, backend="zigzag_ring", process_group_timeout=60),
        precision="64-true", max_steps=TRAIN_STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(data, batch_size=1, shuffle=False))
    ref = clone(base)
    opt = torch.optim.SGD(ref.parameters(), lr=TRAIN_LR)
    for sample in data:
        logits = ref(input_ids=sample["input_ids"][None]).logits
        loss = F.cross_entropy(logits[0, :-1], sample["labels"][1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained = dict(module.model.named_parameters())
    diff = max(_max_diff(trained[n].detach(), p.detach()) for n, p in ref.named_parameters())
    moved = max(_max_diff(p.detach(), q.detach()) for p, q in zip(ref.parameters(), base.parameters()))
    return {"diff": diff, "moved": moved}


def _unbound_and_misuse(world: int) -> dict:
    """No group, no strategy: local attention on the whole sequence even though a process group exists
    (plain DDP). A model sharded over P > 1 ranks but called without its ShardInfo must refuse."""
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import clone, reference, tiny_batch, tiny_model

    base = tiny_model("esm")
    batch = tiny_batch("esm", N_REAL_PADDED, pad_to=N)
    ref_logits, _ = reference(clone(base), "esm", batch)
    model = apply_sequence_parallel(clone(base))
    shard = shard_inputs(batch, model)
    shard.pop("labels")
    res = {"unbound": _max_diff(model(**shard).logits.detach(), ref_logits.detach()[:, :N_REAL_PADDED]),
           "unbound_len": shard["input_ids"].size(1)}
    # HF gradient checkpointing: the recompute in backward reads the same ShardInfo
    llama = tiny_model("llama")
    llama_batch = tiny_batch("llama", N_REAL_PADDED, pad_to=N)
    ref = clone(llama)
    _, ref_loss = reference(ref, "llama", llama_batch)
    ref_loss.backward()
    ckpt = apply_sequence_parallel(clone(llama), group=dist.group.WORLD, backend="zigzag_ring")
    ckpt.gradient_checkpointing_enable()
    _, loss, grads = _sp_forward(ckpt, llama_batch, dist.group.WORLD, seq_len=N_REAL_PADDED)
    res["checkpointed"] = max(abs(float(loss - ref_loss)), _grad_diff(grads, ref))
    model = apply_sequence_parallel(clone(base), group=dist.group.WORLD, backend="ring")
    shard = shard_inputs(batch, model)
    try:
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        res["no_info_error"] = ""
    except ValueError as err:
        res["no_info_error"] = str(err)
    return res


def _readme_recipe(world: int) -> dict:
    """The README's standalone HF recipe, executed as written, vs the unsharded model (float64)."""
    import torch.distributed as dist

    from tests.distributed.test_readme import readme_block
    from tests.hf_tiny import clone, reference, tiny_batch, tiny_model

    code = readme_block("hf standalone")
    out = {}
    for name in ("llama", "esm"):
        base = tiny_model(name)
        batch = tiny_batch(name, N_REAL_PADDED, pad_to=N)
        ref = clone(base)
        _, ref_loss = reference(ref, name, batch)
        ref_loss.backward()
        scope = {"model": clone(base), "sp_group": dist.group.WORLD, "batch": batch}
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
        grads = {}
        for pname, p in scope["model"].named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[pname] = g / world
        out[name] = max(abs(float(scope["loss"].detach() - ref_loss.detach())), _grad_diff(grads, ref))
    return out


# ------------------------------------------------------------------------------ fine-tuning patterns

OTHER_N = 15  # the interleaved batch: another length, the same layout padding as N (16 on 2 and 4 ranks)
OTHER_DOCS = 6  # ... and packed documents (causal LMs): [0, 6, 15]
NUM_ITEMS = 7  # HF Trainer's num_items_in_batch: a count the loss divides by instead of its own


def _global_grads(model, group) -> dict:
    """Every parameter's gradient summed over the group / P (zeros where none): what DDP over dp x sp averages."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[name] = g / world
    return grads


def _ref_grads(model) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _dict_diff(a: dict, b: dict) -> float:
    return max(_max_diff(a[n], b[n]) for n in b)


def _other_batch(name: str) -> dict:
    from tests.hf_tiny import tiny_batch

    other = tiny_batch(name, OTHER_N, seed=7)
    if name == "llama":
        other["position_ids"] = torch.tensor([list(range(OTHER_DOCS)) + list(range(OTHER_N - OTHER_DOCS))])
        other["use_cache"] = False  # HF's own mask packs documents only without a cache
    return other


class _SharedInfoControl:
    """The old behaviour, reintroduced for a negative control: the attention reads the ShardInfo of the
    model's most recent forward (one slot the whole model shares) instead of its own forward's."""

    def __init__(self, model):
        import lightning_sp.integrations.transformers as hf

        self.hf, self.last = hf, None
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True, prepend=True)
        self.original = hf._shard_info_of_call
        hf._shard_info_of_call = lambda module, state, kwargs: (kwargs.pop(hf.SHARD_INFO_KEY, None), self.last)[1]

    def _record(self, module, args, kwargs):
        self.last = kwargs.get(self.hf.SHARD_INFO_KEY)

    def remove(self):
        self.hf._shard_info_of_call = self.original
        self.handle.remove()


def _checkpointing_cases(world: int) -> dict:
    """HF gradient checkpointing (reentrant and not) with a ``no_grad`` forward of another batch (another
    length; for Llama packed documents too) between forward and backward, and two forwards alive at once
    (backward in reverse order): gradients vs the unsharded model, and the shared-slot control."""
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import _sp_modules, apply_sequence_parallel, shard_inputs
    from lightning_sp.layout import padded_length
    from tests.hf_tiny import clone, reference, tiny_batch, tiny_model

    group = dist.group.WORLD
    out: dict = {}
    for name in ("llama", "esm"):
        base = tiny_model(name)
        batch, other = tiny_batch(name, N), _other_batch(name)
        ref = clone(base)
        _, ref_loss = reference(ref, name, batch)
        ref_loss.backward()
        ref_a = _ref_grads(ref)
        ref = clone(base)
        _, ref_loss_b = reference(ref, name, other)
        ref_loss_b.backward()
        ref_b = _ref_grads(ref)

        def checkpointed(reentrant: bool):
            model = apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")
            model.train()
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:  # transformers < 5.24
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            return model

        def interleaved(model):  # forward, no_grad forward of another batch, backward
            loss = model(**shard_inputs(batch, model)).loss
            with torch.no_grad():
                model(**shard_inputs(other, model))
            loss.backward()
            return max(abs(float(loss.detach() - ref_loss.detach())), _dict_diff(_global_grads(model, group), ref_a))

        def two_alive(model):  # forward A, forward B, backward B, backward A
            loss_a = model(**shard_inputs(batch, model)).loss
            loss_b = model(**shard_inputs(other, model)).loss
            loss_b.backward()
            diff_b = _dict_diff(_global_grads(model, group), ref_b)
            model.zero_grad(set_to_none=True)
            loss_a.backward()
            return max(diff_b, _dict_diff(_global_grads(model, group), ref_a))

        layout = _sp_modules(apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring"))[0].layout
        # the interleaved batch passes the shard-size check: only its facts (length, documents) differ
        assert padded_length(N, world, layout) == padded_length(OTHER_N, world, layout)
        for reentrant in (False, True):
            out[(name, reentrant, "interleaved")] = interleaved(checkpointed(reentrant))
            out[(name, reentrant, "two_alive")] = two_alive(checkpointed(reentrant))
            model = checkpointed(reentrant)
            control = _SharedInfoControl(model)
            try:
                out[(name, reentrant, "control")] = interleaved(model)
            except Exception as err:  # noqa: BLE001 - the old behaviour may also trip torch's own recompute check
                out[(name, reentrant, "control")] = f"{type(err).__name__}: {err}"[:200]
            finally:
                control.remove()
        model = checkpointed(False)
        control = _SharedInfoControl(model)
        try:
            out[(name, "two_alive_control")] = two_alive(model)
        except Exception as err:  # noqa: BLE001
            out[(name, "two_alive_control")] = f"{type(err).__name__}: {err}"[:200]
        finally:
            control.remove()
    # a model whose forward does not hand **kwargs down to its attention: refused under checkpointing
    from tests.hf_tiny import registry_model, sweep_batch

    nemotron, masked = registry_model("nemotron")
    model = apply_sequence_parallel(nemotron, group=group, backend="zigzag_ring")
    model.train()
    model.gradient_checkpointing_enable()
    try:
        model(**shard_inputs(sweep_batch(masked), model))
        out["no_kwargs_refused"] = ""
    except NotImplementedError as err:
        out["no_kwargs_refused"] = str(err)
    out["running_after_refusal"] = len(model._lightning_sp_state.forwards)  # the refused forward left no entry
    return out


def _labels_cases(world: int) -> dict:
    """``model(**shard)`` with the labels ``shard_inputs`` returned (HF Trainer's call) vs the unsharded
    ``model(**batch)``: loss and gradients, with padding and with ``num_items_in_batch``; the control is
    HF's own loss on the shard (labels shifted again inside it, the shard's own mean)."""
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import _STATE_ATTR, _State, apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import KeepFloat64, clone, tiny_batch, tiny_model, tiny_rows

    group = dist.group.WORLD
    out: dict = {}
    with KeepFloat64():  # HF's loss upcasts logits with .float(): kept float64 in the reference
        for name in ("llama", "esm"):
            base = tiny_model(name)
            for padded in (False, True):
                batch = tiny_batch(name, N_REAL_PADDED if padded else N, pad_to=N if padded else None)
                for num_items in (None, NUM_ITEMS):
                    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
                    ref = clone(base)
                    ref_loss = ref(**batch, **extra).loss
                    ref_loss.backward()
                    model = apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")
                    shard = shard_inputs(batch, model)
                    loss = model(**shard, **extra).loss
                    loss.backward()
                    out[(name, padded, num_items)] = {
                        "loss": abs(float(loss.detach() - ref_loss.detach())),
                        "grads": _dict_diff(_global_grads(model, group), _ref_grads(ref)),
                    }
                    with torch.no_grad():  # return_dict=False: the loss first, as HF's tuples have it
                        as_tuple = model(**shard, **extra, return_dict=False)
                    out[(name, padded, num_items)]["tuple"] = abs(float(as_tuple[0] - ref_loss.detach()))
                    # control: HF's loss inside the shard (what model(**shard) gave before), averaged over ranks
                    with torch.no_grad():
                        logits = model(**{k: v for k, v in shard.items() if k != "labels"}).logits
                        hf_loss = type(model).loss_function.fget(model)(
                            logits=logits, labels=shard["labels"], vocab_size=model.config.vocab_size, **extra)
                    dist.all_reduce(hf_loss, group=group)
                    out[(name, padded, num_items)]["control"] = abs(float(hf_loss / world - ref_loss.detach()))
        # no group (local attention, as under plain DDP): shard_inputs' labels are shifted all the same
        base = tiny_model("llama")
        batch = tiny_batch("llama", N_REAL_PADDED, pad_to=N)
        ref = clone(base)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        model = apply_sequence_parallel(clone(base))
        shard = shard_inputs(batch, model)
        loss = model(**shard).loss
        loss.backward()
        with torch.no_grad():
            hf_loss = type(model).loss_function.fget(model)(
                logits=model(**{k: v for k, v in shard.items() if k != "labels"}).logits, labels=shard["labels"],
                vocab_size=model.config.vocab_size)
        out["local"] = {"loss": abs(float(loss.detach() - ref_loss.detach())), "tuple": 0.0, "control": abs(float(hf_loss - ref_loss)),
                        "grads": _dict_diff(_ref_grads(model), _ref_grads(ref))}
        # a deep copy of an applied model (an EMA / SWA copy; unbound: a process group cannot be copied) keeps
        # to its own state: ESM's embeddings read the running forward's token-dropout ratio of each packed row
        base = tiny_model("esm")
        batch = tiny_rows("esm", ROW_LENGTHS, pad_to=N)
        ref = clone(base)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        model = clone(apply_sequence_parallel(clone(base)))
        loss = model(**shard_inputs(batch, model)).loss
        loss.backward()
        out["deep_copy"] = max(abs(float(loss.detach() - ref_loss.detach())), _dict_diff(_ref_grads(model), _ref_grads(ref)))
        for module in model.modules():  # control: embeddings reading a state no hook of this copy writes
            if type(module).__name__ == "EsmEmbeddings":
                setattr(module, _STATE_ATTR, _State())
        with torch.no_grad():
            out["deep_copy_control"] = abs(float(model(**shard_inputs(batch, model)).loss - ref_loss))
        model = apply_sequence_parallel(clone(tiny_model("llama")), group=group, backend="zigzag_ring")
        try:
            model(**shard_inputs(tiny_batch("llama", N), model) | {"labels": tiny_batch("llama", N)["labels"]})
            out["global_labels_refused"] = ""
        except ValueError as err:
            out["global_labels_refused"] = str(err)
    return out


def _peft_cases(world: int) -> dict:
    """A PEFT-like model (``tests.hf_tiny.lora_like``: LoRA adapters on q/v, the PeftModel/tuner wrappers)
    accepted by apply_sequence_parallel and exact; prompt learning refused; the real ``peft`` too where installed."""
    import torch.distributed as dist

    from lightning_sp.integrations.transformers import apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import KeepFloat64, clone, lora_like, tiny_batch, tiny_model

    group = dist.group.WORLD
    out: dict = {}

    def compare(wrapped, name, batch, ref=None):
        ref = clone(wrapped) if ref is None else ref
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        model = apply_sequence_parallel(wrapped, group=group, backend="zigzag_ring")
        assert model is wrapped
        loss = model(**shard_inputs(batch, model)).loss
        loss.backward()
        grads = _global_grads(model, group)
        trainable = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
        assert trainable and all(n in grads for n in trainable)
        return {"loss": abs(float(loss.detach() - ref_loss.detach())), "grads": _dict_diff(grads, trainable),
                "moved": max(float(g.abs().max()) for g in trainable.values())}

    with KeepFloat64():  # HF's causal-LM loss upcasts logits with .float(): kept float64 in the reference
        for name in ("llama", "esm"):
            targets = ("q_proj", "v_proj") if name == "llama" else ("query", "value")
            out[name] = compare(lora_like(tiny_model(name), targets=targets), name, tiny_batch(name, N_REAL_PADDED, pad_to=N))
        # apply_sequence_parallel before the adapters are added (the order get_peft_model users may pick)
        sharded_first = lora_like(apply_sequence_parallel(tiny_model("llama"), group=group, backend="zigzag_ring"))
        out["applied_first"] = compare(sharded_first, "llama", tiny_batch("llama", N), ref=lora_like(tiny_model("llama")))
    try:
        apply_sequence_parallel(lora_like(tiny_model("llama"), prompt_learning=True), group=group, backend="ring")
        out["prompt_learning_refused"] = ""
    except NotImplementedError as err:
        out["prompt_learning_refused"] = str(err)
    try:
        import peft
    except ImportError:
        out["real_peft"] = None
    else:
        lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                         init_lora_weights=False))
        with KeepFloat64():
            out["real_peft"] = compare(lora, "llama", tiny_batch("llama", N_REAL_PADDED, pad_to=N))
    return out


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "huggingface-finetuning.md"
GUIDE_BLOCKS = ("ft trainer-style", "ft accumulation", "ft checkpointing", "ft peft", "ft padding")


def guide_block(marker: str) -> str:
    """The python code block that follows ``<!-- test: <marker> ...-->`` in the fine-tuning guide."""
    match = re.search(rf"<!-- test: {re.escape(marker)}[^>]*-->\s*```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert match, f"{GUIDE.name} has no block marked '{marker}'"
    return match.group(1)


def _stand_in_peft():
    """A ``peft`` module of ``LoraConfig`` / ``get_peft_model`` over ``tests.hf_tiny.lora_like``, for the guide's
    block where the real package is not installed."""
    import types

    from tests.hf_tiny import lora_like

    module = types.ModuleType("peft")

    class LoraConfig:
        def __init__(self, r=8, target_modules=()):
            self.r, self.target_modules = r, tuple(target_modules)

    module.LoraConfig = LoraConfig
    module.get_peft_model = lambda model, config: lora_like(model, targets=config.target_modules)
    return module


def _guide_recipes(world: int) -> dict:
    """Each block of docs/guides/huggingface-finetuning.md, executed as written, vs the unsharded model:
    ``{block: max(|loss - ref|, max |grad - ref|)}``."""
    import sys

    import torch.distributed as dist

    from lightning_sp.integrations.transformers import apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import KeepFloat64, clone, reference, tiny_batch, tiny_model

    group = dist.group.WORLD
    base = tiny_model("llama")
    batch = tiny_batch("llama", N_REAL_PADDED, pad_to=N)
    out: dict = {}

    def run(marker: str, scope: dict) -> dict:
        scope.update(torch=torch, sp_group=group, shard_inputs=shard_inputs, apply_sequence_parallel=apply_sequence_parallel)
        exec(compile(guide_block(marker), GUIDE.name, "exec"), scope)  # noqa: S102 - the guide's own code
        return scope

    def diff(loss, ref_loss, model, ref) -> float:
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        return max(abs(float(loss.detach() - ref_loss.detach())), _dict_diff(_global_grads(model, group), ref_grads))

    with KeepFloat64():
        ref = clone(base)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        scope = run("ft trainer-style", {"model": clone(base), "batch": batch})
        out["ft trainer-style"] = diff(scope["out"].loss, ref_loss, scope["model"], ref)

        micro_batches = [batch, tiny_batch("llama", N, seed=3)]
        ref = clone(base)
        num_items = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
        ref_losses = [ref(**b, num_items_in_batch=num_items).loss for b in micro_batches]
        sum(ref_losses).backward()
        model = apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")
        scope = run("ft accumulation", {"model": model, "micro_batches": micro_batches})
        out["ft accumulation"] = diff(scope["loss"], ref_losses[-1], model, ref)

        padded_ref = clone(base)
        scope = run("ft padding", {"model": apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")})
        padded_ref_loss = padded_ref(**scope["batch"]).loss
        padded_ref_loss.backward()
        out["ft padding"] = diff(scope["loss"], padded_ref_loss, scope["model"], padded_ref)

        real_peft = sys.modules.get("peft")
        try:
            import peft  # noqa: F401
        except ImportError:
            sys.modules["peft"] = _stand_in_peft()
        try:
            torch.manual_seed(5)
            ref = sys.modules["peft"].get_peft_model(clone(base), sys.modules["peft"].LoraConfig(
                r=8, target_modules=["q_proj", "v_proj"]))
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            torch.manual_seed(5)
            scope = run("ft peft", {"model": clone(base), "batch": batch})
            out["ft peft"] = diff(scope["loss"], ref_loss, scope["model"], ref)
        finally:
            if real_peft is None:
                sys.modules.pop("peft", None)

    # gradient checkpointing recomputes outside KeepFloat64's reach: float64 reference loss of its own
    ref = clone(base)
    _, ref_loss = reference(ref, "llama", batch)
    ref_loss.backward()
    model = apply_sequence_parallel(clone(base), group=group, backend="zigzag_ring")
    scope = run("ft checkpointing", {"model": model, "batch": batch, "eval_batch": _other_batch("llama")})
    out["ft checkpointing"] = diff(scope["loss"], ref_loss, model, ref)
    return out


def _worker(rank: int, world: int) -> dict:
    from tests.hf_tiny import KeepFloat64

    torch.manual_seed(0)
    with KeepFloat64():  # HF's own float32 roundings stay float64 in the reference and the sharded runs alike
        grid = _exactness_grid(world)
    res = {"grid": grid, "misc": _unbound_and_misuse(world), "readme": _readme_recipe(world),
           "checkpointing": _checkpointing_cases(world), "labels": _labels_cases(world), "peft": _peft_cases(world),
           "guide": _guide_recipes(world)}
    if world == 2:
        res["roberta"] = _roberta_cumsum_positions(world)
        res["trainer"] = _train_with_trainer(world)
    return res


def _spawn(world: int):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return world, run_on_ranks(_worker, world, timeout_s=420, pg_timeout_s=60)


@pytest.fixture(scope="module")
def results_p2():
    return _spawn(2)


@pytest.fixture(scope="module")
def results_p4():
    return _spawn(4)


@pytest.fixture(params=[2, 4], ids=lambda p: f"P{p}")
def results(request):
    return request.getfixturevalue(f"results_p{request.param}")


CASES = [(m, p, b) for m in MODELS for p in (False, True) for b in BACKENDS] + [
    (m, "rows", b) for m in MODELS for b in PACKED_BACKENDS]


def test_every_model_backend_and_mask_exact(results):
    world, per_rank = results
    failures = []
    for rank, res in enumerate(per_rank):
        for case in CASES:
            d = res["grid"][case]
            for key in ("logits", "loss", "grads"):
                if not d[key] < TOL:
                    failures.append(f"P={world} rank {rank} {case} {key}: {d[key]:.3e}")
    assert not failures, "\n".join(failures)


def test_negative_controls_miss(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for name in MODELS:
            for padded in (False, True):
                controls = res["grid"][(name, padded, "controls")]
                assert len(controls) == 2, controls
                for trap, diff in controls.items():
                    assert diff > MISS, f"P={world} rank {rank} {name} padded={padded}: control {trap} only differs by {diff:.3e}"


def test_roberta_cumsum_positions_exact(results_p2):
    _, per_rank = results_p2
    for res in per_rank:
        r = res["roberta"]
        assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
        assert r["control"] > MISS, r


def test_lightning_module_trains_like_one_process(results_p2):
    _, per_rank = results_p2
    for rank, res in enumerate(per_rank):
        t = res["trainer"]
        assert t["moved"] > 1e-2, f"training barely moved the parameters ({t['moved']:.3e}): comparison is vacuous"
        assert t["diff"] < TOL, f"rank {rank}: max |param - one-process| = {t['diff']:.3e}"


def test_unbound_model_is_local_under_a_process_group(results):
    world, per_rank = results
    for res in per_rank:
        assert res["misc"]["unbound_len"] == N_REAL_PADDED  # not sharded; right padding dropped
        assert res["misc"]["unbound"] < TOL


def test_hf_gradient_checkpointing_exact(results):
    world, per_rank = results
    for res in per_rank:
        assert res["misc"]["checkpointed"] < TOL


def test_sharded_call_without_shard_info_refused(results):
    world, per_rank = results
    for res in per_rank:
        assert "shard_inputs(global_batch, model)" in res["misc"]["no_info_error"]


def test_readme_standalone_recipe_exact(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for name, diff in res["readme"].items():
            assert diff < TOL, f"P={world} rank {rank} {name}: README recipe differs by {diff:.3e}"


def _misses(diff) -> bool:
    """A negative control's outcome: a difference above MISS (NaN counts: a shard with no labels makes HF's
    own mean NaN), or the old behaviour tripping torch's own recompute check."""
    return isinstance(diff, str) or not diff <= MISS


def test_checkpointing_with_interleaved_forwards_exact(results):
    """Gradient checkpointing (reentrant and not): a no_grad forward of another batch between forward and
    backward, and two forwards alive with backward in reverse order, give the unsharded gradients; the
    same check with one ShardInfo slot shared by the whole model misses."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        ck = res["checkpointing"]
        for name in ("llama", "esm"):
            for reentrant in (False, True):
                for case in ("interleaved", "two_alive"):
                    diff = ck[(name, reentrant, case)]
                    assert diff < TOL, f"P={world} rank {rank} {name} reentrant={reentrant} {case}: {diff:.3e}"
                control = ck[(name, reentrant, "control")]
                assert _misses(control), f"P={world} rank {rank} {name} reentrant={reentrant}: shared-slot control {control}"
            assert _misses(ck[(name, "two_alive_control")]), (world, rank, name, ck[(name, "two_alive_control")])


def test_checkpointing_refused_where_kwargs_do_not_reach_attention(results):
    world, per_rank = results
    for res in per_rank:
        message = res["checkpointing"]["no_kwargs_refused"]
        assert "NemotronAttention gets no keyword arguments" in message and "gradient_checkpointing_disable" in message
        assert res["checkpointing"]["running_after_refusal"] == 0


def test_model_call_with_shard_labels_exact(results):
    """model(**shard) with shard_inputs' labels (HF Trainer's call): loss (also as return_dict=False's first
    item) and gradients equal the unsharded model(**batch), with padding and num_items_in_batch; HF's own
    loss inside the shard (labels shifted again, the shard's own mean) misses."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        lab = res["labels"]
        for name in ("llama", "esm"):
            for padded in (False, True):
                for num_items in (None, NUM_ITEMS):
                    d = lab[(name, padded, num_items)]
                    case = f"P={world} rank {rank} {name} padded={padded} num_items={num_items}"
                    assert max(d["loss"], d["grads"], d["tuple"]) < TOL, f"{case}: {d}"
                    assert _misses(d["control"]), f"{case}: control only {d['control']:.3e}"
        d = lab["local"]
        assert max(d["loss"], d["grads"]) < TOL and _misses(d["control"]), f"rank {rank} without a group: {d}"
        assert lab["deep_copy"] < TOL, f"rank {rank}: a deep copy of the applied ESM differs by {lab['deep_copy']:.3e}"
        assert _misses(lab["deep_copy_control"]), lab["deep_copy_control"]
        assert "pass model(**shard) the labels shard_inputs returned" in lab["global_labels_refused"]


def test_peft_model_accepted_and_exact(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        peft = res["peft"]
        for name in ("llama", "esm", "applied_first"):
            d = peft[name]
            assert d["moved"] > 1e-3, f"adapter gradients too small to compare: {d}"
            assert d["loss"] < TOL and d["grads"] < TOL, f"P={world} rank {rank} {name}: {d}"
        if peft["real_peft"] is not None:  # peft installed: the real get_peft_model(LoRA) too
            assert peft["real_peft"]["loss"] < TOL and peft["real_peft"]["grads"] < TOL, peft["real_peft"]
        assert "prompt learning" in peft["prompt_learning_refused"]


def test_finetuning_guide_recipes_exact(results):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        assert set(res["guide"]) == set(GUIDE_BLOCKS)
        for block, diff in res["guide"].items():
            assert diff < TOL, f"P={world} rank {rank}: the guide's {block!r} differs by {diff:.3e}"
