"""``ocpc gc``: decide which of ocpc's files to delete, then delete them under the index lock.

``plan_gc`` is the whole policy and does no I/O, so every rule is testable on made-up
folders. ``run_gc`` lists the folder, loads the index, and applies the plan.

ocpc writes five kinds of file in the slot folder, each with its own rule:

- ``head`` (``oc-prefix-<16 hex>.bin``): kept while used within the TTL (days), plus the
  ``keep_recent`` most recent; orphans (no index entry) go once older than the TTL;
- ``proj`` (``oc-proj-<16 hex>.bin``, a project's system prompt for one day): kept until
  its entry's ``expires``; an orphan goes after a day;
- ``conv`` (``oc-conv-<16 hex>.bin``, a parked conversation): kept while used within the
  park TTL (hours), with its own size cap (never trimming the newest park); orphans go once
  older than the park TTL;
- ``part`` (``<final name>.<8 hex>.part``, a save in progress): gone after an hour, since a
  file still being written has a fresh mtime;
- ``doctor`` (``ocpc-doctor-<pid>.bin``, ``ocpc doctor``'s probe, and ``ocpc-selftest-<pid>-<8 hex>.bin``,
  the self-test at first contact with a server: engine/capability.py): gone once its process is
  not running and it is ten minutes old.

Heads and project heads share one size cap, parked conversations have their own; each is
trimmed least recently used first. What is never deleted, whatever the settings: any other
name, anything that is not a regular file (a symlink is never followed), a current key
(while a running ocpc has seen its slot in the last three days: ``STALE_CURRENT_S``), and
the file of an index entry of a kind this ocpc does not know (a newer ocpc's, after a
downgrade: ``Index.foreign``), nor that entry, whatever its file is named.
A corrupt index, or a slot folder that cannot be listed, turns cleanup off for the run:
without the index we cannot tell what is current; without the listing (a disk not mounted)
every entry would look like a deleted file.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from oc_prefix_cache.disk.index import Entry, Index, Store
from oc_prefix_cache.disk.slotfile import DOCTOR_RE, PART_RE, fingerprint_of, kind_of, part_target
from oc_prefix_cache.errors import IndexCorrupt, OcpcError, StoreError
from oc_prefix_cache.llama.supervisor import pid_alive
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.gc")

HOUR = 3600.0
DAY = 86400.0
GB = 10**9  # decimal, like disk vendors and df -H
PART_MAX_AGE = HOUR  # a save in progress is never that old: its mtime moves as it is written
DOCTOR_MAX_AGE = 600.0  # ocpc doctor deletes its probe within seconds; this one was left behind
PROJ_ORPHAN_AGE = DAY  # a project head lives one day; without an entry nothing can use it
# A current key protects its file while some running ocpc has seen its slot within this long
# (a daemon or proxy writes that at least hourly, store.UsageLog.alive). A key of a port or a
# slot no longer in use then stops pinning a GB-sized head over the cap; the file itself is
# then judged by its kind's rules (a head used within the TTL stays).
STALE_CURRENT_S = 3 * DAY
GC_REQUEUE_S = 600.0  # a pass queued this long ago and not started was dropped (``AfterSaves``)

Action = Literal["keep", "delete"]
Kind = Literal["head", "proj", "conv", "part", "doctor"]
FINISHED: tuple[Kind, ...] = ("head", "proj", "conv")
_FINISHED_KIND: dict[str, Kind] = {k: k for k in FINISHED}
#: Which rule decided; ``reason`` says the same for people.
Rule = Literal["current", "ttl", "recent", "expired", "orphan", "cap", "stale", "in_progress", "disabled", "skipped"]


@dataclass(frozen=True)
class DiskFile:
    """One directory entry of the slot folder, as ``lstat`` saw it (any name, any kind)."""

    name: str
    bytes: int
    mtime: float
    regular: bool = True  # False for symlinks, folders, sockets: never touched


@dataclass(frozen=True)
class Decision:
    name: str
    kind: Kind
    fingerprint: str  # the name's 16-hex key (a temp file: its target's); "" for a doctor probe
    bytes: int
    action: Action
    rule: Rule
    reason: str
    used_at: float  # the entry's last_used, or the file's mtime when there is no entry


@dataclass(frozen=True)
class GcPlan:
    decisions: tuple[Decision, ...]  # one per file ocpc writes (any kind), by name
    ignored: tuple[str, ...]  # other names in the folder, and non-regular files: never touched
    orphans: tuple[str, ...]  # finished files no index entry names
    missing: tuple[str, ...]  # index keys whose file is not in the folder (dropped on apply)
    disabled: str | None  # why nothing is deleted this run, or None
    warnings: tuple[str, ...]
    bytes_on_disk: int  # ocpc's files only
    bytes_after: int
    applied: bool = False  # True once run_gc has deleted and saved (not for a dry run)
    stale_current: tuple[str, ...] = ()  # current keys no running ocpc has seen lately (dropped on apply)

    @property
    def to_delete(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "delete")

    @property
    def bytes_freed(self) -> int:
        return self.bytes_on_disk - self.bytes_after


def name_kind(name: str) -> Kind | None:
    """Which kind of ocpc file ``name`` is, or None for every name ocpc does not write."""
    kind = _FINISHED_KIND.get(kind_of(name) or "")
    if kind is not None:
        return kind
    if PART_RE.fullmatch(name):
        return "part"
    return "doctor" if doctor_pid(name) is not None else None


def doctor_pid(name: str) -> int | None:
    """The pid in the name of a doctor probe or a self-test's file (``DOCTOR_RE`` takes ASCII digits only)."""
    match = DOCTOR_RE.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else None


def plan_gc(
    *,
    files: Sequence[DiskFile],
    index: Index | None,
    index_error: str | None,
    listing_error: str | None,
    now: float,
    ttl_days: float,
    keep_recent: int,
    max_bytes: int | None,
    park_ttl_hours: float,
    park_max_bytes: int | None,
    live_pids: Collection[int],
) -> GcPlan:
    """Pure policy: the same inputs always give the same plan (see the module docstring).

    ``live_pids``: which doctor-probe pids are running (the caller asks the system).
    """
    foreign = index.foreign_files() if index is not None else frozenset()
    ours = sorted(
        (f for f in files if f.regular and name_kind(f.name) and not _foreign(f.name, foreign)), key=lambda f: f.name
    )
    ignored = tuple(sorted(f.name for f in files if f not in ours))
    total = sum(f.bytes for f in ours)
    why = _why_disabled(index, index_error, listing_error)
    if index is None or why is not None:
        kept = tuple(_decide(f, "keep", "disabled", "cleanup is off this run", f.mtime) for f in ours)
        return GcPlan(kept, ignored, (), (), why, (), total, total)

    stale = stale_current(index, now)
    view = _IndexView.of(index, stale=stale)
    present = {f.name for f in files}  # any kind: a symlinked entry is not "missing"
    missing = tuple(sorted(k for k, e in index.entries.items() if e.file not in present))
    heads = [f for f in ours if name_kind(f.name) == "head" and f.name in view.keys_of]
    heads.sort(key=lambda f: (-view.used_at(f), f.name))
    recent = {f.name for f in heads[: max(keep_recent, 0)]}
    limits = _Limits(
        now=now,
        ttl_days=ttl_days,
        keep_recent=keep_recent,
        recent=frozenset(recent),
        park_ttl_hours=park_ttl_hours,
        live_pids=frozenset(live_pids),
    )
    decided = {f.name: _decide_one(f, view, limits) for f in ours}

    warnings = [
        w
        for w in (
            _trim(decided, ("head", "proj"), max_bytes, label="cap"),
            _trim(decided, ("conv",), park_max_bytes, label="park cap"),
        )
        if w
    ]
    kept_total = sum(d.bytes for d in decided.values() if d.action == "keep")
    orphans = tuple(f.name for f in ours if name_kind(f.name) in FINISHED and f.name not in view.keys_of)
    return GcPlan(
        tuple(decided[f.name] for f in ours),
        ignored,
        orphans,
        missing,
        None,
        tuple(warnings),
        total,
        kept_total,
        stale_current=stale,
    )


def _foreign(name: str, foreign: Collection[str]) -> bool:
    """A file an entry of an unknown kind names, or a temp file saving one: never ours to judge."""
    return name in foreign or (part_target(name) or "") in foreign


def stale_current(index: Index, now: float) -> tuple[str, ...]:
    """Slot keys of ``index.current`` that no running ocpc has seen for ``STALE_CURRENT_S``.

    A key with no date yet (an index from before ``current_seen``) is not stale: gc dates it
    when it applies a plan, so it gets the same three days from then.
    """
    seen = index.current_seen
    return tuple(sorted(slot for slot in index.current if slot in seen and now - seen[slot] > STALE_CURRENT_S))


def _why_disabled(index: Index | None, index_error: str | None, listing_error: str | None) -> str | None:
    """Why nothing may be deleted this run, or None."""
    if index is None or index_error is not None:
        return (
            f"index.json is unreadable ({index_error or 'no index given'}): "
            "cleanup is off until it is fixed or moved away"
        )
    if listing_error is not None:
        return f"{listing_error}: cleanup is off this run (nothing deleted, index.json left as it is)"
    return None


@dataclass(frozen=True)
class _IndexView:
    """What the rules read from the index, by file name."""

    index: Index
    keys_of: dict[str, list[str]]  # file name -> index keys naming it
    slots_of: dict[str, list[str]]  # key -> slots it is current in

    @classmethod
    def of(cls, index: Index, *, stale: Collection[str] = ()) -> _IndexView:
        keys_of: dict[str, list[str]] = {}
        for key, entry in index.entries.items():
            keys_of.setdefault(entry.file, []).append(key)
        slots_of: dict[str, list[str]] = {}
        for slot, key in sorted(index.current.items()):
            if slot not in stale:
                slots_of.setdefault(key, []).append(slot)
        return cls(index, keys_of, slots_of)

    def entries(self, f: DiskFile) -> list[Entry]:
        return [self.index.entries[k] for k in self.keys_of.get(f.name, [])]

    def used_at(self, f: DiskFile) -> float:
        entries = self.entries(f)
        return max(e.last_used for e in entries) if entries else f.mtime

    def expires(self, f: DiskFile) -> int:
        """0 (never) when any entry naming the file never expires; else the latest."""
        dates = [e.expires for e in self.entries(f)]
        return 0 if not dates or 0 in dates else max(dates)

    def current_slots(self, f: DiskFile) -> list[str]:
        keys = [fingerprint_of(f.name) or "", *self.keys_of.get(f.name, [])]
        return sorted({s for key in keys for s in self.slots_of.get(key, [])})


@dataclass(frozen=True)
class _Limits:
    now: float
    ttl_days: float
    keep_recent: int
    recent: frozenset[str]  # the keep_recent most recently used heads with an entry
    park_ttl_hours: float
    live_pids: frozenset[int]


def _decide_one(f: DiskFile, view: _IndexView, limits: _Limits) -> Decision:
    kind = name_kind(f.name)
    if kind == "part":
        return _decide_part(f, limits.now)
    if kind == "doctor":
        return _decide_doctor(f, limits.now, limits.live_pids)
    when = view.used_at(f)
    slots = view.current_slots(f)
    if slots:
        return _decide(f, "keep", "current", f"current fingerprint of {', '.join(slots)}", when)
    expires = view.expires(f)
    if expires and limits.now >= expires:
        return _decide(f, "delete", "expired", f"expired {_age(limits.now - expires)} ago", when)
    if kind == "proj":
        return _decide_proj(f, view, limits, when, expires)
    if kind == "conv":
        return _decide_conv(f, view, limits, when)
    return _decide_head(f, view, limits, when)


def _decide_head(f: DiskFile, view: _IndexView, limits: _Limits, when: float) -> Decision:
    ttl_days, age = limits.ttl_days, limits.now - when
    ttl = f"TTL {ttl_days:g} days"
    fresh = age <= ttl_days * DAY
    if f.name not in view.keys_of:
        tail = f"kept until {ttl_days:g} days" if fresh else f"older than the {ttl_days:g}-day TTL"
        return _decide(
            f, "keep" if fresh else "delete", "orphan", f"orphan (not in the index), {_age(age)} old: {tail}", when
        )
    if fresh:
        return _decide(f, "keep", "ttl", f"used {_age(age)} ago ({ttl})", when)
    if f.name in limits.recent:
        return _decide(
            f, "keep", "recent", f"one of the {limits.keep_recent} most recent (unused for {_age(age)})", when
        )
    return _decide(f, "delete", "expired", f"unused for {_age(age)} ({ttl})", when)


def _decide_proj(f: DiskFile, view: _IndexView, limits: _Limits, when: float, expires: int) -> Decision:
    """Kept until its day ends; without an expiry date (0) the heads' TTL applies."""
    if f.name not in view.keys_of:
        age = limits.now - f.mtime
        old = age > PROJ_ORPHAN_AGE
        tail = "older than a day" if old else "kept for a day"
        return _decide(
            f,
            "delete" if old else "keep",
            "orphan",
            f"orphan project head (not in the index), {_age(age)} old: {tail}",
            when,
        )
    if expires:
        return _decide(f, "keep", "ttl", f"project head valid for {_age(expires - limits.now)} more", when)
    return _decide_head(f, view, limits, when)


def _decide_conv(f: DiskFile, view: _IndexView, limits: _Limits, when: float) -> Decision:
    hours = limits.park_ttl_hours
    ttl = f"park TTL {hours:g} hours"
    age = limits.now - when
    fresh = age <= hours * HOUR
    if f.name not in view.keys_of:
        tail = f"kept until {hours:g} hours" if fresh else f"older than the {ttl}"
        return _decide(
            f,
            "keep" if fresh else "delete",
            "orphan",
            f"orphan parked conversation (not in the index), {_age(age)} old: {tail}",
            when,
        )
    if fresh:
        return _decide(f, "keep", "ttl", f"parked conversation used {_age(age)} ago ({ttl})", when)
    return _decide(f, "delete", "expired", f"parked conversation unused for {_age(age)} ({ttl})", when)


def _decide_part(f: DiskFile, now: float) -> Decision:
    age = now - f.mtime
    if age > PART_MAX_AGE:
        return _decide(
            f,
            "delete",
            "stale",
            f"temp file of a save, {_age(age)} old: a save in progress is never over 1 h old",
            f.mtime,
        )
    return _decide(f, "keep", "in_progress", f"temp file of a save in progress, {_age(age)} old", f.mtime)


def _decide_doctor(f: DiskFile, now: float, live_pids: frozenset[int]) -> Decision:
    pid, age = doctor_pid(f.name), now - f.mtime
    if pid in live_pids:
        return _decide(f, "keep", "in_progress", f"ocpc doctor's probe; process {pid} is running", f.mtime)
    if age > DOCTOR_MAX_AGE:
        return _decide(
            f, "delete", "stale", f"ocpc doctor's probe left behind: process {pid} is gone, {_age(age)} old", f.mtime
        )
    return _decide(f, "keep", "in_progress", f"ocpc doctor's probe, {_age(age)} old: kept for 10 min", f.mtime)


def _trim(decided: dict[str, Decision], kinds: tuple[Kind, ...], max_bytes: int | None, *, label: str) -> str | None:
    """Delete kept files of ``kinds`` least recently used first (never a current one) until
    their total fits ``max_bytes``; a warning when what is never trimmed alone does not fit.

    Parked conversations also keep their newest: it was written a moment ago for a
    conversation about to come back, and deleting it would make that save pure waste (the
    park path checks before saving that one park fits the cap, so it can be kept)."""
    if max_bytes is None:
        return None
    mine = [d for d in decided.values() if d.kind in kinds and d.action == "keep"]
    kept_total = sum(d.bytes for d in mine)
    if kept_total <= max_bytes:
        return None
    trimmable = sorted((d for d in mine if d.rule != "current"), key=lambda d: (d.used_at, d.name))
    newest = trimmable.pop() if kinds == ("conv",) and trimmable else None
    reason = f"over the {_size(max_bytes)} {label}: oldest first"
    for d in trimmable:
        if kept_total <= max_bytes:
            break
        decided[d.name] = replace(d, action="delete", rule="cap", reason=reason)
        kept_total -= d.bytes
    if kept_total <= max_bytes:
        return None
    what = "slot files" if kinds == ("head", "proj") else "parked conversations"
    also = f" and the newest ({newest.name})" if newest is not None else ""
    return (
        f"the current {what}{also} alone take {_size(kept_total)}, over the "
        f"{_size(max_bytes)} {label}; they are never deleted"
    )


def _decide(f: DiskFile, action: Action, rule: Rule, reason: str, used_at: float) -> Decision:
    kind = name_kind(f.name)
    if kind is None:  # plan_gc decides on ocpc's names only
        raise ValueError(f"not an ocpc file: {f.name!r}")
    key = fingerprint_of(part_target(f.name) or "" if kind == "part" else f.name) or ""
    return Decision(f.name, kind, key, f.bytes, action, rule, reason, used_at)


def _age(seconds: float) -> str:
    """Coarse on purpose: a person reads it, the decision used the exact number."""
    if seconds < 3600:
        return f"{max(int(seconds // 60), 0)} min"
    if seconds < DAY:
        return f"{int(seconds // 3600)} h"
    return "1 day" if seconds < 2 * DAY else f"{int(seconds // DAY)} days"


def _size(n: int) -> str:
    for unit, scale in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def list_slot_dir(slot_dir: Path) -> list[DiskFile]:
    """Every entry of the folder via lstat (a symlink is reported, never followed).

    Raises ``OSError`` (``FileNotFoundError`` included) when the folder cannot be listed:
    a missing folder is not an empty one.
    """
    with os.scandir(slot_dir) as it:
        entries = list(it)
    files = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # deleted while we listed it
        files.append(DiskFile(entry.name, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode)))
    return files


class AfterSaves:
    """The same policy as `ocpc gc`, run off the request path after a running ocpc saved files.

    One pass is queued however many saves a prepare made (a park, a warm and a project head are
    three saves; one pass after them sees them all). ``flush``: the uses noted since the last
    flush go to the index first, so gc sees a head restored a moment ago as used and current,
    not as last used a month ago. ``schedule``: where the pass runs (the daemon's worker)."""

    def __init__(
        self, settings: Settings, *, schedule: Callable[[Callable[[], None]], None], flush: Callable[[], None]
    ) -> None:
        self._settings, self._schedule, self._flush = settings, schedule, flush
        self._guard = threading.Lock()
        self._queued_at: float | None = None

    def saved(self) -> None:
        now = time.monotonic()
        with self._guard:  # a pass queued long ago was dropped (a full queue): queue another
            if self._queued_at is not None and now - self._queued_at < GC_REQUEUE_S:
                return
            self._queued_at = now
        self._schedule(self._run)

    def _run(self) -> None:
        with self._guard:
            self._queued_at = None  # a save from here on queues the next pass
        self._flush()
        try:
            plan = run_gc(self._settings, dry_run=False)
        except (OcpcError, OSError) as exc:  # cleanup must never fail anything
            log.error("gc after save failed: %s", exc)
            return
        if plan.disabled:
            log.error("gc after save: %s", plan.disabled)
        for decision in plan.to_delete:
            log.info("gc deleted %s: %s", decision.name, decision.reason)


def run_gc(settings: Settings, *, dry_run: bool, now: float | None = None) -> GcPlan:
    """Plan (and unless ``dry_run``, apply) a cleanup of ``settings.slot_dir``.

    A real run plans under the index lock, from a fresh listing and a fresh index, so no
    daemon can record or mark a file current between the decision and the delete.
    """
    now = time.time() if now is None else now
    store = Store(index_path=settings.index_path, lock_path=settings.lock_path)
    if dry_run:
        return _plan_now(settings, store, now)[0]
    with store.locked():
        plan, index, files = _plan_now(settings, store, now)
        if plan.disabled is not None or index is None:
            return plan
        return _apply(plan, index, {f.name: f for f in files}, settings, store, now)


def _plan_now(settings: Settings, store: Store, now: float) -> tuple[GcPlan, Index | None, list[DiskFile]]:
    index, error = None, None
    try:
        index = store.load()
    except IndexCorrupt as exc:
        error = str(exc)
    files, listing_error = _listing(settings.slot_dir, index)
    max_bytes = None if settings.max_gb is None else round(settings.max_gb * GB)
    park_max = None if settings.park_max_gb is None else round(settings.park_max_gb * GB)
    plan = plan_gc(
        files=files,
        index=index,
        index_error=error,
        listing_error=listing_error,
        now=now,
        ttl_days=settings.ttl_days,
        keep_recent=settings.keep_recent,
        max_bytes=max_bytes,
        park_ttl_hours=settings.park_ttl_hours,
        park_max_bytes=park_max,
        live_pids=_live_doctor_pids(files),
    )
    return plan, index, files


def _listing(slot_dir: Path, index: Index | None) -> tuple[list[DiskFile], str | None]:
    """The folder's entries, or why they cannot be known.

    A missing folder is fine only when the index names no file (a fresh install: nothing
    to lose); otherwise it is probably a disk that is not mounted, and treating it as empty
    would drop every entry.
    """
    try:
        return list_slot_dir(slot_dir), None
    except FileNotFoundError:
        if index is not None and not index.entries:
            return [], None
        return [], f"the slot folder {slot_dir} does not exist (a disk not mounted?)"
    except OSError as exc:
        return [], f"cannot list the slot folder {slot_dir} ({exc})"


def _live_doctor_pids(files: Iterable[DiskFile]) -> frozenset[int]:
    pids = (doctor_pid(f.name) for f in files)
    return frozenset(pid for pid in pids if pid is not None and pid_alive(pid))


def _apply(
    plan: GcPlan, index: Index, listed: dict[str, DiskFile], settings: Settings, store: Store, now: float
) -> GcPlan:
    """Delete what the plan says, re-checking each file first; then drop its entries."""
    current = {key for slot, key in index.current.items() if slot not in plan.stale_current}
    foreign = index.foreign_files()
    decisions, warnings, gone = list[Decision](), list(plan.warnings), set[str]()
    for d in plan.decisions:
        if d.action == "delete":
            path = settings.slot_dir / d.name
            why = _still_deletable(path, listed[d.name], current=current, alive=pid_alive, foreign=foreign)
            if why is None:
                try:
                    path.unlink(missing_ok=True)
                    gone.add(d.name)
                except OSError as exc:
                    why = f"could not delete: {exc}"
            if why is not None:
                warnings.append(f"{d.name}: {why}")
                d = replace(d, action="keep", rule="skipped", reason=why)
        decisions.append(d)
    drop = set(plan.missing) | {k for k, e in index.entries.items() if e.file in gone}
    undated = [slot for slot in index.current if slot not in index.current_seen]
    if drop or plan.stale_current or undated:
        for key in drop:
            index.entries.pop(key, None)
        for slot in plan.stale_current:
            index.current.pop(slot, None)
            index.current_seen.pop(slot, None)
        for slot in undated:
            index.current_seen[slot] = int(now)
        try:
            store.save(index)
        except StoreError as exc:
            warnings.append(f"{exc}; the next gc drops the entries of deleted files")
    kept = sum(d.bytes for d in decisions if d.action == "keep")
    return replace(plan, decisions=tuple(decisions), warnings=tuple(warnings), bytes_after=kept, applied=True)


def _still_deletable(
    path: Path,
    planned: DiskFile,
    *,
    current: set[str],
    alive: Callable[[int], bool],
    foreign: Collection[str] = frozenset(),
) -> str | None:
    """None if ``path`` is still the regular ocpc file we planned on; else why not.

    Run just before each unlink: the name must still be one ocpc writes, a finished file's
    key must not be current, a doctor probe's process must not be running, and the file
    must still be the regular file of the size and mtime the plan saw.
    """
    kind = name_kind(path.name)
    if kind is None:
        return "not a file ocpc writes"
    if _foreign(path.name, foreign):
        return "named by an index entry of a kind this ocpc does not know"
    if kind in FINISHED and fingerprint_of(path.name) in current:
        return "is a current fingerprint"
    pid = doctor_pid(path.name)
    if pid is not None and alive(pid):
        return f"ocpc doctor (process {pid}) is running"
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None  # already gone: unlink(missing_ok) is a no-op, the entry is dropped
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file"
    if (st.st_size, st.st_mtime) != (planned.bytes, planned.mtime):
        return "changed while gc ran"
    return None
