"""The torchrun recipe survives a killed rank and a lost node: ``scripts/torchrun_multinode.sh``
(``--max-restarts``) restarts every rank of ``scripts/cluster_train.py`` and each resumes from its last
checkpoint, mid-epoch, ending with the parameters of a run that was never interrupted (float64, 1e-10).

Two launches, one per checkpoint format, all at once with the one-process reference. Epochs of 3 steps, a
checkpoint every 2 steps, the fault (``CLUSTER_TRAIN_FAULT``, torchrun's first attempt only) between a rank's
forward and backward of step 6, in the middle of epoch 1; the restart resumes from step 4, the second step of
epoch 1:

- ``single``: one node of two ranks, sp=2 x dp=1, a single-file checkpoint; rank 1 is killed and torchrun
  restarts both ranks.
- ``sharded``: two simulated nodes of one rank, sp=1 x dp=2 (the data module's ``DistributedSampler`` splits
  the batch), a sharded checkpoint; node 1 is lost (its rank kills its torchrun agent, then itself), node 0's
  torchrun restarts its rank and waits in the rendezvous, and a replacement node 1 (the same command started
  again, as a scheduler would on a new node) joins it. Node 0's agent also gets SLURM's warning signal
  (SIGUSR1), which it must survive.

Both run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which the node script sets (checked below): without
it a restarted rank can read a dead rank's address from the rendezvous store shared across attempts
(pytorch #135712) and the restart fails or stalls in the process-group set-up. On this machine that is a
race (a bare gloo job killed and restarted without it failed in some runs and trained in others), so no
test here depends on it failing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import free_port
from tests.distributed.test_multinode import DEADLINE_S, NODE_SCRIPT, ROOT, _kill_tree, _wait_all

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, CKPT_EVERY, FAULT_STEP = 8, 2, 5  # FAULT_STEP: global_step when the rank dies (the 6th step)
RESUME_STEP = FAULT_STEP - FAULT_STEP % CKPT_EVERY  # 4: the last checkpoint before the kill
TRAIN_ARGS = ["--n-images", "3", "--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--precision", "64-true",
              "--hardware", "h100-80gb", "--timeout", "60", "--global-batch-size", "2", "--steps", str(STEPS),
              "--samples-per-epoch", "6", "--ckpt-every", str(CKPT_EVERY), "--backend", "ring"]
JOBS = {  # name: (extra arguments, run name, nodes x ranks per node, fault)
    "single": (["--sp", "2", "--ckpt-format", "single"], "ring-sp2-dp1", (1, 2), f"1:{FAULT_STEP}"),
    "sharded": (["--sp", "1", "--ckpt-format", "sharded"], "ring-sp1-dp2", (2, 1), f"1:{FAULT_STEP}:node"),
}
TOL = 1e-10

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("restarts")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable,
           "PYTHONWARNINGS": "ignore", "MAX_RESTARTS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmds = {}
    for name, (extra, _, (nodes, per_node), fault) in JOBS.items():
        args = [*TRAIN_ARGS, *extra, "--report", str(out / name / "report"), "--log-dir", str(out / name / "runs"),
                "--ckpt-dir", str(out / name / "ckpt")]
        job_env = {**env, "NNODES": str(nodes), "NPROC_PER_NODE": str(per_node), "MASTER_PORT": str(free_port()),
                   "RDZV_ID": f"restart-{name}-{os.getpid()}"}
        for node in range(nodes):
            node_env = {**job_env, "NODE_RANK": str(node)}
            if node == nodes - 1:
                node_env["CLUSTER_TRAIN_FAULT"] = fault
            cmds[f"{name}-node{node}"] = (["bash", str(NODE_SCRIPT), *args], node_env)
    cmds["reference"] = ([sys.executable, str(ROOT / "scripts" / "cluster_train.py"), *TRAIN_ARGS, "--reference",
                          "--ckpt-every", "0", "--report", str(out / "reference"), "--log-dir", str(out / "ref-runs")],
                         env)
    procs, logs = {}, {}

    def start(name: str, cmd: list[str], cmd_env: dict[str, str]) -> None:
        logs[name] = out / f"{name}.log"
        with logs[name].open("w") as log:
            procs[name] = subprocess.Popen(cmd, cwd=out, env=cmd_env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    lost = "sharded-node1"
    for name, (cmd, cmd_env) in cmds.items():
        if name == lost:  # node 0's agent must host the rendezvous store, as MASTER_ADDR's node does
            _wait_for_port(int(cmd_env["MASTER_PORT"]), procs["sharded-node0"])
        start(name, cmd, cmd_env)
    usr1_ignored = _signal_the_agent(procs["sharded-node0"])
    lost_rc = _wait_for_exit(procs.pop(lost))
    cmd, cmd_env = cmds[lost]
    start("sharded-node1-replacement", cmd, {k: v for k, v in cmd_env.items() if k != "CLUSTER_TRAIN_FAULT"})
    _wait_all(procs, {n: logs[n] for n in procs})
    return {"out": out, "logs": {n: p.read_text() for n, p in logs.items()}, "usr1_ignored": usr1_ignored,
            "lost_rc": lost_rc}


def _wait_for_port(port: int, owner: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and owner.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"node 0's torchrun did not open its rendezvous port {port} (exit status {owner.poll()})")


def _wait_for_exit(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise AssertionError(f"the node meant to be lost was still running after {DEADLINE_S} s") from None


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
def test_a_fault_restarts_and_ends_like_an_uninterrupted_run(launched, job):
    """The job succeeds after the fault; its ranks resumed from the checkpoint of step 4 (mid-epoch), and the
    per-step global losses after it and the final parameters equal the reference's. ``single``: a rank killed,
    both restarted by torchrun. ``sharded``: a node lost (its agent killed) and replaced."""
    _, run, (nodes, per_node), _ = JOBS[job]
    out = launched["out"]
    logs = launched["logs"]
    faulted = logs[f"{job}-node{nodes - 1}"]
    what = "its node lost" if job == "sharded" else "killed"
    assert faulted.count(f"rank 1 {what} at step {FAULT_STEP}") == 1, faulted[-3000:]
    if job == "sharded":
        assert launched["lost_rc"] == -signal.SIGKILL  # the node's torchrun died with it
    ref = json.loads((out / "reference" / "reference-rank0.json").read_text())
    ref_params = torch.load(out / "reference" / "reference-params.pt", weights_only=True)
    ckpt = out / job / "ckpt" / run / "last.ckpt"
    restarts = []
    for r in range(nodes * per_node):
        info = json.loads((out / job / "report" / f"{run}-rank{r}.json").read_text())
        restarts.append(info["restart_count"])
        assert info["resumed_from"] == str(ckpt) and info["first_step"] == RESUME_STEP, info  # not from scratch
        resumed_losses = info["losses"]
        assert len(resumed_losses) == STEPS - RESUME_STEP
        diff = max(abs(a - b) for a, b in zip(resumed_losses, ref["losses"][RESUME_STEP:]))
        assert diff < TOL, f"{job} rank {r}: losses after the resume {resumed_losses} vs {ref['losses'][RESUME_STEP:]}"
    # torchrun restarted the ranks of a surviving agent; the replacement node's agent started them once
    assert sorted(restarts) == ([0, 1] if job == "sharded" else [1, 1]), restarts
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
