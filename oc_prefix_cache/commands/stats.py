"""``ocpc stats``: what the cache saved, per day and harness, from the event log (disk/events.py).

Days are local dates: a range of ``days`` starts at local midnight that many calendar days back
(date arithmetic, not 86,400-second steps, so a daylight-saving change inside the range moves no
event into the wrong day), and every day of the range is listed, a day without requests as zeros
(the chart's bars then stand on their dates). The log is bounded (disk/events.py): when it has rolled
over and its oldest kept event is younger than the range, ``log_from`` says from when it holds
events, so a quiet early day is not mistaken for one whose events were rolled out.

"Saved" is counted honestly against plain llama-server: only the prompt tokens a request
reused from what ocpc put in the slot from a file (a head, a project head, a park) count as
saved; a hit on the slot's own live state, or on the server's RAM cache, the server would have
had without ocpc. What ocpc processed for itself (warming a head, a park's tail) is a cost and
is taken off. Time is tokens over the server's own measured prefill speed (its ``prompt_ms``
for the tokens it processed, on requests of at least ``SPEED_MIN_TOKENS``), per server.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from oc_prefix_cache.disk.events import FILE, Event, read_events

FROM_FILES = ("head", "proj", "park")  # what ocpc restored: the tokens plain llama-server would redo
SPEED_MIN_TOKENS = 64  # shorter prefills measure the call's overhead more than the speed


@dataclass
class Row:
    """One day and harness."""

    day: str  # YYYY-MM-DD, local time
    harness: str
    requests: int = 0
    reused: int = 0  # prompt tokens the server reused (any cause)
    saved: int = 0  # of those, reused from what ocpc restored from a file
    processed: int = 0  # prompt tokens the server processed for these requests
    ocpc_prefill: int = 0  # prompt tokens the server processed for ocpc itself (a warm, a park's tail)
    by_source: dict[str, int] = field(default_factory=dict)  # requests by what served them
    saved_s: float | None = None  # (saved - ocpc_prefill) at the server's measured speed

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["saved_s"] = None if self.saved_s is None else round(self.saved_s, 1)
        return data


@dataclass(frozen=True)
class Stats:
    rows: tuple[Row, ...]  # by day, then harness
    speed_tok_s: dict[str, float]  # per server: its measured prefill speed
    first: float | None  # the oldest event in the range
    days: tuple[str, ...] = ()  # every local date of the range, oldest first (empty: the rows' days)
    log_from: float | None = None  # the log rolled over and holds events only from then on

    def by_day(self) -> list[Row]:
        """One row per day of the range (all harnesses), a day without events as zeros."""
        days = self.days or tuple(sorted({r.day for r in self.rows}))
        out = []
        for day in days:
            row = total(r for r in self.rows if r.day == day)
            row.day = day
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        totals = total(self.rows)
        return {
            "rows": [r.to_json() for r in self.rows],
            "days": [_without_harness(r.to_json()) for r in self.by_day()],
            "total": totals.to_json(),
            "speed_tok_s": {k: round(v, 1) for k, v in self.speed_tok_s.items()},
            "first_event": self.first,
            "log_from": self.log_from,
        }


def gather(folder: Path, *, days: int, now: float) -> Stats:
    """The stats of the last ``days`` days (today included) of the event log in ``folder``."""
    dates = local_days(now, days)
    start = _midnight(dates[0])
    stats = summarise(read_events(folder, since=start))
    kept_from = oldest_kept(folder)
    rolled = kept_from is not None and kept_from > start
    return replace(stats, days=tuple(d.isoformat() for d in dates), log_from=kept_from if rolled else None)


def local_days(now: float, days: int) -> list[dt.date]:
    """The ``days`` local dates ending with ``now``'s, oldest first."""
    today = dt.datetime.fromtimestamp(now).date()
    return [today - dt.timedelta(days=back) for back in range(days - 1, -1, -1)]


def oldest_kept(folder: Path) -> float | None:
    """The time of the log's oldest event when it has rolled over (an older generation exists),
    else None: then the log holds everything it was ever given."""
    if not (folder / f"{FILE}.1").exists():
        return None
    return next((e.at for e in read_events(folder)), None)


def summarise(events: Iterable[Event]) -> Stats:
    rows: dict[tuple[str, str], Row] = {}
    speed: dict[str, list[float]] = {}  # server -> [tokens, ms]
    per_row_server: dict[tuple[str, str], dict[str, int]] = {}  # net saved tokens per server
    first: float | None = None
    for e in events:
        first = e.at if first is None else min(first, e.at)
        day = dt.datetime.fromtimestamp(e.at).strftime("%Y-%m-%d")
        key = (day, e.harness or "unknown")
        row = rows.setdefault(key, Row(day=day, harness=key[1]))
        if e.prompt_ms is not None and e.prompt_n >= SPEED_MIN_TOKENS and e.prompt_ms > 0:
            acc = speed.setdefault(e.server, [0.0, 0.0])
            acc[0] += e.prompt_n
            acc[1] += e.prompt_ms
        net = per_row_server.setdefault(key, {})
        if e.door == "ocpc":
            row.ocpc_prefill += e.prompt_n
            net[e.server] = net.get(e.server, 0) - e.prompt_n
            continue
        row.requests += 1
        row.reused += e.cache_n
        row.processed += e.prompt_n
        source = e.source or "none"
        row.by_source[source] = row.by_source.get(source, 0) + 1
        if e.source in FROM_FILES:
            row.saved += e.cache_n
            net[e.server] = net.get(e.server, 0) + e.cache_n
    speeds = {server: tokens / ms * 1000 for server, (tokens, ms) in speed.items() if ms > 0}
    for key, row in rows.items():
        known = [(tokens, speeds[s]) for s, tokens in per_row_server.get(key, {}).items() if s in speeds]
        if known:
            row.saved_s = sum(tokens / tok_s for tokens, tok_s in known)
    return Stats(tuple(rows[k] for k in sorted(rows)), speeds, first)


def total(rows: Iterable[Row]) -> Row:
    out = Row(day="all", harness="all")
    seconds: list[float] = []
    for r in rows:
        out.requests += r.requests
        out.reused += r.reused
        out.saved += r.saved
        out.processed += r.processed
        out.ocpc_prefill += r.ocpc_prefill
        for source, n in r.by_source.items():
            out.by_source[source] = out.by_source.get(source, 0) + n
        if r.saved_s is not None:
            seconds.append(r.saved_s)
    out.saved_s = sum(seconds) if seconds else None
    return out


@dataclass(frozen=True)
class Bars:
    """What ``chart`` draws, per day of the range (stacked, bottom to top)."""

    days: tuple[str, ...]
    saved: tuple[int, ...]  # reused from ocpc's files
    other: tuple[int, ...]  # reused by the server itself
    processed: tuple[int, ...]  # processed, ocpc's own prefill included


def bars(stats: Stats) -> Bars:
    rows = stats.by_day()
    return Bars(
        days=tuple(r.day for r in rows),
        saved=tuple(r.saved for r in rows),
        other=tuple(r.reused - r.saved for r in rows),
        processed=tuple(r.processed + r.ocpc_prefill for r in rows),
    )


def chart(stats: Stats, path: Path) -> Bars:
    """A PNG of the days: prompt tokens reused from ocpc's files, reused otherwise, processed
    (matplotlib, from the ``bench`` extra; ``ImportError`` when it is missing). Returns the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = bars(stats)
    days, saved, other, processed = (list(drawn.days), list(drawn.saved), list(drawn.other), list(drawn.processed))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(days) + 2), 3.6))
    ax.bar(days, saved, label="reused from ocpc's files (saved)", color="#2a9d8f")
    ax.bar(days, other, bottom=saved, label="reused by the server itself", color="#8ecae6")
    ax.bar(
        days,
        processed,
        bottom=[a + b for a, b in zip(saved, other, strict=True)],
        label="processed (ocpc's own included)",
        color="#e76f51",
    )
    ax.set_ylabel("prompt tokens")
    ax.set_title("ocpc: prompt tokens per day")
    ax.legend(fontsize=8)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _without_harness(row: dict[str, Any]) -> dict[str, Any]:
    row.pop("harness", None)
    return row


def _midnight(day: dt.date) -> float:
    """Local midnight of ``day`` (mktime resolves the zone's offset on that date)."""
    return dt.datetime(day.year, day.month, day.day).timestamp()
