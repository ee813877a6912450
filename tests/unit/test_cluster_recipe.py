"""``scripts/cluster_train.py``'s fault handling, without launching it: the cluster environment it hands
Lightning inside a SLURM job started by torchrun (SLURM's requeue on SIGUSR1, torchrun's ranks), the
checkpoint a restart resumes from, and the test-only fault switch. The launches themselves are in
``tests/distributed/test_restarts.py`` and ``test_multinode.py``."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment



def _load_cluster_train():
    """``scripts/cluster_train.py`` as a module (the scripts are entry points run by path, not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "cluster_train.py"
    spec = importlib.util.spec_from_file_location("cluster_train_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster_train = _load_cluster_train()

TORCHRUN = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "77"}
# srun starts one task per node (the torchrun agent): SLURM's numbering is the node's, not the rank's
SLURM = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_JOB_NAME": "lightning-sp", "SLURM_NODELIST": "node[01-02]"}


@pytest.fixture
def environ(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in TORCHRUN:
            monkeypatch.delenv(name)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def _trainer(plugins) -> L.Trainer:
    # rank 3 of 2 nodes x 2: nothing is launched or initialised by constructing it
    return L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", plugins=plugins, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _requeue_handler_installed(trainer: L.Trainer) -> bool:
    before = signal.getsignal(signal.SIGUSR1)
    trainer._signal_connector.register_signal_handlers()
    try:
        return signal.getsignal(signal.SIGUSR1) is not before
    finally:
        trainer._signal_connector.teardown()


def test_slurm_job_under_torchrun_gets_requeue_with_torchrun_ranks(environ):
    environ(**TORCHRUN, **SLURM)
    (env,) = cluster_train.cluster_plugins()
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert (env.main_address, env.main_port, env.creates_processes_externally) == ("node01", 29555, True)
    trainer = _trainer(cluster_train.cluster_plugins())
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.node_rank) == (3, 4, 1, 1)
    assert _requeue_handler_installed(trainer)
    # the control: Lightning on its own picks torchrun's environment there, and no requeue handler
    plain = _trainer(None)
    assert type(plain._accelerator_connector.cluster_environment) is TorchElasticEnvironment
    assert not _requeue_handler_installed(plain)


def test_outside_slurm_or_torchrun_lightning_chooses(environ):
    environ(**TORCHRUN)
    assert cluster_train.cluster_plugins() == []
    environ(**SLURM)
    for name in TORCHRUN:
        os.environ.pop(name)
    assert cluster_train.cluster_plugins() == []  # srun without torchrun: Lightning's SLURMEnvironment


def test_ranks_take_back_the_signal_torchrun_ignores():
    """The node script starts torchrun with SIGUSR1 ignored, which the ranks inherit; a rank restores the
    default so that Lightning's requeue handler can be installed."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        cluster_train.restore_requeue_signal()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
        handler = signal.signal(signal.SIGUSR1, lambda *_: None)  # a handler already there is kept
        cluster_train.restore_requeue_signal()
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_newest_checkpoint_is_the_latest_of_last_and_hpc(tmp_path):
    assert cluster_train.newest_checkpoint(tmp_path / "none") is None
    assert cluster_train.newest_checkpoint(tmp_path) is None
    names = ["last.ckpt", "hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "epoch=0-step=4.ckpt", "last.ckpt.tmp",
             ".hpc_ckpt_11.ckpt.saving-0a1b2c", ".last.ckpt.saving-9f"]
    for age, name in enumerate(names):  # later in the list: written later
        path = tmp_path / name
        path.mkdir() if "saving" in name else path.write_bytes(b"x")
        os.utime(path, (1_000 + age, 1_000 + age))
    # the staging directories and other names are never picked, however new
    assert cluster_train.newest_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_10.ckpt"
    os.utime(tmp_path / "last.ckpt", (5_000, 5_000))  # a periodic save after the requeue's
    assert cluster_train.newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"


def test_fault_switch_first_attempt_only(environ):
    assert cluster_train.FaultInjection.from_env() is None
    environ(CLUSTER_TRAIN_FAULT="1:5")
    fault = cluster_train.FaultInjection.from_env()
    assert (fault.rank, fault.step, fault.node) == (1, 5, False)
    environ(CLUSTER_TRAIN_FAULT="0:2:node")
    fault = cluster_train.FaultInjection.from_env()
    assert (fault.rank, fault.step, fault.node) == (0, 2, True)
    environ(TORCHELASTIC_RESTART_COUNT="1")
    assert cluster_train.FaultInjection.from_env() is None  # the restart trains
    for bad in ("rank1", "1:5:disk", "1"):
        environ(TORCHELASTIC_RESTART_COUNT="0", CLUSTER_TRAIN_FAULT=bad)
        with pytest.raises(SystemExit, match="RANK:STEP"):
            cluster_train.FaultInjection.from_env()


def test_ckpt_every_must_not_be_negative():
    with pytest.raises(SystemExit):
        cluster_train.parse_args(["--ckpt-every", "-1"])
    args = cluster_train.parse_args([])
    assert args.ckpt_every > 0 and args.ckpt_format == "auto" and not args.fresh
