"""A GPU job's collectives, on 4 CPU ranks whose process group, like NCCL, refuses tensors of another device.

Every rank's default group is a ``StrictDeviceGroup`` (tests/stand_ins/device_group.py): its device is the
stand-in accelerator ``standin``, and a collective given a CPU tensor raises NCCL's "No backend type
associated with device type cpu". Through it run the paths a job on GPUs takes (Note [Collectives on the
group's device] in ``lightning_sp/comm/device.py``):

- checkpoints: ``is_sharded_checkpoint`` (what ``fit(ckpt_path=...)`` asks first) on a directory, a file and
  a path that is a directory on some ranks only; a sharded save (its save id broadcast, DCP's own
  collectives) and the resume from it, exact;
- the cross-rank agreement (``gather_rows``, for a model on another device than the group's too), the batch
  agreement the strategy runs each step, ``backend="auto"``'s agreed measurement and cache, the agreed
  memory budget of ``kv_pieces="auto"``;
- attention (every backend) forward and backward on stand-in tensors against dense fp64 attention, and the
  sequence-parallel loss and its gradient against the one-process loss (``backend="auto"`` inside attention
  draws random inputs on the device, which needs a generator the Python stand-in device cannot register: its
  agreement is run through ``choices.agreed_fastest`` above);
- negative control: the CPU-tensor ``_gather_ints`` and ``_broadcast_from_first`` the checkpoint module had
  fail through the stand-in, as they would on NCCL.

One spawn of 4 ranks; the cases run in order and each records its own outcome.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch

from tests.distributed.harness import run_on_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORLD = 4


def _old_gather_ints(value, process_group):  # the checkpoint module's before: CPU tensors on any group
    import torch.distributed as dist

    from lightning_sp.comm.release import collective

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(process_group))]
    collective(dist.all_gather, out, torch.tensor([value], dtype=torch.int64), group=process_group)
    return [int(v) for v in out]


def _old_broadcast_from_first(value, process_group):
    import torch.distributed as dist

    from lightning_sp.comm.release import collective

    t = torch.tensor([value], dtype=torch.int64)
    collective(dist.broadcast, t, src=0, group=process_group)
    return int(t)


BACKENDS = ("ring", "zigzag_ring", "ulysses", "allgather_kv", "usp")


def _attention_errors(backend, group, n=32, h=4, h_kv=2, d=8):
    """(the output's device, the gradient's, max |error| of out, dq, dk, dv against dense fp64 attention) for
    stand-in tensors."""
    from lightning_sp import SequenceParallelAttention, shard_sequence
    from tests.reference import dense_attention

    attn = SequenceParallelAttention(causal=True, backend=backend, group=group, kernel="torch")
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, n, x, d, generator=g, dtype=torch.float64) for x in (h, h_kv, h_kv, h))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qr, kr, vr, causal=True)
    ref.backward(dout)
    ql, kl, vl, dl = (shard_sequence(t, group, layout=attn.layout).to("standin") for t in (q, k, v, dout))
    ql, kl, vl = (t.detach().requires_grad_() for t in (ql, kl, vl))
    out = attn(ql, kl, vl, seq_len=n)
    out.backward(dl)
    errors = [(mine.detach().cpu() - shard_sequence(full.detach(), group, layout=attn.layout)).abs().max().item()
              for mine, full in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))]
    return str(out.device), str(ql.grad.device), max(errors)


def _worker(rank, world, tmpdir):
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from tests.stand_ins.device_group import BACKEND, install

    install()
    dist.destroy_process_group()  # the harness's gloo world: replaced by the stand-in
    dist.init_process_group(BACKEND, store=dist.FileStore(os.path.join(tmpdir, "store"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    from lightning_sp import checkpoint, choices
    from lightning_sp.comm.agree import gather_rows
    from lightning_sp.comm.device import group_device

    world_group = dist.group.WORLD
    sp_groups = [dist.new_group([0, 1], backend=BACKEND), dist.new_group([2, 3], backend=BACKEND)]
    sp_group = sp_groups[rank // 2]
    out = {}

    def case(name, fn):
        try:
            out[name] = ("ok", fn())
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - recorded, asserted in the parent
            out[name] = ("raised", f"{type(err).__name__}: {err}", traceback.format_exc(limit=-3))

    # the stand-in is in force: the group's device is not the CPU, and a CPU tensor is refused
    case("group_device", lambda: (str(group_device(world_group)), str(group_device(sp_group, torch.device("cpu")))))
    case("cpu_all_reduce", lambda: dist.all_reduce(torch.ones(1), group=world_group))
    case("mixed_devices_op", lambda: torch.ones(3, device="standin") + torch.ones(3))

    # negative control: the old CPU-tensor helpers
    case("old_gather_ints", lambda: _old_gather_ints(rank, world_group))
    case("old_broadcast_from_first", lambda: _old_broadcast_from_first(rank, world_group))
    case("gather_ints", lambda: checkpoint._gather_ints(rank, world_group))
    case("broadcast_from_first", lambda: checkpoint._broadcast_from_first(rank + 7, sp_group))

    # checkpoints: the kind of a path, a sharded save and its resume
    shared = os.path.join(tmpdir, "shared")
    os.makedirs(os.path.join(shared, "a_dir"), exist_ok=True)
    open(os.path.join(shared, "a_file.ckpt"), "w").close()
    case("sharded_dir", lambda: checkpoint.is_sharded_checkpoint(os.path.join(shared, "a_dir")))
    case("sharded_file", lambda: checkpoint.is_sharded_checkpoint(os.path.join(shared, "a_file.ckpt")))
    case("sharded_split", lambda: checkpoint.is_sharded_checkpoint(
        os.path.join(shared, "a_dir" if rank % 2 else "a_file.ckpt")))

    def save_and_resume():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
        path = os.path.join(shared, "step=1.ckpt")
        checkpoint.save(path, checkpoint.model_state(model), {"epoch": 1, "global_step": 1})
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double()
        before = max((a - b).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters()))
        assert checkpoint.is_sharded_checkpoint(path)
        checkpoint.load(path, checkpoint.model_state(fresh))
        after = max((a - b).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters()))
        return before, after, checkpoint.load_meta(path)["global_step"]

    case("save_and_resume", save_and_resume)

    # the cross-rank agreement, for a group's own device and for a model on the CPU
    case("gather_rows", lambda: gather_rows((rank, 2.5), sp_group, device=torch.device("cpu")))
    case("gather_rows_standin", lambda: gather_rows((rank,), world_group, device=torch.device("standin", 0)))

    def batch_agreement():
        from types import SimpleNamespace

        from lightning_sp.batch_sharding import BatchSharder
        from lightning_sp.topology import ParallelDims

        dims = ParallelDims(world_size=world, sequence_parallel_size=2)
        sharder = BatchSharder(SimpleNamespace(parallel_dims=dims))
        sharder.agree_only({"input_ids": torch.zeros(1, 8 if rank != 3 else 9, dtype=torch.long, device="standin")})

    case("batch_agreement", batch_agreement)

    # backend="auto": the agreed measurement, then the cache; kv_pieces="auto": the agreed budget
    os.environ["LIGHTNING_SP_CACHE_DIR"] = os.path.join(tmpdir, "cache")  # one node: rank 0 writes it
    standin = torch.device("standin", 0)
    case("auto_measured", lambda: choices.agreed_fastest("key", ["a", "b"], lambda label: None, world_group, standin))
    dist.barrier(group=world_group)  # rank 0 has written the cache (a new process reads it: here the next call)
    case("auto_cached", lambda: choices.agreed_fastest("key", ["a", "b"], lambda label: None, world_group, standin))
    case("budget", lambda: choices.agreed_min(1000 + rank, sp_group, torch.device("cpu")))

    # attention and the loss on stand-in tensors
    for backend in BACKENDS:
        group = world_group if backend == "usp" else sp_group  # usp on a sub-group needs the strategy's sub-groups
        case(f"attention_{backend}", lambda backend=backend, group=group: _attention_errors(backend, group))

    def loss():
        from lightning_sp import shard_sequence
        from lightning_sp.loss import sequence_parallel_cross_entropy

        g = torch.Generator().manual_seed(5)
        logits = torch.randn(2, 12, 7, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 7, (2, 12), generator=g)
        labels[0, :3] = -100
        full = logits.clone().requires_grad_()
        ref = torch.nn.functional.cross_entropy(full.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
        ref.backward()
        mine = shard_sequence(logits, sp_group).to("standin").requires_grad_()
        value = sequence_parallel_cross_entropy(mine, shard_sequence(labels, sp_group).to("standin"), group=sp_group)
        value.backward()
        grad_err = (mine.grad.cpu() - 2 * shard_sequence(full.grad, sp_group)).abs().max().item()  # summed over 2 ranks
        return str(value.device), abs(value.item() - ref.item()), grad_err

    case("loss", loss)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_worker, WORLD, args=(str(tmp_path_factory.mktemp("group_device")),), timeout_s=400,
                        pg_timeout_s=60)


def _ok(results, name):
    for rank, r in enumerate(results):
        assert r[name][0] == "ok", (rank, name, r[name])
    return [r[name][1] for r in results]


def _raised(results, name):
    for rank, r in enumerate(results):
        assert r[name][0] == "raised", (rank, name, r[name])
    return [r[name][1] for r in results]


def test_the_stand_in_refuses_cpu_tensors_as_nccl_does(results):
    assert _ok(results, "group_device") == [("standin:0", "standin:0")] * WORLD
    for message in _raised(results, "cpu_all_reduce"):
        assert "No backend type associated with device type cpu" in message, message
    for message in _raised(results, "mixed_devices_op"):
        assert "Expected all tensors to be on the same device" in message, message


def test_negative_control_the_old_cpu_tensor_helpers_fail(results):
    for name in ("old_gather_ints", "old_broadcast_from_first"):
        for message in _raised(results, name):
            assert "No backend type associated with device type cpu" in message, message


def test_checkpoint_agreements_run_on_the_groups_device(results):
    assert _ok(results, "gather_ints") == [[0, 1, 2, 3]] * WORLD
    assert _ok(results, "broadcast_from_first") == [7, 7, 9, 9]
    assert _ok(results, "sharded_dir") == [True] * WORLD
    assert _ok(results, "sharded_file") == [False] * WORLD
    for message in _raised(results, "sharded_split"):
        assert "CheckpointError" in message and "directory on rank(s) [1, 3]" in message, message


def test_sharded_save_resumes_exactly(results):
    for before, after, step in _ok(results, "save_and_resume"):
        assert before > 1e-3 and after == 0.0 and step == 1, (before, after, step)


def test_agreement_batch_check_auto_and_budget(results):
    assert _ok(results, "gather_rows") == [[[0, 2.5], [1, 2.5]]] * 2 + [[[2, 2.5], [3, 2.5]]] * 2
    assert _ok(results, "gather_rows_standin") == [[[0], [1], [2], [3]]] * WORLD
    for message in _raised(results, "batch_agreement"):  # rank 3's batch differs from rank 2's: all raise
        assert "ValueError" in message and "seq_len: 8 on rank [2]; 9 on rank [3]" in message, message
    measured = _ok(results, "auto_measured")
    assert all(m[0] == measured[0][0] and m[1] == measured[0][1] for m in measured) and measured[0][1] is not None
    assert _ok(results, "auto_cached") == [(measured[0][0], None)] * WORLD
    assert _ok(results, "budget") == [1000, 1000, 1002, 1002]


def test_attention_and_loss_on_the_stand_in_device_are_exact(results):
    for backend in BACKENDS:
        for out_device, grad_device, err in _ok(results, f"attention_{backend}"):
            assert out_device == grad_device == "standin:0" and err < 1e-12, (backend, err)
    for device, loss_err, grad_err in _ok(results, "loss"):
        assert device == "standin:0" and loss_err < 1e-14 and grad_err < 1e-14, (loss_err, grad_err)
