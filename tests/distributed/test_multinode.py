"""The multi-node recipe runs as documented: two simulated nodes x two ranks, each node started by
``scripts/torchrun_multinode.sh`` (torchrun, c10d rendezvous on 127.0.0.1), training the demo decoder
(``scripts/cluster_train.py``) in float64, equal to one process on the same global batch; and the groups
are node-aware (checked from what every rank reports, the node being the torchrun agent that started it).

One launch trains three layouts in the same processes: ``auto`` at sp=2 x dp=2 (groups inside a node),
``usp`` at sp=4 (Ulysses inside a node, ring across) and ``auto`` at sp=4 (priced with the GPU preset's
slower cross-node links). The SLURM wrapper cannot run here: its syntax and the command it builds are
checked against the one this test runs."""

from __future__ import annotations

import json
import math
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

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "scripts" / "torchrun_multinode.sh"
SBATCH = ROOT / "scripts" / "slurm_train.sbatch"
N_IMAGES, D_MODEL, N_HEADS, GLOBAL_BATCH, STEPS = 3, 32, 4, 2, 3
SEQ_LEN = 21 * N_IMAGES + 9  # 72 tokens
TRAIN_ARGS = ["--n-images", str(N_IMAGES), "--d-model", str(D_MODEL), "--n-heads", str(N_HEADS), "--n-layers", "2",
              "--steps", str(STEPS), "--global-batch-size", str(GLOBAL_BATCH), "--precision", "64-true",
              "--hardware", "h100-80gb", "--timeout", "60", "--ckpt-every", "0"]  # restarts: test_restarts.py
RUNS = {"auto-sp2-dp2": ("auto", 2), "usp-sp4-dp1": ("usp", 4), "auto-sp4-dp1": ("auto", 4)}
DEADLINE_S = 480  # the launch under heavy load (2 shared cores); a hang fails here, never later
TOL = 1e-10  # float64: same math, different reduction order


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop a torchrun agent and its ranks. The ranks run in sessions of their own (torch's
    ``start_new_session``), so killing the agent's group would orphan them: SIGTERM the agent (it stops
    its ranks), then SIGKILL whatever of the tree is left."""
    ranks = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *ranks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    """Wait for every process; on a failure or past the deadline kill them all (whole sessions: torchrun
    and its ranks) and fail with their logs. Never hangs."""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                _kill_tree(p)
    bad = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    tails = "\n".join(f"--- {n} (rc {procs[n].returncode}):\n{logs[n].read_text()[-4000:]}" for n in procs)
    assert not bad, f"failed or timed out after {DEADLINE_S} s: {bad}\n{tails}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two torchrun 'nodes' and the one-process reference, all started at once."""
    out = tmp_path_factory.mktemp("multinode")
    report = out / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable,
           "NNODES": "2", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RDZV_ID": f"test-{os.getpid()}", "PYTHONWARNINGS": "ignore", "MAX_RESTARTS": "0"}  # a failure fails
    args = [*TRAIN_ARGS, "--report", str(report), "--log-dir", str(out / "runs"), "--backend", "auto", "--sp", "2",
            "--also", "usp:4", "--also", "auto:4"]
    cmds = {f"node{n}": (["bash", str(NODE_SCRIPT), *args], {**env, "NODE_RANK": str(n)}) for n in (0, 1)}
    cmds["reference"] = ([sys.executable, str(ROOT / "scripts" / "cluster_train.py"), *args, "--reference"],
                         {k: v for k, v in env.items() if k not in ("NNODES", "NPROC_PER_NODE")})
    procs, logs = {}, {}
    for name, (cmd, cmd_env) in cmds.items():
        logs[name] = out / f"{name}.log"
        with logs[name].open("w") as log:
            procs[name] = subprocess.Popen(cmd, cwd=out, env=cmd_env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    _wait_all(procs, logs)
    reports = {run: [json.loads((report / f"{run}-rank{r}.json").read_text()) for r in range(4)] for run in RUNS}
    return {"report": report, "reports": reports, "agents": {procs["node0"].pid: 0, procs["node1"].pid: 1},
            "reference": json.loads((report / "reference-rank0.json").read_text()), "args": args,
            "log_dir": out / "runs"}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_run_leaves_its_tensorboard_log_whole(launched, run):
    """``cluster_train.py`` under torchrun leaves without the interpreter's finalization (``leave_without_finalizing``):
    what it wrote before must be whole. Each run's TensorBoard file, read back, holds ``Loss/train`` at every step;
    with one data-parallel replica (dp = 1) the logged values are the global losses of rank 0's report (with more,
    rank 0 logs its own replica's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (launched["log_dir"] / run).glob("version_*/events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    logged = [e.value for e in acc.Scalars("Loss/train")]
    reported = next(info for info in launched["reports"][run] if info["rank"] == 0)["losses"]
    assert len(logged) == STEPS and all(math.isfinite(x) for x in logged), logged
    if run.endswith("dp1"):
        assert logged == pytest.approx(reported, rel=1e-6), (logged, reported)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_nodes_train_like_one_process(launched, run):
    """Per-step global losses and final parameters equal one process's on the same global batch."""
    ref = launched["reference"]["losses"]
    ref_params = torch.load(launched["report"] / "reference-params.pt", weights_only=True)
    params = torch.load(launched["report"] / f"{run}-params.pt", weights_only=True)
    for info in launched["reports"][run]:
        assert len(info["losses"]) == len(ref) == STEPS
        diff = max(abs(a - b) for a, b in zip(info["losses"], ref))
        assert diff < TOL, f"{run} rank {info['rank']}: losses {info['losses']} vs one process {ref}"
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert p.dtype == torch.float64
        assert (p - ref_params[name]).abs().max() < TOL, f"{run}: parameter {name} differs from one process"
    # negative control: training moves the loss by far more than the tolerance (a replica reading the
    # wrong samples moved the first loss by 2e-2)
    assert abs(ref[0] - ref[-1]) > 1e6 * TOL, ref


def test_groups_are_node_aware(launched):
    """Every rank knows its node size from torchrun; the topology keeps sp groups (sp=2) and usp's Ulysses
    groups inside a node and runs usp's ring across nodes."""
    agents = launched["agents"]
    for run, infos in launched["reports"].items():
        node_of = {i["rank"]: agents[i["launcher_pid"]] for i in infos}  # the torchrun agent that started it
        assert sorted(node_of.values()) == [0, 0, 1, 1], (run, node_of)
        for i in infos:
            assert (i["num_nodes"], i["devices"], i["ranks_per_node"]) == (2, 2, 2), (run, i)
            assert i["node_rank"] == node_of[i["rank"]], (run, i)
        if run == "auto-sp2-dp2":
            for i in infos:
                assert {node_of[r] for r in i["sp_group"]} == {node_of[i["rank"]]}, i  # inside its node
                assert {node_of[r] for r in i["dp_group"]} == {0, 1}, i  # replicas on both nodes
        if run == "usp-sp4-dp1":
            for i in infos:
                assert (i["ulysses"], i["ring"]) == (2, 2), i
                assert {node_of[r] for r in i["ulysses_group"]} == {node_of[i["rank"]]}, i
                assert {node_of[r] for r in i["ring_group"]} == {0, 1}, i


@pytest.mark.parametrize("run,batch", [("auto-sp2-dp2", GLOBAL_BATCH // 2), ("auto-sp4-dp1", GLOBAL_BATCH)])
def test_auto_prices_the_node_topology(launched, run, batch):
    """``auto``'s decision on every rank is the cost model's for the real node size (2 ranks per node of
    the H100 preset), not for one big node or for every rank on its own node."""
    from lightning_sp.attention import auto_choice

    _, sp = RUNS[run]

    def predicted(ranks_per_node: int) -> dict[str, float]:
        choice = auto_choice(N_HEADS, sp, seq_len=SEQ_LEN, num_kv_heads=N_HEADS, head_dim=D_MODEL // N_HEADS,
                             dtype=torch.float64, batch=batch, causal=True, ranks_per_node=ranks_per_node,
                             hardware="h100-80gb", usp_allowed=sp == 4)
        return {p.label: p.total_s for p in choice.predictions}

    expected = predicted(2)
    for info in launched["reports"][run]:
        assert info["auto"]["hardware"] == "h100-80gb", info["auto"]
        assert info["auto"]["predictions"] == pytest.approx(expected, rel=1e-12), info["auto"]["summary"]
    # negative controls: the other node sizes price the same group differently
    other = predicted(4) if sp == 4 else predicted(1)
    assert other != pytest.approx(expected, rel=1e-6)


def sbatch_directives(path: Path) -> dict[str, str]:
    """The ``#SBATCH --name[=value]`` lines of a batch script, as sbatch reads them: from the top, up to the
    first command (sbatch ignores any after it)."""
    directives = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH"):
            name, _, value = line.split(None, 1)[1].partition("=")
            directives[name] = value
        elif line.strip() and not line.startswith("#"):
            break
    return directives


def test_slurm_wrapper_asks_for_the_requeue_signal_and_requeue():
    """The batch script asks SLURM for a warning signal before the time limit (``--signal=USR1@<s>``, every
    process of the step: not ``B:``, which reaches the batch shell only), to be requeued (``--requeue``) and
    for an appending log (``--open-mode=append``); sbatch reads them (they come before the first command)."""
    import re

    directives = sbatch_directives(SBATCH)
    assert "--requeue" in directives and directives.get("--open-mode") == "append", directives
    match = re.fullmatch(r"USR1@(\d+)", directives.get("--signal", ""))
    assert match and int(match.group(1)) >= 60, directives
    # the ranks' requeue handler waits for SIGUSR1 (Lightning's SLURMEnvironment default)
    from lightning.fabric.plugins.environments import SLURMEnvironment

    assert SLURMEnvironment().requeue_signal.name == "SIGUSR1"


def test_slurm_wrapper_builds_the_tested_command(tmp_path, launched):
    """``slurm_train.sbatch`` parses, and under stand-ins for ``srun``/``scontrol`` (two nodes) it runs
    ``torchrun_multinode.sh`` once per node with the same command this test launched (with restarts and the
    rendezvous store variable), the first node's address as the rendezvous and each node's index."""
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol: the node list; srun: run the step once per node with SLURM_NODEID, printing the command
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho gpu-node-07\necho gpu-node-08\n")
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'for n in 0 1; do SLURM_NODEID=$n DRY_RUN=1 "$@" || exit 1; done\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(ROOT),
           "PYTHON": sys.executable}
    args = launched["args"]
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for node, line in enumerate(lines):
        cmd = shlex.split(line)
        assert cmd[:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m",
                           "torch.distributed.run"], cmd
        assert "--max-restarts=3" in cmd, cmd
        assert f"--node-rank={node}" in cmd and "--nnodes=2" in cmd and "--nproc-per-node=2" in cmd, cmd
        assert "--rdzv-endpoint=gpu-node-07:29500" in cmd and "--rdzv-id=4242" in cmd, cmd
        assert cmd[cmd.index(str(ROOT / "scripts" / "cluster_train.py")) + 1:] == args, cmd
    # the command the test launched is the same one, up to the node's environment
    tested = subprocess.run(["bash", str(NODE_SCRIPT), *args], env={**os.environ, "DRY_RUN": "1", "NNODES": "2",
                            "NPROC_PER_NODE": "2", "NODE_RANK": "0", "PYTHON": sys.executable,
                            "MASTER_ADDR": "gpu-node-07", "RDZV_ID": "4242"}, capture_output=True, text=True)
    assert tested.stdout.strip() == lines[0].strip()
