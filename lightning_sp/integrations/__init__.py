"""Integrations with other libraries, each imported lazily (``import lightning_sp`` imports none of them).

- ``lightning_sp.integrations.transformers``: Hugging Face ``transformers`` models under sequence
  parallelism (``apply_sequence_parallel``, ``shard_inputs``); needs the ``hf`` extra.
- ``lightning_sp.integrations.hf_module``: ``HFSequenceParallelModule``, a ``LightningModule`` that trains any ``*ForCausalLM`` /
  ``*ForMaskedLM`` under ``SequenceParallelStrategy``.
"""
