"""The park-ahead policy (engine/park_ahead.py), without a server: which idle slots get their park written now."""

from __future__ import annotations

from oc_prefix_cache.engine.executor import SaveCosts
from oc_prefix_cache.engine.park_ahead import IDLE_S, Candidate, Idle, IdleSlots, due


def candidate(slot: int = 0, *, idle_for: float = IDLE_S, unsaved: int = 5000, est: float | None = 3.0) -> Candidate:
    return Candidate(slot, Idle(epoch=1, conversation=f"c{slot}", since=100.0 - idle_for), unsaved, est)


def test_a_slot_idle_long_enough_with_a_costly_park_is_due() -> None:
    assert due([candidate()], now=100.0, park_min=256, threshold_s=1.0) == [candidate()]


def test_what_is_not_due() -> None:
    for c in (
        candidate(idle_for=IDLE_S - 0.5),  # the agent's tool may still be quick
        candidate(unsaved=100),  # too little in no file yet
        candidate(est=0.4),  # parking at displacement costs less than the threshold
        candidate(est=None),
    ):  # no save seen on this server yet: nothing to go by
        assert due([c], now=100.0, park_min=256, threshold_s=1.0) == [], c
    assert due([candidate()], now=100.0, park_min=256, threshold_s=None) == []  # off


def test_save_costs_scale_with_the_largest_save_and_the_latest_rate() -> None:
    costs = SaveCosts()
    assert costs.seconds_for(1000) is None
    costs.saw(tokens=8000, size=800_000_000, seconds=2.0)  # 100 KB per token, 400 MB/s
    costs.saw(tokens=100, size=30_000_000, seconds=0.03)  # a small save: its fixed part is large
    assert costs.bytes_for(30_000) == 3_000_000_000  # from the largest save
    assert costs.seconds_for(30_000) == 3.0  # at the latest rate (1 GB/s)


def test_a_prepare_clears_what_a_report_marked() -> None:
    slots = IdleSlots()
    slots.mark(0, Idle(epoch=1, conversation="a", since=1.0))
    slots.mark(1, Idle(epoch=1, conversation="b", since=2.0))
    slots.clear(0)
    assert [slot for slot, _ in slots.items()] == [1] and slots.get(0) is None
