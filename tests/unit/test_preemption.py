"""The preemption flag, without a Trainer or a process group (the ranks' agreement: tests/distributed/test_preemption.py)."""

from __future__ import annotations

import os
import signal

import pytest

from lightning_sp.preemption import Preemption, PreemptionCallback, agree_max, preemption_callback


def test_signal_only_sets_a_flag_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        callback = PreemptionCallback(Preemption(enabled=True), signal.SIGUSR1)
        callback.arm()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert callback.requested and callback.saved_path is None and seen == []  # a flag, nothing else
        callback.disarm()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # control: the handler before it is back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_enabled_by_slurm_auto_requeue_or_by_request(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    assert preemption_callback(None, LightningEnvironment()) is None
    assert preemption_callback(None, SLURMEnvironment(auto_requeue=False)) is None
    slurm = preemption_callback(None, SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR2))
    assert slurm is not None and slurm.signum == signal.SIGUSR2  # SLURM's configured requeue signal
    assert preemption_callback(Preemption(enabled=False), SLURMEnvironment(auto_requeue=True)) is None
    anywhere = preemption_callback(Preemption(enabled=True, signal=signal.SIGTERM), LightningEnvironment())
    assert anywhere is not None and anywhere.signum == signal.SIGTERM
    assert agree_max(3) == 3  # no process group: this process decides alone


@pytest.mark.parametrize("kwargs, match", [
    (dict(signal=signal.SIGKILL), "cannot be caught"),
    (dict(signal=12345), "not a signal"),
    (dict(requeue="scontrol requeue"), "callable"),
    (dict(enabled="yes"), "True, False or None"),
])
def test_bad_settings_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Preemption(**kwargs)


def test_requeue_outside_slurm_is_refused_with_the_alternative(monkeypatch):
    from lightning_sp.preemption import slurm_requeue

    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"Preemption\(requeue=...\)"):
        slurm_requeue()
