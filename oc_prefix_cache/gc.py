"""``ocpc gc``: decide which slot files to delete, then delete them under the index lock.

``plan_gc`` is the whole policy and does no I/O, so every rule is testable on made-up
folders. ``run_gc`` lists the folder, loads the index, and applies the plan. What is never
deleted, whatever the settings: anything not named ``oc-prefix-<16 hex>.bin``, anything
that is not a regular file (a symlink is never followed), and a current fingerprint.
A corrupt index turns cleanup off: without it we cannot tell what is current.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from .errors import IndexCorrupt, StoreError
from .settings import Settings
from .slotfile import fingerprint_of, is_slot_file_name
from .store import Index, Store

DAY = 86400.0
GB = 10**9  # decimal, like disk vendors and df -H

Action = Literal["keep", "delete"]
#: Which rule decided; ``reason`` says the same for people.
Rule = Literal["current", "ttl", "recent", "expired", "orphan", "cap", "disabled", "skipped"]


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
    fingerprint: str
    bytes: int
    action: Action
    rule: Rule
    reason: str
    used_at: float  # the entry's last_used, or the file's mtime for an orphan


@dataclass(frozen=True)
class GcPlan:
    decisions: tuple[Decision, ...]  # one per ocpc slot file, by name
    ignored: tuple[str, ...]  # other names in the folder, and non-regular files: never touched
    orphans: tuple[str, ...]  # slot files no index entry names
    missing: tuple[str, ...]  # index keys whose file is not in the folder (dropped on apply)
    disabled: str | None  # why nothing is deleted this run, or None
    warnings: tuple[str, ...]
    bytes_on_disk: int  # ocpc slot files only
    bytes_after: int
    applied: bool = False  # True once run_gc has deleted and saved (not for a dry run)

    @property
    def to_delete(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "delete")

    @property
    def bytes_freed(self) -> int:
        return self.bytes_on_disk - self.bytes_after


def plan_gc(*, files: Sequence[DiskFile], index: Index | None, index_error: str | None,
            now: float, ttl_days: float, keep_recent: int, max_bytes: int | None) -> GcPlan:
    """Pure policy: the same inputs always give the same plan (see the module docstring)."""
    ours = sorted((f for f in files if f.regular and is_slot_file_name(f.name)), key=lambda f: f.name)
    ignored = tuple(sorted(f.name for f in files if f not in ours))
    total = sum(f.bytes for f in ours)
    if index is None or index_error is not None:
        why = f"index.json is unreadable ({index_error or 'no index given'}): "
        why += "cleanup is off until it is fixed or moved away"
        kept = tuple(_decide(f, "keep", "disabled", "cleanup is off this run", f.mtime) for f in ours)
        return GcPlan(kept, ignored, (), (), why, (), total, total)

    present = {f.name for f in files}  # any kind: a symlinked entry is not "missing"
    keys_of: dict[str, list[str]] = {}
    for key, entry in index.entries.items():
        keys_of.setdefault(entry.file, []).append(key)
    missing = tuple(sorted(k for k, e in index.entries.items() if e.file not in present))
    slots_of: dict[str, list[str]] = {}
    for slot, fp in sorted(index.current.items()):
        slots_of.setdefault(fp, []).append(slot)

    def used_at(f: DiskFile) -> float:
        keys = keys_of.get(f.name)
        return max(index.entries[k].last_used for k in keys) if keys else f.mtime

    indexed = sorted((f for f in ours if f.name in keys_of), key=lambda f: (-used_at(f), f.name))
    recent = {f.name for f in indexed[: max(keep_recent, 0)]}
    ttl = f"TTL {ttl_days:g} days"
    decided: dict[str, Decision] = {}
    for f in ours:
        fps = [fingerprint_of(f.name) or "", *keys_of.get(f.name, [])]
        slots = sorted({s for fp in fps for s in slots_of.get(fp, [])})
        when, age, orphan = used_at(f), now - used_at(f), f.name not in keys_of
        fresh = age <= ttl_days * DAY
        if slots:
            d = _decide(f, "keep", "current", f"current fingerprint of {', '.join(slots)}", when)
        elif orphan:
            tail = f"kept until {ttl_days:g} days" if fresh else f"older than the {ttl_days:g}-day TTL"
            d = _decide(f, "keep" if fresh else "delete", "orphan",
                        f"orphan (not in the index), {_age(age)} old: {tail}", when)
        elif fresh:
            d = _decide(f, "keep", "ttl", f"used {_age(age)} ago ({ttl})", when)
        elif f.name in recent:
            d = _decide(f, "keep", "recent",
                        f"one of the {keep_recent} most recent (unused for {_age(age)})", when)
        else:
            d = _decide(f, "delete", "expired", f"unused for {_age(age)} ({ttl})", when)
        decided[f.name] = d

    warnings: list[str] = []
    kept_total = sum(d.bytes for d in decided.values() if d.action == "keep")
    if max_bytes is not None and kept_total > max_bytes:
        cap = f"over the {_size(max_bytes)} cap: oldest first"
        trimmable = sorted((d for d in decided.values() if d.action == "keep" and d.rule != "current"),
                           key=lambda d: (d.used_at, d.name))
        for d in trimmable:
            if kept_total <= max_bytes:
                break
            decided[d.name] = replace(d, action="delete", rule="cap", reason=cap)
            kept_total -= d.bytes
        if kept_total > max_bytes:
            warnings.append(f"the current slot files alone take {_size(kept_total)}, over the "
                            f"{_size(max_bytes)} cap; they are never deleted")
    orphans = tuple(f.name for f in ours if f.name not in keys_of)
    return GcPlan(tuple(decided[f.name] for f in ours), ignored, orphans, missing, None,
                  tuple(warnings), total, kept_total)


def _decide(f: DiskFile, action: Action, rule: Rule, reason: str, used_at: float) -> Decision:
    return Decision(f.name, fingerprint_of(f.name) or "", f.bytes, action, rule, reason, used_at)


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
    """Every entry of the folder via lstat (a symlink is reported, never followed)."""
    try:
        with os.scandir(slot_dir) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    files = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # deleted while we listed it
        files.append(DiskFile(entry.name, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode)))
    return files


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
        return _apply(plan, index, {f.name: f for f in files}, settings, store)


def _plan_now(settings: Settings, store: Store, now: float) -> tuple[GcPlan, Index | None, list[DiskFile]]:
    try:
        files = list_slot_dir(settings.slot_dir)
    except OSError as exc:  # an unreadable folder: say so, delete nothing
        why = f"cannot list {settings.slot_dir} ({exc}): cleanup is off this run"
        return GcPlan((), (), (), (), why, (), 0, 0), None, []
    index, error = None, None
    try:
        index = store.load()
    except IndexCorrupt as exc:
        error = str(exc)
    max_bytes = None if settings.max_gb is None else round(settings.max_gb * GB)
    plan = plan_gc(files=files, index=index, index_error=error, now=now, ttl_days=settings.ttl_days,
                   keep_recent=settings.keep_recent, max_bytes=max_bytes)
    return plan, index, files


def _apply(plan: GcPlan, index: Index, listed: dict[str, DiskFile], settings: Settings,
           store: Store) -> GcPlan:
    """Delete what the plan says, re-checking each file first; then drop its entries."""
    current = set(index.current.values())
    decisions, warnings, gone = list[Decision](), list(plan.warnings), set[str]()
    for d in plan.decisions:
        if d.action == "delete":
            why = _still_deletable(settings.slot_dir / d.name, listed[d.name], current)
            if why is None:
                try:
                    (settings.slot_dir / d.name).unlink(missing_ok=True)
                    gone.add(d.name)
                except OSError as exc:
                    why = f"could not delete: {exc}"
            if why is not None:
                warnings.append(f"{d.name}: {why}")
                d = replace(d, action="keep", rule="skipped", reason=why)
        decisions.append(d)
    drop = set(plan.missing) | {k for k, e in index.entries.items() if e.file in gone}
    if drop:
        for key in drop:
            index.entries.pop(key, None)
        try:
            store.save(index)
        except StoreError as exc:
            warnings.append(f"{exc}; the next gc drops the entries of deleted files")
    kept = sum(d.bytes for d in decisions if d.action == "keep")
    return replace(plan, decisions=tuple(decisions), warnings=tuple(warnings),
                   bytes_after=kept, applied=True)


def _still_deletable(path: Path, planned: DiskFile, current: set[str]) -> str | None:
    """None if ``path`` is still the regular ocpc file we planned on; else why not."""
    fp = fingerprint_of(path.name)
    if fp is None or fp in current:
        return "is a current fingerprint" if fp else "not an ocpc slot file"
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None  # already gone: unlink(missing_ok) is a no-op, the entry is dropped
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file"
    if (st.st_size, st.st_mtime) != (planned.bytes, planned.mtime):
        return "changed while gc ran"
    return None
