"""A launch prints no LeafSpec deprecation and no Lightning product tip, and the filters that
silence them are narrow: the same deprecation from the user's own code, and Lightning's other rank-zero
messages, still come through."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from lightning_sp.dependency_noise import LIGHTNING_TIP_PREFIX, silence_dependency_noise


def _lightning_flatten():
    """What Lightning's CombinedLoader does on every fit: flatten the dataloaders with its own pytree copy."""
    from lightning.pytorch.utilities._pytree import _tree_flatten

    return _tree_flatten({"a": [torch.zeros(1), torch.zeros(1)]})


def test_lightning_leafspec_deprecation_is_silenced_and_the_users_is_not():
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        _lightning_flatten()
    if not any("LeafSpec" in str(w.message) for w in before):
        pytest.skip("this torch/Lightning pair does not emit the LeafSpec deprecation")  # newer releases
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        silence_dependency_noise()
        _lightning_flatten()
        from torch.utils._pytree import LeafSpec

        LeafSpec()  # the user's own use of the deprecated class: still reported
    messages = [(str(w.message), w.filename) for w in after if "LeafSpec" in str(w.message)]
    assert messages, "the filter also hid the deprecation raised from the user's code"
    assert all(not f.replace("\\", "/").endswith("lightning/pytorch/utilities/_pytree.py") for _, f in messages), messages


def test_lightning_tips_are_dropped_and_other_rank_zero_info_kept(caplog):
    silence_dependency_noise()
    silence_dependency_noise()  # idempotent: one filter per logger
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(type(f).__name__ == "_DropLightningTips" for f in log.filters) == 1
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        rank_zero_info(f"{LIGHTNING_TIP_PREFIX} For seamless cloud logging, try installing [litlogger](...)")
        rank_zero_info("GPU available: False, used: False")  # negative control: an ordinary message
    texts = [r.getMessage() for r in caplog.records]
    assert "GPU available: False, used: False" in texts, texts
    assert not any(t.startswith(LIGHTNING_TIP_PREFIX) for t in texts), texts


def test_trainer_with_the_strategy_prints_no_tip(caplog):
    # the strategy installs the filters on every rank (the CLI too); Trainer.__init__ then builds the logger
    import lightning as L

    from lightning_sp import SequenceParallelStrategy

    with caplog.at_level(logging.INFO):
        L.Trainer(accelerator="cpu", devices=1, strategy=SequenceParallelStrategy(1), logger=True,
                  enable_progress_bar=False, enable_model_summary=False)
    assert not any(r.getMessage().startswith(LIGHTNING_TIP_PREFIX) for r in caplog.records), caplog.text
