"""The cost model (``lightning_sp/cost_model.py``) and ``backend="auto"``'s use of it, without processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_sp import cost_model as cm
from lightning_sp.attention import resolve_auto_backend

A100 = cm.preset("a100-80gb")
SHAPE = cm.AttentionShape(seq_len=65536, num_heads=32, num_kv_heads=8, head_dim=128)


def test_ulysses_comm_falls_as_one_over_p():
    times = {p: cm.predict_attention("ulysses", SHAPE, p, replace(A100, intra_latency=0.0)).comm_s for p in (2, 4, 8)}
    # bytes per rank fall as 1/P (the send buffer, as CommStats counts it) and no latency: time ~ 1/P
    assert times[4] == pytest.approx(times[2] / 2, rel=1e-9)
    assert times[8] == pytest.approx(times[2] / 4, rel=1e-9)
    # negative control: the ring's transfer does not fall as 1/P
    ring = {p: cm.predict_attention("zigzag_ring", SHAPE, p, A100).comm_s for p in (2, 8)}
    assert ring[8] > ring[2] / 2


def test_ring_overlap_hides_transfer_when_blocks_are_big():
    slow_compute = replace(A100, attention_curve=((1, 1e12),))  # compute per block >> transfer
    fast_compute = replace(A100, attention_curve=((1, 1e17),))  # compute per block << transfer
    hidden = cm.predict_attention("zigzag_ring", SHAPE, 8, slow_compute)
    exposed = cm.predict_attention("zigzag_ring", SHAPE, 8, fast_compute)
    # forward and the backward's K/V transfers hide; what remains: the dK/dV partial sums (fp32, one per
    # ring step, not overlapped) and the cross-rank check (one small all-gather: 7 latencies)
    c, lat, bw = 65536 // 8, A100.intra_latency, A100.intra_bandwidth
    dkv = lat + 2 * c * 8 * 128 * 4 / bw
    assert hidden.exposed_comm_s == pytest.approx(8 * dkv + 7 * lat, rel=1e-6)
    assert hidden.exposed_comm_s < 0.01 * hidden.total_s
    assert exposed.exposed_comm_s > 0.9 * exposed.total_s
    # all-to-all and all-gather are never overlapped: exposed = all of it
    for b in ("ulysses", "allgather_kv"):
        p = cm.predict_attention(b, SHAPE, 8, slow_compute)
        assert p.exposed_comm_s == pytest.approx(p.comm_s)


def test_monotone_in_length_and_zigzag_beats_plain_ring_causal():
    for b in ("ulysses", "zigzag_ring", "allgather_kv", "ring", "colossal"):
        t = [cm.predict_attention(b, replace(SHAPE, seq_len=n), 8, A100).total_s for n in (8192, 16384, 65536)]
        assert t == sorted(t) and t[0] < t[-1], b
    flat = replace(A100, attention_curve=((1, 1e14),))  # the same rate for every call: work counts alone
    zig = cm.predict_attention("zigzag_ring", SHAPE, 8, flat).compute_s
    ring = cm.predict_attention("ring", SHAPE, 8, flat).compute_s
    assert ring / zig == pytest.approx(2 * 7.5 / 8, rel=1e-6)  # (P - 1/2) blocks vs P/2, from the plan
    bidir = replace(SHAPE, causal=False)
    assert cm.predict_attention("ring", bidir, 8, flat).compute_s == pytest.approx(
        cm.predict_attention("zigzag_ring", bidir, 8, flat).compute_s)


def test_calibrated_terms_per_call_step_and_shared_cores():
    """The per-call and per-step terms of a calibrated profile (Note [Per-call terms]), by hand."""
    # free links: every added second is compute
    flat = replace(A100, attention_curve=((1, 1e14),), intra_latency=0.0, intra_bandwidth=1e30)
    shape = cm.AttentionShape(seq_len=4096, num_heads=8, num_kv_heads=8, head_dim=64, causal=False, dtype_bytes=4)
    base = cm.predict_attention("zigzag_ring", shape, 4, flat)
    # a fixed cost per kernel call (bidirectional zigzag: the plan coalesces a step into one call)
    per_call = cm.predict_attention("zigzag_ring", shape, 4, replace(flat, kernel_call_s=(1e-3, 0.0)))
    assert per_call.total_s - base.total_s == pytest.approx(4 * 1e-3, rel=1e-6)
    # pieces: more, smaller calls (kv_pieces=2: backward 2 pieces x 2 query chunks per step)
    pieces = cm.predict_attention("zigzag_ring", shape, 4, replace(flat, kernel_call_s=(0.0, 1e-3)), kv_pieces=2)
    assert pieces.total_s - cm.predict_attention("zigzag_ring", shape, 4, flat, kv_pieces=2).total_s == \
        pytest.approx(4 * 2 * 2 * 1e-3, rel=1e-6)
    # ranks sharing cores: 4 ranks of equal work on 2 cores take twice one rank's compute; on 4 cores, once
    two = cm.predict_attention("ulysses", shape, 4, replace(flat, compute_slots=2))
    four = cm.predict_attention("ulysses", shape, 4, replace(flat, compute_slots=4))
    assert two.compute_s == pytest.approx(2 * four.compute_s, rel=1e-9)
    assert four.compute_s == pytest.approx(cm.predict_attention("ulysses", shape, 4, flat).compute_s, rel=1e-9)
    # a calibrated kernel table replaces the curve: twice the table's time, twice the compute
    table = tuple((k, 64, q, kk, 1e-6, 2e-6) for k in ("full", "causal") for q in (64, 4096) for kk in (64, 4096))
    t1 = cm.predict_attention("ulysses", shape, 4, replace(flat, kernel_table=table)).compute_s
    t2 = cm.predict_attention("ulysses", shape, 4, replace(flat, kernel_table=tuple(
        (k, d, q, kk, 2 * f, 2 * b) for k, d, q, kk, f, b in table))).compute_s
    assert t2 == pytest.approx(2 * t1, rel=1e-9) and t1 != pytest.approx(four.compute_s)  # negative control
    # a calibrated message time replaces the link latency on every ring exchange
    msg = cm.predict_attention("zigzag_ring", shape, 4, replace(flat, message_s=((4, 1e-3),)))
    assert msg.total_s > base.total_s + 0.9 * 3 * 2 * 1e-3


def test_inter_node_links_slow_ulysses_and_keep_usp_all_to_all_inside():
    two_nodes = replace(A100, ranks_per_node=8)
    p16 = cm.predict_attention("ulysses", SHAPE, 16, two_nodes)
    p8 = cm.predict_attention("ulysses", SHAPE, 8, two_nodes)
    assert p16.comm_s > p8.comm_s  # half the bytes, but over 25 GB/s instead of 300
    usp = cm.predict_attention("usp", SHAPE, 16, two_nodes, ulysses_degree=8)
    assert usp.total_s < p16.total_s


def test_memory_falls_with_p_and_colossal_keeps_scores():
    m = [cm.predict_attention("zigzag_ring", SHAPE, p, A100).activation_bytes for p in (2, 4, 8)]
    assert m[0] > m[1] > m[2]
    assert cm.predict_attention("colossal", SHAPE, 8, A100).activation_bytes > 10 * m[2]
    from experiments.cost_model import papers  # the step-level memory model of the papers' predictions

    model = papers.ModelShape(num_layers=32, hidden=4096, num_heads=32)
    one = papers.max_context(model, 80e9, "zigzag_ring", 1, shard_states_over=8)
    eight = papers.max_context(model, 80e9, "zigzag_ring", 8, shard_states_over=8)
    assert 4 * one < eight


def test_auto_picks_ulysses_inside_a_node_ring_across_slow_links_never_inexact():
    # inside one fast node: Ulysses (all-to-all over NVLink, one big kernel call)
    kw = dict(seq_len=65536, num_kv_heads=32, head_dim=128, hardware="a100-80gb")
    backend, why = resolve_auto_backend(32, 8, ranks_per_node=8, **kw)
    assert backend == "ulysses" and "zigzag_ring" in why and "predicted fwd+bwd per layer" in why
    # one rank per node on slow links, GQA: the ring (overlapped, small K/V) beats the all-to-all
    slow = replace(A100, inter_bandwidth=2e9, inter_latency=1e-4)
    # (H_kv = 2: the ring's dK/dV partial sums travel in fp32 at every step, not overlapped; at H_kv = 4
    # they cost as much as Ulysses' all-to-alls here)
    backend, why = resolve_auto_backend(32, 8, ranks_per_node=1, seq_len=65536, num_kv_heads=2, head_dim=128,
                                        hardware=slow)
    assert backend == "zigzag_ring", why
    # heads not divisible: never Ulysses, and usp only with a degree dividing the heads
    choice = cm.choose_backend(replace(SHAPE, num_heads=12, num_kv_heads=4), 8, A100)
    labels = {p.label for p in choice.predictions}
    assert "ulysses" not in labels and "usp(ulysses=4)" in labels and "usp(ulysses=2)" in labels
    assert "ulysses" in choice.excluded
    for hw in (A100, slow, replace(A100, ranks_per_node=2)):
        for h in (3, 6, 12, 32):
            c = cm.choose_backend(cm.AttentionShape(seq_len=4096, num_heads=h, num_kv_heads=1, head_dim=64), 8, hw)
            assert c.backend in cm.AUTO_LAYOUT_BACKENDS
            if c.backend == "ulysses":
                assert h % 8 == 0
            if c.backend == "usp":
                assert h % c.ulysses_degree == 0 and 8 % c.ulysses_degree == 0
    # usp not offered when its sub-groups cannot be built
    c = cm.choose_backend(SHAPE, 16, replace(A100, ranks_per_node=8), usp_allowed=False)
    assert all(p.backend != "usp" for p in c.predictions) and "usp(ulysses=8)" in c.excluded


def test_auto_rule_without_shapes_unchanged():
    assert resolve_auto_backend(8, 4)[0] == "ulysses"
    assert resolve_auto_backend(6, 4)[0] == "zigzag_ring"
    assert resolve_auto_backend(16, 16, ranks_per_node=8)[0] == "zigzag_ring"


def test_bad_input_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        cm.AttentionShape(seq_len=8, num_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="divisible"):
        cm.predict_attention("ulysses", replace(SHAPE, num_heads=12, num_kv_heads=4), 8, A100)
    with pytest.raises(ValueError, match="ulysses_degree"):
        cm.predict_attention("usp", SHAPE, 8, A100)
    with pytest.raises(ValueError, match="backend must be one of"):
        cm.predict_attention("striped", SHAPE, 8, A100)
    with pytest.raises(ValueError, match="unknown hardware preset"):
        cm.preset("tpu")
    with pytest.raises(ValueError, match="ascending"):
        replace(A100, attention_curve=((10, 1.0), (5, 1.0)))
    hw = cm.HardwareProfile.from_dict(A100.to_dict())
    assert hw == A100
    calibrated = replace(A100, kernel_table=(("full", 32, 64, 64, 1e-6, 2e-6),), kernel_call_s=(1e-5, 2e-5),
                         message_s=((2, 1e-4),), collective_fits=(("all_to_all", 2, 1e-4, 1e9),), colossal_s=(0.1, 1e-9, 0.0))
    assert cm.HardwareProfile.from_dict(calibrated.to_dict()) == calibrated


def test_busy_collective_cost_replaces_the_idle_latency():
    """``collective_busy_s`` (a tiny collective with every rank computing) replaces the idle fit's
    latency for its op and group size only; the bandwidth term stays the fit's."""
    fits = (("all_to_all", 4, 1e-4, 1e9), ("all_gather", 4, 2e-4, 5e8))
    idle = replace(A100, collective_fits=fits)
    busy = replace(idle, collective_busy_s=(("all_to_all", 4, 3e-3),))
    assert idle.collective_time("all_to_all", 1e6, 4) == pytest.approx(1e-4 + 1e-3)
    assert busy.collective_time("all_to_all", 1e6, 4) == pytest.approx(3e-3 + 1e-3)
    assert busy.collective_time("all_gather", 1e6, 4) == idle.collective_time("all_gather", 1e6, 4)  # not measured busy
    # it reaches a prediction: Ulysses' all-to-alls each pay the busy cost
    shape = cm.AttentionShape(seq_len=4096, num_heads=8, num_kv_heads=8, head_dim=64, dtype_bytes=4)
    gap = cm.predict_attention("ulysses", shape, 4, busy).total_s - cm.predict_attention("ulysses", shape, 4, idle).total_s
    assert gap == pytest.approx(8 * (3e-3 - 1e-4), rel=1e-6)  # 4 all-to-alls forward, 4 backward
    assert cm.HardwareProfile.from_dict(busy.to_dict()) == busy


def test_calibration_fit_in_relative_error_keeps_the_small_messages_latency():
    from experiments.cost_model.calibrate import fit_line

    xs = [1 << k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB, as calibrate_links
    line = [2e-3 + x / 1e9 for x in xs]
    for relative in (False, True):  # an exact line is recovered either way
        a, b = fit_line(xs, line, relative=relative)
        assert a == pytest.approx(2e-3, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    # gloo's all-gather on 8 ranks of 2 cores (calibration of 2026-11-23): 11-16 ms up to 256 KiB, then
    # steeply up; the plain fit's latency is set by the 4 MiB point, the relative one's by the small ones
    measured = [12.7e-3, 15.1e-3, 11.2e-3, 16.1e-3, 28.3e-3, 190.9e-3]
    assert fit_line(xs, measured)[0] < 7e-3  # negative control: the old fit, half the small messages' time
    assert 10e-3 < fit_line(xs, measured, relative=True)[0] < 14e-3


def test_colossal_calibration_primitive_runs_the_backends_own_math():
    """``calibrate.colossal_local`` (ops/colossal.py with its messages stubbed) is exact causal attention
    forward and backward in float64: the timed primitive is the backend's whole local compute."""
    import torch

    from experiments.cost_model.calibrate import colossal_local
    from tests.reference import dense_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 24, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 24, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 24, 4, 8, generator=g, dtype=torch.float64)
    out = colossal_local(q, k, v, dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = dense_attention(q, k, v, causal=True)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=1e-10, atol=1e-10)
    bidirectional = dense_attention(q, k, v, causal=False)
    assert (out - bidirectional).abs().max() > 1e-3  # negative control: the mask matters at this size


def test_colossal_table_per_score_element_at_the_ranks_size():
    """``colossal_table``: seconds per score element interpolated in the rank's score elements (log) and
    D; a rank's whole layer costs that times its ``H x S/P x N`` scores, whatever the ring's steps."""
    table = ((1 << 20, 32, 10e-9), (1 << 24, 32, 40e-9), (1 << 20, 128, 20e-9), (1 << 24, 128, 80e-9))
    hw = replace(A100, colossal_table=table, colossal_s=(1.0, 1.0, 1.0))  # the table wins over the line
    assert hw.colossal_seconds_per_score(1 << 20, 32) == pytest.approx(10e-9)
    assert hw.colossal_seconds_per_score(1 << 22, 32) == pytest.approx(25e-9)  # halfway in log E
    assert hw.colossal_seconds_per_score(1 << 26, 128) == pytest.approx(80e-9)  # clamped outside
    assert hw.colossal_seconds_per_score(1 << 20, 80) == pytest.approx(15e-9, rel=0.2)  # between the dims
    free = replace(hw, intra_latency=0.0, intra_bandwidth=1e30)
    shape = cm.AttentionShape(seq_len=4096, num_heads=8, num_kv_heads=8, head_dim=32, dtype_bytes=4)
    for p in (2, 4):
        rank_scores = 8 * (4096 // p) * 4096  # [H, S/P, N]
        expected = rank_scores * free.colossal_seconds_per_score(rank_scores, 32)
        assert cm.predict_attention("colossal", shape, p, free).compute_s == pytest.approx(expected, rel=1e-6)
    assert cm.HardwareProfile.from_dict(hw.to_dict()) == hw


def test_layer_latency_lies_on_each_ranks_path_and_is_hidden_where_ranks_share_cores():
    """``layer_latency_s`` (Note [Per-call terms]): a backend's own latency at the nearest calibrated world, spread
    over its steps on every rank's path. With a core per rank it adds in full; where ranks share cores and the
    shared compute is the longer term, another rank's compute fills it (less than the latency is added); it never
    reaches another backend or a single rank."""
    shape = cm.AttentionShape(seq_len=4096, num_heads=8, num_kv_heads=8, head_dim=64, dtype_bytes=4)
    hw = replace(A100, compute_slots=None)  # a device per rank: no shared term
    lat = replace(hw, layer_latency_s=(("zigzag_ring", 2, 5e-3), ("zigzag_ring", 8, 9e-3), ("ulysses", 2, 1e-3)))
    assert lat.layer_latency("zigzag_ring", 4) == 5e-3  # nearest world in log, the smaller on a tie
    assert lat.layer_latency("zigzag_ring", 16) == 9e-3 and lat.layer_latency("ring", 2) == 0.0
    assert lat.layer_latency("zigzag_ring", 1) == 0.0
    for backend, world, added in (("zigzag_ring", 2, 5e-3), ("zigzag_ring", 8, 9e-3), ("ulysses", 2, 1e-3),
                                  ("allgather_kv", 2, 0.0)):
        gap = (cm.predict_attention(backend, shape, world, lat).total_s
               - cm.predict_attention(backend, shape, world, hw).total_s)
        assert gap == pytest.approx(added, rel=1e-6, abs=1e-12), (backend, world)
    # 8 ranks on 2 slots: each step lasts as long as the cores take for all ranks' work, which hides the latency
    shared, long = replace(A100, compute_slots=2), replace(shape, seq_len=65536)  # steps of ~1 ms compute per rank
    gap = (cm.predict_attention("zigzag_ring", long, 8, replace(shared, layer_latency_s=lat.layer_latency_s)).total_s
           - cm.predict_attention("zigzag_ring", long, 8, shared).total_s)
    assert 0.0 <= gap < 0.5 * 9e-3
    alone = (cm.predict_attention("zigzag_ring", long, 8, replace(hw, layer_latency_s=lat.layer_latency_s)).total_s
             - cm.predict_attention("zigzag_ring", long, 8, hw).total_s)
    assert alone == pytest.approx(9e-3, rel=1e-6)  # control: the same shape with a device per rank pays it all
    assert cm.HardwareProfile.from_dict(lat.to_dict()) == lat


def test_calibrated_layer_latency_reproduces_the_stubbed_measurement():
    """``calibrate.with_layer_latency``: the latency found for each (world, backend) makes the model predict the
    stubbed layer's measured time at ``LATENCY_SHAPE`` (plus the two barriers); 0 where the other terms already
    predict more than was measured."""
    from experiments.cost_model.calibrate import LATENCY_SHAPE, with_layer_latency

    hw = replace(A100, compute_slots=2, kernel_call_s=(2e-5, 6e-5))
    n, h, h_kv, d, pieces = LATENCY_SHAPE
    shape = cm.AttentionShape(seq_len=n, num_heads=h, num_kv_heads=h_kv, head_dim=d, causal=True, batch=1, dtype_bytes=4)
    base = {w: {b: cm.predict_attention(b, shape, w, hw, ulysses_degree=2 if b == "usp" else None,
                                        kv_pieces=pieces).total_s for b in ("ulysses", "zigzag_ring", "usp")}
            for w in (2, 4)}
    barriers = {2: 1e-4, 4: 3e-4}
    measured = {2: {"ulysses": base[2]["ulysses"] + 2e-4 + 4e-3, "zigzag_ring": base[2]["zigzag_ring"] * 0.5},
                4: {"usp": base[4]["usp"] + 6e-4 + 7e-3}}
    got = with_layer_latency(hw, measured, barriers)
    assert got.layer_latency("zigzag_ring", 2) == 0.0  # predicted more than measured already
    for world, backend in ((2, "ulysses"), (4, "usp")):
        again = cm.predict_attention(backend, shape, world, got, ulysses_degree=2 if backend == "usp" else None,
                                     kv_pieces=pieces).total_s + 2 * barriers[world]
        assert again == pytest.approx(measured[world][backend], rel=1e-6)
        assert got.layer_latency(backend, world) > 0


def test_kernel_table_is_the_median_over_rounds_so_a_slow_spell_misses_it(monkeypatch):
    """``calibrate_local`` times the kernel table in rounds over all points (the order rotated) and keeps each point's
    median: a slow spell of the machine covering half of one round does not reach the table. Control: in one round,
    the same spell lands on the points it covers (one run of 2026-11-24 saw whole D blocks of the table 30-60% slow in two
    calibrations out of five)."""
    from experiments.cost_model import calibrate

    tiny, fast, slow_factor = (1e-5, 2e-5), (1e-3, 2e-3), 10.0
    shape = dict(sides=(32, 128), dims=(32,), causal_extra=(256,))
    n_points = len(calibrate.kernel_table_points(**shape))

    def table_with_a_spell(rounds, spell):
        calls = []

        def fake_pair(kernel, kind, q_len, k_len, heads, d, reps):
            if (q_len, k_len, heads) == (8, 8, 1):
                return tiny
            calls.append((kind, d, q_len, k_len))
            factor = slow_factor if len(calls) - 1 in spell else 1.0
            return fast[0] * factor, fast[1] * factor

        monkeypatch.setattr(calibrate, "_kernel_pair", fake_pair)
        local = calibrate.calibrate_local(reps=1, rounds=rounds, **shape)
        assert len(calls) == rounds * n_points and len(set(calls)) == n_points  # every point once per round
        return local

    expected = ((fast[0] - tiny[0]) / calibrate.KERNEL_HEADS, (fast[1] - tiny[1]) / calibrate.KERNEL_HEADS)
    local = table_with_a_spell(3, spell=range(n_points, n_points + n_points // 2))  # half of round 2
    assert all(row[4:] == pytest.approx(expected) for row in local["kernel_table"])
    assert all(len(row[4]) == 3 for row in local["kernel_table_rounds"])
    slow = table_with_a_spell(1, spell=range(n_points // 2))
    assert sum(row[4] > 5 * expected[0] for row in slow["kernel_table"]) == n_points // 2


def test_colossal_table_is_the_median_over_rounds_and_round_0_is_the_one_pass(monkeypatch):
    """``calibrate_colossal`` times its points in rounds (each once per round, the order rotated) and keeps each point's
    median, so a slow spell over part of one round misses the table (Note [Colossal table in rounds]); round 0 alone
    (``colossal_table_of_round``) is what the one pass timed until 2026-11-25 kept, spell included. A calibration
    without rounds is refused by the study that needs them."""
    from experiments.cost_model import calibrate

    points = ((256, 32), (512, 32), (512, 64), (1024, 32), (1024, 128))
    fast, slow_factor = 1e-3, 10.0

    def table_with_a_spell(rounds, spell):
        calls = []

        def fake_time(n, d, reps):
            calls.append((n, d))
            return fast * (slow_factor if len(calls) - 1 in spell else 1.0)

        monkeypatch.setattr(calibrate, "_colossal_local_time", fake_time)
        got = calibrate.calibrate_colossal(reps=1, points=points, rounds=rounds)
        assert len(calls) == rounds * len(points) and set(calls) == set(points)  # every point once per round
        assert rounds == 1 or calls[len(points)] != points[0]  # round 1 starts elsewhere
        return got

    def per_score(n):
        return fast / (calibrate.COLOSSAL_HEADS * n * n * calibrate.COLOSSAL_WORLD)

    got = table_with_a_spell(5, spell=range(2))  # the first two points of round 0
    assert [row[2] for row in got["colossal_table"]] == pytest.approx([per_score(n) for n, _ in points])
    assert all(len(times) == 5 for _, _, times in got["rounds"])
    first = calibrate.colossal_table_of_round(got, 0)
    assert [row[2] > 5 * per_score(n) for row, (n, _) in zip(first, points)] == [True, True, False, False, False]
    one_pass = table_with_a_spell(1, spell=range(2))  # control: one pass keeps the spell, as round 0 does
    assert one_pass["colossal_table"] == first  # the same arithmetic on the same times
    with pytest.raises(ValueError, match="one pass"):
        calibrate.colossal_table_of_round({k: v for k, v in got.items() if k != "rounds"})


def test_sync_delay_is_added_once_per_synchronisation_that_ends_compute():
    """``sync_delay_s`` (Note [Per-call terms]): the delay is added once at every collective or ring wait that follows
    kernel compute, and at the layer's end if compute ran since the last one; a collective right after another meets
    none. Counted by hand from the backends' loops (P = 2, whole blocks, 1 group):
    - ``ulysses``: the forward call then the output's all-to-all (1); the backward call then dq/dk/dv's (1): 2;
    - ``zigzag_ring``: forward step 0 computes then waits for the K/V block (1); step 1 computes, no wait; backward
      step 0 computes then waits for the block and the dK/dV sum (1, the forward's last compute included); step 1
      computes then waits for the dK/dV sum (1): 3.
    Nothing at one rank, and nothing without the term."""
    shape = cm.AttentionShape(seq_len=1024, num_heads=8, num_kv_heads=4, head_dim=32, dtype_bytes=4)
    hw = replace(A100, compute_slots=None)
    delayed = replace(hw, sync_delay_s=((2, 1e-3), (8, 3e-3)))
    assert delayed.sync_delay(2) == 1e-3 and delayed.sync_delay(4) == 1e-3 and delayed.sync_delay(16) == 3e-3
    assert delayed.sync_delay(1) == 0.0 and hw.sync_delay(2) == 0.0
    for backend, count in (("ulysses", 2), ("zigzag_ring", 3)):
        gap = (cm.predict_attention(backend, shape, 2, delayed, kv_pieces=1).total_s
               - cm.predict_attention(backend, shape, 2, hw, kv_pieces=1).total_s)
        assert gap == pytest.approx(count * 1e-3, rel=1e-9), backend
    # control: more ring steps, more waits after compute; Ulysses' count does not grow with P
    more = (cm.predict_attention("zigzag_ring", shape, 8, delayed, kv_pieces=1).total_s
            - cm.predict_attention("zigzag_ring", shape, 8, hw, kv_pieces=1).total_s) / 3e-3
    assert more > 3.5
    ulysses8 = (cm.predict_attention("ulysses", shape, 8, delayed, kv_pieces=1).total_s
                - cm.predict_attention("ulysses", shape, 8, hw, kv_pieces=1).total_s)
    assert ulysses8 == pytest.approx(2 * 3e-3, rel=1e-9)
    assert cm.predict_attention("ulysses", shape, 1, delayed).total_s == cm.predict_attention("ulysses", shape, 1, hw).total_s
    assert cm.HardwareProfile.from_dict(delayed.to_dict()) == delayed


def test_sync_delay_from_rounds_is_the_median_gap_per_synchronisation():
    """``calibrate.sync_delay_from_rounds``: per block, the median over the steps of (median round - fastest round) /
    ``SYNC_CALLS``; the median over blocks, so one block caught by a slow spell does not set it."""
    from experiments.cost_model.calibrate import SYNC_CALLS, sync_delay_from_rounds

    calm = [[0.10, 0.10 + 8 * SYNC_CALLS * 1e-3, 0.10 + 2 * SYNC_CALLS * 1e-3]] * 3  # median - fastest: 2 ms per sync
    assert sync_delay_from_rounds([calm]) == pytest.approx(2e-3)
    spell = [[0.10, 0.5, 0.6]] * 3
    assert sync_delay_from_rounds([calm, spell, calm]) == pytest.approx(2e-3)
    assert sync_delay_from_rounds([spell]) > 40e-3  # control: alone, the spell is the reading
