"""Slot affinity for ``-np N``: which slot a request goes to. Pure choice, plus a small table.

llama-server picks a slot by itself when a request names none (the most similar prompt, else the
least recently used), which is good for one conversation and bad for several: two conversations
that share a 9k-token head look alike, so each turn of one may land in the slot the other just
used, and every turn then prefills its whole history again. The proxy names the slot (``id_slot``)
and chooses it here, by these rules, in order:

1. **Its own slot.** A conversation keeps the slot it had, busy or not: its history is there, and
   a request of the same conversation still running (a retry) ends soon; the prepare waits for it
   within its deadline and then fails open.
2. **A free slot that holds exactly its head** (the tracker's view: a warmed or restored head and
   no conversation on top), least recently used first.
3. **A free slot that holds no conversation**: a restore costs milliseconds there and evicts nobody.
4. **A free slot that holds its head under another conversation**: on a transformer the server
   reuses the head from it; the conversation it evicts is the prepare core's to park.
5. **Any free slot**, least recently used first.
A conversation coming back (it has earlier turns) whose slot went to another skips rules 2-4: its
history comes back from the server's RAM cache or its park whatever the slot holds, and a free slot
that does not hold its head comes first (the server swaps from RAM only when the slot keeps under
half of what it holds: ``_returning``).

6. Only when every slot is busy: the least recently used slot. The proxy does not take it at
   once: it waits, in arrival order, for any slot to free within the request's deadline
   (``doors/proxy.py``), so requests never pile up on one slot's lock while others go idle.

What a slot holds comes from two places: the proxy's own table (its requests in flight) and the
shared tracker (what any front door, the plugin's daemon included, left there): a conversation the
plugin runs on slot 0 is slot 0's conversation for the proxy too.

A request with no head worth caching (a title, a summary) has no conversation to keep: it is
chosen for as a new conversation with none (``Want("")``), so it lands on a free slot without a
conversation when there is one, and the prepare parks what it displaces.

So a busy slot is never chosen while a free one qualifies, and a new conversation takes the slot of
a live one only when no slot is free of conversations. What to do with a conversation that loses
its slot (park it to disk first) is the prepare core's decision, not this module's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlotView:
    """One slot as the chooser sees it."""

    slot: int
    busy: bool  # a request (or prepare) of ours runs in it now
    conversation: str  # the conversation whose turns it holds ("" none known)
    head: str  # the head fingerprint the tracker says it holds ("" none known)
    exact_head: bool  # it holds exactly that head, nothing on top
    last_used: float  # when a request last ended in it (0: never)


@dataclass(frozen=True)
class Want:
    conversation: str  # "" unknown
    head: str = ""  # the head fingerprint this conversation's requests prepared before ("" unknown)
    returning: bool = False  # a conversation with earlier turns, whose slot went to another


@dataclass(frozen=True)
class Choice:
    slot: int
    rule: str  # which rule chose it (for logs and tests)


def choose(slots: Sequence[SlotView], want: Want) -> Choice:
    """The slot for a request (see the module docstring for the rules)."""
    if not slots:
        raise ValueError("no slots to choose from")
    if want.conversation:
        own = [s for s in slots if s.conversation == want.conversation]
        if own:
            return Choice(_lru(own).slot, "own")
    free = [s for s in slots if not s.busy]
    if want.returning:  # its history comes back from RAM or a park, whatever the slot holds
        return _returning(slots, free, want)
    rules: list[tuple[str, list[SlotView]]] = [
        ("exact-head", [s for s in free if want.head and s.head == want.head and s.exact_head]),
        ("no-conversation", [s for s in free if not s.conversation]),
        ("head", [s for s in free if want.head and s.head == want.head]),
        ("free-lru", free),
        ("busy-lru", list(slots)),
    ]
    for rule, candidates in rules:
        if candidates:
            return Choice(_lru(candidates).slot, rule)
    raise AssertionError("unreachable: the last rule takes every slot")


def _returning(slots: Sequence[SlotView], free: list[SlotView], want: Want) -> Choice:
    """A conversation coming back (rule 1 did not apply): a free slot that does not hold its head
    first. The server swaps a returning conversation in from its RAM cache only when the slot
    would keep under half of what it holds (``ramcache.swaps_from_ram``); a slot holding the same
    head under a short conversation would keep the head and re-process the rest, so it is the
    last choice (a park's restore serves there too, as a slot action)."""
    for rule, candidates in (
        ("other-head", [s for s in free if not want.head or s.head != want.head]),
        ("free-lru", free),
        ("busy-lru", list(slots)),
    ):
        if candidates:
            return Choice(_lru(candidates).slot, rule)
    raise AssertionError("unreachable: the last rule takes every slot")


def _lru(candidates: Sequence[SlotView]) -> SlotView:
    return min(candidates, key=lambda s: (s.last_used, s.slot))


@dataclass(frozen=True)
class Held:
    """One slot as the shared tracker knows it (any front door's last action there)."""

    head: str = ""
    exact: bool = False  # exactly that head, no conversation on top
    conversation: str = ""


@dataclass
class _Use:
    conversation: str = ""
    busy: int = 0
    last_used: float = 0.0


@dataclass
class AffinityTable:
    """What the proxy sent where: per slot, its conversation, requests in flight, last use.

    Thread-safe (the proxy chooses in worker threads). The head a slot holds is not kept here but
    read from the shared ``SlotTracker`` when choosing, so a slot the daemon restored counts too.
    """

    #: a head's cheap key (its text, as the adapter cuts it) -> the fingerprint its prepare found; lets a
    #: new conversation find a slot holding its head before its own prepare has planned anything
    heads: dict[str, str] = field(default_factory=dict)
    _uses: dict[int, _Use] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    MAX_HEADS = 4096

    def views(self, n_slots: int, held: dict[int, Held]) -> list[SlotView]:
        """``held``: what the tracker says each slot holds. The conversation is the table's while a
        request of ours runs there (the newest intent), else the tracker's when it knows one (the
        daemon's conversations included), else the last one the table sent there."""
        with self._guard:
            out = []
            for i in range(n_slots):
                use, known = self._use(i), held.get(i, Held())
                conversation = use.conversation if use.busy or not known.conversation else known.conversation
                out.append(
                    SlotView(
                        slot=i,
                        busy=use.busy > 0,
                        conversation=conversation,
                        head=known.head,
                        exact_head=known.exact,
                        last_used=use.last_used,
                    )
                )
            return out

    def begin(self, slot: int, conversation: str) -> None:
        """A request of ``conversation`` is going to ``slot`` now."""
        with self._guard:
            for other, use in self._uses.items():
                if other != slot and conversation and use.conversation == conversation:
                    use.conversation = ""  # a conversation lives in one slot at a time
            use = self._use(slot)
            use.busy += 1
            use.conversation = conversation

    def end(self, slot: int, *, now: float) -> None:
        with self._guard:
            use = self._use(slot)
            use.busy = max(0, use.busy - 1)
            use.last_used = now

    def busy_conversations(self) -> set[str]:
        """The conversations a request of ours runs for now (a conversation sends one turn at a time)."""
        with self._guard:
            return {use.conversation for use in self._uses.values() if use.busy and use.conversation}

    def busy(self) -> set[int]:
        """The slots a request of ours runs in now."""
        with self._guard:
            return {slot for slot, use in self._uses.items() if use.busy}

    def learn_head(self, key: str, fingerprint: str) -> None:
        if not key or not fingerprint:
            return
        with self._guard:
            if len(self.heads) >= self.MAX_HEADS:
                self.heads.pop(next(iter(self.heads)))
            self.heads[key] = fingerprint

    def head_of(self, key: str) -> str:
        with self._guard:
            return self.heads.get(key, "")

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._guard:
            return {
                str(i): {"conversation": u.conversation, "busy": u.busy, "last_used": round(u.last_used, 3)}
                for i, u in sorted(self._uses.items())
            }

    def _use(self, slot: int) -> _Use:
        return self._uses.setdefault(slot, _Use())
