"""The torchrun recipe survives a killed rank: ``scripts/torchrun_multinode.sh`` (``--max-restarts``) restarts
every rank of ``scripts/cluster_train.py`` and each resumes from its last checkpoint, mid-epoch, ending with
the parameters of a run that was never interrupted (float64, 1e-10).

One launch per checkpoint format, all at once with the one-process reference: a single file with sp=2 x dp=1,
a sharded directory with sp=1 x dp=2 (two replicas: the data module's ``DistributedSampler`` splits the
batch). Epochs of 3 steps, a checkpoint every 2 steps, a rank killed (``CLUSTER_TRAIN_FAULT``, torchrun's
first attempt only) between its forward and backward of step 6, in the middle of epoch 1; the restart resumes
from step 4, the second step of epoch 1. The sharded job's torchrun agent also gets SLURM's warning signal
(SIGUSR1), which it must survive.

The control: a bare gloo job (no Lightning) killed the same way and restarted by torchrun, with and without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; without it the restart fails (or stalls) in the process-group set-up
(pytorch #135712), which is why the node script sets it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import free_port
from tests.distributed.test_multinode import NODE_SCRIPT, ROOT, _kill_tree, _wait_all

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, CKPT_EVERY, FAULT_STEP = 8, 2, 5  # FAULT_STEP: global_step when the rank dies (the 6th step)
RESUME_STEP = FAULT_STEP - FAULT_STEP % CKPT_EVERY  # 4: the last checkpoint before the kill
TRAIN_ARGS = ["--n-images", "3", "--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--precision", "64-true",
              "--hardware", "h100-80gb", "--timeout", "60", "--global-batch-size", "2", "--steps", str(STEPS),
              "--samples-per-epoch", "6", "--ckpt-every", str(CKPT_EVERY), "--backend", "ring"]
JOBS = {  # name: (extra arguments, run name, the rank killed)
    "single": (["--sp", "2", "--ckpt-format", "single"], "ring-sp2-dp1", 1),
    "sharded": (["--sp", "1", "--ckpt-format", "sharded"], "ring-sp1-dp2", 0),
}
TOL = 1e-10
CONTROL_GRACE_S = 15  # the control's restart fails in seconds, or stalls on a port reused since

# a bare gloo job: init, a new group, a collective; on the first attempt rank 1 dies while rank 0 waits on it
BARE_WORKER = """
import datetime, os
import torch, torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
group = dist.new_group(list(range(dist.get_world_size())))
t = torch.ones(1)
dist.all_reduce(t, group=group)
if attempt == 0:
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(13)
    dist.all_reduce(t)
print(f"attempt {attempt}: rank {dist.get_rank()} trained", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("restarts")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable,
           "PYTHONWARNINGS": "ignore", "NNODES": "1", "NPROC_PER_NODE": "2", "MAX_RESTARTS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmds = {}
    for name, (extra, _, rank) in JOBS.items():
        args = [*TRAIN_ARGS, *extra, "--report", str(out / name / "report"), "--log-dir", str(out / name / "runs"),
                "--ckpt-dir", str(out / name / "ckpt")]
        cmds[name] = (["bash", str(NODE_SCRIPT), *args],
                      {**env, "MASTER_PORT": str(free_port()), "RDZV_ID": f"restart-{name}-{os.getpid()}",
                       "CLUSTER_TRAIN_FAULT": f"{rank}:{FAULT_STEP}"})
    cmds["reference"] = ([sys.executable, str(ROOT / "scripts" / "cluster_train.py"), *TRAIN_ARGS, "--reference",
                          "--ckpt-every", "0", "--report", str(out / "reference"), "--log-dir", str(out / "ref-runs")],
                         env)
    bare = out / "bare_worker.py"
    bare.write_text(BARE_WORKER)
    for share in ("0", "1"):
        port = free_port()
        cmds[f"bare-disable={share}"] = (
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bare-{share}", str(bare)],
            {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share})
    procs, logs = {}, {}
    for name, (cmd, cmd_env) in cmds.items():
        logs[name] = out / f"{name}.log"
        with logs[name].open("w") as log:
            procs[name] = subprocess.Popen(cmd, cwd=out, env=cmd_env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    usr1_ignored = _signal_the_agent(procs["sharded"])
    control = procs.pop("bare-disable=0")  # expected to fail: waited for on its own
    _wait_all(procs, {n: logs[n] for n in procs})
    try:  # by now its restart has had as long as the others' took; a stalled one is stopped
        control.wait(timeout=CONTROL_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_tree(control)
    return {"out": out, "logs": {n: p.read_text() for n, p in logs.items()}, "control_rc": control.returncode,
            "usr1_ignored": usr1_ignored}


def _signal_the_agent(agent: subprocess.Popen) -> bool:
    """Once the node script has become torchrun (it execs: same pid), send the agent SIGUSR1, as SLURM's
    ``--signal=USR1@...`` does to every process of the step. Returns whether the agent ignored the signal
    (its ``SigIgn`` mask) when it was sent; the job must then go on to succeed."""
    deadline = time.monotonic() + 60
    cmdline = Path(f"/proc/{agent.pid}/cmdline")
    while time.monotonic() < deadline and agent.poll() is None:
        if b"torch.distributed.run" in cmdline.read_bytes():
            break
        time.sleep(0.05)
    status = Path(f"/proc/{agent.pid}/status").read_text()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    os.kill(agent.pid, signal.SIGUSR1)
    return bool(ignored >> (signal.SIGUSR1 - 1) & 1)


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_killed_rank_restarts_and_ends_like_an_uninterrupted_run(launched, job):
    """The job succeeds after one restart; the restarted ranks resumed from the checkpoint of step 4
    (mid-epoch), and the per-step global losses after it and the final parameters equal the reference's."""
    _, run, rank = JOBS[job]
    out = launched["out"]
    log = launched["logs"][job]
    assert log.count(f"rank {rank} killed at step {FAULT_STEP}") == 1, log[-3000:]
    ref = json.loads((out / "reference" / "reference-rank0.json").read_text())
    ref_params = torch.load(out / "reference" / "reference-params.pt", weights_only=True)
    ckpt = out / job / "ckpt" / run / "last.ckpt"
    for r in range(2):
        info = json.loads((out / job / "report" / f"{run}-rank{r}.json").read_text())
        assert info["restart_count"] == 1 and info["resumed_from"] == str(ckpt), info
        assert info["first_step"] == RESUME_STEP, info  # resumed, not started again from scratch
        resumed_losses = info["losses"]
        assert len(resumed_losses) == STEPS - RESUME_STEP
        diff = max(abs(a - b) for a, b in zip(resumed_losses, ref["losses"][RESUME_STEP:]))
        assert diff < TOL, f"{job} rank {r}: losses after the resume {resumed_losses} vs {ref['losses'][RESUME_STEP:]}"
    params = torch.load(out / job / "report" / f"{run}-params.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert p.dtype == torch.float64
        assert (p - ref_params[name]).abs().max() < TOL, f"{job}: parameter {name} differs from the reference"
    # the format asked for: a sharded directory with its commit record, or one file
    assert (ckpt / "commit.json").is_file() if job == "sharded" else ckpt.is_file()
    # training moves the loss by far more than the tolerance
    assert abs(ref["losses"][0] - ref["losses"][-1]) > 1e6 * TOL


def test_torchrun_agent_survives_slurms_warning_signal(launched):
    """SLURM's ``--signal=USR1@...`` reaches the torchrun agent too: the node script starts it ignoring
    SIGUSR1 (its default action would end the agent mid-training), and the job signalled this way succeeds."""
    assert launched["usr1_ignored"]


def test_restart_needs_the_store_variable(launched):
    """With the variable the bare job's restart trains; without it the restarted ranks cannot connect: they
    read the dead ranks' addresses from the shared rendezvous store, and the job fails ("connectFullMesh ...
    Connection refused") or, where another process has taken such a port since, stalls (stopped here)."""
    logs = launched["logs"]
    assert "attempt 1: rank 0 trained" in logs["bare-disable=1"] and "attempt 1: rank 1 trained" in logs["bare-disable=1"]
    assert launched["control_rc"] != 0, logs["bare-disable=0"][-3000:]
    assert "attempt 1: rank" not in logs["bare-disable=0"]
    assert "exitcode: 13" in logs["bare-disable=0"]  # the first attempt's kill


def test_node_script_sets_restarts_and_the_store_variable():
    """``torchrun_multinode.sh`` passes ``--max-restarts`` (3 unless ``MAX_RESTARTS``) and starts torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    base = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    base.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    for extra, restarts in (({}, "3"), ({"MAX_RESTARTS": "7"}, "7")):
        line = subprocess.run(["bash", str(NODE_SCRIPT), "--steps", "5"], env={**base, **extra}, capture_output=True,
                              text=True, check=True).stdout
        cmd = shlex.split(line)
        assert cmd[:4] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m"], cmd
        assert f"--max-restarts={restarts}" in cmd, cmd
