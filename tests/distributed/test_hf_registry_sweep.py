"""Hugging Face: exact or refused, never in between, across transformers' own registry.

One 2-rank spawn sweeps ``tests.hf_tiny.SWEEP`` (tiny ``from_config`` float64 models of 35+ model
types, the class ``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` maps each to) and ``tests.hf_tiny.ENCODER_SWEEP``
(T5, MT5 and UMT5 encoders, the class ``MODEL_FOR_TEXT_ENCODING_MAPPING`` maps each to: ``T5EncoderModel``, ...,
with T5's learned relative-position bias; their last hidden states stand for logits) on two backends:
every case must be exact (logits, loss and every parameter gradient within 1e-9 of the unsharded HF
model on the full sequence, HF's own float32 roundings kept in float64: ``tests.hf_tiny.KeepFloat64``) or refused
with ``NotImplementedError`` on every rank with the same message. Each exact case carries a negative control (the
reference with its first token changed must miss by far more), and each trap it once fell into is reproduced with its fix
switched off (it must miss).
The README's support table must equal the one this sweep renders (``scripts/hf_support_table.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.distributed.harness import run_on_ranks  # noqa: E402
from tests.docs_text import HF_GUIDE  # noqa: E402
from tests.hf_tiny import (  # noqa: E402
    ENCODER_SWEEP,
    SWEEP,
    SWEEP_BACKENDS,
    SWEEP_N,
    TABLE_BEGIN,
    TABLE_END,
    TABLE_VERSION,
    support_table,
    sweep_case_id,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]  # ~35 s of CPU; minutes on a loaded machine

TOL = 1e-9
MISS = 1e-6
README = HF_GUIDE  # the page that holds the support table


def _traps_with_fix_off(rank: int, world: int) -> dict:
    """Each fix of a trap switched off on an otherwise exact run: ``{trap: max |diff|}`` vs the reference."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations.transformers import SHARD_INFO_KEY, _sp_modules, apply_sequence_parallel, shard_inputs
    from tests.hf_tiny import clone, registry_model, sweep_batch

    group = dist.group.WORLD
    cases = dict((sweep_case_id(mt, ov), (mt, ov)) for mt, ov in SWEEP)

    def run(case, edit_shard=None, edit_model=None, causal_lm=None, backend="zigzag_ring"):
        base, masked = registry_model(*cases[case])
        batch = sweep_batch(masked)
        ref_logits = clone(base)(input_ids=batch["input_ids"]).logits.detach()
        ref_loss = F.cross_entropy(ref_logits[0, :-1], batch["labels"][0, 1:])
        model = apply_sequence_parallel(clone(base), group=group, backend=backend)
        if edit_model is not None:
            edit_model(model)
        shard = shard_inputs(batch, model, causal_lm=causal_lm)
        if edit_shard is not None:
            shard[SHARD_INFO_KEY] = dataclasses.replace(shard[SHARD_INFO_KEY], **edit_shard)
        labels = shard.pop("labels")
        with torch.no_grad():
            logits = model(**shard).logits
            loss = sequence_parallel_cross_entropy(logits, labels, group=group)
        full = gather_sequence(logits, group, layout=_sp_modules(model)[0].layout, seq_len=SWEEP_N)
        return max(float((full - ref_logits).abs().max()), abs(float(loss - ref_loss)))

    def local_rope(model):
        for m in model.modules():
            m.__dict__.pop("forward", None)  # back to HF's rotary, which reads the shard's own length

    return {
        "gpt2_labels_not_shifted": run("gpt2", causal_lm=False),
        "dynamic_rope_local_length": run("llama[dynamic]", edit_model=local_rope, backend="ulysses"),
        # contiguous shards: rank 0 ends at position 7, below LongRoPE's original length 8 (zigzag's do not)
        "longrope_local_length": run("phi3[longrope]", edit_model=local_rope, backend="ulysses"),
        "llama4_local_temperature": run("llama4_text", edit_shard={"token_index": None}),
        "llama4_chunks_dropped": run("llama4_text", edit_shard={"chunk_cu_seqlens": torch.tensor([0, SWEEP_N], dtype=torch.int32)}),
    }


MLA_BACKENDS = ("ring", "allgather_kv", "usp", "colossal")  # the sweep's two plus these: every parallel backend


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tests.hf_tiny import sweep_case, sweep_worker

    torch.manual_seed(0)
    deepseek = dict(SWEEP)["deepseek_v3"]
    return {"sweep": sweep_worker(rank, world), "traps": _traps_with_fix_off(rank, world),
            "mla": sweep_case("deepseek_v3", deepseek, dist.group.WORLD, backends=MLA_BACKENDS)}


@pytest.fixture(scope="module")
def results():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_on_ranks(_worker, 2, timeout_s=840, pg_timeout_s=60)  # ~35 s of CPU: slowness, not hangs, under load


CASE_IDS = tuple(sweep_case_id(mt, ov) for mt, ov in SWEEP) + tuple(mt for mt, _ in ENCODER_SWEEP)


def test_every_architecture_exact_or_refused_on_every_rank(results):
    assert tuple(results[0]["sweep"]) == CASE_IDS
    failures = []
    for case_id in CASE_IDS:
        for backend in SWEEP_BACKENDS:
            per_rank = [res["sweep"][case_id][backend] for res in results]
            if any("refused" in r for r in per_rank):
                if not all(r.get("refused") == per_rank[0].get("refused") for r in per_rank):
                    failures.append(f"{case_id} {backend}: refused on some ranks only, or differently: {per_rank}")
                continue
            for rank, r in enumerate(per_rank):
                bad = {k: r[k] for k in ("logits", "loss", "grads") if not r[k] < TOL}
                if bad:
                    failures.append(f"{case_id} {backend} rank {rank}: not exact and not refused: {bad}")
                if not r["control"] > MISS:
                    failures.append(f"{case_id} {backend} rank {rank}: negative control only {r['control']:.3e}")
    assert not failures, "\n".join(failures)


def test_sweep_is_broad_and_has_both_outcomes(results):
    sweep = results[0]["sweep"]
    assert len({mt for mt, _ in SWEEP}) >= 30
    outcomes = {("refused" in r[b]) for r in sweep.values() for b in SWEEP_BACKENDS}
    assert outcomes == {True, False}
    # the families once found silently wrong are now exact, or refused naming the layer
    for case in ("gpt2", "ctrl", "bert", "llama[dynamic]", "phi3[longrope]", "llama4_text", "deepseek_v2", "deepseek_v3"):
        assert all("refused" not in sweep[case][b] for b in SWEEP_BACKENDS), (case, sweep[case])
    assert "Lfm2ShortConv" in sweep["lfm2"]["zigzag_ring"]["refused"]
    # windows shorter than the sequence, soft-capping and sinks: exact (tests/distributed/test_hf_masks.py has more)
    for case in ("mistral", "gemma2", "gemma3_text", "cohere2", "gpt_oss", "modernbert"):
        assert all("refused" not in sweep[case][b] for b in SWEEP_BACKENDS), (case, sweep[case])
    # T5's learned relative-position bias (encoders): exact (tests/distributed/test_hf_masks.py: every backend)
    for case, cls in (("t5", "T5EncoderModel"), ("mt5", "MT5EncoderModel"), ("umt5", "UMT5EncoderModel")):
        assert sweep[case]["class"] == cls and all("refused" not in sweep[case][b] for b in SWEEP_BACKENDS), sweep[case]


def test_each_trap_reproduced_with_its_fix_off(results):
    for rank, res in enumerate(results):
        for trap, diff in res["traps"].items():
            assert diff > MISS, f"rank {rank}: {trap} with the fix off only differs by {diff:.3e} (control is vacuous)"


def test_readme_table_matches_the_sweep(results):
    text = README.read_text()
    match = re.search(re.escape(TABLE_BEGIN) + r"\n(.*?)\n" + re.escape(TABLE_END), text, re.S)
    assert match, f"README.md has no block between {TABLE_BEGIN!r} and {TABLE_END!r}"
    swept = TABLE_VERSION.search(match.group(1))
    assert swept, "README's HF support table does not name the transformers it was swept with"
    assert swept.group(1) == transformers.__version__, (
        f"README's HF support table was swept with transformers {swept.group(1)}, this environment has "
        f"{transformers.__version__}: `make install` installs the version constraints.txt pins; after upgrading on "
        "purpose, update constraints.txt and run `python scripts/hf_support_table.py --write`")
    assert match.group(1) == support_table(results[0]["sweep"]), (
        "README's HF support table is stale: run `python scripts/hf_support_table.py --write`")


def test_mla_exact_on_every_backend(results):
    """DeepSeek-V3's MLA (value head dim 6, query/key head dim 12) on the backends the sweep leaves out."""
    for rank, res in enumerate(results):
        for backend in MLA_BACKENDS:
            r = res["mla"][backend]
            assert "refused" not in r, (backend, r)
            assert max(r["logits"], r["loss"], r["grads"]) < TOL and r["control"] > MISS, (rank, backend, r)
