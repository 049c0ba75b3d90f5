"""Slot affinity (oc_prefix_cache/affinity.py): a table of cases, then properties over any slot state."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oc_prefix_cache.engine.affinity import AffinityTable, Held, SlotView, Want, choose


def view(
    slot: int, *, busy: bool = False, conv: str = "", head: str = "", exact: bool = False, used: float = 0.0
) -> SlotView:
    return SlotView(slot=slot, busy=busy, conversation=conv, head=head, exact_head=exact, last_used=used)


CASES = [
    # (slots, want, expected slot, rule)
    ([view(0, conv="a", used=5), view(1, conv="b", used=1)], Want("a"), 0, "own"),
    ([view(0, conv="a", busy=True), view(1)], Want("a"), 0, "own"),  # its history is there: wait for it
    ([view(0, conv="a", head="H", used=1), view(1, head="H", exact=True, used=9)], Want("new", "H"), 1, "exact-head"),
    ([view(0, conv="a", head="H", used=1), view(1, used=9)], Want("new", "H"), 1, "no-conversation"),
    ([view(0, conv="a", head="H", used=5), view(1, conv="b", used=1)], Want("new", "H"), 0, "head"),
    ([view(0, conv="a", used=5), view(1, conv="b", used=1)], Want("new", "H"), 1, "free-lru"),
    ([view(0, conv="a", used=5, busy=True), view(1, conv="b", used=9)], Want("new"), 1, "free-lru"),
    ([view(0, head="H", exact=True, busy=True), view(1, conv="b", used=9)], Want("new", "H"), 1, "free-lru"),
    ([view(0, busy=True, used=5), view(1, busy=True, used=1)], Want("new"), 1, "busy-lru"),
    ([view(0, used=0), view(1, used=0)], Want(""), 0, "no-conversation"),  # ties: the lower slot
    ([view(0)], Want("x", "H"), 0, "no-conversation"),
]


@pytest.mark.parametrize(("slots", "want", "slot", "rule"), CASES)
def test_choice_table(slots: list[SlotView], want: Want, slot: int, rule: str) -> None:
    choice = choose(slots, want)
    assert (choice.slot, choice.rule) == (slot, rule)


def test_no_slots_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose([], Want("a"))


convs = st.sampled_from(["", "a", "b", "c"])
heads = st.sampled_from(["", "H", "G"])


@st.composite
def slot_states(draw: st.DrawFn) -> list[SlotView]:
    n = draw(st.integers(min_value=1, max_value=6))
    taken: set[str] = set()
    out = []
    for i in range(n):
        conv = draw(convs)
        if conv in taken:
            conv = ""  # a conversation lives in one slot
        taken.add(conv)
        out.append(
            view(
                i,
                busy=draw(st.booleans()),
                conv=conv,
                head=draw(heads),
                exact=draw(st.booleans()),
                used=draw(st.floats(min_value=0, max_value=100)),
            )
        )
    return out


@given(slot_states(), convs, heads)
def test_properties(slots: list[SlotView], conv: str, head: str) -> None:
    choice = choose(slots, Want(conv, head))
    chosen = slots[choice.slot]
    own = [s for s in slots if conv and s.conversation == conv]
    free = [s for s in slots if not s.busy]
    if own:  # each conversation keeps its slot
        assert chosen is own[0]
        return
    if free:  # never a busy slot while a free one qualifies
        assert not chosen.busy
    else:
        assert chosen.last_used == min(s.last_used for s in slots)
    if head and any(s.head == head and s.exact_head for s in free):  # its head, held exactly, wins
        assert chosen.head == head and chosen.exact_head
    elif any(not s.conversation for s in free):  # then a slot that evicts nobody
        assert not chosen.conversation
    if choice.rule == "free-lru":  # nothing better: the least recently used free slot
        assert chosen.last_used == min(s.last_used for s in free)


def test_table_keeps_one_slot_per_conversation_and_tracks_use() -> None:
    table = AffinityTable()
    table.begin(0, "a")
    table.begin(1, "b")
    views = table.views(2, {0: Held("H", False)})
    assert [(v.conversation, v.busy, v.head) for v in views] == [("a", True, "H"), ("b", True, "")]
    table.end(0, now=5.0)
    table.begin(1, "a")  # "a" moved (its slot was taken while it was away): it is no longer in slot 0
    views = table.views(2, {})
    assert [(v.conversation, v.busy, v.last_used) for v in views] == [("", False, 5.0), ("a", True, 0.0)]
    table.learn_head("key", "fp")
    assert table.head_of("key") == "fp" and table.head_of("other") == ""


def test_a_conversation_another_front_door_left_in_a_slot_is_that_slots_conversation() -> None:
    """The defect: the proxy read only (head, exact) from the tracker, so the plugin's conversation
    on slot 0 looked free and the first proxied conversation (lowest-id tie-break) landed on it:
    the two harnesses parked each other on slot 0 every turn while slot 1 sat idle."""
    table = AffinityTable()
    held = {0: Held("H", False, conversation="ses_opencode")}
    views = table.views(2, held)
    assert views[0].conversation == "ses_opencode"
    assert choose(views, Want("claude-1", head="H")).slot == 1  # the free slot without a conversation
    table.begin(0, "claude-1")  # while a request of ours runs there, the table's intent wins
    assert table.views(2, held)[0].conversation == "claude-1"
