"""The model of llama-server's own RAM prompt cache (pure): who the server still holds in RAM."""

from __future__ import annotations

from dataclasses import replace

from oc_prefix_cache.decision import FileState, RequestFacts, SlotFacts, decide
from oc_prefix_cache.ramcache import DEFAULT_CACHE_RAM_MIB, RamLimit, RamModel


def test_the_limit_is_read_as_the_server_reads_it() -> None:
    assert RamLimit.from_flag(None).mib == DEFAULT_CACHE_RAM_MIB  # b11434's default: 8 GiB
    assert RamLimit.from_flag("-1").tokens(1000.0) is None  # unlimited
    assert RamLimit.from_flag("0").tokens(1000.0) == 0  # off
    assert RamLimit.from_flag("100").tokens(None) == 0  # no save seen yet: believe nothing is in RAM
    assert RamLimit.from_flag("1").tokens(1024.0) == 1024


def test_the_oldest_stash_goes_first_as_the_server_evicts() -> None:
    model = RamModel()
    for name, tokens in (("a", 400), ("b", 300), ("c", 300)):
        model.stashed(name, tokens, epoch=0, capacity=1000)
    assert model.snapshot() == {"a": 400, "b": 300, "c": 300}
    model.stashed("d", 200, epoch=0, capacity=1000)  # 1,200 > 1,000: the oldest (a) is dropped
    assert model.snapshot() == {"b": 300, "c": 300, "d": 200}
    model.stashed("big", 5000, epoch=0, capacity=1000)  # over the whole limit: the server skips it
    assert model.holds("big", epoch=0) == 0 and model.holds("b", epoch=0) == 300
    model.loaded("b", epoch=0)  # swapped back into a slot (the server erases the entry)
    assert model.holds("b", epoch=0) == 0
    assert model.over(1000, live=600, epoch=0) and not model.over(1000, live=100, epoch=0)
    assert model.holds("c", epoch=1) == 0  # a restart empties the server's RAM cache


def test_a_conversation_the_ram_cache_holds_is_left_to_the_server() -> None:
    """Below memory pressure ocpc must be invisible: the server swaps a returning conversation
    in from RAM faster than a disk park's restore (a slot action between batches), and it
    stashes the occupant itself, so nothing is parked on the request path."""
    slot = SlotFacts(restarted=False, known=True, empty=False, holds_head="H", exact=False,
                     holds_conversation="other", partial_cache=True, occupant_parkable=True)
    back = RequestFacts(skip=None, conversation="ses_a", continues_slot=False, continuing=True, head="H",
                        head_file=FileState.PROVEN, park=FileState.PROVEN)
    action = decide(slot, replace(back, in_ram=True))
    assert (action.kind, action.target, action.park_first) == ("hit", "ram", False)
    action = decide(slot, back)  # dropped from RAM: its park, the occupant parked first
    assert (action.kind, action.target, action.park_first) == ("restore", "park", True)
    assert decide(replace(slot, restarted=True, empty=True), replace(back, in_ram=True)).kind == "restore"
