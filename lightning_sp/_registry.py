"""Lightning's ``StrategyRegistry`` learns ``"sequence_parallel"`` without ``import lightning_sp`` importing
Lightning (Note [A light import]).

Note [A light import]
~~~~~~~~~~~~~~~~~~~~~
Standalone users (attention, layouts, losses under ``torchrun``) and every spawned test rank import the
package; Lightning and transformers cost seconds to import and are not needed there. So the package
``__init__`` binds the Lightning-facing names (``SequenceParallelStrategy``, ``SequenceParallelMonitor``)
lazily (PEP 562 ``__getattr__``), and registration with Lightning happens when Lightning's strategy
registry exists::

    Lightning already imported  ->  register now (cheap: Lightning is loaded)
    Lightning imported later    ->  a one-shot finder on sys.meta_path registers right after
                                    ``lightning.pytorch.strategies`` has executed, then removes itself

Either way ``Trainer(strategy="sequence_parallel")`` works after ``import lightning_sp``. The entry is a
factory (``make_strategy``) that imports ``lightning_sp.strategy`` on first use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

LIGHTNING_STRATEGIES_MODULE = "lightning.pytorch.strategies"

# name -> (description, init params)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "sequence_parallel": ("Sequence parallelism (ulysses/ring/zigzag/usp) x data parallelism (DDP/FSDP2)", {}),
    "sequence_parallel_spawn": ("SequenceParallelStrategy with start_method='spawn'", {"start_method": "spawn"}),
}


def make_strategy(**kwargs: Any) -> Any:
    """Registry factory: ``SequenceParallelStrategy(**kwargs)``, importing the strategy on first use."""
    from lightning_sp.strategy import SequenceParallelStrategy

    return SequenceParallelStrategy(**kwargs)


def register(registry: Any) -> None:
    """Register every name of ``STRATEGY_NAMES`` (idempotent; never replaces a user's own entry)."""
    for name, (description, init_params) in STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(name, make_strategy, description=description, **init_params)


class _RegisterAfterLightningStrategies(importlib.abc.MetaPathFinder):
    """One-shot finder: lets the normal finders load ``lightning.pytorch.strategies``, then registers."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != LIGHTNING_STRATEGIES_MODULE:
            return None
        remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            register(module.StrategyRegistry)

        spec.loader.exec_module = exec_then_register  # this spec's loader only (a fresh loader object)
        return spec


def remove_hook() -> None:
    for finder in [f for f in sys.meta_path if isinstance(f, _RegisterAfterLightningStrategies)]:
        sys.meta_path.remove(finder)


def register_when_lightning_loads() -> None:
    """Register now if Lightning's registry is loaded, else once it is (called by the package ``__init__``)."""
    strategies = sys.modules.get(LIGHTNING_STRATEGIES_MODULE)
    if strategies is not None and hasattr(strategies, "StrategyRegistry"):
        register(strategies.StrategyRegistry)
    elif not any(isinstance(f, _RegisterAfterLightningStrategies) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightningStrategies())
