"""The benches' own logic, without a server: what the agents bench's rows and ratios say is what
ran, and the router bench's client does what the router asks of it."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest
import respx

from tests.helpers import ROOT


def _bench(name: str) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec and spec.loader
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


bench = _bench("agents_bench")


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
    merged = bench.Point.merged(
        [_round(1.0, 3, processed=150, cores=0.25, hop=0.004), _round(2.0, 1, processed=50, cores=None, hop=0.008)]
    )
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
        "noahead",
        {"OC_PREFIX_CACHE_PARK_AHEAD_S": "off"},
    )
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


@respx.mock
def test_the_router_bench_loads_again_when_the_router_says_try_again_later() -> None:
    """b11434's router answers a load with 500 "model limit reached, try again later" while the
    model it would unload has a request in flight; a full test run once failed on it. The router
    cannot be made to do that on demand, so a stub answers it once."""
    load = respx.post("http://router/models/load").mock(
        side_effect=[
            httpx.Response(500, json={"error": {"message": "model limit reached, try again later"}}),
            httpx.Response(200, json={"success": True}),
        ]
    )
    client = SimpleNamespace(url="http://router", load_retries=0)
    _bench("router_load_bench").Bench.load(client, "qwen35")
    assert load.call_count == 2 and client.load_retries == 1


@respx.mock
def test_the_router_bench_stops_on_any_other_refusal() -> None:
    respx.post("http://router/models/load").mock(
        return_value=httpx.Response(500, json={"error": {"message": "model name=x failed to load"}})
    )
    with pytest.raises(httpx.HTTPStatusError):
        _bench("router_load_bench").Bench.load(SimpleNamespace(url="http://router", load_retries=0), "x")
