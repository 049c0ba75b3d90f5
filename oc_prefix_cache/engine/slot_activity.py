"""What is going on in each slot outside the tracker's record: prepares running for it, and
the long step one of them is taking now.

Two readers need this and nothing else of the prepare path: a warm start (engine/lifecycle.py)
yields a slot a prepare is working on, or answered for a moment ago (its request may still be
on its way to the server); and ``status()``'s ``doing`` lets ``ocpc top`` show a long restore
or warm with its expected time. Kept apart so the prepare path and the lifecycle share a small
record, not each other.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

CLAIM_GRACE_S = 5.0  # a prepare's answer this recent: its request may still be on its way to the server


class SlotActivity:
    """Per server: the prepares running for each slot, and what each is doing there."""

    def __init__(self, *, epoch: Callable[[], int], seconds_for: Callable[[int], float | None]) -> None:
        self._epoch, self._seconds_for = epoch, seconds_for
        self._guard = threading.Lock()
        self._claims: Counter[int] = Counter()  # slot -> prepares running for it
        self._claim_ended: dict[int, tuple[float, int]] = {}  # slot -> (when the last one answered, epoch)
        self._doing: dict[int, dict[str, Any]] = {}  # slot -> the long step a prepare takes there now

    @contextmanager
    def claimed(self, slot: int) -> Iterator[None]:
        """A prepare runs for ``slot`` for the span of the ``with``, however it ends."""
        self._claim(slot, 1)
        try:
            yield
        finally:
            self._claim(slot, -1)

    def _claim(self, slot: int, change: int) -> None:
        epoch = self._epoch()
        with self._guard:
            self._claims[slot] += change
            if change < 0:
                self._claim_ended[slot] = (time.monotonic(), epoch)
                if self._claims[slot] <= 0:
                    del self._claims[slot]

    def busy(self, slot: int) -> bool:
        """A prepare runs for ``slot``, or answered for it in this server process a moment ago."""
        epoch = self._epoch()
        with self._guard:
            ended, ended_epoch = self._claim_ended.get(slot, (float("-inf"), -1))
            return self._claims[slot] > 0 or (ended_epoch == epoch and time.monotonic() - ended < CLAIM_GRACE_S)

    @contextmanager
    def doing(self, slot: int, what: str, tokens: int) -> Iterator[None]:
        """What a prepare is doing to ``slot`` now, with its expected time for a restore
        (from the restores measured so far)."""
        expected = self._seconds_for(tokens) if what.startswith("restore") and tokens else None
        with self._guard:
            self._doing[slot] = {"what": what, "since": time.time(), "tokens": tokens, "expected_s": expected}
        try:
            yield
        finally:
            with self._guard:
                self._doing.pop(slot, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._guard:
            return {str(slot): dict(doing) for slot, doing in sorted(self._doing.items())}
