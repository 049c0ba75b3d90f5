"""What an install plans, and what every config format must do with it.

A harness module plans ``Edit``s on the parsed config (a pure function); a ``ConfigFormat``
turns them into new text and one record entry per edit, and takes exactly those entries out
again when uninstall cannot simply put the backup back (the user or the agent changed the
file since). JSON(C) edits text in place (``json_format``), TOML goes through tomlkit
(``toml_format``), YAML through text edits at the spans PyYAML reports (``yaml_format``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from oc_prefix_cache.errors import InstallError

EditKind = Literal["member", "append", "replace"]


@dataclass(frozen=True)
class Edit:
    """One change to a config: add ``key: value`` to the object at ``path`` (``member``),
    add ``value`` to the array ``key`` there (``append``), or set ``key``'s value (``replace``)."""

    path: tuple[str, ...]
    key: str
    value: Any
    says: str  # the line install prints; "" for a part of another change (a skeleton it needs)
    kind: EditKind = "member"
    # An object whose members are each ocpc's own (Claude Code's ``env`` block): when the user
    # adds to it, uninstall takes out ocpc's members and leaves the object with theirs.
    container: bool = False
    # The members of an object value that make it ocpc's: an agent that stamps its own fields
    # on an entry (Cline refreshes ``updatedAt`` on every run) leaves it ocpc's as long as
    # these still hold ocpc's values (for a ``container``: the same, for each of its members).
    # Empty: the whole value must still be ocpc's.
    same_when: tuple[str, ...] = ()


def still_ours(current: Any, ours: Any, same_when: tuple[str, ...] | list[str] | None) -> bool:
    """Whether ``current`` is still the value ocpc wrote (see ``Edit.same_when``)."""
    if current == ours:
        return True
    if not same_when or not isinstance(current, dict) or not isinstance(ours, dict):
        return False
    return all(current.get(key) == ours.get(key) for key in same_when)


def change_still_ours(change: dict[str, Any], current: Any) -> bool:
    """Whether the member a recorded change wrote still is ocpc's as a whole (a container's
    ``same_when`` is about its members, so the container itself must be unchanged)."""
    if change.get("container"):
        return bool(current == change["value"])
    return still_ours(current, change["value"], change.get("same_when"))


class ConfigFormat(Protocol):
    """How a config's text is read, edited and un-edited; ``name`` is recorded with the
    install so that uninstall reads the file the same way."""

    name: str

    def parse(self, text: str) -> dict[str, Any]:
        """The config as plain data; FormatError when it is not valid or not a mapping."""
        ...

    def apply(self, text: str, edits: list[Edit]) -> tuple[str, list[dict[str, Any]]]:
        """The edited text and one record entry per edit (enough to undo it)."""
        ...

    def undo(self, text: str, changes: list[dict[str, Any]], kept: list[str]) -> str:
        """``text`` without ocpc's changes that are still ocpc's; a line in ``kept`` for each
        one the user changed since (those stay). FormatError/InstallError when impossible."""
        ...


def expected_after(data: dict[str, Any], edits: list[Edit]) -> dict[str, Any]:
    """``data`` as the edits should leave it: what a format's output must parse back to."""
    out = copy.deepcopy(data)
    for edit in edits:
        node: Any = out
        for part in edit.path:
            node = node[part]
        if edit.kind == "append":
            node[edit.key] = [*node[edit.key], copy.deepcopy(edit.value)]
        else:
            node[edit.key] = copy.deepcopy(edit.value)
    return out


@dataclass(frozen=True)
class UndoOp:
    """One step of an uninstall on a config that changed since: ``delete`` the member ``key``
    of the mapping at ``path``, or ``restore`` the user's value there (``old``, and for formats
    that keep it, ``old_text``: its exact source)."""

    op: Literal["delete", "restore"]
    path: tuple[str, ...]
    key: str
    old: Any = None
    old_text: str | None = None


def plan_undo(data: dict[str, Any], changes: list[dict[str, Any]]) -> tuple[list[UndoOp], list[str]]:
    """What to take out of (or put back into) ``data`` for each change that is still ocpc's,
    newest first, and one line for each that the user changed since (those stay)."""
    ops: list[UndoOp] = []
    kept: list[str] = []
    for change in reversed(changes):
        path, key, ours = tuple(change["path"]), str(change["key"]), change["value"]
        node = _at(data, path)
        if not isinstance(node, dict) or key not in node:
            continue  # the user took it out already
        current = node[key]
        if change["kind"] == "replace":
            if still_ours(current, ours, change.get("same_when")):
                ops.append(UndoOp("restore", path, key, change.get("old"), change.get("old_text")))
            else:
                kept.append(
                    f"kept {dotted(path, key)}: you changed it since install (it was "
                    f"{change.get('old_text') or change.get('old')!r} before)"
                )
        elif change["kind"] == "append":
            raise InstallError(f"cannot undo an append to {dotted(path, key)} in this format")
        elif change_still_ours(change, current):
            ops.append(UndoOp("delete", path, key))
        elif change.get("container") and isinstance(current, dict) and isinstance(ours, dict):
            mine = [
                sub
                for sub, value in ours.items()
                if sub in current and still_ours(current[sub], value, change.get("same_when"))
            ]
            kept += [
                f"kept {dotted((*path, key), sub)}: you changed it since install"
                for sub in ours
                if sub in current and sub not in mine
            ]
            if set(mine) == set(current):
                ops.append(UndoOp("delete", path, key))
            else:
                ops += [UndoOp("delete", (*path, key), sub) for sub in mine]
        else:
            kept.append(f"kept {dotted(path, key)}: you changed it since install")
    return ops, kept


def apply_undo(data: dict[str, Any], ops: list[UndoOp]) -> dict[str, Any]:
    """``data`` after ``ops``: what the un-edited text must parse back to."""
    out = copy.deepcopy(data)
    for op in ops:
        node = _at(out, op.path)
        if not isinstance(node, dict):
            continue  # an earlier step took its parent out
        if op.op == "delete":
            node.pop(op.key, None)
        else:
            node[op.key] = copy.deepcopy(op.old)
    return out


def _at(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def dotted(path: tuple[str, ...] | list[str], key: str) -> str:
    return ".".join((*path, key))
