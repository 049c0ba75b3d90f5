"""`ocpc demo`: the token facts it shows on the rig, and how it makes its numbers.

Timings are never asserted (the machine is shared); what is checked is the method that
makes them trustworthy: arms alternate round by round, every cold sample runs on a
freshly started server, and ratios are taken within a round before the median.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from oc_prefix_cache.cli import app
from oc_prefix_cache.commands.demo import (
    CASES,
    COLD,
    ORDER,
    RESTART,
    DemoResult,
    Sample,
    Spread,
    render_demo,
    summarize,
)


@pytest.mark.rig
def test_demo_alternates_its_arms_and_serves_the_head_from_cache_after_a_restart(models) -> None:
    result = CliRunner().invoke(app, ["demo", "--json", "--rounds", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rounds"] == 2 and data["order"] == list(ORDER) * 2  # ocpc, ocpc, cold, ocpc, ocpc, ...
    assert ORDER.index(COLD) + 1 == ORDER.index(RESTART)  # the headline's two sides side by side
    rows = {row["case"]: row for row in data["rows"]}
    cold, first = rows["cold, no ocpc"], rows["first run (paid once)"]
    same, restart = rows["new session, same server"], rows["new session after restart"]
    assert cold["cache_n"] == 0 and cold["prompt_n"] > 7000
    assert first["action"] == "warmed"  # every round: a fresh ocpc home
    head = first["cache_n"]  # the warmed head, reused by the request that follows
    assert same["action"] in ("hit", "restored") and same["cache_n"] >= head
    assert restart["action"] == "restored" and restart["cache_n"] >= head
    assert cold["prompt_n"] >= 15 * restart["prompt_n"]
    samples = data["samples"]
    for i, sample in enumerate(samples):
        if sample["case"] == COLD:  # a fresh server: no task ever ran in its slot, nothing reused
            assert sample["task_before"] is None and sample["cache_n"] == 0, sample
            assert all(other["server_pid"] != sample["server_pid"] for other in samples[:i]), sample
        if sample["case"] == RESTART:
            assert sample["task_before"] is None, sample  # the restart really happened
    assert data["headline"]["speedup"]["n"] == 2


def _sample(case: str, round_: int, total: float) -> Sample:
    return Sample(case, round_, "-", 100, 0, 0.0, total, total, 1, None)


def test_ratios_are_taken_within_a_round_before_the_median() -> None:
    # Round 1 ran under load: both of its arms are slow. Per-round ratios stay 5x; a ratio
    # of the arms' medians would mix rounds (and moves with where the load lands).
    samples = [
        _sample(COLD, 0, 1000),
        _sample(RESTART, 0, 200),
        _sample(COLD, 1, 3000),
        _sample(RESTART, 1, 600),
        _sample(COLD, 2, 1100),
        _sample(RESTART, 2, 220),
    ]
    cold, restart = summarize(samples, cases=(COLD, RESTART))
    assert restart.vs_cold == Spread(median=5.0, low=5.0, high=5.0, n=3)
    assert restart.total == Spread(median=220, low=200, high=600, n=3)
    assert cold.vs_cold.median == 1.0


def test_a_case_without_a_cold_sample_in_its_round_is_not_compared() -> None:
    samples = [_sample(COLD, 0, 1000), _sample(RESTART, 0, 250), _sample(RESTART, 1, 10)]
    _, restart = summarize(samples, cases=(COLD, RESTART))
    assert restart.vs_cold.n == 1 and restart.vs_cold.median == 4.0


def test_spread_deviation_is_the_widest_sample_from_the_median() -> None:
    spread = Spread.of([4.0, 5.0, 6.5])
    assert (spread.median, spread.low, spread.high) == (5.0, 4.0, 6.5)
    assert spread.deviation() == pytest.approx(0.3)


def test_the_headline_prints_its_range_and_the_load() -> None:
    samples = [
        s
        for r in range(3)
        for s in (
            _sample(COLD, r, 1000 + 100 * r),
            _sample(CASES[1], r, 900),
            _sample(CASES[2], r, 120),
            _sample(RESTART, r, 200),
        )
    ]
    data = DemoResult(samples=samples, load_start=(1.5, 1.0, 1.0), load_end=(2.5, 1.0, 1.0)).to_json()
    console = Console(record=True, width=120)
    render_demo(data, "tiny.gguf", console)
    text = console.export_text()
    assert "5.5x faster than cold (5.0-6.0x over 3 rounds" in text
    assert "load average 1.5 at the start, 2.5 at the end" in text
