"""benchmarks/vllm.py's schedule: which requests each variant sends in a phase, the order
of the phases, and how answers are compared, so a shorter run stays comparable with run 1
(``docs/performance.md``): every variant but NixlConnector sends run 1's 72 requests per
section, and NixlConnector a subset of the same prompts with every turn's share kept."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    import importlib

    return importlib.import_module("benchmarks.vllm")


def shape(bench: ModuleType, rounds: int, convs: int, turns: int, requests: int = 24) -> object:
    return bench.Shape(
        rounds=rounds,
        convs=convs,
        turns=turns,
        system=1536,
        question=128,
        answer=24,
        builtin_convs=bench.builtin_convs(convs, rounds, turns, requests),
    )


def sent(bench: ModuleType, sh: object, v: str, section: str) -> list[tuple[int, int, int]]:
    return [
        (rnd, q.conv, q.turn)
        for rnd in range(sh.rounds)  # type: ignore[attr-defined]
        for q in bench.asks(sh, v, rnd, section)
    ]


@pytest.mark.parametrize("section", ["alone", "contended"])
def test_the_full_run_sends_nixlconnector_24_of_run_1s_72_prompts_each_conversation_once(
    bench: ModuleType, section: str
) -> None:
    full = shape(bench, 3, 6, 4)
    assert full.builtin_convs == 2  # type: ignore[attr-defined]
    others = sent(bench, full, "pdxfer_nixl", section)
    builtin = sent(bench, full, "builtin", section)
    assert len(others) == 72 and len(builtin) == 24
    assert set(builtin) <= set(others)
    # every conversation, whole: the same turns in the same proportion as the others'
    assert Counter((c, t) for _, c, t in builtin) == Counter(
        (c, t) for c in range(6) for t in range(4)
    )
    assert [bench.convs_of(full, "builtin", r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    seeds = {
        (rnd, q.conv, q.turn): q.seed
        for rnd in range(3)
        for q in bench.asks(full, "colocated", rnd, section)
    }
    assert all(
        seeds[(rnd, q.conv, q.turn)] == q.seed
        for rnd in range(3)
        for q in bench.asks(full, "builtin", rnd, section)
    )


@pytest.mark.parametrize("section", ["alone", "contended"])
def test_one_timed_request_in_24_computes_the_shared_prefix_cold_for_every_variant(
    bench: ModuleType, section: str
) -> None:
    """A section's first request computes its conversations' shared system prefix cold. In
    run 1 that was 3 of each variant's 72; NixlConnector's later rounds start with other
    conversations, so their prefill first gets conversation 0's first turn, untimed (the
    request the others send first), and only round 0's cold request is timed."""
    full = shape(bench, 3, 6, 4)
    # the others: each round's first timed request, 3 of 72
    assert all(bench.untimed_first(full, "pdxfer_nixl", r, section) is None for r in range(3))
    cold = [r for r in range(3) if bench.untimed_first(full, "builtin", r, section) is None]
    assert cold == [0] and len(cold) / 24 == 3 / 72
    first = bench.asks(full, "colocated", 1, section)[0]
    assert bench.untimed_first(full, "builtin", 1, section) == first
    assert bench.untimed_first(full, "builtin", 0, section) is None


def test_quick_sends_every_variant_at_least_24_requests_per_section(bench: ModuleType) -> None:
    quick = shape(bench, 2, 4, 3)
    for v in ("colocated", "pdxfer_tcp", "pdxfer_nixl", "pdxfer_reuse", "builtin"):
        for section in ("alone", "contended"):
            assert len(sent(bench, quick, v, section)) >= 24
    assert quick.builtin_convs == quick.convs  # type: ignore[attr-defined]


def test_nixlconnector_never_sends_more_than_the_others_nor_no_conversation(
    bench: ModuleType,
) -> None:
    assert bench.builtin_convs(2, 1, 2, 24) == 2  # a smoke run: all it has
    assert bench.builtin_convs(6, 3, 4, 0) == 1
    assert bench.builtin_convs(6, 3, 4, 25) == 3  # whole conversations, rounded up
    assert bench.builtin_convs(6, 3, 4, 1000) == 6


def test_a_conversation_keeps_its_prompts_turn_by_turn_and_the_halves_differ(
    bench: ModuleType,
) -> None:
    full = shape(bench, 3, 6, 4)
    alone = bench.asks(full, "colocated", 1, "alone")
    assert [(q.turn, q.conv) for q in alone] == [(t, c) for t in range(4) for c in range(6)]
    assert len({q.seed for q in alone}) == 24
    loaded = {q.seed for q in bench.asks(full, "colocated", 1, "contended")}
    assert not loaded & {q.seed for q in alone}
    assert not {q.seed for q in bench.asks(full, "colocated", 0, "alone")} & {q.seed for q in alone}


def test_each_round_rotates_the_phases_so_each_variant_leads_one(bench: ModuleType) -> None:
    vs = ["colocated", "pdxfer_tcp", "builtin"]
    rounds = [bench.order(vs, r) for r in range(3)]
    assert all(sorted(r) == sorted(vs) for r in rounds)
    assert [r[0] for r in rounds] == vs
    assert bench.order([], 2) == []


def test_answers_are_compared_over_the_requests_each_variant_sent(bench: ModuleType) -> None:
    ref = {("colocated", (0, "alone", c, 0)): [c, 1] for c in range(3)}
    ok, what = bench.compare_outputs(
        {
            **ref,
            ("builtin", (0, "alone", 0, 0)): [0, 1],
            ("pdxfer_nixl", (0, "alone", 2, 0)): [2, 1],
            ("pdxfer_nixl", (0, "alone", 1, 0)): [1, 1],
        },
        "colocated",
        ["pdxfer_nixl", "builtin"],
    )
    assert ok and what == "pdxfer_nixl 2, builtin 1 requests vs colocated (3)"
    assert not bench.compare_outputs(
        {**ref, ("builtin", (0, "alone", 0, 0)): [0, 2]}, "colocated", ["builtin"]
    )[0]
    assert not bench.compare_outputs(ref, "colocated", ["builtin"])[0]  # answered nothing
    assert not bench.compare_outputs(
        {**ref, ("builtin", (1, "alone", 0, 0)): [0, 1]}, "colocated", ["builtin"]
    )[0]  # a request ref never sent


def test_kv_moved_per_request_and_phase_time_compare_variants_of_unequal_request_counts(
    bench: ModuleType,
) -> None:
    """NixlConnector sends a third of the others' requests: its KV moved in all is a third,
    per request the same; a variant's phase seconds are its steps' sum over its phases."""
    mib = 96 * 2**20
    got = {
        ("pdxfer_nixl", "alone"): bench.Samples(
            ttft=[0.2] * 72, prefill=[0.1] * 72, kv_bytes=72 * mib, ready_s=1, loads=72
        ),
        ("builtin", "alone"): bench.Samples(
            ttft=[2.0] * 24, prefill=[1.5] * 24, kv_bytes=24 * mib, ready_s=1, loads=24
        ),
    }
    log = [
        {"variant": "builtin", "round": r, "seconds": {"startup": 36.0, "alone": 100.0}}
        for r in range(3)
    ] + [{"variant": "builtin", "round": 0, "seconds": {}}]
    res = bench.summary(got, log, ["pdxfer_nixl", "builtin"])
    assert res["vllm.kv_mib.builtin"] == 24 * 96 and res["vllm.kv_mib.pdxfer_nixl"] == 72 * 96
    assert res["vllm.kv_mib_per_request.builtin"] == 96
    assert res["vllm.kv_mib_per_request.pdxfer_nixl"] == 96
    assert res["vllm.phase_seconds.builtin"] == 3 * 136.0
    assert res["vllm.phase_seconds.pdxfer_nixl"] == 0


def _timeout() -> Exception:
    import openai

    req = openai.DefaultHttpxClient().build_request("POST", "http://127.0.0.1:9/v1/completions")
    return openai.APITimeoutError(request=req)


def test_a_request_without_an_answer_ends_its_conversation_and_the_run_goes_on(
    bench: ModuleType,
) -> None:
    """One request beside the load that gets no answer (a NixlConnector request waited
    600 s) must not end the run: it is recorded, counted, its conversation's later turns
    (which need its answer) skipped, and every other conversation goes on with its own
    history."""
    sh = shape(bench, 1, 3, 3)
    sent = bench.asks(sh, "pdxfer_tcp", 0, "alone")
    s = bench.Samples()
    prompts: dict[tuple[int, int], list[int]] = {}

    def ask(q: object, prompt: list[int]) -> list[int]:
        conv, turn = q.conv, q.turn  # type: ignore[attr-defined]
        prompts[(conv, turn)] = prompt
        if (conv, turn) == (1, 1):
            raise _timeout()
        return [1000 + 10 * conv + turn] * 2

    failed = list(bench.converse(sent, [7] * 5, 4, ask, s))
    assert [(q.conv, q.turn) for q, _, _ in failed] == [(1, 1)]
    assert type(failed[0][2]).__name__ == "APITimeoutError" and failed[0][1] >= 0
    assert len(s.failed) == 1 and s.skipped == 1, "conversation 1's third turn is skipped"
    assert set(prompts) == {(c, t) for c in range(3) for t in range(3)} - {(1, 2)}
    for c in (0, 2):  # the others: each turn's prompt is the last prompt and its answer
        for t in (1, 2):
            last = prompts[(c, t - 1)]
            assert prompts[(c, t)][: len(last) + 2] == last + [1000 + 10 * c + t - 1] * 2


def test_a_failed_request_counts_in_the_ttft_percentiles_as_its_wait_and_is_reported(
    bench: ModuleType,
) -> None:
    """Left out, a stalled request would make its variant look faster than one that answers
    late: it counts as the time it took to fail (a lower bound of its TTFT)."""
    s = bench.Samples(ttft=[0.1, 0.2, 0.3], prefill=[0.05, 0.1, 0.15], failed=[600.0], skipped=2)
    res = bench.summary({("builtin", "contended"): s}, [], [])
    assert res["vllm.failed_requests.builtin.contended"] == 1
    assert res["vllm.skipped_requests.builtin.contended"] == 2
    assert res["vllm.requests.builtin.contended"] == 3
    assert res["vllm.ttft_p90_ms.builtin.contended"] > 1e3 * 0.3, "the failed one counts"
    assert res["vllm.decode_leg_p50_ms.builtin.contended"] > 0, "legs: answered requests only"


def test_a_run_that_breaks_mid_way_keeps_what_it_measured_and_says_why(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An exception in a later phase does not lose the measurements of the phases done:
    they are reported, and the run names what ended it."""
    import argparse

    def rounds(
        shape: object,
        setup: object,
        a: object,
        active: list[str],
        got: dict,
        outs: dict,
        log: list,
        res: dict,
    ) -> None:
        log.append(
            {
                "variant": "colocated",
                "round": 0,
                "loadavg_before": (0.5, 0.5, 0.5),
                "background_cores_before": 0.01,
                "idle_cpu_cores": 0.02,
                "seconds": {"alone": 3.0},
            }
        )
        got[("colocated", "alone")] = bench.Samples(
            ttft=[0.1, 0.12], prefill=[0.07, 0.08], first_chunk=[0.09, 0.1]
        )
        outs[("colocated", (0, "alone", 0, 0))] = [5, 6]
        log.append(
            {
                "variant": "pdxfer_tcp",
                "round": 0,
                "loadavg_before": (0.6, 0.5, 0.5),
                "background_cores_before": 0.02,
                "seconds": {},
            }
        )
        raise RuntimeError("a server died")

    monkeypatch.setattr(bench, "all_phases", rounds)
    monkeypatch.setattr(bench, "build_model", lambda path, shape: path)
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    a = argparse.Namespace(
        quick=True, rounds=1, convs=1, turns=1, builtin_requests=2, variants="colocated,pdxfer_tcp"
    )
    res = bench.run(a)
    assert res["vllm.error"] == "RuntimeError: a server died"
    assert res["vllm.error_phase"] == "pdxfer_tcp round 0"
    assert res["vllm.ttft_p50_ms.colocated"] > 0 and res["vllm.idle_cpu_cores.colocated"]
    assert res["vllm.background_cores_max_before_phase"] == 0.02
