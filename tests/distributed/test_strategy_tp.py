"""``SequenceParallelStrategy(tensor_parallel_size=t)`` through a real Trainer on 4 gloo ranks, float64:
the demo models (GQA, vocabularies 31 and 279, length 13: divided by no degree) trained under tp=4,
tp=2 x dp=2 (DDP), tp=2 x cp=2 (zigzag ring, Ulysses) and tp=2 x dp=2 (FSDP2) equal a plain
one-process PyTorch loop (same AdamW + warmup) to 1e-10, by changing the strategy only. Also: FSDP
``trainer.validate()`` after ``fit()`` (a re-broadcast crash once) and the mesh groups.

tp x cp x dp needs 8 ranks, more than this 2-core machine runs: its rank layout is covered by the
pure topology tests (tests/unit/test_topology_tp.py) and the mesh built on a fake 8-rank group
(tests/unit/test_mesh_eight_ranks.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
SEQ_LEN = 13
STEPS = 3
TOL = 1e-10
N_SAMPLES = 8


def _c(name, model, tp, sp, *, backend="zigzag_ring", dp="ddp", b=1, validate=False, clip=None):
    return dict(name=name, model=model, tp=tp, sp=sp, backend=backend, dp=dp, b=b, validate=validate, clip=clip)


CASES = [  # clip: gradient clipping active (global norm ~1 >> 0.05): the norm must be the whole model's
    _c("tp4/protein+clip", "protein", 4, 1, b=2, clip=0.05),
    _c("tp2xdp2/ddp/decoder", "decoder", 2, 1),
    _c("tp2xcp2/zigzag_ring/decoder", "decoder", 2, 2, b=2),
    _c("tp2xcp2/ulysses/protein", "protein", 2, 2, backend="ulysses", b=2),
    _c("tp2xdp2/fsdp/decoder+validate+clip", "decoder", 2, 1, dp="fsdp", validate=True, clip=0.05),
    _c("cp2xdp2/fsdp/protein+validate", "protein", 1, 2, dp="fsdp", validate=True),
]


def _make(kind: str):
    from lightning_sp.models import MultimodalDecoder, ProteinEncoder

    torch.manual_seed(1234)
    if kind == "protein":  # bidirectional, vocabulary 31, 8 query / 4 key-value heads
        return ProteinEncoder(d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, lr=1e-2, warmup_steps=2)
    return MultimodalDecoder(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, lr=1e-2, warmup_steps=2)


def _data(vocab: int, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        labels = torch.randint(vocab, (SEQ_LEN,), generator=g)
        labels[: i % 3] = -100  # ignored tokens; each replica's loss is the mean over its own tokens
        out.append({"input_ids": torch.randint(vocab, (SEQ_LEN,), generator=g), "labels": labels})
    return out


def _replica_batches(cfg: dict, n: int) -> list[list[list[int]]]:
    """Per optimizer step, the sample indices of every dp replica (unshuffled DistributedSampler)."""
    from torch.utils.data import DistributedSampler

    dp = WORLD // (cfg["tp"] * cfg["sp"])
    per = [list(DistributedSampler(range(n), num_replicas=dp, rank=r, shuffle=False)) for r in range(dp)]
    b = cfg["b"]
    return [[per[r][t * b:(t + 1) * b] for r in range(dp)] for t in range(len(per[0]) // b)]


def _replica_mean_loss(model, data, replicas: list[list[int]]) -> torch.Tensor:
    """What the strategy optimises: the mean over dp replicas of each replica's token-mean loss."""
    losses = []
    for idx in replicas:
        ids = torch.stack([data[i]["input_ids"] for i in idx])  # [b, N]
        labels = torch.stack([data[i]["labels"] for i in idx])
        logits = model(ids)  # [b, N, V]
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    return torch.stack(losses).mean()


def _reference(cfg: dict, data, val_data):
    from lightning_sp.models.base import make_optimizer

    model = _make(cfg["model"]).double()
    h = model.hparams
    conf = make_optimizer(model, h.lr, h.weight_decay, h.warmup_steps)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    for replicas in _replica_batches(cfg, len(data))[:STEPS]:
        loss = _replica_mean_loss(model, data, replicas)
        opt.zero_grad()
        loss.backward()
        if cfg["clip"] is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            assert norm > 2 * cfg["clip"], norm  # clipping is active: the case tests something
        opt.step()
        sched.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    val = None
    if val_data is not None:
        with torch.no_grad():
            val = _replica_mean_loss(model, val_data, _replica_batches(cfg, len(val_data))[0]).item()
    return params, val


def _full_params(module, tp: int, group) -> dict[str, torch.Tensor]:
    """Every parameter reassembled whole: FSDP shards gathered over dp x sp, tp slices over tp."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_sp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_range

    local = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}
    if tp == 1:
        return local
    t = tp

    def gather(x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(t)]
        dist.all_gather(sizes, torch.tensor([x.size(dim)]), group=group)
        width = max(int(s) for s in sizes)
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, width - x.size(dim)]
        parts = [torch.empty_like(F.pad(x, pad)) for _ in range(t)]
        dist.all_gather(parts, F.pad(x, pad).contiguous(), group=group)
        return [p.narrow(dim, 0, int(s)) for p, s in zip(parts, sizes)]

    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, ColumnParallelLinear):
            for pn in m.tensor_parallel_parameter_names():
                parts = gather(local[prefix + pn], 0)  # rank r: [seg_0 part r, seg_1 part r, ...]
                lens = [[b - a for a, b in (shard_range(n, t, r) for n in m.output_sizes)] for r in range(t)]
                local[prefix + pn] = torch.cat([parts[r].narrow(0, sum(lens[r][:k]), lens[r][k])
                                                for k in range(len(m.output_sizes)) for r in range(t)], 0)
        elif isinstance(m, RowParallelLinear):
            local[prefix + "weight"] = torch.cat(gather(local[prefix + "weight"], 1), 1)
        elif isinstance(m, VocabParallelEmbedding):
            local[prefix + "weight"] = torch.cat(gather(local[prefix + "weight"], 0), 0)
    return local


def _fit(cfg: dict, model, data, val_data, probe):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_sp.callbacks import SequenceParallelMonitor
    from lightning_sp.strategy import SequenceParallelStrategy

    os.environ["WORLD_SIZE"] = str(WORLD)
    strategy = SequenceParallelStrategy(
        cfg["sp"], backend=cfg["backend"], data_parallel=cfg["dp"], tensor_parallel_size=cfg["tp"],
        shuffle=False, process_group_timeout=60,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[probe, SequenceParallelMonitor()], gradient_clip_val=cfg["clip"],
    )
    trainer.fit(model, DataLoader(data, batch_size=cfg["b"], shuffle=False))
    val = None
    if val_data is not None:
        # a second Trainer stage on the same (FSDP-sharded, tp-split) model: used to crash re-broadcasting
        metrics = trainer.validate(model, DataLoader(val_data, batch_size=cfg["b"], shuffle=False), verbose=False)
        val = metrics[0]["Loss/val"]
    return trainer, val


def _probe():
    """Records the strategy's mesh groups and tp traffic at the end of fit (teardown destroys them)."""
    import lightning as L
    import torch.distributed as dist

    from lightning_sp.callbacks import SequenceParallelMonitor

    class Probe(L.Callback):
        seen: dict = {}

        def on_train_end(self, trainer, pl_module):
            s = trainer.strategy
            monitor = next(c for c in trainer.callbacks if isinstance(c, SequenceParallelMonitor))
            self.seen = {"groups": {a: dist.get_process_group_ranks(s._mesh.group(a)) for a in ("tp", "sp", "dp", "dp_sp")},
                         "comm": s.tensor_parallel_context.comm.total_bytes, "monitor": dict(monitor.last_metrics)}

    return Probe()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _worker(rank: int, world_size: int, tmpdir: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    import torch.distributed as dist

    from lightning_sp.topology import ParallelDims

    out: dict = {"diff": {}, "moved": {}, "val": {}, "groups": {}, "comm": {}}
    for cfg in CASES:
        dims = ParallelDims(world_size=WORLD, sequence_parallel_size=cfg["sp"], tensor_parallel_size=cfg["tp"])
        tp_groups = [dist.new_group(r) for r in dims.groups("tp")]  # the test's own, to reassemble tp slices
        tp_group = tp_groups[rank // cfg["tp"]]
        vocab = 31 if cfg["model"] == "protein" else 279
        data = _data(vocab, N_SAMPLES, 5)
        val_data = _data(vocab, dims.dp * cfg["b"], 6) if cfg["validate"] else None
        model = _make(cfg["model"])
        init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        probe = _probe()
        trainer, val = _fit(cfg, model, data, val_data, probe)
        ref, ref_val = _reference(cfg, data, val_data)
        got = _full_params(trainer.lightning_module, cfg["tp"], tp_group)
        out["diff"][cfg["name"]] = _max_diff(got, ref)
        out["moved"][cfg["name"]] = _max_diff(ref, init)
        if val is not None:
            out["val"][cfg["name"]] = (float(val), ref_val)
        out["groups"][cfg["name"]] = probe.seen["groups"]
        out["comm"][cfg["name"]] = probe.seen["comm"]
        out.setdefault("monitor", {})[cfg["name"]] = probe.seen["monitor"]
        for g in tp_groups:
            dist.destroy_process_group(g)
    out["resume"] = _resume_worker(rank, world_size, tmpdir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # one spawn for the module: training cases, then the resume cases
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_on_ranks(_worker, WORLD, args=(str(tmp_path_factory.mktemp("dcp")),), timeout_s=800, pg_timeout_s=60)


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_training_equals_one_process(results, name):
    for rank, res in enumerate(results):
        assert res["diff"][name] < TOL, f"rank {rank} {name}: max |param - reference| = {res['diff'][name]:.3e}"
        assert res["moved"][name] > 1e-3, f"{name}: training barely moved the parameters; comparison is vacuous"


def test_validate_after_fit(results):
    for res in results:
        assert set(res["val"]) == {c["name"] for c in CASES if c["validate"]}
        for name, (val, ref) in res["val"].items():
            assert abs(val - ref) < 1e-10, (name, val, ref)


def test_mesh_groups_tp_innermost(results):
    g = [r["groups"] for r in results]
    assert g[1]["tp2xcp2/zigzag_ring/decoder"] == {"tp": [0, 1], "sp": [1, 3], "dp": [1], "dp_sp": [1, 3]}
    assert g[2]["tp2xdp2/ddp/decoder"] == {"tp": [2, 3], "sp": [2], "dp": [0, 2], "dp_sp": [0, 2]}
    assert g[3]["tp4/protein+clip"] == {"tp": [0, 1, 2, 3], "sp": [3], "dp": [3], "dp_sp": [3]}
    assert all(r["comm"]["tp4/protein+clip"] > 0 for r in results)  # the tp collectives ran (and were counted)


def test_monitor_counts_tensor_parallel_traffic(results):
    for res in results:
        for cfg in CASES:
            m = res["monitor"][cfg["name"]]
            if cfg["tp"] == 1:  # negative control: no tensor-parallel traffic, no tp tags
                assert not any(k.startswith("communication/tp") for k in m), (cfg["name"], sorted(m))
                continue
            assert m.get("communication/tp_mib", 0) > 0, (cfg["name"], sorted(m))
            assert any(k.startswith("communication/tp/") for k in m), (cfg["name"], sorted(m))
            total = m["communication/tp_mib"] + m.get("communication/sp_mib", 0.0)
            assert m["communication/mib"] == pytest.approx(total), m
        # the monitor resets the counters every step: at the end of fit they hold the last step, which it logged
        m = res["monitor"]["tp4/protein+clip"]
        assert m["communication/tp_mib"] * 2**20 == res["comm"]["tp4/protein+clip"], (m, res["comm"])


# --------------------------------------------------------------------------- sharded checkpoints
# one epoch (2 optimizer steps, global batch 2) under the first layout, saved with
# torch.distributed.checkpoint; a second epoch resumed under the second layout
RESUME = [
    ("resume/protein tp2xdp2 fsdp -> tp4 ddp", _c("a", "protein", 2, 1, dp="fsdp"), _c("b", "protein", 4, 1, b=2)),
    ("resume/decoder tp2xcp2 ddp -> cp2xdp2 fsdp", _c("a", "decoder", 2, 2, b=2), _c("b", "decoder", 1, 2, dp="fsdp")),
]


def _fit_epochs(cfg, model, data, epochs, *, ckpt_in=None, ckpt_out=None):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_sp.strategy import SequenceParallelStrategy

    os.environ["WORLD_SIZE"] = str(WORLD)
    strategy = SequenceParallelStrategy(
        cfg["sp"], backend=cfg["backend"], data_parallel=cfg["dp"], tensor_parallel_size=cfg["tp"],
        shuffle=False, process_group_timeout=60, distributed_checkpoint=True,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=cfg["b"], shuffle=False), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return trainer


def _resume_worker(rank: int, world_size: int, tmpdir: str) -> dict:
    import torch.distributed as dist

    from lightning_sp.models.base import make_optimizer
    from lightning_sp.topology import ParallelDims

    out: dict = {"diff": {}, "moved": {}, "files": {}}
    for name, first, second in RESUME:
        vocab = 31 if first["model"] == "protein" else 279
        data = _data(vocab, 4, 9)
        path = os.path.join(tmpdir, name.replace("/", "_").replace(" ", "_"))
        _fit_epochs(first, _make(first["model"]), data, 1, ckpt_out=path)
        if rank == 0:
            out["files"][name] = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}
        fresh = _make(second["model"])
        with torch.no_grad():  # a different start: only the checkpoint can make it right
            for p in fresh.parameters():
                p.add_(1.0)
        trainer = _fit_epochs(second, fresh, data, 2, ckpt_in=path)
        dims = ParallelDims(world_size=WORLD, sequence_parallel_size=second["sp"], tensor_parallel_size=second["tp"])
        tp_groups = [dist.new_group(r) for r in dims.groups("tp")]
        got = _full_params(trainer.lightning_module, second["tp"], tp_groups[rank // second["tp"]])
        # reference: epoch 0 with the first layout's replicas, epoch 1 with the second's, one optimizer
        model = _make(first["model"]).double()
        h = model.hparams
        conf = make_optimizer(model, h.lr, h.weight_decay, h.warmup_steps)
        opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        for replicas in _replica_batches(first, len(data)) + _replica_batches(second, len(data)):
            loss = _replica_mean_loss(model, data, replicas)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        ref = {n: p.detach() for n, p in model.named_parameters()}
        out["diff"][name] = _max_diff(got, ref)
        out["moved"][name] = _max_diff(ref, {n: p.detach().double() for n, p in _make(first["model"]).named_parameters()})
        for g in tp_groups:
            dist.destroy_process_group(g)
    return out


@pytest.fixture(scope="module")
def resumed(results):
    return [r["resume"] for r in results]


@pytest.mark.parametrize("name", [r[0] for r in RESUME])
def test_resume_across_degrees_equals_uninterrupted(resumed, name):
    for rank, res in enumerate(resumed):
        assert res["diff"][name] < TOL, f"rank {rank} {name}: {res['diff'][name]:.3e}"
        assert res["moved"][name] > 1e-3


@pytest.mark.parametrize("name", [r[0] for r in RESUME])
def test_no_rank_writes_the_whole_state(resumed, name):
    files = resumed[0]["files"][name]
    shards = {f: n for f, n in files.items() if f.endswith(".distcp")}
    assert len(shards) == WORLD and "meta.pt" in files, files
    # every rank wrote its own chunks; none holds (close to) all of them
    assert max(shards.values()) < 0.6 * sum(shards.values()), shards
