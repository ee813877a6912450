"""Cross-rank checks never deadlock: steps run normally, then ONE rank's input changes
at a later step; every rank must raise ``ValueError`` within ``RAISE_WITHIN_S`` naming the ranks and their
values, where a check that some ranks skip would wait for the process-group timeout.

The process groups time out after ``PG_TIMEOUT_S`` (30 s), so a regression fails as a timeout (a
``RuntimeError`` after 30 s), not as a slow pass. Negative control: the same change with the good ranks
skipping the check (what a rank-local cache of seen signatures did) times out instead of raising.
Spawns: standalone attention at P=4 and P=2, a Trainer at P=4.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_on_ranks

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 30
RAISE_WITHIN_S = 2.0
N, H, D = 32, 4, 8
BAD_STEP = 2
BACKENDS = ("ring", "zigzag_ring", "ulysses", "allgather_kv", "usp", "colossal", "auto")
CHANGES = ("length", "padded_length", "dtype", "heads", "cu_seqlens", "bad_cu_seqlens", "not_4d", "memory_budget")
# memory_budget: one rank sets a budget at BAD_STEP; whole-block rings copy blocks head-major only without one, so the
# ranks would read each other's blocks in different layouts (Note [Head-major blocks]): it must be rejected too
# The check runs before the backend does anything: every backend once, every change on zigzag_ring.
CASES_P4 = (*((b, "length") for b in BACKENDS), *(("zigzag_ring", c) for c in CHANGES[1:]))
CASES_P2 = (("ring", "length"), ("zigzag_ring", "padded_length"), ("usp", "dtype"), ("allgather_kv", "bad_cu_seqlens"),
            ("colossal", "heads"))
GOOD_DOCS = [0, 2, 8, N]
BAD_DOCS = [0, 5, 6, N]  # same count, same position-weighted sum as GOOD_DOCS (the old checksum collided)


def _global(seed, n, heads, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def _step_inputs(change: str, step: int, bad: bool):
    """``(n, heads, dtype, cu_seqlens, make_3d)`` of this rank at ``step``; only the bad rank at BAD_STEP differs."""
    n, heads, dtype, docs, flat = N, H, torch.float32, None, False
    if change in ("cu_seqlens", "bad_cu_seqlens"):
        docs = GOOD_DOCS
    if bad and step == BAD_STEP:
        if change == "length":
            n = 2 * N  # another shard length
        elif change == "padded_length":
            n = N - 1  # the same shard length (zigzag pads to 2P), another global length
        elif change == "dtype":
            dtype = torch.float64
        elif change == "heads":
            heads = 2 * H
        elif change == "cu_seqlens":
            docs = BAD_DOCS
        elif change == "bad_cu_seqlens":
            docs = [0, 8, 2, N]  # decreasing: a local error on this rank only
        elif change == "not_4d":
            flat = True
    cu = torch.tensor(docs, dtype=torch.int32) if docs is not None else None
    return n, heads, dtype, cu, flat


def _expected(change: str, bad_rank: int, world: int) -> str:
    """A regex every rank's message must match at BAD_STEP: the bad rank and its value."""
    if change in ("bad_cu_seqlens", "not_4d"):  # a local error: the bad rank says what, its peers who
        return rf"rejected their attention inputs.*\{{{bad_rank}: '(bad cu_seqlens|q, k, v are not 4-D)"
    field, value = {
        "length": ("S_local", str(2 * N // world)), "padded_length": ("seq_len", str(N - 1)),
        "dtype": ("dtype", "torch.float64"), "heads": ("H", str(2 * H)), "cu_seqlens": ("hash\\(cu_seqlens\\)", r"\d+"),
        "memory_budget": (r"hash\(auto_policy, hardware, ranks_per_node, memory_budget\)", r"\d+"),
    }[change]
    return rf"different inputs.*\n(.*\n)*  {field}: .*{value} on rank \[{bad_rank}\]"


def _attempt(fn):
    """``("ok", s)``, ``("ValueError", s, message)`` or ``("other", s, message)``; ``s``: seconds to return."""
    dist.barrier()  # time from the moment every rank is ready, not from a rank's late arrival
    start = time.monotonic()
    try:
        fn()
        return ("ok", time.monotonic() - start)
    except ValueError as e:
        return ("ValueError", time.monotonic() - start, str(e))
    except Exception as e:  # noqa: BLE001 - a timeout here is the regression this module exists for
        return ("other", time.monotonic() - start, f"{type(e).__name__}: {e}")


def _standalone_worker(rank: int, world: int, bad_rank: int, cases: tuple, negative_control: bool) -> dict:
    from lightning_sp import SequenceParallelAttention, shard_sequence

    group = dist.group.WORLD
    results = {}
    for backend, change in cases:
        attn = SequenceParallelAttention(causal=True, backend=backend, group=group,
                                         ulysses_degree=2 if backend == "usp" and world == 4 else None,
                                         # explicit whole blocks: the budget then decides nothing but the layout
                                         kv_pieces=1 if change == "memory_budget" else "auto")
        outcomes = []
        for step in range(BAD_STEP + 1):
            n, heads, dtype, cu, flat = _step_inputs(change, step, rank == bad_rank)
            if change == "memory_budget":
                attn.memory_budget = 1 << 40 if rank == bad_rank and step == BAD_STEP else None
            q, k, v = (shard_sequence(t, group, layout=attn.layout).requires_grad_()
                       for t in _global(step, n, heads, dtype))

            def run(q=q, k=k, v=v, cu=cu, flat=flat):
                out = attn(q[0] if flat else q, k, v, cu_seqlens=cu)
                out.sum().backward()

            outcomes.append(_attempt(run))
        results[(backend, change)] = outcomes
    if negative_control:  # the transformers integration rejects one rank's call before its attention runs
        from lightning_sp.integrations.transformers import _STATE_ATTR, ShardInfo, _State, sequence_parallel_attention

        layer = torch.nn.Module()
        layer.is_causal, layer.sp_attention = True, SequenceParallelAttention(backend="zigzag_ring", group=group)
        outcomes = []
        for step in range(BAD_STEP + 1):
            stale = rank == bad_rank and step == BAD_STEP  # another batch's ShardInfo
            setattr(layer, _STATE_ATTR, _State())
            info = ShardInfo(seq_len=N, padded_len=2 * N if stale else N)
            q, k, v = (shard_sequence(t, group, layout=layer.sp_attention.layout).transpose(1, 2)  # [B, H, S/P, D]
                       for t in _global(step, N, H, torch.float32))
            outcomes.append(_attempt(lambda q=q, k=k, v=v, info=info: sequence_parallel_attention(
                layer, q, k, v, None, sequence_parallel=info)))
        results["transformers"] = outcomes
    if negative_control:  # the old rank-local cache: the good ranks skip the check the bad rank runs
        short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3))
        attn = SequenceParallelAttention(causal=True, backend="ring", group=short, validate_inputs=rank == bad_rank)
        n = 2 * N if rank == bad_rank else N
        q, k, v = (shard_sequence(t, short) for t in _global(0, n, H, torch.float32))
        results["negative_control"] = _attempt(lambda: attn(q, k, v))
    return results


def _check_standalone(results: list[dict], bad_rank: int, cases: tuple) -> None:
    assert [key for key in results[0] if key not in ("negative_control", "transformers")] == list(cases)
    for key in cases:
        backend, change = key
        for rank, per_rank in enumerate(results):
            outcomes = per_rank[key]
            assert [o[0] for o in outcomes[:BAD_STEP]] == ["ok"] * BAD_STEP, (key, rank, outcomes)
            kind, seconds, message = outcomes[BAD_STEP]
            assert kind == "ValueError", (key, rank, message)
            assert seconds < RAISE_WITHIN_S, f"{key}: rank {rank} raised after {seconds:.2f}s"
            if rank == bad_rank and change in ("bad_cu_seqlens", "not_4d"):
                assert re.search(r"never decrease|\[B, S_local, H, D\]", message), (key, message)
            else:
                assert re.search(_expected(change, bad_rank, len(results)), message), (key, rank, message)


# ------------------------------------------------------------------------------- the Lightning strategy
STRATEGY_CASES = (  # (backend, change of the bad rank's batch at BAD_STEP)
    ("zigzag_ring", "length"), ("ulysses", "missing_key"), ("ring", "no_sequence"),
)


def _strategy_worker(rank: int, world: int, bad_rank: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_sp.strategy import SequenceParallelStrategy
    from tests.distributed.test_strategy import _dataset, _make_model

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    results = {}
    for backend, change in STRATEGY_CASES:
        made = {"batches": 0, "bad_at": None}

        def collate(samples, change=change):
            batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}  # [B, N]
            made["batches"] += 1
            if made["batches"] == BAD_STEP + 1:
                made["bad_at"] = time.monotonic()
                if rank == bad_rank:
                    if change == "length":  # the sequences [B, N] -> [B, N + 1]; the samples' index [B] stays
                        batch = {key: torch.cat([t, t[:, :1]], dim=1) if t.dim() == 2 else t for key, t in batch.items()}
                    elif change == "dtype":
                        batch["input_ids"] = batch["input_ids"].int()
                    elif change == "missing_key":
                        del batch["labels"]
                    elif change == "no_sequence":
                        batch = {key: t[:, 0] if t.dim() == 2 else t for key, t in batch.items()}  # [B]: no sequence dim
            return batch

        os.environ["WORLD_SIZE"] = str(world)
        strategy = SequenceParallelStrategy(world, backend=backend, process_group_timeout=PG_TIMEOUT_S)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, precision="64-true", max_steps=BAD_STEP + 2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )
        dist.barrier()
        try:
            trainer.fit(_make_model(causal=True), DataLoader(_dataset(8), batch_size=1, shuffle=False, collate_fn=collate))
            results[(backend, change)] = ("finished", None, made["batches"])
        except ValueError as e:
            results[(backend, change)] = ("ValueError", time.monotonic() - made["bad_at"], str(e))
        except Exception as e:  # noqa: BLE001 - a timeout is the regression
            results[(backend, change)] = ("other", None, f"{type(e).__name__}: {e}")
    return results


def _four_rank_worker(rank: int, world: int) -> dict:
    return {"standalone": _standalone_worker(rank, world, 1, CASES_P4, False), "strategy": _strategy_worker(rank, world, 2)}


@pytest.fixture(scope="module")
def four_ranks():  # the one spawn of 4 ranks of this module
    return run_on_ranks(_four_rank_worker, 4, timeout_s=600, pg_timeout_s=PG_TIMEOUT_S)


@pytest.mark.timeout(600)  # it spawns the 4 ranks (13 standalone cases, then 3 Trainer fits)
def test_one_rank_changing_at_a_later_step_raises_everywhere_p4(four_ranks):
    _check_standalone([r["standalone"] for r in four_ranks], 1, CASES_P4)


@pytest.mark.timeout(600)
def test_one_rank_changing_at_a_later_step_raises_everywhere_p2_and_negative_control():
    results = run_on_ranks(_standalone_worker, 2, args=(0, CASES_P2, True), timeout_s=400, pg_timeout_s=PG_TIMEOUT_S)
    _check_standalone(results, 0, CASES_P2)
    for rank, per_rank in enumerate(results):  # a caller's rejection on rank 0 reaches rank 1 too
        outcomes = per_rank["transformers"]
        assert [o[0] for o in outcomes] == ["ok"] * BAD_STEP + ["ValueError"], (rank, outcomes)
        seconds, message = outcomes[BAD_STEP][1:]
        assert seconds < RAISE_WITHIN_S, (rank, seconds)
        expected = "belongs to another batch" if rank == 0 else r"rejected their attention inputs.*\{0: 'rejected by its caller"
        assert re.search(expected, message), (rank, message)
    for rank, per_rank in enumerate(results):  # skipping the check on some ranks: a timeout, not a message
        kind, seconds, message = per_rank["negative_control"]
        assert kind == "other" and seconds > 2.5, (rank, seconds, message)


@pytest.mark.timeout(600)  # when run alone it spawns the 4 ranks
def test_trainer_batch_changing_on_one_rank_raises_everywhere(four_ranks):
    from tests.distributed.test_strategy import SEQ_LEN

    results = [r["strategy"] for r in four_ranks]
    expected = {
        "length": rf"seq_len: {SEQ_LEN} on ranks \[0, 1, 3\]; {SEQ_LEN + 1} on rank \[2\]",
        "dtype": r"hash\(keys, shapes, dtypes\): .* on rank \[2\]",
        "missing_key": r"hash\(keys, shapes, dtypes\): .* on rank \[2\]",
        "no_sequence": r"could not shard their batch .*\{2: 'no sequence tensor",
    }
    for (backend, change) in STRATEGY_CASES:
        for rank, per_rank in enumerate(results):
            kind, seconds, message = per_rank[(backend, change)]
            assert kind == "ValueError", ((backend, change), rank, message)
            assert seconds < RAISE_WITHIN_S, f"{backend}/{change}: rank {rank} raised after {seconds:.2f}s"
            if rank == 2 and change == "no_sequence":
                assert "found no sequence tensor" in message, message
            else:
                assert re.search(expected[change], message), ((backend, change), rank, message)
