"""Hugging Face mask kwargs under sequence parallelism vs the unsharded HF model (its own eager attention), float64.

One spawn per world size (2 and 4) runs tiny registry models whose attention layers pass HF's per-layer mask
kwargs: Mistral (``sliding_window`` on every layer), Qwen2, Qwen3, Cohere2 and Gemma-3 (a sliding-window layer
beside a global one; Gemma-3 also with bidirectional layers), Gemma-2 (``softcap`` and alternating local/global
layers), gpt-oss (``s_aux`` sinks and windows) and ModernBERT (bidirectional local attention,
``|q - k| <= local_attention // 2``), on every backend, at a global length (13) no degree divides, with windows
smaller than a shard and spanning shards (and, for Mistral, right-padded rows of different lengths packed into
documents). Logits, loss and every parameter gradient (gpt-oss's sinks included) must equal the reference to 1e-9
(HF's own float32 roundings kept in float64: ``tests.hf_tiny.KeepFloat64``). Negative controls, each on the same
run with one mapping broken, must miss: the window ignored, the window one token too wide, the soft-cap ignored,
the sinks ignored.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed.harness import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.distributed

TOL = 1e-9
MISS = 1e-6
N = 13
BACKENDS = ("ulysses", "ring", "zigzag_ring", "allgather_kv", "usp", "colossal")
_TWO_LAYERS = ["sliding_attention", "full_attention"]
# (case, model_type, config overrides, feature controls): windows 3-5 are smaller than a shard at P = 2 (7 tokens)
# and span shards at P = 4 (4 tokens); larger weights (initializer_range) make the soft-cap and the sinks matter
CASES = (
    ("mistral", "mistral", {"sliding_window": 4}, ("window_ignored", "window_too_wide")),
    ("qwen3", "qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0,
                        "layer_types": _TWO_LAYERS}, ("window_ignored", "window_too_wide")),
    ("qwen2", "qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0,
                        "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    ("cohere2", "cohere2", {"sliding_window": 5, "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    ("gemma2", "gemma2", {"sliding_window": 4, "attn_logit_softcapping": 0.5, "final_logit_softcapping": None,
                          "layer_types": _TWO_LAYERS}, ("window_ignored", "softcap_ignored")),
    ("gemma3_text", "gemma3_text", {"sliding_window": 4, "layer_types": _TWO_LAYERS}, ("window_ignored",)),
    # EmbeddingGemma-style: bidirectional layers, the local ones |q - k| < sliding_window
    ("gemma3_bidirectional", "gemma3_text", {"sliding_window": 4, "layer_types": _TWO_LAYERS,
                                             "use_bidirectional_attention": True}, ("window_ignored", "window_too_wide")),
    ("gpt_oss", "gpt_oss", {"sliding_window": 4, "layer_types": _TWO_LAYERS}, ("window_ignored", "sinks_ignored")),
    ("modernbert", "modernbert", {"local_attention": 6, "global_attn_every_n_layers": 2},
     ("window_ignored", "window_too_wide")),
)


def _broken(control: str):
    """A ``_mask_and_sinks`` with one mapping broken (a negative control)."""
    from lightning_sp.integrations import transformers as integration

    right = integration._mask_and_sinks

    def broken(query, causal, kwargs):
        kwargs = dict(kwargs)
        if control == "window_ignored":
            kwargs.pop("sliding_window", None)
        elif control == "window_too_wide" and kwargs.get("sliding_window") is not None:
            kwargs["sliding_window"] += 1
        elif control == "softcap_ignored":
            kwargs.pop("softcap", None)
        elif control == "sinks_ignored":
            kwargs.pop("s_aux", None)
        return right(query, causal, kwargs)

    return broken


def _case(model_type: str, overrides: dict, controls: tuple, group) -> dict:
    import torch.nn.functional as F

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff, registry_model, sweep_batch

    base, masked = registry_model(model_type, {"initializer_range": 0.5, **overrides})
    base.set_attn_implementation("eager")  # the reference: HF's plain softmax with its soft-cap, sinks and masks
    batch = sweep_batch(masked, n=N)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"]).logits  # [1, N, V]
    shift = 0 if masked else 1
    loss_ref = F.cross_entropy(logits_ref[:, : N - shift].flatten(0, 1), batch["labels"][:, shift:].flatten())
    loss_ref.backward()

    def sharded(backend: str, grads: bool):
        model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
        shard = integration.shard_inputs(batch, model)
        labels = shard.pop("labels")
        logits = model(**shard).logits  # [1, S_local, V]
        full = gather_sequence(logits.detach(), group, layout=integration._sp_modules(model)[0].layout, seq_len=N)
        if not grads:
            return float((full - logits_ref.detach()).abs().max())
        loss = sequence_parallel_cross_entropy(logits, labels, group=group)
        loss.backward()
        grad_diff = max_grad_diff(model, ref, group)
        return {"logits": float((full - logits_ref.detach()).abs().max()),
                "loss": abs(float(loss.detach() - loss_ref.detach())), "grads": grad_diff}

    out: dict = {backend: sharded(backend, grads=True) for backend in BACKENDS}
    if model_type == "gpt_oss":  # the sinks' own gradient, by name (it must reach the module's parameter)
        out["sinks_grad_norm"] = float(ref.model.layers[0].self_attn.sinks.grad.abs().max())
    if model_type == "mistral":  # rows of different lengths (right padding) -> packed documents, windowed
        out["packed_rows"] = {backend: _packed_rows(base, backend, group) for backend in ("zigzag_ring", "ulysses")}
    right = integration._mask_and_sinks
    out["controls"] = {}
    for control in controls:
        integration._mask_and_sinks = _broken(control)
        try:
            out["controls"][control] = sharded("zigzag_ring", grads=False)
        finally:
            integration._mask_and_sinks = right
    return out


def _packed_rows(base, backend: str, group) -> dict:
    """Two right-padded rows (9 and 13 tokens) through ``shard_inputs`` (packed into 22 tokens, two documents) vs
    the padded batch through HF's eager attention: max differences of the real tokens' logits, the loss and the
    gradients."""
    import torch.nn.functional as F

    from lightning_sp import gather_sequence, sequence_parallel_cross_entropy
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff, tiny_rows

    lengths = (9, N)
    batch = tiny_rows("llama", lengths, pad_to=N)
    ref = clone(base)
    logits_ref = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [2, N, V]
    real = torch.cat([logits_ref[i, :n] for i, n in enumerate(lengths)])  # [22, V]
    loss_ref = F.cross_entropy(torch.cat([logits_ref[i, : n - 1] for i, n in enumerate(lengths)]),
                               torch.cat([batch["input_ids"][i, 1:n] for i, n in enumerate(lengths)]))
    loss_ref.backward()
    model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
    shard = integration.shard_inputs(batch, model)
    labels = shard.pop("labels")
    logits = model(**shard).logits
    loss = sequence_parallel_cross_entropy(logits, labels, group=group)
    loss.backward()
    grad_diff = max_grad_diff(model, ref, group)
    full = gather_sequence(logits.detach(), group, layout=integration._sp_modules(model)[0].layout, seq_len=sum(lengths))
    return {"logits": float((full[0] - real.detach()).abs().max()), "loss": abs(float(loss.detach() - loss_ref.detach())),
            "grads": grad_diff}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from tests.hf_tiny import KeepFloat64

    torch.manual_seed(0)
    with KeepFloat64():
        out = {name: _case(mt, ov, controls, dist.group.WORLD) for name, mt, ov, controls in CASES}
        out["padding_4d"] = _padding_and_4d_cases(dist.group.WORLD)
        out["block_diagonal"] = _block_diagonal_cases(dist.group.WORLD)
        out["t5_encoders"] = _t5_encoders(dist.group.WORLD)
        return out


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def results(request):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return request.param, run_on_ranks(_worker, request.param, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_exact_on_every_backend(results, case):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for backend in BACKENDS:
            r = res[case][backend]
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, (world, rank, case, backend, r)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_each_mapping_broken_misses(results, case):
    world, per_rank = results
    controls = dict((c[0], c[3]) for c in CASES)[case]
    for rank, res in enumerate(per_rank):
        assert set(res[case]["controls"]) == set(controls)
        for control, diff in res[case]["controls"].items():
            assert diff > MISS, f"P={world} rank {rank} {case}: {control} only differs by {diff:.3e}"


def test_sinks_have_a_gradient(results):
    """gpt-oss's sinks are compared with the reference's gradient above; that gradient is not zero."""
    _, per_rank = results
    assert all(res["gpt_oss"]["sinks_grad_norm"] > 1e-6 for res in per_rank)


def test_window_over_packed_rows_is_exact(results):
    """Right-padded rows of different lengths become packed documents; the window stays inside each."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        for backend, r in res["mistral"]["packed_rows"].items():
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, (world, rank, backend, r)


# ------------------------------------------------------------------------ padding and 4-D masks

PAD_LEFT = 4  # row 0: 4 padding tokens, then 9 real ones; row 1: 13 real tokens
PAD_BACKENDS = ("zigzag_ring", "ulysses")
ROWS_BACKENDS = ("ring", "zigzag_ring", "allgather_kv", "ulysses", "usp", "colossal")


def _left_padded_batch(name: str) -> dict:
    """Two rows of ``N``: row 0 left-padded (HF's ``padding_side='left'``), row 1 full; labels -100 on padding."""
    from tests.hf_tiny import PAD_ID, tiny_batch

    rows = [tiny_batch(name, N, seed=7 + i) for i in range(2)]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :PAD_LEFT] = 0
    batch["input_ids"][0, :PAD_LEFT] = PAD_ID
    batch["labels"][0, :PAD_LEFT] = -100
    batch["attention_mask"] = mask
    return batch


def _four_d(batch: dict, heads: int | None):
    """HF-style additive float 4-D masks: ``heads=None``: causal + the batch's padding, ``[B, 1, N, N]``; else an
    arbitrary per-head pattern ``[B, heads, N, N]`` (every query sees itself) that no structured mask describes."""
    q, k = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
    if heads is None:
        visible = (k <= q)[None, None] & batch["attention_mask"].bool()[:, None, None, :]
    else:
        h = torch.arange(heads).view(heads, 1, 1)
        visible = (((q + 2 * k + h) % 3 != 0) | (q == k)).expand(2, heads, N, N)
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)


def _hf_reference(base, name: str, batch: dict, attention_mask, real_only: bool):
    """HF's eager model on the padded batch -> (logits of the compared tokens in row order [T, V], loss, model):
    the loss counts real tokens predicting real tokens (``real_only``) or every labelled position."""
    import torch.nn.functional as F

    from tests.hf_tiny import clone, is_mlm

    ref = clone(base)
    logits = ref(input_ids=batch["input_ids"], attention_mask=attention_mask).logits  # [2, N, V]
    shift = 0 if is_mlm(name) else 1
    starts = (PAD_LEFT, 0) if real_only else (0, 0)
    kept = torch.cat([logits[i, s:] for i, s in enumerate(starts)])
    labels = batch["labels"]
    loss = F.cross_entropy(torch.cat([logits[i, s: N - shift] for i, s in enumerate(starts)]),
                           torch.cat([labels[i, s + shift:] for i, s in enumerate(starts)]), ignore_index=-100)
    loss.backward()
    return kept.detach(), loss.detach(), ref


def _sharded_run(base, batch: dict, backend: str, group, ref_logits, ref_loss, ref) -> dict:
    from lightning_sp import gather_sequence
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, max_grad_diff

    model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
    shard = integration.shard_inputs(batch, model)
    out = model(**shard)  # labels left in: the loss of model(**shard)
    out.loss.backward()
    layout = integration._sp_modules(model)[0].layout
    full = gather_sequence(out.logits.detach(), group, layout=layout, seq_len=shard["sequence_parallel"].seq_len)
    full = full.flatten(0, 1)  # [B' * N', V] in row order (packed rows: B' = 1)
    return {"logits": float((full - ref_logits).abs().max()) if full.shape == ref_logits.shape else float("inf"),
            "loss": abs(float(out.loss.detach() - ref_loss)), "grads": max_grad_diff(model, ref, group)}


def _padding_and_4d_cases(group) -> dict:
    """Left padding (2-D), the same as a recognised 4-D mask, and an arbitrary per-head 4-D mask, sharded, vs HF's
    eager model on the padded batch; the unsharded call with left padding (AttentionMask.key_padding); controls."""
    import warnings

    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, registry_model, tiny_model

    out: dict = {}
    for name in ("llama", "esm", "gpt2"):  # GPT-2: learned absolute positions (HF numbers the left padding too)
        base = registry_model(name)[0] if name == "gpt2" else tiny_model(name)
        base.set_attn_implementation("eager")
        batch = _left_padded_batch(name)
        ref_logits, ref_loss, ref = _hf_reference(base, name, batch, batch["attention_mask"], real_only=True)
        for backend in PAD_BACKENDS:
            out[(name, "left_padding_2d", backend)] = _sharded_run(base, batch, backend, group, ref_logits, ref_loss, ref)
        # negative control: HF's positions not kept (each row's positions restart at 0 after its padding)
        restarted = dict(batch, position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))
        if name == "gpt2":
            out[(name, "control_positions_restarted")] = _sharded_run(
                base, restarted, "zigzag_ring", group, ref_logits, ref_loss, clone(base))["logits"]
        # the unsharded model, padding passed to it: HF hands the 2-D mask to the attention (key_padding)
        local = integration.apply_sequence_parallel(clone(base), backend="local")
        logits = local(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        real = torch.cat([logits[0, PAD_LEFT:], logits[1]]).detach()
        out[(name, "unsharded_left_padding")] = float((real - ref_logits).abs().max())
    base = tiny_model("llama")
    base.set_attn_implementation("eager")
    batch = _left_padded_batch("llama")
    # a 4-D mask that is causal attention with left padding: recognised, the same as the 2-D mask
    causal_4d = dict(batch, attention_mask=_four_d(batch, heads=None))
    ref_logits, ref_loss, ref = _hf_reference(base, "llama", batch, causal_4d["attention_mask"], real_only=True)
    out[("llama", "causal_padding_4d", "zigzag_ring")] = _sharded_run(base, causal_4d, "zigzag_ring", group,
                                                                      ref_logits, ref_loss, ref)
    # an arbitrary per-head 4-D mask: each rank's query rows (a warning says what it costs)
    rows_4d = dict(batch, attention_mask=_four_d(batch, heads=4))
    ref_logits, ref_loss, ref = _hf_reference(base, "llama", batch, rows_4d["attention_mask"], real_only=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in ROWS_BACKENDS:
            out[("llama", "arbitrary_4d", backend)] = _sharded_run(base, rows_4d, backend, group, ref_logits, ref_loss,
                                                                   ref)
    out["rows_warning"] = [str(w.message) for w in caught if "query rows" in str(w.message)][:1]
    # what each rank holds: [B, H, N_pad / P, N_pad] rows, of its own (zigzag) positions, in its layout order
    import torch.distributed as dist

    from lightning_sp.layout import token_indices

    held = {}
    for backend in ("zigzag_ring", "ulysses"):
        model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = integration.shard_inputs(rows_4d, model)["sequence_parallel"].given_mask.mask.mask_mod
        layout, world = integration._sp_modules(model)[0].layout, dist.get_world_size(group)
        mine = token_indices(layout, world, rows.row_of.numel(), dist.get_rank(group))
        in_order = bool((rows.row_of[mine] == torch.arange(mine.numel())).all()) if backend == "zigzag_ring" else None
        held[backend] = (tuple(rows.rows.shape), rows.row_of.numel(), in_order)
    out["rows_held"] = held
    # negative controls: the 4-D mask ignored; every head given head 0's rows
    out["control_4d_ignored"] = _sharded_run(base, dict(batch, attention_mask=None), "zigzag_ring", group,
                                             ref_logits, ref_loss, clone(base))["logits"]
    heads_collapsed = dict(batch, attention_mask=rows_4d["attention_mask"][:, :1])
    out["control_4d_heads_collapsed"] = _sharded_run(base, heads_collapsed, "ulysses", group, ref_logits, ref_loss,
                                                     clone(base))["logits"]
    return out


def test_left_padding_and_4d_masks_are_exact(results):
    """Left padding (Llama, ESM, GPT-2) and a 4-D mask, sharded, equal HF's eager model on the padded batch
    (logits of the real tokens, the loss, every gradient) to 1e-9; an arbitrary per-head 4-D mask on the ring,
    zigzag, allgather_kv, Ulysses, usp and colossal layouts too (each rank reads its own rows, N_pad / P of them
    off Ulysses), with the memory warning; the unsharded model with left padding as well. Controls that must
    miss: HF's positions not kept, the 4-D mask ignored, heads collapsed."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        cases = res["padding_4d"]
        exact = {k: v for k, v in cases.items() if isinstance(k, tuple) and len(k) == 3}
        assert len(exact) == 3 * len(PAD_BACKENDS) + 1 + len(ROWS_BACKENDS)
        for key, r in exact.items():
            assert max(r["logits"], r["loss"], r["grads"]) < TOL, (world, rank, key, r)
        for name in ("llama", "esm", "gpt2"):
            assert cases[(name, "unsharded_left_padding")] < TOL, (world, rank, name, cases)
        for control in (("gpt2", "control_positions_restarted"), "control_4d_ignored", "control_4d_heads_collapsed"):
            assert cases[control] > MISS, (world, rank, control, cases[control])
        assert cases["rows_warning"] and "O(N^2 / P)" in cases["rows_warning"][0]
        shape, n_pad, in_order = cases["rows_held"]["zigzag_ring"]
        assert shape == (2, 4, n_pad // world, n_pad) and in_order, (world, rank, shape, n_pad)
        shape, n_pad, _ = cases["rows_held"]["ulysses"]
        assert shape == (2, 4, n_pad, n_pad), (world, rank, shape)  # Ulysses: every query position


# ------------------------------------------------------------------------ block-diagonal 4-D masks (packed sequences)

# row 0: documents of 5, 4 and 4 tokens; row 1: documents of 3 and 6 tokens, then 4 padding tokens
PACKED_DOCS = ([0] * 5 + [1] * 4 + [2] * 4, [0] * 3 + [1] * 6 + [-1] * 4)
TRAFFIC_N, TRAFFIC_DOC = 16, 4  # documents of 4 never cross a contiguous shard (8 tokens at P = 2, 4 at P = 4)


def _block_diagonal(doc_ids, bidirectional: bool = False) -> torch.Tensor:
    """Rows of document ids (-1 = padding) -> additive float64 ``[B, 1, N, N]``: each query sees its own document
    (causally unless ``bidirectional``), as packed-sequence collators build it."""
    ids = torch.tensor(doc_ids)  # [B, N]
    n = ids.size(1)
    visible = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)
    if not bidirectional:
        visible &= torch.arange(n)[None, :, None] >= torch.arange(n)[None, None, :]
    visible = visible[:, None]  # [B, 1, N, N]
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)


def _packed_batch(doc_ids, seed: int) -> dict:
    """``input_ids``, ``labels`` (-100 on padding), position ids restarting at 0 per document and the causal
    block-diagonal 4-D mask of ``doc_ids``."""
    ids_of = torch.tensor(doc_ids)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, 30, ids_of.shape, generator=g)
    starts = torch.ones_like(ids_of, dtype=torch.bool)
    starts[:, 1:] = ids_of[:, 1:] != ids_of[:, :-1]
    col = torch.arange(ids_of.size(1)).expand_as(ids_of)
    start_col = torch.where(starts, col, 0).cummax(-1).values
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(ids_of < 0, -100),
            "position_ids": (col - start_col).masked_fill(ids_of < 0, 0), "attention_mask": _block_diagonal(doc_ids)}


def _packed_reference(base, batch: dict, doc_ids):
    """HF's eager model on the padded batch with the 4-D mask and the restarted positions -> (real tokens' logits in
    row order [T, V], the loss of real tokens predicting real tokens, the model with its gradients)."""
    import torch.nn.functional as F

    from tests.hf_tiny import clone

    real = torch.tensor(doc_ids) >= 0
    ref = clone(base)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"]).logits  # [B, N, V]
    shifted = batch["labels"][:, 1:].masked_fill(~real[:, :-1], -100)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), ignore_index=-100)
    loss.backward()
    return logits[real].detach(), loss.detach(), ref


def _ring_bytes(model) -> int:
    """K/V (and dK/dV) bytes every attention layer of ``model`` sent (all-to-alls apart)."""
    from lightning_sp.integrations import transformers as integration

    return sum(b for sp in integration._sp_modules(model) for op, b in sp.comm_stats.bytes_by_op.items()
               if op != "all_to_all")


def _block_diagonal_cases(group) -> dict:
    """A block-diagonal 4-D mask with restarted position ids (two rows, different documents, one row padded) on
    every backend vs HF's eager model on the padded batch; the rows-path warning must not appear; the traffic of
    documents that never cross a shard on the contiguous ring (none) against the same model with a plain causal
    4-D mask (some); the control: the documents ignored (the plain causal mask over the same real tokens)."""
    import warnings

    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone, tiny_model

    base = tiny_model("llama")
    base.set_attn_implementation("eager")
    batch = _packed_batch(PACKED_DOCS, seed=11)
    ref_logits, ref_loss, ref = _packed_reference(base, batch, PACKED_DOCS)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in BACKENDS:
            out[backend] = _sharded_run(base, batch, backend, group, ref_logits, ref_loss, ref)
        out["cu_seqlens"] = integration.shard_inputs(batch, integration.apply_sequence_parallel(
            clone(base), group=group, backend="ring"))["sequence_parallel"].cu_seqlens.tolist()
        # bidirectional documents (the 4-D mask makes the causal Llama bidirectional inside each document)
        both_ways = dict(batch, attention_mask=_block_diagonal(PACKED_DOCS, bidirectional=True))
        b_logits, b_loss, b_ref = _packed_reference(base, both_ways, PACKED_DOCS)
        for backend in ("zigzag_ring", "ulysses"):
            out[("bidirectional", backend)] = _sharded_run(base, both_ways, backend, group, b_logits, b_loss, b_ref)
    out["rows_warnings"] = [str(w.message) for w in caught if "query rows" in str(w.message)]
    # negative control: the documents ignored (causal attention over each row's real tokens)
    real = torch.tensor(PACKED_DOCS) >= 0
    causal_real = [[0 if r else -1 for r in row] for row in real.tolist()]
    plain = dict(batch, attention_mask=_block_diagonal(causal_real))
    out["control_documents_ignored"] = _sharded_run(base, plain, "zigzag_ring", group, ref_logits, ref_loss,
                                                    clone(base))["logits"]
    # traffic: one row of documents of TRAFFIC_DOC tokens on the contiguous ring, and the same row plain causal
    docs = [[i // TRAFFIC_DOC for i in range(TRAFFIC_N)]]
    traffic_batch = _packed_batch(docs, seed=12)
    for what, doc_ids in (("documents", docs), ("causal", [[0] * TRAFFIC_N])):
        # "causal": the 4-D mask, not the restarted positions, says what attends (HF's rule): one document
        one = dict(traffic_batch, attention_mask=_block_diagonal(doc_ids))
        _, t_loss, _ = _packed_reference(base, one, doc_ids)
        model = integration.apply_sequence_parallel(clone(base), group=group, backend="ring")
        for sp in integration._sp_modules(model):
            sp.comm_stats.reset()
        out_model = model(**integration.shard_inputs(one, model))
        out_model.loss.backward()
        out[("traffic", what)] = (_ring_bytes(model), abs(float(out_model.loss.detach() - t_loss)))
    return out


def test_block_diagonal_4d_mask_is_documents_on_every_backend(results):
    """A block-diagonal (packed sequences) 4-D mask with restarted position ids, sharded: the rows packed into one
    row of documents (cu_seqlens), logits, loss and every gradient within 1e-9 of HF's eager model on the padded
    batch on every backend (bidirectional documents on zigzag_ring and Ulysses), with no O(N^2 / P) rows warning; documents that never cross a shard send no K/V byte on
    the contiguous ring (the plain causal mask sends some, and with the same restarted position ids stays one
    document: the mask, not the positions, says what attends, as in HF); the documents ignored miss."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        r = res["block_diagonal"]
        for backend in BACKENDS:
            assert max(r[backend]["logits"], r[backend]["loss"], r[backend]["grads"]) < TOL, (world, rank, backend, r)
        for backend in ("zigzag_ring", "ulysses"):
            b = r[("bidirectional", backend)]
            assert max(b["logits"], b["loss"], b["grads"]) < TOL, (world, rank, "bidirectional", backend, b)
        assert r["cu_seqlens"] == [0, 5, 9, 13, 16, 22], (world, rank, r["cu_seqlens"])
        assert not r["rows_warnings"], (world, rank, r["rows_warnings"])
        assert r["control_documents_ignored"] > MISS, (world, rank, r["control_documents_ignored"])
        (sent_docs, loss_docs), (sent_causal, loss_causal) = r[("traffic", "documents")], r[("traffic", "causal")]
        assert loss_docs < TOL and loss_causal < TOL, (world, rank, loss_docs, loss_causal)
        assert sent_docs == 0 and sent_causal > 0, (world, rank, sent_docs, sent_causal)


# ------------------------------------------------------------------------------ T5's learned relative-position bias

T5_ENCODERS = (("t5", "T5EncoderModel", "T5Config"), ("mt5", "MT5EncoderModel", "MT5Config"),
               ("umt5", "UMT5EncoderModel", "UMT5Config"))
# buckets and a reach smaller than the sequence (13), so distances past max_distance share a bucket
_T5_CONFIG = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, dropout_rate=0.0,
                  relative_attention_num_buckets=8, relative_attention_max_distance=6, pad_token_id=0)


def _t5_encoder(class_name: str, config_name: str):
    import transformers as tf

    torch.manual_seed(0)
    cfg = getattr(tf, config_name)(**_T5_CONFIG)
    model = getattr(tf, class_name)._from_config(cfg, attn_implementation="eager").double().eval()
    with torch.no_grad():  # a table large enough that the bias decides the attention
        for m in model.modules():
            if getattr(m, "has_relative_attention_bias", False):
                m.relative_attention_bias.weight.normal_(0.0, 2.0)
    return model


def _t5_reference(base, batch: dict, lengths, weight):
    """HF's eager encoder on the padded batch, the loss ``sum(hidden * weight)`` over the real tokens:
    ``(model with its gradients, real tokens' hidden states [1, sum(lengths), d], loss)``."""
    from tests.hf_tiny import clone

    ref = clone(base)
    hidden = ref(**batch).last_hidden_state  # [B, N, d]
    real = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])[None]
    loss_ref = (real * weight).sum()
    loss_ref.backward()
    return ref, real.detach(), loss_ref.detach()


def _t5_run(base, batch: dict, reference, weight, backend: str, group, control: str | None = None) -> dict:
    """The sharded encoder (``shard_inputs``: rows of different lengths are packed documents) against
    ``_t5_reference``: max differences of the hidden states, the loss and every parameter's gradient (summed over
    the group), and the smallest table gradient of the reference."""
    import torch.distributed as dist

    from lightning_sp import gather_sequence
    from lightning_sp.integrations import transformers as integration
    from tests.hf_tiny import clone

    ref, real, loss_ref = reference
    model = integration.apply_sequence_parallel(clone(base), group=group, backend=backend)
    right = integration._with_relative_position_bias

    def broken(mask, module, query, kwargs):  # a negative control: the bias dropped (in some layers)
        if control == "first_layer_only" and getattr(module, "has_relative_attention_bias", False):
            return right(mask, module, query, kwargs)
        kwargs.pop("position_bias", None)
        return mask

    if control is not None:
        integration._with_relative_position_bias = broken
    try:
        shard = integration.shard_inputs(batch, model)
        local = model(**shard).last_hidden_state  # [1, S_local, d]
    finally:
        integration._with_relative_position_bias = right
    layout = integration._sp_modules(model)[0].layout
    full = gather_sequence(local.detach(), group, layout=layout, seq_len=real.size(1))
    if control is not None:
        return {"hidden": float((full - real).abs().max())}
    loss = (local * shard_sequence_like(weight, group, layout)).sum()
    loss.backward()
    grads = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)  # each rank's share (its rows' part of every weight's gradient)
        grads = max(grads, float((g - (p_ref.grad if p_ref.grad is not None else 0)).abs().max()))
    loss_total = loss.detach().clone()
    dist.all_reduce(loss_total, group=group)
    tables = [m.relative_attention_bias.weight.grad for m in ref.modules()
              if getattr(m, "has_relative_attention_bias", False)]
    return {"hidden": float((full - real).abs().max()), "loss": abs(float(loss_total - loss_ref)),
            "grads": grads, "table_grad": min(float(t.abs().max()) for t in tables)}


def shard_sequence_like(weight, group, layout):
    from lightning_sp import shard_sequence

    return shard_sequence(weight, group, layout=layout)


def _t5_encoders(group) -> dict:
    """T5 and UMT5 encoders (UMT5: a table in every layer; T5: the first layer's, shared) on every backend over one
    row of 13 tokens, and on zigzag_ring over two right-padded rows (9, 13) packed into documents; MT5 (HF's T5
    attention, copied) on zigzag_ring only; the controls on zigzag_ring."""
    g = torch.Generator().manual_seed(3)
    one = {"input_ids": torch.randint(4, 63, (1, N), generator=g)}
    two = {"input_ids": torch.randint(4, 63, (2, N), generator=g),
           "attention_mask": (torch.arange(N)[None, :] < torch.tensor([[9], [N]])).long()}
    out = {}
    for name, class_name, config_name in T5_ENCODERS:
        base = _t5_encoder(class_name, config_name)
        res = {}
        for batch, lengths, tag in ((one, (N,), "row"), (two, (9, N), "packed_rows")):
            weight = torch.randn(1, sum(lengths), _T5_CONFIG["d_model"], generator=g, dtype=torch.float64)
            reference = _t5_reference(base, batch, lengths, weight)
            backends = BACKENDS if tag == "row" and name != "mt5" else ("zigzag_ring",)
            res[tag] = {backend: _t5_run(base, batch, reference, weight, backend, group) for backend in backends}
            if tag == "row":
                res["controls"] = {c: _t5_run(base, batch, reference, weight, "zigzag_ring", group, control=c)["hidden"]
                                   for c in ("bias_ignored",) + (("first_layer_only",) if name != "umt5" else ())}
        out[name] = res
    return out


@pytest.mark.parametrize("encoder", [e[0] for e in T5_ENCODERS])
def test_t5_encoders_with_their_relative_bias_are_exact_on_every_backend(results, encoder):
    """Hidden states, the loss and every parameter's gradient (the bucket tables' included, summed over the group)
    within 1e-9 of HF's eager encoder; right-padded rows of different lengths packed into documents too. Controls:
    the bias ignored, and (T5, MT5) the later layers without the first layer's table, both miss."""
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        r = res["t5_encoders"][encoder]
        for tag in ("row", "packed_rows"):
            for backend, d in r[tag].items():
                assert max(d["hidden"], d["loss"], d["grads"]) < TOL, (world, rank, encoder, tag, backend, d)
                assert d["table_grad"] > 1e-3, (world, rank, encoder, tag, backend, d)
        assert set(r["controls"]) == ({"bias_ignored"} | ({"first_layer_only"} if encoder != "umt5" else set()))
        for control, diff in r["controls"].items():
            assert diff > MISS, f"P={world} rank {rank} {encoder}: {control} only differs by {diff:.3e}"
