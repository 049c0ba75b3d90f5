"""Taking a slot on ``-np N``, for every front door: which one, waiting for it, giving it back.

One broker per server, owned by the ``Preparer``, so the plugin's daemon and the proxy that
``ocpc launch`` runs beside it share one view of the slots: a slot taken by either is busy for
both, and a request waiting in line wakes when either frees a slot. Before this was shared, the
daemon prepared its one configured slot while a proxied conversation could be sent onto it
mid-request (the proxy's table did not know the plugin's request ran there), and the server then
overwrote the plugin's conversation unparked.

A taken slot is held (``SlotTracker.hold``: nothing else of ours prepares, parks or parks ahead
there) from its prepare to the end of the request's answer. The proxy sees that end itself; the
daemon does not (the plugin sends the request to the server directly), so it *lends* the slot
until the plugin's report for that prepare arrives, and a lease whose report never comes (an
answer without timings, a plugin that gave up) is taken back once the server shows the slot idle
(``reclaim``). A front door taking a slot for a conversation that still has a lease out (its
previous request ended, the report was lost) takes the lease back first.

Which slot: ``affinity.choose``'s rules. With every slot busy, a request waits *in line* for
whichever slot frees first, not on one slot's lock while others free up.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from oc_prefix_cache.chat.conversation import INSTANCE_SEP, ConversationKey, text_digest
from oc_prefix_cache.chat.head import Head
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.affinity import AffinityTable, Held, Want, choose
from oc_prefix_cache.engine.tracker import SlotHold, SlotTracker
from oc_prefix_cache.errors import LockTimeout, OcpcError

log = logging.getLogger("ocpc.broker")

DIRECT = frozenset({"own", "client", "single"})  # rules that wait for one slot's lock, not in line
LEASE_GRACE_S = 5.0  # a lent slot is not reclaimed sooner: the plugin sends its request after the prepare
IDLE_LOOKS_S = 10.0  # and only once the server showed it idle this long (a busy machine can deliver the
# answer's last chunk, and the report after it, seconds after the server went idle)


#: Names the conversation of a shared key (engine/instances.py): (key, body, continuing, rewrites_history,
#: the names with a request in flight) -> its name.
Namer = Callable[[ConversationKey, bytes, bool, bool, frozenset[str]], str]


@dataclass(frozen=True)
class Ask:
    """What a front door knows of a request before its prepare."""

    conversation: str  # "" for a request with no head worth caching (a title): it keeps no slot
    head_key: str = ""  # the head's cheap key ("" when not cut)
    # a shared key to name under the broker's lock (``conversation`` is then filled in by ``take``):
    # two requests named at once never take one name (engine/instances.py)
    key: ConversationKey | None = None
    raw: bytes = b""  # the body as chat completions, for its message chain
    continuing: bool = False  # it carries earlier turns of its own (a harness's canned examples are none)
    rewrites_history: bool = False  # its harness rewrites earlier turns (Aider, after an edit)
    n_slots: int = 1
    client_slot: int | None = None  # the client's own id_slot
    default_slot: int = 0  # the slot of a single-slot server (settings.slot)
    returning: bool = False  # it carries earlier assistant turns: a conversation coming back


@dataclass
class Taken:
    """A slot taken for one request; give it back exactly once (``SlotBroker.give_back``)."""

    slot: int
    rule: str
    conversation: str
    hold: SlotHold | None = None
    why_not: str = ""  # why the slot's lock was not had (then the request goes on unprepared)
    at: float = field(default_factory=time.monotonic)  # taken; once lent, when lent
    idle_since: float | None = None  # a lease's slot first seen idle (``reclaim``)
    task_at: int | None = None  # once lent: the newest task ocpc had seen in the slot (``reclaim``)
    returned: bool = False


class Claim:
    """What one request took from the broker, given back exactly once by the request's owner.

    Why: a slot taken and then lost track of (an exception between the take and the code that
    gives it back) stayed busy for good, and its lock held until Python's cyclic garbage
    collector ran; every later request for that slot waited out its deadline (a lone surrogate
    in a body pinned with ``"id_slot": -1``, issue 36). So the front door makes a ``Claim`` when
    the request arrives and releases it in a ``finally`` that spans the whole request, from the
    take to the last byte sent or the error, whatever happened in between. A take that finishes
    after the request was released (a client gone, a shutdown) is given back at once.
    """

    def __init__(self, broker: SlotBroker) -> None:
        self._broker = broker
        self._guard = threading.Lock()
        self._taken: Taken | None = None
        self._released = False

    def take(self, ask: Ask, *, deadline: Deadline, gone: threading.Event | None = None) -> Taken:
        taken = self._broker.take(ask, deadline=deadline, gone=gone)
        with self._guard:
            late, self._taken = self._released, taken
        if late:
            self._broker.give_back(taken)
        return taken

    @property
    def taken(self) -> Taken | None:
        with self._guard:
            return self._taken

    def release(self) -> None:
        """Give back what was taken (nothing, if nothing was); idempotent."""
        with self._guard:
            self._released = True
            taken = self._taken
        if taken is not None:
            self._broker.give_back(taken)


#: A lease whose request has not started in its slot (no new task there) is kept this long.
UNSTARTED_S = 120.0
UNKNOWN_SLOTS_RETRY_S = 1.0  # a slot count that could not be read is asked again after this long


class SlotBroker:
    """Per server: the affinity table, the line of requests waiting for a slot, the leases."""

    def __init__(
        self,
        *,
        server: str,
        tracker: SlotTracker,
        props: Callable[[Deadline], dict[str, Any]],
        slots_ttl_s: float = 30.0,
        process_gone: Callable[[], bool] = lambda: False,
        namer: Namer | None = None,
    ) -> None:
        """``process_gone``: whether the server process ocpc knew has ended (a restart, known before
        any look at the slots notices it: microseconds, from ``/proc``)."""
        self.server = server
        self.tracker = tracker
        self.table = AffinityTable()
        self._props = props
        self._slots_ttl_s = slots_ttl_s
        self._process_gone = process_gone
        self.namer = namer
        self._naming: set[str] = set()  # names given to requests that have not begun in a slot yet
        self._slots: tuple[float, int, int] = (0.0, 1, -1)  # (when read, how many, the server process's epoch)
        self._slots_known = False  # whether that count is the server's answer (not the fallback)
        # choosing and marking a slot busy happen at once (two new conversations never pick one
        # slot); requests that found every slot busy wait here, in line, for a slot to free
        self._freed = threading.Condition()
        self._line: deque[object] = deque()
        self._leases: dict[str, Taken] = {}  # prepare_id -> a slot lent to the plugin's request

    # -- the server's slot count -----------------------------------------------------------
    def n_slots(self, *, fresh: bool = False) -> int:
        """``/props`` ``total_slots``, re-read every ``slots_ttl_s`` (``fresh``: now), and at once
        after a restart: a server restarted with fewer slots wraps an ``id_slot`` past its last
        (b11434), and a request pinned to a slot that is gone ran over another slot's
        conversation, unparked. A read that failed (a router's model still loading, a server
        restarting) is tried again a second later: its fallback of one slot must not pin every
        request to slot 0 for the whole ttl."""
        read_at, n, epoch = self._slots
        ttl = self._slots_ttl_s if self._slots_known else UNKNOWN_SLOTS_RETRY_S
        same_process = epoch == self.tracker.epoch(self.server) and not self._process_gone()
        if not fresh and same_process and time.monotonic() - read_at < ttl:
            return n
        epoch = self.tracker.epoch(self.server)
        try:
            total = self._props(Deadline.after(2.0)).get("total_slots")
            n = total if isinstance(total, int) and total > 0 else 1
            self._slots_known = isinstance(total, int) and total > 0
        except OcpcError as exc:
            log.info("cannot read the server's slot count (%s); assuming %d", exc, n)
            self._slots_known = False
        self._slots = (time.monotonic(), n, epoch)
        return n

    def slots_known(self) -> int | None:
        """``n_slots`` when the server's last answer said it, else None (not a guess)."""
        n = self.n_slots()
        return n if self._slots_known else None

    # -- taking and giving back ------------------------------------------------------------
    def take(self, ask: Ask, *, deadline: Deadline, gone: threading.Event | None = None) -> Taken:
        """Choose the slot and hold it. A conversation's own slot, or the client's choice, is
        waited for directly (its lock); otherwise, with every slot busy, in arrival order for any
        slot to free. Past the deadline (or once the client left) the LRU slot is taken without
        its lock: ``why_not`` says so and the request goes on unprepared. A client that leaves
        while the request waits for a slot's lock ends that wait too. A shared key is named here
        first (``Ask.key``), so ``Taken.conversation`` is the name the prepare must use."""
        ask = self._named(ask)
        try:
            return self._take(ask, deadline=deadline, gone=gone)
        finally:
            with self._freed:
                self._naming.discard(ask.conversation)

    def _named(self, ask: Ask) -> Ask:
        """``ask`` with its conversation's name, when a shared key must be named: under the lock,
        and reserved until the request begins in a slot, so two requests named at once (two twins'
        next turns) never get one name."""
        if ask.key is None or not ask.key.shared or not ask.key.name or self.namer is None:
            return ask
        with self._freed:
            in_flight = frozenset(self.table.busy_conversations()) | frozenset(self._naming)
            try:
                name = self.namer(ask.key, ask.raw, ask.continuing, ask.rewrites_history, in_flight)
            except Exception:  # noqa: BLE001 (naming must not fail a request: a new name)
                log.exception("naming a request's conversation failed; it gets a new name")
                name = ""
            if not name or name in in_flight:
                name = ask.key.name + INSTANCE_SEP + secrets.token_hex(4)
            self._naming.add(name)
        return replace(ask, conversation=name)

    def _take(self, ask: Ask, *, deadline: Deadline, gone: threading.Event | None) -> Taken:
        if ask.conversation:
            self._take_back_lease_of(ask.conversation)
        with self._freed:
            ticket, in_line = object(), False
            try:
                while True:
                    slot, rule = self._choose(ask)
                    first = not self._line or (in_line and self._line[0] is ticket)
                    if rule in DIRECT or (rule != "busy-lru" and first):
                        break
                    if deadline.remaining() <= 0 or (gone is not None and gone.is_set()):
                        break  # the LRU slot, whose hold times out at once
                    if not in_line:
                        self._line.append(ticket)
                        in_line = True
                    self._freed.wait(timeout=min(0.5, deadline.remaining()))
            finally:
                if in_line:
                    self._line.remove(ticket)
                    self._freed.notify_all()  # the next in line looks again
            self.table.begin(slot, ask.conversation)
        taken = Taken(slot=slot, rule=rule, conversation=ask.conversation)
        try:
            taken.hold = self.tracker.hold(self.server, slot, deadline=deadline, gone=gone)
        except (LockTimeout, OcpcError) as exc:
            if gone is None or not gone.is_set():
                log.warning("slot %d stayed busy past the prepare's deadline; going on unprepared: %s", slot, exc)
            taken.why_not = str(exc)
        except BaseException:  # marked busy above: never left so by a surprise
            self.give_back(taken)
            raise
        return taken

    def give_back(self, taken: Taken) -> None:
        """The request's answer ended (or it never went): the slot is free again. Idempotent."""
        with self._freed:
            if taken.returned:
                return
            taken.returned = True
            self._leases = {k: v for k, v in self._leases.items() if v is not taken}
        try:
            if taken.hold is not None:
                taken.hold.release()
        finally:
            with self._freed:
                self.table.end(taken.slot, now=time.monotonic())
                self._freed.notify_all()

    # -- leases (the daemon's path) --------------------------------------------------------
    def lend(self, prepare_id: str, taken: Taken) -> None:
        """Keep ``taken`` until the report of ``prepare_id`` (``returned``) or ``reclaim``. Its
        grace counts from now, the prepare's answer: a minutes-long warm must not make the lease
        look stale before the plugin has even sent its request."""
        with self._freed:
            taken.at = time.monotonic()
            taken.task_at = self.tracker.last_task(self.server, taken.slot)
            self._leases[prepare_id] = taken

    def returned(self, prepare_id: str) -> bool:
        """The plugin reported on ``prepare_id``: its answer ended, its slot is free."""
        with self._freed:
            taken = self._leases.pop(prepare_id, None)
        if taken is None:
            return False
        self.give_back(taken)
        return True

    def reclaim(
        self,
        idle: Callable[[int], bool],
        *,
        now: float | None = None,
        task: Callable[[int], int | None] = lambda slot: None,
    ) -> int:
        """Take back leases whose report is not coming: older than ``LEASE_GRACE_S`` and their slot
        shown idle by the server on two looks ``IDLE_LOOKS_S`` apart (one idle look can fall between
        the answer's end and its report). ``idle(slot)``: the server's own view. Returns how many.

        ``task(slot)``: the server's newest task id in the slot. While it is still the one ocpc saw
        when it lent the slot, the plugin's request has not started there: it is on its way or in
        the server's queue (a loaded CPU server starts it only at its next batch, seconds away), so
        an idle slot says nothing about its report until ``UNSTARTED_S``. Measured: a lease taken
        back 15 s after a prepare while the server prefilled another slot's 1,885-token warm."""
        now = time.monotonic() if now is None else now
        with self._freed:
            old = [t for t in self._leases.values() if now - t.at >= LEASE_GRACE_S]
        back = 0
        for taken in old:
            newest = task(taken.slot)
            unstarted = newest is not None and taken.task_at is not None and newest <= taken.task_at
            if unstarted and now - taken.at < UNSTARTED_S:
                taken.idle_since = None
                continue
            if not idle(taken.slot):
                taken.idle_since = None
            elif taken.idle_since is None:
                taken.idle_since = now
            elif now - taken.idle_since >= IDLE_LOOKS_S:
                log.info(
                    "slot %d (%s): no report came for its request %.1f s after its prepare; taken back",
                    taken.slot,
                    taken.conversation or "no conversation",
                    now - taken.at,
                )
                self.give_back(taken)
                back += 1
        return back

    def leases(self) -> int:
        with self._freed:
            return len(self._leases)

    def overdue(self, *, now: float | None = None) -> int:
        """Leases past their grace: only these are worth a look at the server's slots."""
        now = time.monotonic() if now is None else now
        with self._freed:
            return sum(1 for t in self._leases.values() if now - t.at >= LEASE_GRACE_S)

    def _take_back_lease_of(self, conversation: str) -> None:
        with self._freed:
            mine = [t for t in self._leases.values() if t.conversation == conversation]
        for taken in mine:  # its previous request ended (a front door sends one turn at a time)
            self.give_back(taken)

    # -- choosing --------------------------------------------------------------------------
    def _choose(self, ask: Ask) -> tuple[int, str]:
        """(slot, the rule that chose it), under ``_freed``."""
        if ask.client_slot is not None:
            return ask.client_slot, "client"  # the client chose: prepare that slot
        if ask.n_slots <= 1:
            return ask.default_slot, "single"
        views = self.table.views(ask.n_slots, self._held(ask.n_slots))
        if ask.conversation and any(v.conversation == ask.conversation for v in views):
            choice = choose(views, Want(conversation=ask.conversation))
        else:
            choice = choose(
                views,
                Want(conversation=ask.conversation, head=self.table.head_of(ask.head_key), returning=ask.returning),
            )
            log.debug("slot %d for new conversation %s (%s)", choice.slot, ask.conversation or "(none)", choice.rule)
        return choice.slot, choice.rule

    def _held(self, n_slots: int) -> dict[int, Held]:
        """What the shared tracker says each slot holds (every front door's actions and conversations)."""
        out: dict[int, Held] = {}
        for slot in range(n_slots):
            holding = self.tracker.holding(self.server, slot)
            if holding is not None:
                out[slot] = Held(
                    head=holding.head,
                    exact=holding.exact and not holding.conversation,
                    conversation=holding.conversation,
                )
        return out


def returning(chat: dict[str, Any]) -> bool:
    """Whether a chat body carries earlier assistant turns (a conversation coming back, not a new one)."""
    messages = chat.get("messages")
    return isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


def head_key(head: Head) -> str:
    """A head's cheap key (its text as the adapter cut it), before any prepare planned it."""
    return text_digest(f"{head.model}\0{head.tools_json}\0{head.system_head}")
