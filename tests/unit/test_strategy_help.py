"""Every argument of ``SequenceParallelStrategy`` is described where users look: ``help()``, the docs site
(mkdocstrings renders the docstring's Args section) and LightningCLI's ``--trainer.strategy.help`` (jsonargparse
reads the same section)."""

from __future__ import annotations

import inspect

import docstring_parser

from lightning_sp.strategy import SequenceParallelStrategy


def _undocumented(cls) -> list[str]:
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    documented = {p.arg_name.lstrip("*") for p in docstring_parser.parse(cls.__doc__ or "").params}
    return [p for p in params if p not in documented]


def test_every_strategy_argument_has_a_description_in_the_docstring():
    assert _undocumented(SequenceParallelStrategy) == []
    parsed = docstring_parser.parse(SequenceParallelStrategy.__doc__)
    assert all(len(p.description or "") > 20 for p in parsed.params), [p.arg_name for p in parsed.params]
    assert "README" not in SequenceParallelStrategy.__doc__

    class Undocumented(SequenceParallelStrategy):  # control: an argument the docstring does not name
        def __init__(self, sequence_parallel_size=None, *, new_option: int = 0, **kwargs): ...

    Undocumented.__doc__ = SequenceParallelStrategy.__doc__
    assert "new_option" in _undocumented(Undocumented)


def test_lightning_cli_strategy_help_shows_the_descriptions():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="strategy-help")
    parser.add_class_arguments(SequenceParallelStrategy, "strategy")
    text = " ".join(parser.format_help().split())
    for phrase in ("Ranks that share one sequence", "Attention backend for modules built with",
                   "Seconds (or a ``timedelta``) a collective", "Megatron tensor + sequence parallelism"):
        assert phrase in text, phrase
