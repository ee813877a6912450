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
"""

from __future__ import annotations

import os

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


def _worker(rank: int, world: int) -> dict:
    from tests.hf_tiny import KeepFloat64

    torch.manual_seed(0)
    with KeepFloat64():  # HF's own float32 roundings stay float64 in the reference and the sharded runs alike
        grid = _exactness_grid(world)
    res = {"grid": grid, "misc": _unbound_and_misuse(world), "readme": _readme_recipe(world)}
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
