"""4-D attention masks recognised as structured masks (or not), block-diagonal ones (packed sequences) as documents,
and their exactness on the unsharded model against HF's eager attention given the same mask (float64). The sharded
runs: tests/distributed/test_hf_masks.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_sp.integrations import transformers as integration  # noqa: E402
from tests.hf_tiny import KeepFloat64, clone, tiny_model  # noqa: E402

N = 11
Q, K = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
CAUSAL = K <= Q
REAL = torch.tensor([[0] * 3 + [1] * 8, [1] * 9 + [0] * 2]).bool()  # row 0 left-, row 1 right-padded


def _batched(visible):
    return visible.expand(2, 1, N, N) if visible.dim() == 2 else visible


def _same_document(doc_ids) -> torch.Tensor:
    """``doc_ids [N]`` (-1 = padding) -> ``[N, N]``: query and key in one document (padding in none)."""
    ids = torch.tensor(doc_ids)
    return (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)


# row 0: 3 padding tokens, documents of 3 and 5; row 1: documents of 2, 3 and 4, then 2 padding tokens
DOCS_0 = [-1] * 3 + [0] * 3 + [1] * 5
DOCS_1 = [0] * 2 + [1] * 3 + [2] * 4 + [-1] * 2
PACKED = torch.stack([_same_document(DOCS_0), _same_document(DOCS_1)])[:, None]  # [2, 1, N, N]
TWO_DOCS = (Q < 5) == (K < 5)  # documents [0, 5) and [5, 11)
SPLIT = ((0, 5, N), (0, 5, N))


def _flipped(visible, q, k):
    out = visible.clone()
    out[..., q, k] = ~out[..., q, k]
    return out


# name -> (visible [B, 1 or H, N, N] or [N, N], expected (causal, window, padded, documents) or None: not recognised)
PATTERNS = {
    "causal": (CAUSAL, (True, None, False, None)),
    "bidirectional": (torch.ones(N, N, dtype=torch.bool), (False, None, False, None)),
    "causal_window_4": (CAUSAL & (Q - K < 4), (True, (3, 0), False, None)),
    "bidirectional_window": ((Q - K).abs() <= 2, (False, (2, 2), False, None)),
    "causal_padding": (CAUSAL[None, None] & REAL[:, None, None, :], (True, None, True, None)),
    "causal_padding_window": ((CAUSAL & (Q - K < 3))[None, None] & REAL[:, None, None, :], (True, (2, 0), True, None)),
    "bidirectional_padding": (REAL[:, None, :, None] & REAL[:, None, None, :], (False, None, True, None)),
    # block-diagonal (packed sequences): documents
    "documents": (CAUSAL & TWO_DOCS, (True, None, False, SPLIT)),
    "documents_bidirectional": (TWO_DOCS, (False, None, False, SPLIT)),
    "documents_per_row_with_padding": (CAUSAL & PACKED, (True, None, True, ((0, 3, 8), (0, 2, 5, 9)))),
    "documents_bidirectional_per_row_with_padding": (PACKED, (False, None, True, ((0, 3, 8), (0, 2, 5, 9)))),
    "documents_per_head_copies": ((CAUSAL & PACKED).expand(2, 4, N, N), (True, None, True, ((0, 3, 8), (0, 2, 5, 9)))),
    "documents_window": (CAUSAL & TWO_DOCS & (Q - K < 3), (True, (2, 0), False, SPLIT)),
    "documents_of_one_token": (Q == K, (True, (0, 0), False, None)),  # read as the fewer parts: a window of 1
    # not recognised: rows
    "strided": (CAUSAL & ((Q - K) % 2 == 0), None),
    "heads_differ": (torch.stack([CAUSAL, torch.ones(N, N, dtype=torch.bool)])[None].expand(2, 2, N, N), None),
    "hole_in_padding": (CAUSAL[None, None] & torch.tensor([1] * 4 + [0] + [1] * 6).bool()[None, None, None, :], None),
    "documents_one_entry_hidden": (_flipped(CAUSAL & TWO_DOCS, 7, 6), None),
    "documents_one_entry_across": (_flipped(CAUSAL & TWO_DOCS, 8, 2), None),
    "documents_bidirectional_one_entry_across": (_flipped(TWO_DOCS, 2, 8), None),
    "document_sees_the_previous_ones_last_token": (CAUSAL & (TWO_DOCS | (K == 4)), None),
    "document_not_contiguous": (_same_document([0, 0, 1, 1, 0, 0, 2, 2, 2, 2, 2]), None),  # {0, 1, 4, 5} and {2, 3}
    "documents_heads_differ": (torch.stack([CAUSAL & TWO_DOCS, CAUSAL])[None].expand(2, 2, N, N), None),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_patterns_recognised_or_not(name):
    visible, expected = PATTERNS[name]
    got = integration._recognised_pattern(_batched(visible))
    if expected is None:
        assert got is None
        return
    assert (got.causal, got.window, not bool(got.real.all()), got.documents) == expected


def test_additive_block_diagonal_mask_is_recognised():
    """HF's additive form (0 / finfo.min) of a block-diagonal mask is the same documents as the bool form."""
    visible = (CAUSAL & PACKED).expand(2, 4, N, N)
    additive = torch.zeros(visible.shape, dtype=torch.float32).masked_fill(~visible, torch.finfo(torch.float32).min)
    got = integration._recognised_pattern(integration._four_d_visible(additive, 2, N, 4))
    assert got is not None and got.documents == ((0, 3, 8), (0, 2, 5, 9)) and got.causal


@pytest.mark.parametrize("name", ["causal_window_4", "bidirectional_window", "bidirectional_padding", "strided"])
def test_unsharded_model_with_a_4d_mask_matches_hf_eager(name):
    """The 4-D mask (recognised, or as rows) is the whole mask, as in HF's eager attention: the causal Llama turns
    bidirectional where the mask says so. Compared on the queries that see some key (zeros elsewhere: HF's
    eager averages the values there)."""
    visible = _batched(PATTERNS[name][0])
    additive = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    ids = torch.randint(4, 30, (2, N), generator=torch.Generator().manual_seed(0))
    with KeepFloat64():
        base = tiny_model("llama")
        base.set_attn_implementation("eager")
        ref = clone(base)(input_ids=ids, attention_mask=additive).logits
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        with pytest.warns(UserWarning, match="query rows") if name == "strided" else _no_warning():
            got = model(input_ids=ids, attention_mask=visible).logits
        ignored = model(input_ids=ids).logits  # negative control: the plain causal model
    seen = visible.any(-1).all(1)  # [B, N] queries that see some key
    assert (got - ref)[seen].abs().max() < 1e-9
    assert (ignored - ref)[seen].abs().max() > 1e-4


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def _additive(visible):
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)


def _restarted_positions(doc_ids) -> torch.Tensor:
    """``[N]`` positions restarting at 0 in each document (padding: 0), as packed-sequence collators give them."""
    ids = torch.tensor(doc_ids)
    pos = torch.zeros(len(doc_ids), dtype=torch.long)
    for d in set(doc_ids) - {-1}:
        where = torch.nonzero(ids == d).flatten()
        pos[where] = torch.arange(where.numel())
    return pos


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind", ["causal", "bidirectional", "causal_window_2"])
def test_unsharded_model_with_a_block_diagonal_mask_matches_hf_eager(rows, kind):
    """A block-diagonal 4-D mask (with padding) given to the unsharded model directly: one row runs as documents
    (cu_seqlens, no warning; a window inside the documents too); several rows cannot be one row of documents there,
    so they run as rows, with a warning
    that says why. Real tokens' logits equal HF's eager attention given the same mask and positions; the control
    (the documents ignored: the plain causal mask over the real tokens) misses."""
    visible = {"causal": CAUSAL & PACKED, "bidirectional": PACKED, "causal_window_2": CAUSAL & PACKED & (Q - K < 2)}[kind]
    visible = visible[:rows]
    pos = torch.stack([_restarted_positions(DOCS_0), _restarted_positions(DOCS_1)])[:rows]
    ids = torch.randint(4, 30, (rows, N), generator=torch.Generator().manual_seed(0))
    real = torch.stack([torch.tensor(DOCS_0), torch.tensor(DOCS_1)])[:rows] >= 0  # [rows, N]
    plain = (CAUSAL[None, None] & real[:, None, None, :] & real[:, None, :, None])
    with KeepFloat64():
        base = tiny_model("llama")
        base.set_attn_implementation("eager")
        ref = clone(base)(input_ids=ids, attention_mask=_additive(visible), position_ids=pos).logits
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        with pytest.warns(UserWarning, match="several rows") if rows > 1 else _no_warning():
            got = model(input_ids=ids, attention_mask=visible, position_ids=pos).logits
        ignored = model(input_ids=ids, attention_mask=plain, position_ids=pos).logits
    assert (got - ref)[real].abs().max() < 1e-9
    assert (ignored - ref)[real].abs().max() > 1e-4


@pytest.mark.parametrize("restarted", [True, False])
def test_shard_inputs_turns_a_block_diagonal_mask_into_documents(restarted):
    """``shard_inputs`` (one process) packs the rows of a block-diagonal 4-D mask into one row of documents: the
    ShardInfo's cu_seqlens are the documents, the positions are what HF's RoPE sees (the given ones, restarted per
    document, or without them HF's column of each row), padding is dropped, and model(**shard) equals HF's eager
    model on the padded batch (real tokens' logits and the loss)."""
    import torch.nn.functional as F

    pos = torch.stack([_restarted_positions(DOCS_0), _restarted_positions(DOCS_1)])
    if not restarted:
        pos = torch.arange(N).expand(2, N)
    ids = torch.randint(4, 30, (2, N), generator=torch.Generator().manual_seed(1))
    real = torch.stack([torch.tensor(DOCS_0), torch.tensor(DOCS_1)]) >= 0
    labels = ids.masked_fill(~real, -100)
    visible = CAUSAL & PACKED
    with KeepFloat64():
        base = tiny_model("llama")
        base.set_attn_implementation("eager")
        ref = clone(base)(input_ids=ids, attention_mask=_additive(visible),
                          position_ids=pos if restarted else None).logits
        shifted = labels[:, 1:].masked_fill(~real[:, :-1], -100)  # padding predicts nothing (the guide's rule)
        loss_ref = F.cross_entropy(ref[:, :-1].flatten(0, 1), shifted.flatten(), ignore_index=-100)
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        batch = {"input_ids": ids, "labels": labels, "attention_mask": visible}
        if restarted:
            batch["position_ids"] = pos
        with _no_warning():
            shard = integration.shard_inputs(batch, model)
        info = shard["sequence_parallel"]
        assert info.cu_seqlens.tolist() == [0, 3, 8, 10, 13, 17] and info.seq_len == 17
        assert torch.equal(shard["position_ids"][0], pos[real])
        assert torch.equal(shard["input_ids"][0], ids[real])
        out = model(**shard)
    assert (out.logits[0] - ref[real]).abs().max() < 1e-9
    assert abs(float(out.loss.detach() - loss_ref.detach())) < 1e-9
    with pytest.raises(ValueError, match="pass one of them"):
        integration.shard_inputs(dict(batch, cu_seqlens=torch.tensor([0, 17])), model)


@pytest.mark.parametrize("model_type", ["llama4_text", "mistral"])
def test_a_4d_mask_replaces_chunks_and_windows(model_type):
    """HF hands a 4-D mask to every layer as given, so Llama-4's chunked layers (chunks of 4 here) and Mistral's
    sliding window (3) attend as the mask says, not in chunks or windows: a block-diagonal mask, given to the
    unsharded model and through ``shard_inputs`` (one process), equals HF's eager model with it. The control: the
    same mask cut at the chunk boundaries / to the window too (what the layers would run if they kept theirs)
    misses."""
    from tests.hf_tiny import registry_model

    doc_ids = [0] * 6 + [1] * 5  # documents longer than a chunk
    visible = (CAUSAL & _same_document(doc_ids))[None, None]  # [1, 1, N, N]
    pos = _restarted_positions(doc_ids)[None]
    ids = torch.randint(4, 60, (1, N), generator=torch.Generator().manual_seed(2))
    with KeepFloat64():
        if model_type == "llama4_text":
            base = registry_model(model_type)[0]
            assert "chunked_attention" in base.config.layer_types and base.config.attention_chunk_size == 4
            chunked = visible & ((Q // 4) == (K // 4))
        else:
            base = registry_model(model_type, {"sliding_window": 3})[0]
            chunked = visible & (Q - K < 3)
        base.set_attn_implementation("eager")
        ref = clone(base)(input_ids=ids, attention_mask=_additive(visible), position_ids=pos).logits
        ref_chunked = clone(base)(input_ids=ids, attention_mask=_additive(chunked), position_ids=pos).logits
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        got = model(input_ids=ids, attention_mask=visible, position_ids=pos).logits
        shard = integration.shard_inputs({"input_ids": ids, "attention_mask": visible, "position_ids": pos}, model)
        assert shard["sequence_parallel"].cu_seqlens.tolist() == [0, 6, 11]
        got_sharded = model(**shard).logits
    assert (got - ref).abs().max() < 1e-9 and (got_sharded - ref).abs().max() < 1e-9
    assert (ref_chunked - ref).abs().max() > 1e-4


def test_an_unsharded_4d_mask_is_read_once_per_tensor_not_per_layer(monkeypatch):
    """HF hands every layer the same mask tensor: it is read once per forward; the same tensor changed in place, or
    another tensor, is read again (and the logits follow it)."""
    reads = []
    real_read = integration._read_given_mask
    monkeypatch.setattr(integration, "_read_given_mask", lambda *a: reads.append(1) or real_read(*a))
    visible = _batched(PATTERNS["causal_window_4"][0]).clone()
    ids = torch.randint(4, 30, (2, N), generator=torch.Generator().manual_seed(0))
    with KeepFloat64():
        base = tiny_model("llama")
        assert base.config.num_hidden_layers > 1
        model = integration.apply_sequence_parallel(clone(base), backend="local")
        first = model(input_ids=ids, attention_mask=visible).logits
        assert len(reads) == 1  # control: without the memo, one read per layer
        visible[..., 0] = False  # in place: the first key hidden from every query
        changed = model(input_ids=ids, attention_mask=visible).logits
        assert len(reads) == 2
        fresh = model(input_ids=ids, attention_mask=visible.clone()).logits
        assert len(reads) == 3
    assert (changed - first).abs().max() > 1e-4
    assert (fresh - changed).abs().max() < 1e-12


def test_a_4d_mask_held_as_rows_is_compared_across_ranks_by_its_contents():
    """Ranks given different unrecognised 4-D masks must disagree in the cross-rank check (which compares
    ``AttentionMask.signature()``), not run different attention silently; the same mask agrees, whichever rows a
    rank holds."""
    visible = _batched(PATTERNS["strided"][0]).clone()
    other = visible.clone()
    other[0, 0, N - 1, 0] = ~other[0, 0, N - 1, 0]
    with pytest.warns(UserWarning, match="query rows"):
        rank0 = integration._dense_rows_mask(visible, torch.arange(0, 6), 12)
        rank1 = integration._dense_rows_mask(visible, torch.arange(6, 12), 12)
        changed = integration._dense_rows_mask(other, torch.arange(6, 12), 12)
    assert rank0.signature() == rank1.signature()
    assert changed.signature() != rank1.signature()  # control: by name alone they would agree
