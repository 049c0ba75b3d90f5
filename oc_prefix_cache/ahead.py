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
(``OC_PREFIX_CACHE_PARK_AHEAD_S``, from what this server's saves cost so far). The
Preparer's between-requests watch carries it out under the slot's lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

#: How long a slot stays idle after its request's report before its park is written ahead.
#: An agent's quick tool call (a file read) comes back within this; a long one (a build, a
#: test run, a subagent's turn on another slot) does not.
IDLE_S = 2.0


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
    return [c for c in candidates
            if now - c.idle.since >= IDLE_S and c.unsaved >= max(park_min, 1)
            and c.est_seconds is not None and c.est_seconds > threshold_s]


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
