"""When ocpc stands down on a server: restores cannot serve there, so it does nothing.

ocpc's first rule is never to be worse than plain llama-server. On a server that does not
reuse a restored slot (a sliding-window model without ``--swa-full``, a hybrid without
context checkpoints, or a cause nobody foresaw), every warm, probe, park and rebuild is
pure cost: measured on Gemma 3 270M without ``--swa-full``, ocpc made the server process
46,079 prompt tokens against plain's 26,152 on the same work, 101 s against 62 s.

So, per server process, ocpc stands down when it knows or learns that restores do not
serve, and says so once (log and status):
- **known**: the model's family and the server's flags say so (``families.CacheFacts``);
- **learned from the gates**: ``PROBE_FAILURES`` files failed their probe on an untouched
  slot in one server process (one damaged file is rebuilt; a second failure on the same
  process is the server, not the files);
- **learned from the reports**: ``MISSES`` real requests in a row reused less than was
  restored for them, with no proof of reuse (a passed probe, a served report) between.
Standing down, each request goes to the server as it would without ocpc. A restart (a new
server process: new flags, perhaps) ends it, and the facts are read again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from oc_prefix_cache.engine.telemetry import Telemetry

log = logging.getLogger("ocpc.prepare")

PROBE_FAILURES = 2
MISSES = 3


@dataclass
class StandDown:
    """The evidence for one server, for its current process (the tracker's epoch)."""

    _epoch: int = -1
    _why: str | None = None
    _probe_failures: int = 0
    _misses: int = 0
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def why(self, epoch: int) -> str | None:
        with self._guard:
            return self._why if epoch == self._epoch else None

    def declare(self, epoch: int, why: str) -> bool:
        """Stand down on this process; True the first time (the caller says it once)."""
        with self._guard:
            self._at(epoch)
            first = self._why is None
            if first:
                self._why = why
            return first

    def probe_failed(self, epoch: int) -> str | None:
        """A file failed its probe on a slot nobody else touched. The reason to stand down
        when this makes ``PROBE_FAILURES`` on this process, else None."""
        with self._guard:
            self._at(epoch)
            self._probe_failures += 1
            if self._probe_failures < PROBE_FAILURES:
                return None
        return (
            f"{self._probe_failures} files failed their probe on an untouched slot on this server process: "
            "it does not reuse restored slots"
        )

    def proof(self, epoch: int) -> None:
        """The server reused a restore (a passed probe, a served report)."""
        with self._guard:
            self._at(epoch)
            self._misses = 0

    def missed(self, epoch: int) -> str | None:
        """A real request reused less than was restored for it."""
        with self._guard:
            self._at(epoch)
            self._misses += 1
            if self._misses < MISSES:
                return None
        return (
            f"{MISSES} real requests in a row reused less than was restored for them, with no proof of "
            "reuse between: the server does not reuse restored slots"
        )

    def _at(self, epoch: int) -> None:
        if epoch != self._epoch:  # a new server process: what was learned was about the old one
            self._epoch, self._why, self._probe_failures, self._misses = epoch, None, 0, 0


class Declarer:
    """Stand down on a server process, and say so once: the log, a counter, a recent event.

    Every part that learns restores cannot serve (a prepare, the loader's gates, a report)
    calls this one, so the announcement is made in one place whoever learned it."""

    def __init__(self, *, server: str, standdown: StandDown, telemetry: Telemetry) -> None:
        self.server, self.standdown, self.telemetry = server, standdown, telemetry

    def __call__(self, epoch: int, why: str) -> None:
        if self.standdown.declare(epoch, why):  # said once per server process
            self.telemetry.count("stand_down")
            log.warning(
                "ocpc stands down on %s until it restarts: %s; requests go to the server as they would without ocpc",
                self.server,
                why,
            )
            self.telemetry.noted({"action": "stand_down", "reason": why})
