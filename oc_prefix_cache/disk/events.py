"""The event log behind ``ocpc stats`` and ``ocpc top``: one JSON line per answered request.

Both front doors feed it from one place, ``Preparer.report`` (the plugin's report, the proxy's
own reading of the answer), and ocpc's own prefills (a head warmed, a park's tail) are logged
too, as ``door: "ocpc"``: what the server processed for ocpc is a cost, and the sum of every
line's ``prompt_n`` is what the server's ``/metrics`` counts as processed.

Bounded: the file rolls over at ``MAX_BYTES`` and one old generation is kept, so a busy day
costs at most twice that (about 20k requests per generation). Writing never fails a request:
an error is counted by the caller and the line is dropped. The file is 0600 in a 0700 folder
(disk/privacy.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oc_prefix_cache.files import private_dir, private_opener

MAX_BYTES = 4_000_000
FILE = "events.jsonl"


@dataclass(frozen=True, kw_only=True)
class Event:
    """One answered request (or one prefill of ocpc's own)."""

    at: float  # unix seconds
    door: str  # "plugin" | "proxy" | "ocpc" (its own warm or park prefill)
    server: str
    slot: int
    harness: str  # the User-Agent's first product ("" when unknown)
    action: str  # what the prepare did: hit, restored, warmed, saved, side, unknown...
    source: str  # what the request reused: slot, head, proj, park, ram ("" when nothing)
    cache_n: int  # prompt tokens the server reused
    prompt_n: int  # prompt tokens it processed
    prompt_ms: float | None = None  # its time for them (the server's own timings), when known

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["at"] = round(self.at, 3)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event | None:
        """An event, or None for a line another version wrote in another shape."""
        try:
            ms = data.get("prompt_ms")
            return cls(
                at=float(data["at"]),
                door=str(data["door"]),
                server=str(data["server"]),
                slot=int(data["slot"]),
                harness=str(data.get("harness", "")),
                action=str(data["action"]),
                source=str(data.get("source", "")),
                cache_n=int(data["cache_n"]),
                prompt_n=int(data["prompt_n"]),
                prompt_ms=None if ms is None else float(ms),
            )
        except (KeyError, TypeError, ValueError):
            return None


class EventLog:
    """Appends events to ``folder/events.jsonl`` (thread-safe; one old generation kept)."""

    def __init__(self, folder: Path, *, max_bytes: int = MAX_BYTES) -> None:
        self.path = folder / FILE
        self.max_bytes = max_bytes
        self._guard = threading.Lock()

    def write(self, event: Event) -> None:
        """Append one line; OSError to the caller (who counts it and goes on)."""
        line = (json.dumps(event.to_json(), separators=(",", ":")) + "\n").encode()
        with self._guard:
            private_dir(self.path.parent)
            try:
                if self.path.stat().st_size + len(line) > self.max_bytes:
                    os.replace(self.path, self.path.with_suffix(".jsonl.1"))
            except FileNotFoundError:
                pass
            with open(self.path, "ab", opener=private_opener) as out:
                out.write(line)


def read_events(folder: Path, *, since: float = 0.0) -> Iterator[Event]:
    """Every event kept (the old generation first), at or after ``since``; bad lines skipped."""
    for path in (folder / f"{FILE}.1", folder / FILE):
        try:
            lines = path.read_bytes().splitlines()
        except FileNotFoundError:
            continue
        for raw in lines:
            try:
                data = json.loads(raw)
            except ValueError:
                continue  # a line cut by a crash
            event = Event.from_json(data) if isinstance(data, dict) else None
            if event is not None and event.at >= since:
                yield event
