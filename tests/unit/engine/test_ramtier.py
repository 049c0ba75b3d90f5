"""The RAM tier's own bookkeeping, without a server: what it counts and what it asks the server.

What the server's RAM cache does is tested on the rig (tests/rig/engine/test_ram_swaps.py); here the
client is a recorder, because the questions are ocpc's: a query counts nothing, a clear asks
the server's vocabulary once per server process, not once per clear.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.tracker import Holding, Observation, Seen, SlotTracker
from oc_prefix_cache.llama.families import CacheFacts, Family

SERVER = "http://127.0.0.1:9"
VOCAB = {"0": [15], "1": [16]}


class Recorder:
    """Answers /tokenize from a fixed vocabulary and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def tokenize(self, content: str, *, add_special: bool, deadline: Deadline | None = None) -> list[int]:
        self.calls.append(("tokenize", content))
        return VOCAB[content]

    def evaluate(self, tokens: list[int], *, slot: int, deadline: Deadline | None = None) -> None:
        self.calls.append(("evaluate", (tuple(tokens), slot)))


def tier(tracker: SlotTracker, counts: Counter[str], client: Recorder) -> RamTier:
    return RamTier(
        server=SERVER,
        client=client,
        tracker=tracker,  # type: ignore[arg-type]
        argv=lambda: ["llama-server", "--cache-ram", "8192"],
        bytes_per_token=lambda: 100.0,
        busy=set,
        count=lambda name: counts.update([name]),
    )


def test_a_clear_evaluates_one_token_the_request_does_not_start_with() -> None:
    tracker, counts, client = SlotTracker(), Counter[str](), Recorder()
    ram = tier(tracker, counts, client)
    ram.clear(0, (15, 1, 2), deadline=Deadline.after(5))
    ram.clear(1, (3, 4), deadline=Deadline.after(5))
    ram.clear(0, (), deadline=Deadline.after(5))
    evaluated = [args for name, args in client.calls if name == "evaluate"]
    assert evaluated == [((16,), 0), ((15,), 1), ((15,), 0)]
    assert counts["ram_clear"] == 3


def test_the_clear_tokens_are_asked_once_per_server_process() -> None:
    """Every clear used to tokenize "0" and "1" again: two requests to a busy server on the path
    of the request waiting for its slot. Asked again after a restart (the model may differ)."""
    tracker, counts, client = SlotTracker(), Counter[str](), Recorder()
    ram = tier(tracker, counts, client)
    for _ in range(3):
        ram.clear(0, (15,), deadline=Deadline.after(5))
    assert sum(name == "tokenize" for name, _ in client.calls) == 2
    tracker.restarted(SERVER, "test")
    ram.clear(0, (15,), deadline=Deadline.after(5))
    assert sum(name == "tokenize" for name, _ in client.calls) == 4


def test_asking_where_a_conversation_is_counts_nothing() -> None:
    """``where`` is a question the decision asks; only what ocpc does is counted (a clear), so a
    prepare that decides against a clear leaves the counters as they were."""
    tracker, counts, client = SlotTracker(), Counter[str](), Recorder()
    ram = tier(tracker, counts, client)
    left = Observation(id_task=3, n_tokens=900, n_processed=10, n_cached=890)
    occupant = Holding("conv", "b", "h", 900, False, left, conversation="b")
    ram.model.stashed("a", 800, epoch=0, capacity=ram.capacity())
    ram.runs(0, tuple(range(900)), epoch=0)  # the slot holds b, sharing 880 tokens with a's request
    seen = Seen(now=left, restarted=False, holding=occupant, trail=None, epoch=0)
    where = ram.where("a", seen, 0, tuple(range(880)) + (7,) * 20)
    assert where.held == 800 and not where.here  # the server would keep the shared prefix instead
    assert counts == Counter() and client.calls == []


def test_the_share_of_the_limit_counted_on_follows_what_the_entries_carry() -> None:
    """A server that checkpoints (a hybrid, an SWA model without ``--swa-full``) stores each
    entry with copies of its checkpoints, so the tier counts on 60% of the limit; a transformer's
    entries, or an SWA model's with ``--swa-full``, are the slot's state alone, and counting on 60%
    there took conversations the server still held for gone (K = 16 agents on 2 slots, Gemma 3:
    each came back from its head and re-processed its turns). 12 conversations of 700 tokens in a
    10,485-token cache (80% of it)."""
    tracker, counts, client = SlotTracker(), Counter[str](), Recorder()
    ram = RamTier(
        server=SERVER,
        client=client,
        tracker=tracker,  # type: ignore[arg-type]
        argv=lambda: ["llama-server", "--cache-ram", "1"],
        bytes_per_token=lambda: 100.0,
        busy=set,
        count=lambda name: counts.update([name]),
    )
    assert ram.capacity() == 10485
    left = Observation(id_task=3, n_tokens=700, n_processed=10, n_cached=690)
    occupant = Holding("conv", "c11", "h", 700, False, left, conversation="c11")
    seen = Seen(now=left, restarted=False, holding=occupant, trail=None, epoch=0)

    def stash_eleven() -> dict[str, int]:
        ram.model.loaded("c11", epoch=0)
        for i in range(11):
            ram.model.stashed(f"c{i}", 700, epoch=0, capacity=ram.capacity(), fill=ram.fill)
        return ram.model.entries(epoch=0)

    for facts in (CacheFacts(Family.SWA, swa_full=True, checkpoints=32), CacheFacts(Family.TRANSFORMER)):
        ram.learn(facts)
        assert len(stash_eleven()) == 11  # all kept
        assert ram.keeps_occupant(seen) == (False, True)  # the twelfth has room: no park to disk
        assert not ram.over(700)
    for facts in (
        CacheFacts(Family.HYBRID, checkpoints=32),
        CacheFacts(Family.SWA, swa_full=False),
        CacheFacts(Family.UNKNOWN),
    ):
        ram = RamTier(
            server=SERVER,
            client=client,
            tracker=tracker,  # type: ignore[arg-type]
            argv=lambda: ["llama-server", "--cache-ram", "1"],
            bytes_per_token=lambda: 100.0,
            busy=set,
            count=lambda name: counts.update([name]),
        )
        ram.learn(facts)
        assert len(stash_eleven()) == 8  # 6,291 tokens counted on: the oldest three taken for gone
        assert ram.keeps_occupant(seen) == (False, False)  # no room: parked to disk first
        assert ram.over(700)
