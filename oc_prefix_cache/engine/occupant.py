"""A slot's occupant: what happens to the conversation in a slot before something else runs there.

ocpc never lets a request wipe a conversation it could have kept: a new session's restore, a
request with no head (a title, a summary) and a server's stop all park the slot's conversation
first, and a conversation that goes on in another slot waits for its park to be on record. Each
of these is a question about the occupant rather than about the request being prepared, so
they live here, apart from engine/prepare.py (which gathers and decides) and engine/loading.py (which puts
the new prefix in). The parks themselves are written by engine/parker.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.decision import SlotFacts
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.parker import Parker
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.tracker import Seen, SlotTracker
from oc_prefix_cache.errors import OcpcError, ParkTooBig
from oc_prefix_cache.llama.families import CacheFacts
from oc_prefix_cache.llama.fingerprint import ServerIdentity, server_key

log = logging.getLogger("ocpc.prepare")

BUSY_WAIT_S = 2.0  # how long a prepare waits for a slot the server shows processing (then: skip)


def slot_facts(seen: Seen, conversation: str, *, cache: CacheFacts, park_min: int) -> SlotFacts:
    """What the decision needs to know of the slot, for a request of ``conversation``: whose
    it is, and whether its occupant is worth a park (its own turns past what a file holds)."""
    holding = seen.holding
    parkable = (
        holding is not None
        and holding.kind == "conv"
        and bool(holding.conversation)
        and holding.conversation != conversation
        and seen.trail is not None
        and holding.n_tokens - holding.stored >= park_min
    )
    return SlotFacts(
        restarted=seen.restarted,
        known=holding is not None,
        empty=not seen.now.n_tokens,
        busy=seen.now.busy,
        holds_head=holding.head if holding else None,
        exact=bool(holding and holding.exact),
        holds_conversation=holding.conversation if holding else "",
        partial_cache=cache.partial_cache,
        exact_key=holding.key if holding and holding.exact else None,
        occupant_parkable=parkable,
    )


@dataclass
class Occupant:
    """Parks and waits on the conversations in one server's slots, for a Preparer."""

    server: str
    tracker: SlotTracker
    view: ServerView
    parker: Parker
    ram: RamTier
    park_min_tokens: int
    count: Callable[[str], None]

    def park(self, seen: Seen, slot: int, *, server: ServerIdentity, identity: str, deadline: Deadline) -> Seen:
        """Park the slot's conversation, counting how it went (a park over the cap, a failure)."""
        try:
            after = self.parker.park(seen, slot, server=server, identity=identity, deadline=deadline)
        except ParkTooBig:
            self.count("park_failed:over_cap")
            raise
        except OcpcError:
            self.count("park_failed")
            raise
        self.count("parked")
        return after

    def park_with_identity(self, seen: Seen, slot: int, deadline: Deadline) -> Seen:
        """Park the slot's conversation (the park ahead's way: the server's identity read first)."""
        server = self.view.identity(deadline)
        return self.parker.park(seen, slot, server=server, identity=server_key(server), deadline=deadline)

    def park_for_side(self, slot: int, deadline: Deadline) -> str:
        """Before a request with no head (a title) runs over the slot's conversation, park it: it
        would otherwise be lost to that request. Failing here fails nothing: the request goes on.
        The server's identity is read only when there is a conversation to park (a title on a
        slot without one costs one look at the slots). Returns what it did, for the reason."""
        try:
            with self.tracker.slot_lock(self.server, slot, deadline=deadline):
                seen = self.until_idle(slot, self.view.observe(slot, deadline=deadline), deadline=deadline)
                if seen.now.busy or seen.holding is None or seen.holding.kind != "conv":
                    return ""
                server = self.view.identity(deadline)
                if server.cache.restores_serve:
                    return ""
                facts = slot_facts(seen, "", cache=server.cache, park_min=self.park_min_tokens)
                if not (facts.known and facts.occupant_parkable):
                    return ""
                if self.ram.keeps_occupant(seen)[0]:
                    return "; the slot's conversation is whole in the server's RAM cache: not parked to disk"
                parking = time.perf_counter()
                after = self.park(seen, slot, server=server, identity=server_key(server), deadline=deadline)
        except OcpcError as exc:
            log.warning("could not park slot %d's conversation before a request without a head: %s", slot, exc)
            return f"; the slot's conversation could not be parked first ({exc})"
        return (
            f"; parked the slot's conversation first ({after.holding.n_tokens if after.holding else 0} tokens "
            f"in {(time.perf_counter() - parking) * 1000:.0f} ms)"
        )

    def until_idle(self, slot: int, seen: Seen, *, deadline: Deadline) -> Seen:
        """The slot as it is once no request runs in it, waiting at most ``BUSY_WAIT_S``. Why: a
        slot action on a busy slot is deferred by the server until that request's generation
        ends, then wipes what it left unparked (and lands even after ocpc's call timed out).
        Right after a request of ours ends the server may still show it busy for a moment."""
        waited = Deadline.after(min(BUSY_WAIT_S, deadline.remaining()))
        while seen.now.busy and waited.remaining() > 0:
            time.sleep(0.02)
            seen = self.view.observe(slot, deadline=deadline)
        return seen

    def await_park(self, conversation: str, slot: int, *, deadline: Deadline) -> None:
        """A conversation going on in a slot other than the one that holds it, while that slot
        holds its unsaved tail: whoever took that slot is parking it (or about to). Wait until the
        tracker shows that slot moved on, so the index read next finds the park, instead of
        re-prefilling from the head. Bounded by the deadline; a few microseconds when not so."""

        def live_elsewhere() -> bool:
            for other in self.tracker.slots(self.server):
                holding = self.tracker.holding(self.server, other)
                if (
                    other != slot
                    and holding is not None
                    and holding.kind == "conv"
                    and holding.conversation == conversation
                    and holding.stored < holding.n_tokens
                ):
                    return True
            return False

        if not conversation or not live_elsewhere():
            return
        started = time.perf_counter()
        while live_elsewhere() and deadline.remaining() > 0.05:
            time.sleep(0.02)
        self.count("waited_for_park")
        log.info(
            "%s went on in slot %d while another slot held it: waited %.0f ms for its park",
            conversation,
            slot,
            (time.perf_counter() - started) * 1000,
        )
