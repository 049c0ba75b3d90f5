"""The agents bench's own arithmetic (no server): what its rows and ratios say is what ran."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("agents_bench", ROOT / "bench" / "agents_bench.py")
assert _spec and _spec.loader
bench = sys.modules.get("agents_bench") or importlib.util.module_from_spec(_spec)
if "agents_bench" not in sys.modules:
    sys.modules["agents_bench"] = bench  # its dataclasses look their module up
    _spec.loader.exec_module(bench)


def _round(turn_s: float, turns: int, *, processed: float, cores: float | None, hop: float | None = None) -> Any:
    point = bench.Point("ocpc", 1, 2)
    point.turns = [bench.Turn("a", i * 10.0, i * 10.0 + turn_s, 0.5, 1000, 50, 200, hop) for i in range(turns)]
    point.processed_total = processed
    point.server = {"prompt_seconds_total": 1.0, "tokens_predicted_seconds_total": 2.0}
    point.ocpc = {"source:slot": turns}
    point.server_cores = cores
    return point


def test_rounds_of_a_point_add_up_to_one_row_over_all_their_windows() -> None:
    """``--rounds``: a slow round and a fast one make one row whose mean turn weighs every turn,
    whose rate counts every round's window, and whose counters are the rounds' sums."""
    merged = bench.Point.merged([_round(1.0, 3, processed=150, cores=0.25, hop=0.004),
                                 _round(2.0, 1, processed=50, cores=None, hop=0.008)])
    row = merged.row(2 * 60.0)
    assert row["turns"] == 4 and row["turns_per_min"] == 2.0
    assert row["turn_mean_s"] == 1.25
    assert row["cache_share"] == 1 - 200 / 4000
    assert row["prefill_s"] == 2.0 and row["decode_s"] == 4.0
    assert row["server_cores"] == 0.25  # the round that measured it
    assert row["plugin_hop_ms"] == 5.0
    assert [t["s"] for t in row["each_turn"]] == [1.0, 2.0, 1.0, 1.0]  # by start: the slow round's turn is its own
    assert merged.ocpc == {"source:slot": 4}


def test_one_round_is_the_point_itself() -> None:
    point = _round(1.5, 2, processed=100, cores=0.5)
    assert bench.Point.merged([point]).row(60.0) == point.row(60.0)


def test_a_variant_is_ocpc_with_its_settings_and_a_bad_one_stops_the_bench_before_any_server() -> None:
    assert bench._variant("noahead:OC_PREFIX_CACHE_PARK_AHEAD_S=off") == (
        "noahead", {"OC_PREFIX_CACHE_PARK_AHEAD_S": "off"})
    for bad in ("noahead", "ocpc:OC_PREFIX_CACHE_PARK_AHEAD_S=off", ":A=1", "x:OC_PREFIX_CACHE_PARK_AHEAD_S=soon"):
        with pytest.raises(SystemExit):
            bench._variant(bad)


def test_a_variants_ratios_are_against_ocpc_at_the_same_point() -> None:
    rows = [bench.Point.merged([_round(t, n, processed=100, cores=None)]).row(60.0) for t, n in ((2.0, 4), (1.0, 8))]
    rows[0]["arm"], rows[1]["arm"] = "plain", "ocpc"
    variant = _round(1.25, 6, processed=100, cores=None).row(60.0)
    variant["arm"] = "noahead"
    out = bench.ratios([*rows, variant])
    assert out[0]["turns_x"] == 2.0
    assert out[1]["arm"] == "noahead" and out[1]["turns_x_ocpc"] == 0.75 and out[1]["turn_time_x_ocpc"] == 1.25
