"""Parking ahead: write a big conversation's park while its slot is idle, not when it is displaced.

Why: on a 27B model a park is ~100 KB per token (a 30k-token conversation is ~3 GB), and
parking synchronously puts the whole write on the request that displaces it. Measured on
the fat-KV model (102,400 bytes per token, this machine): a 10,655-token park (1.09 GB)
took ~3 s inside the displacing request's prepare. A slot's state cannot be read once a new
request has overwritten it, so the only other time to write it is before: after a turn,
while the agent runs its tools and the slot is idle (a write-back tier). A displacement then
finds the conversation already on disk and writes nothing; a conversation that comes back
first just goes on (the park is a strict prefix of its next request, so nothing is lost
but the write).

The policy is pure (``due``): a slot is parked ahead once it has been idle ``IDLE_S`` since
the report of its last request, holds a conversation ocpc can vouch for with enough tokens
in no file yet, and parking it at displacement would cost more than the configured seconds
(``OC_PREFIX_CACHE_PARK_AHEAD_S``, from what this server's saves cost so far). Under
pressure (a park at displacement within ``DISPLACING_S``: conversations outnumber slots; or
more conversations than the server's RAM cache keeps) the threshold is 0: every idle
conversation is likely displaced before it returns. ``AheadWriter`` carries it out, from the
Preparer's between-requests watch, under the slot's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.tracker import Seen, SlotTracker
from oc_prefix_cache.errors import LockTimeout, OcpcError

log = logging.getLogger("ocpc.ahead")

#: How long a slot stays idle after its request's report before its park is written ahead.
#: An agent's quick tool call (a file read) comes back within this; a long one (a build, a
#: test run, a subagent's turn on another slot) does not.
IDLE_S = 2.0
#: A park at displacement this recent means conversations outnumber slots: park every idle one ahead.
DISPLACING_S = 300.0


@dataclass(frozen=True)
class Idle:
    """A slot left idle by a served request: its conversation, as of that report."""

    epoch: int
    conversation: str
    since: float  # time.monotonic() of the report


@dataclass(frozen=True)
class Candidate:
    """What ``due`` weighs for one idle slot."""

    slot: int
    idle: Idle
    unsaved: int  # tokens of the slot's conversation in no file yet
    est_seconds: float | None  # what parking it now would take (None: no save seen yet on this server)


def due(candidates: list[Candidate], *, now: float, park_min: int, threshold_s: float | None) -> list[Candidate]:
    """The idle slots to park ahead now (see the module docstring); ``threshold_s`` None: never."""
    if threshold_s is None:
        return []
    return [
        c
        for c in candidates
        if now - c.idle.since >= IDLE_S
        and c.unsaved >= max(park_min, 1)
        and c.est_seconds is not None
        and c.est_seconds > threshold_s
    ]


class IdleSlots:
    """Which slots of one server sit idle after a served request. Thread-safe: reports
    mark a slot, every prepare of it clears it (a request is about to run there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[int, Idle] = {}

    def mark(self, slot: int, idle: Idle) -> None:
        with self._lock:
            self._idle[slot] = idle

    def clear(self, slot: int) -> None:
        with self._lock:
            self._idle.pop(slot, None)

    def get(self, slot: int) -> Idle | None:
        with self._lock:
            return self._idle.get(slot)

    def items(self) -> list[tuple[int, Idle]]:
        with self._lock:
            return sorted(self._idle.items())


#: Park the conversation ``Seen`` shows in the slot (``Parker.park`` with the server's identity);
#: what the slot holds afterwards.
ParkNow = Callable[[Seen, int, Deadline], Seen]


class AheadWriter:
    """Parks ahead for one server: which idle slots are due (``due``), then each under its lock,
    unless a request came for the slot meanwhile (the lock is tried briefly: a prepare or a
    request holding it wins). Its collaborators are passed in, so it holds no server state."""

    def __init__(
        self,
        *,
        server: str,
        tracker: SlotTracker,
        idle: IdleSlots,
        seconds_for: Callable[[int], float | None],
        observe: Callable[[int, Deadline], Seen],
        park: ParkNow,
        count: Callable[[str], None],
        ram_over: Callable[[int], bool],
    ) -> None:
        self.server, self.tracker, self.idle = server, tracker, idle
        self._seconds_for, self._observe, self._park, self._count = seconds_for, observe, park, count
        self._ram_over = ram_over  # (tokens live in slots) -> the server's RAM cache cannot keep them all
        self._displaced_at: float | None = None

    def displaced(self) -> None:
        """A prepare parked a conversation to displace it: conversations outnumber slots."""
        self._displaced_at = time.monotonic()

    def run(self, *, threshold_s: float | None, park_min: int) -> None:
        """Park every idle slot whose park is due, one at a time."""
        candidates = []
        for slot, idle in self.idle.items():
            holding = self.tracker.holding(self.server, slot)
            if holding is None or holding.kind != "conv" or holding.conversation != idle.conversation:
                self.idle.clear(slot)  # the slot moved on: nothing of this conversation to park
                continue
            candidates.append(
                Candidate(
                    slot,
                    idle,
                    unsaved=holding.n_tokens - holding.stored,
                    est_seconds=self._seconds_for(holding.n_tokens),
                )
            )
        live = sum(c.unsaved for c in candidates)
        displacing = self._displaced_at is not None and time.monotonic() - self._displaced_at < DISPLACING_S
        if threshold_s is not None and candidates and (displacing or self._ram_over(live)):
            threshold_s = 0.0  # an idle conversation is likely displaced before it returns
        for candidate in due(candidates, now=time.monotonic(), park_min=park_min, threshold_s=threshold_s):
            self._park_slot(candidate)

    def _park_slot(self, candidate: Candidate) -> None:
        slot, started = candidate.slot, time.perf_counter()
        work = Deadline.after(max(30.0, 4 * (candidate.est_seconds or 0.0)))
        try:
            with self.tracker.slot_lock(self.server, slot, deadline=Deadline.after(0.2)):
                if self.idle.get(slot) != candidate.idle:
                    return  # a prepare came for the slot: its request runs first
                self.idle.clear(slot)
                seen = self._observe(slot, work)
                holding = seen.holding
                if (
                    seen.restarted
                    or seen.epoch != candidate.idle.epoch
                    or holding is None
                    or holding.kind != "conv"
                    or holding.conversation != candidate.idle.conversation
                    or seen.trail is None
                ):
                    return
                after = self._park(seen, slot, work)
        except LockTimeout:
            return  # busy: the next watch looks again if the slot is still idle then
        except OcpcError as exc:
            self._count("park_ahead_failed")
            log.warning("could not park slot %d ahead (it is parked at displacement instead): %s", slot, exc)
            return
        self._count("parked_ahead")
        log.info(
            "parked slot %d ahead while it was idle: %d tokens in %.0f ms",
            slot,
            after.holding.n_tokens if after.holding else 0,
            (time.perf_counter() - started) * 1000,
        )
