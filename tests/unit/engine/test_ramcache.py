"""The model of llama-server's own RAM prompt cache (pure): who the server still holds in RAM."""

from __future__ import annotations

from dataclasses import replace

from oc_prefix_cache.engine.decision import FileState, RequestFacts, SlotFacts, decide
from oc_prefix_cache.engine.ram_contents import DEFAULT_CACHE_RAM_MIB, RamLimit, RamModel, swaps_from_ram


def test_the_limit_is_read_as_the_server_reads_it() -> None:
    assert RamLimit.from_flag(None).mib == DEFAULT_CACHE_RAM_MIB  # b11434's default: 8 GiB
    assert RamLimit.from_flag("-1").tokens(1000.0) is None  # unlimited
    assert RamLimit.from_flag("0").tokens(1000.0) == 0  # off
    assert RamLimit.from_flag("100").tokens(None) == 0  # no save seen yet: believe nothing is in RAM
    assert RamLimit.from_flag("1").tokens(1024.0) == 1024


def test_the_oldest_stash_goes_first_as_the_server_evicts() -> None:
    """The model counts on RAM_FILL (0.6) of the limit: 600 of 1,000 tokens here."""
    model = RamModel()
    for name, tokens in (("a", 200), ("b", 200), ("c", 200)):
        model.stashed(name, tokens, epoch=0, capacity=1000)
    assert model.snapshot() == {"a": 200, "b": 200, "c": 200}
    model.stashed("d", 100, epoch=0, capacity=1000)  # 700 > 600: the oldest (a) is taken for gone
    assert model.snapshot() == {"b": 200, "c": 200, "d": 100}
    model.stashed("big", 5000, epoch=0, capacity=1000)  # over the whole limit: the server skips it
    assert model.holds("big", epoch=0) == 0 and model.holds("b", epoch=0) == 200
    model.loaded("b", epoch=0)  # swapped back into a slot (the server erases the entry)
    assert model.holds("b", epoch=0) == 0
    assert model.over(1000, live=400, epoch=0) and not model.over(1000, live=100, epoch=0)
    assert model.holds("c", epoch=1) == 0  # a restart empties the server's RAM cache


def test_a_conversation_the_ram_cache_holds_is_left_to_the_server() -> None:
    """Below memory pressure ocpc must be invisible: the server swaps a returning conversation
    in from RAM faster than a disk park's restore (a slot action between batches), and it
    stashes the occupant itself, so nothing is parked on the request path."""
    slot = SlotFacts(
        restarted=False,
        known=True,
        empty=False,
        holds_head="H",
        exact=False,
        holds_conversation="other",
        partial_cache=True,
        occupant_parkable=True,
    )
    back = RequestFacts(
        skip=None,
        conversation="ses_a",
        continues_slot=False,
        continuing=True,
        head="H",
        head_file=FileState.PROVEN,
        park=FileState.PROVEN,
    )
    action = decide(replace(slot, occupant_stashable=True), replace(back, in_ram=True))
    assert (action.kind, action.target, action.park_first) == ("hit", "ram", False)
    action = decide(slot, replace(back, in_ram=True))  # no room left in RAM for the occupant: to disk first
    assert (action.kind, action.target, action.park_first) == ("hit", "ram", True)
    action = decide(slot, back)  # dropped from RAM: its park, the occupant parked first
    assert (action.kind, action.target, action.park_first) == ("restore", "park", True)
    assert decide(replace(slot, restarted=True, empty=True), replace(back, in_ram=True)).kind == "restore"


def test_a_copy_the_server_already_holds_keeps_its_place_and_a_longer_one_replaces_it() -> None:
    """As ``server_prompt_cache::alloc``: an idle slot copied again at every request start is
    skipped while the cache holds it whole; its conversation gone on replaces it at the end."""
    model = RamModel()
    for name in ("a", "b"):
        model.stashed(name, 250, epoch=0, capacity=1000)
    model.stashed("a", 250, epoch=0, capacity=1000)  # the same copy again: a stays the oldest
    model.stashed("c", 150, epoch=0, capacity=1000)  # 650 > 600: a goes
    assert model.snapshot() == {"b": 250, "c": 150}
    model.stashed("b", 300, epoch=0, capacity=1000)  # b went on: the longer copy, now the newest
    assert list(model.snapshot()) == ["c", "b"] and model.holds("b", epoch=0) == 300
    assert model.room(1000, tokens=150, epoch=0) and not model.room(1000, tokens=151, epoch=0)
    assert model.room(None, tokens=10**9, epoch=0) and not model.room(0, tokens=1, epoch=0)


def test_where_the_server_swaps_a_conversation_in_from_ram() -> None:
    """``get_available_slot`` swaps only where the slot keeps under half of what it holds, and
    never into an empty slot (measured: tests/rig/llama/test_server_facts.py)."""
    head = list(range(1000))
    mine = head + [5000 + i for i in range(800)]
    short = head + [9000 + i for i in range(300)]  # the same head under a short conversation
    other = [7] + list(range(20000, 21500))  # another harness: nothing shared
    assert swaps_from_ram(occupant=other, occupant_tokens=1524, request=mine)
    assert not swaps_from_ram(occupant=short, occupant_tokens=1324, request=mine)  # keeps 1,000 of 1,324
    long = head + [9000 + i for i in range(3000)]
    assert swaps_from_ram(occupant=long, occupant_tokens=4000, request=mine)  # keeps 1,000 of 4,000
    assert not swaps_from_ram(occupant=None, occupant_tokens=0, request=mine)  # an empty slot: never
    assert not swaps_from_ram(occupant=None, occupant_tokens=500, request=mine)  # unknown occupant
    assert not swaps_from_ram(occupant=head[:100], occupant_tokens=4000, request=mine)  # all it knows is shared


def test_a_slot_the_server_would_not_swap_into_gets_one_unrelated_token_first() -> None:
    slot = SlotFacts(
        restarted=False,
        known=True,
        empty=False,
        holds_head="H",
        exact=False,
        holds_conversation="other",
        partial_cache=True,
        occupant_parkable=True,
        occupant_stashable=True,
    )
    back = RequestFacts(
        skip=None,
        conversation="ses_a",
        continues_slot=False,
        continuing=True,
        head="H",
        head_file=FileState.PROVEN,
        park=FileState.PROVEN,
        in_ram=True,
        ram_here=False,
    )
    action = decide(slot, back)
    assert (action.kind, action.target, action.clear_first, action.park_first) == ("hit", "ram", True, False)
    empty = replace(slot, empty=True, holds_conversation="", occupant_parkable=False, holds_head=None)
    assert decide(empty, back).clear_first


def test_before_a_restore_the_occupant_goes_to_the_servers_ram_when_it_has_room() -> None:
    """A restore is a slot action: it wipes the slot without the server stashing it. Where the RAM
    cache has room for the occupant, one unrelated token first makes the server stash it (no park
    to disk); without room, it is parked to disk first as before; a warm always parks (its own
    evaluation could load another conversation's cached prompt over the slot)."""
    slot = SlotFacts(
        restarted=False,
        known=True,
        empty=False,
        holds_head="H",
        exact=False,
        holds_conversation="other",
        partial_cache=True,
        occupant_parkable=True,
    )
    back = RequestFacts(
        skip=None,
        conversation="ses_a",
        continues_slot=False,
        continuing=True,
        head="H",
        head_file=FileState.PROVEN,
        park=FileState.PROVEN,
    )
    action = decide(replace(slot, occupant_stashable=True), back)
    assert (action.kind, action.target, action.clear_first, action.park_first) == ("restore", "park", True, False)
    action = decide(slot, back)
    assert (action.kind, action.clear_first, action.park_first) == ("restore", False, True)
    warm = replace(back, continuing=False, head_file=FileState.MISSING, park=FileState.MISSING)
    action = decide(replace(slot, occupant_stashable=True), warm)
    assert (action.kind, action.clear_first, action.park_first) == ("warm", False, True)
