"""Warm before the first request: which file each slot of a (re)started server should hold.

After ``ocpc launch`` starts a server, each slot is empty, and the first request of every new
session would wait for its head's restore (or, on a fat-KV model, seconds of it). But the index
says what each slot held last (``current``): its head, its project head, or the park a graceful
stop wrote, whose head is underneath. ``choose`` picks, per slot, the file to restore now, while
no request waits: the slot's own head (or the project head last cut on it) or project head, or a
park's head (the conversation's park itself is restored on its next turn, where its tokens are
checked against the request).
Only files written for this very server (its model and build) are chosen; a file is never
trusted because it was chosen: the first request's report proves it, as for any restore.

Pure: ``Preparer.warm_start`` reads the index and the server, and restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from oc_prefix_cache.disk.index import Entry, Index, slot_key


@dataclass(frozen=True)
class Pick:
    slot: int
    key: str  # the index key of the file to restore (a head's fingerprint or a project head's id)
    entry: Entry
    why: str


def choose(
    index: Index, *, server: str, n_slots: int, model: str, build: str, now: float
) -> tuple[list[Pick], list[str]]:
    """Per slot, the head or project head to restore, and a line for each slot passed over.
    A slot that held a head gets the project head last cut on it, when one is still valid: the
    slot's last session was in that project, so its next one likely is too (a session of
    another project then restores the head, as it would have without the warm start)."""
    picks: list[Pick] = []
    passed: list[str] = []
    for slot in range(n_slots):
        key = index.current.get(slot_key(server, slot), "")
        entry = index.entries.get(key)
        if entry is None:
            passed.append(f"slot {slot}: nothing recorded")
            continue
        why = f"slot {slot} held this {_label(entry.kind)} last"
        if entry.kind == "conv":  # a park: its head now, the park itself on its conversation's turn
            key, why = entry.head, f"slot {slot} held a parked conversation on this head"
            entry = index.entries.get(key)
            if entry is None or entry.kind != "head":
                passed.append(f"slot {slot}: its park's head is not on disk")
                continue
        if entry.model != model or entry.server_build != build:
            passed.append(f"slot {slot}: its file was written for another model or build")
            continue
        project = _last_project(index, head=key, now=now) if entry.kind == "head" else None
        if project is not None:  # the slot's last session cut a project head on it: that serves more
            key, entry = project
            why = f"{why}; its last project head on top of it"
        if entry.expires and entry.expires <= now:
            passed.append(f"slot {slot}: its project head has expired")
            continue
        picks.append(Pick(slot=slot, key=key, entry=entry, why=why))
    return picks, passed


def _last_project(index: Index, *, head: str, now: float) -> tuple[str, Entry] | None:
    """The project head cut on ``head`` that was used last and has not expired, if any."""
    projects = [
        (e.last_used, k, e)
        for k, e in index.entries.items()
        if e.kind == "proj" and e.head == head and (not e.expires or e.expires > now)
    ]
    if not projects:
        return None
    _, key, entry = max(projects)
    return key, entry


def _label(kind: str) -> str:
    return {"head": "head", "proj": "project head", "conv": "park"}.get(kind, kind)
