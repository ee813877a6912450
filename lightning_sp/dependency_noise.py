"""Silence two messages that Lightning 2.6 prints on every launch and that a user can do nothing about.

- ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated`` (torch >= 2.10), once per rank: Lightning's
  ``CombinedLoader`` builds ``torch.utils._pytree.LeafSpec()`` in ``lightning/pytorch/utilities/_pytree.py``
  (Lightning 2.6.6, the newest release, still does). The filter matches that message *raised from that
  module* only, so the same deprecation in the user's own code is still shown.
- Lightning's ``"💡 Tip: ... try installing [litlogger] ..."`` / ``[litmodels]`` advertisements (``rank_zero_info``
  in ``logger_connector.py`` and ``callback_connector.py``, printed unless a ``LitLogger`` is configured):
  a ``logging.Filter`` on Lightning's rank-zero logger drops records starting with ``"💡 Tip:"``; every
  other message of that logger (GPU available, seeds, stopping reasons) is kept.

``SequenceParallelStrategy.__init__`` and ``lightning-sp`` call :func:`silence_dependency_noise` (each rank
builds its strategy, so every rank gets the filters); importing this module changes nothing.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["LEAFSPEC_WARNING", "LIGHTNING_TIP_PREFIX", "silence_dependency_noise"]

LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree"  # Lightning's own use only
LIGHTNING_TIP_PREFIX = "💡 Tip:"
# the logger ``rank_zero_info`` writes to: Lightning points ``lightning_utilities``' rank-zero module at one of these
LIGHTNING_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropLightningTips(logging.Filter):
    """Drops Lightning's product tips (``"💡 Tip: ..."``), passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIP_PREFIX)


def silence_dependency_noise() -> None:
    """Install the two filters described in the module docstring (idempotent)."""
    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning, module=LEAFSPEC_MODULE)
    for name in LIGHTNING_RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
