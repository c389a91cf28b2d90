"""benchmarks/goodput.py's figures: goodput is the highest rate that meets the attainment
bar (interpolated to where it falls below), a prompt's TTFT bound scales with its length,
and the workload is the same list for every variant, drawn from the seed."""

from __future__ import annotations

import pytest

from benchmarks.goodput import QUICK, Reference, Req, Result, draw, fifo_ttfts, goodput, queue_model


def test_goodput_is_interpolated_where_attainment_falls_below_the_bar() -> None:
    assert goodput([1, 2, 3], [1.0, 0.95, 0.5]) == pytest.approx(2 + (0.95 - 0.9) / 0.45)
    assert goodput([1, 2, 3], [1.0, 1.0, 0.9]) == 3  # every rate meets it: the highest
    assert goodput([1, 2, 3], [0.8, 1.0, 1.0]) == 0.0  # the lowest already fails
    # a later recovery does not count: goodput is where it first falls below
    assert goodput([1, 2, 3], [1.0, 0.0, 1.0]) == pytest.approx(1 + 0.1)


def test_both_bounds_follow_the_prompt_length_between_and_past_calibration_points() -> None:
    ref = Reference([100, 200, 400], [0.1, 0.2, 0.6], [0.01, 0.012, 0.02])
    assert ref.ttft(50) == 0.1
    assert ref.ttft(150) == pytest.approx(0.15)
    assert ref.ttft(300) == pytest.approx(0.4)
    assert ref.ttft(600) == pytest.approx(1.0)  # the last segment's slope, extended
    assert ref.step(50) == 0.01
    assert ref.step(300) == pytest.approx(0.016)
    assert ref.step(600) == pytest.approx(0.028)
    # a request over a long prompt may step slower than a short one and still meet it
    long = Req(0, 0.0, 400, 3, 1)
    steady = Result(long, ttft=0.6, times=[0.6, 0.635, 0.67], ids=[1, 2, 3])
    assert ref.meets(steady, "tpot_strict")
    assert not ref.meets(
        Result(Req(0, 0.0, 100, 3, 1), 0.1, [0.1, 0.135, 0.17], [1, 2, 3]), "tpot_strict"
    )


def test_a_request_meets_a_target_only_finished_within_both_bounds() -> None:
    ref = Reference([100], [0.1], [0.01])
    req = Req(0, 0.0, 100, 3, 1)
    ok = Result(req, ttft=0.25, times=[0.25, 0.265, 0.28], ids=[1, 2, 3])
    assert ref.meets(ok, "ttft_strict") and ref.meets(ok, "tpot_strict")
    slow_first = Result(req, ttft=0.35, times=[0.35, 0.36, 0.37], ids=[1, 2, 3])
    assert not ref.meets(slow_first, "ttft_strict") and ref.meets(slow_first, "tpot_strict")
    slow_steps = Result(req, ttft=0.1, times=[0.1, 0.13, 0.16], ids=[1, 2, 3])
    assert ref.meets(slow_steps, "ttft_strict") and not ref.meets(slow_steps, "tpot_strict")
    short = Result(req, ttft=0.1, times=[0.1, 0.11], ids=[1, 2])  # lost a token
    assert not ref.meets(short, "ttft_strict")
    failed = Result(req, error="503: full", status=503)
    assert not ref.meets(failed, "tpot_strict")


def test_the_workload_is_seeded_poisson_with_lengths_in_range() -> None:
    a, b = draw(QUICK, 0, 2.0, 0), draw(QUICK, 0, 2.0, 0)
    assert a == b and a != draw(QUICK, 1, 2.0, 0) and a != draw(QUICK, 0, 2.0, 1)
    assert [r.at for r in a] == sorted(r.at for r in a)
    assert all(QUICK.prompt_min <= r.prompt_len <= QUICK.prompt_max for r in a)
    assert all(QUICK.out_min <= r.max_tokens <= QUICK.out_max for r in a)
    assert a[0].prompt() == a[0].prompt() and a[0].prompt() != a[1].prompt()


def test_the_queue_model_waits_behind_the_prompts_ahead_on_each_server() -> None:
    ref = Reference([100, 1000], [1.0, 10.0], [0.01, 0.01])
    reqs = [Req(0, 0.0, 1000, 4, 1), Req(1, 1.0, 100, 4, 2), Req(2, 20.0, 100, 4, 3)]
    # one server: the short prompt waits for the long one (done at 10 s), the last finds it free
    assert fifo_ttfts(reqs, ref, 1) == pytest.approx([10.0, 10.0, 1.0])
    # two: the short one has the second server to itself
    assert fifo_ttfts(reqs, ref, 2) == pytest.approx([10.0, 1.0, 1.0])
    res = {"goodput.pd.unloaded.ttft_ms.100": 1000.0, "goodput.pd.unloaded.ttft_ms.1000": 1e4}
    res |= {"goodput.unloaded.ttft_ms.100": 1.0, "goodput.unloaded.ttft_ms.1000": 2.0}
    res |= {
        f"goodput{v}.unloaded.decode_step_ms.{n}": 10.0 for v in ("", ".pd") for n in (100, 1000)
    }
    got = queue_model(res, "pd", 3, reqs)  # the variant's own unloaded figures, not colocated's
    assert got == {
        "goodput.pd.r3.fifo_model.ttft_p50_ms": 10000.0,
        "goodput.pd.r3.fifo_model.ttft_p99_ms": 10000.0,
    }
