"""What the engine tells about itself: counters, its recent answers, and the event log.

Every part of the engine counts what it does (``count("parked")``), the doors show the
counters (``/ocpc/status``, ``ocpc status``, ``ocpc top``), and each answered request and each
of ocpc's own prefills goes to the event log behind ``ocpc stats``. One object per server holds
them, so a part gets ``telemetry.count`` and nothing else of the engine; a failed event-log
write is counted and fails nothing (the user's request never waits on ocpc's bookkeeping).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from oc_prefix_cache.disk.events import Event, EventLog
from oc_prefix_cache.llama.client import Timings

log = logging.getLogger("ocpc.prepare")


@dataclass
class Stats:
    counters: Counter[str] = field(default_factory=Counter)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    last_report: dict[str, Any] | None = None


class Telemetry:
    """Counters and recent events for one server; the event log's writer. Thread-safe."""

    def __init__(self, *, server: str, events: EventLog) -> None:
        self.server = server
        self.stats = Stats()
        self._log = events
        self._guard = threading.Lock()

    def count(self, key: str) -> None:
        with self._guard:
            self.stats.counters[key] += 1

    def answered(self, action: str, event: dict[str, Any]) -> None:
        """A prepare answered: its action counted, its answer among the recent events."""
        with self._guard:
            self.stats.counters[action] += 1
            self.stats.events.append(event | {"at": time.time()})

    def noted(self, event: dict[str, Any]) -> None:
        """Something worth showing among the recent events (ocpc stood down, and why)."""
        with self._guard:
            self.stats.events.append(event | {"at": time.time()})

    def reported(self, report: dict[str, Any]) -> None:
        with self._guard:
            self.stats.last_report = report

    def write(self, event: Event) -> None:
        """Into the event log (``ocpc stats``, ``ocpc top``); a failed write fails nothing."""
        try:
            self._log.write(event)
        except OSError as exc:
            self.count("event_log_failed")
            log.debug("event log: %s", exc)

    def own_prefill(self, slot: int, timings: Timings) -> None:
        """ocpc's own evaluation (a warm, a park's or project head's tail): a cost in the event log."""
        if timings.prompt_n > 0:
            self.write(
                Event(
                    at=time.time(),
                    door="ocpc",
                    server=self.server,
                    slot=slot,
                    harness="ocpc",
                    action="prefill",
                    source="",
                    cache_n=timings.cache_n,
                    prompt_n=timings.prompt_n,
                    prompt_ms=timings.prompt_ms,
                )
            )

    def snapshot(self) -> tuple[dict[str, int], list[dict[str, Any]], dict[str, Any] | None]:
        """The counters, the recent events and the last report, copied under the lock."""
        with self._guard:
            return dict(self.stats.counters), list(self.stats.events), self.stats.last_report
