"""TOML configs (Codex's ``config.toml``), edited with tomlkit and checked with tomllib.

Why tomlkit and not text edits: a TOML key's place decides what it means (a top-level key
must come before the first ``[table]``; a table may be a header, a dotted key or an inline
table), and tomlkit, the style-preserving TOML library Poetry is built on, parses and
re-emits a document byte for byte, comments, order and spacing included, while it inserts
each new key where TOML needs it. It is not trusted blindly: every text it produces is read
back with the standard library's strict reader (tomllib) and must mean exactly the data the
edits planned (tomlkit mis-nests a table added beside dotted keys, for one); otherwise
nothing is written and the user is told what to add by hand.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import InlineTable, Item, Table

from oc_prefix_cache.errors import FormatError, InstallError
from oc_prefix_cache.install.edits import Edit, apply_undo, expected_after, plan_undo

Container = Any  # tomlkit's TOMLDocument, Table or InlineTable: all behave as mutable mappings


class TomlFormat:
    name = "toml"

    def parse(self, text: str) -> dict[str, Any]:
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FormatError(f"is not valid TOML ({exc})") from exc

    def apply(self, text: str, edits: list[Edit]) -> tuple[str, list[dict[str, Any]]]:
        before = self.parse(text)
        doc = _document(text)
        changes: list[dict[str, Any]] = []
        for edit in edits:
            if edit.kind == "append":
                raise InstallError("TOML installs add or replace keys only")
            parent = _container(doc, edit.path)
            change: dict[str, Any] = {
                "kind": edit.kind,
                "path": list(edit.path),
                "key": edit.key,
                "value": edit.value,
                "container": edit.container,
                "same_when": list(edit.same_when),
            }
            if edit.kind == "replace":
                old: Item = parent[edit.key]
                change.update(old=_jsonable(old.unwrap()), old_text=old.as_string().strip())
            parent[edit.key] = _item(edit.value, inline=isinstance(parent, InlineTable))
            changes.append(change)
        out = _keep_final_newline(text, tomlkit.dumps(doc))
        if self.parse(out) != expected_after(before, edits):
            raise FormatError(
                "cannot take ocpc's entries without changing what the rest of it means "
                "(tomlkit placed them wrongly, e.g. beside dotted keys)"
            )
        return out, changes

    def undo(self, text: str, changes: list[dict[str, Any]], kept: list[str]) -> str:
        data = self.parse(text)
        ops, notes = plan_undo(data, changes)
        kept += notes
        # the value to expect back is what the user's own text says (a date stays a date)
        ops = [replace(op, old=self.parse(f"x = {op.old_text}\n")["x"]) if op.old_text else op for op in ops]
        doc = _document(text)
        for op in ops:
            try:
                parent = _container(doc, op.path)
            except (KeyError, FormatError):
                continue  # an earlier step took its parent out
            if op.key not in parent:
                continue
            if op.op == "delete":
                del parent[op.key]
            elif op.old_text is not None:
                parent[op.key] = _document(f"x = {op.old_text}\n")["x"]
            else:
                parent[op.key] = _item(op.old, inline=isinstance(parent, InlineTable))
        out = _keep_final_newline(text, tomlkit.dumps(doc))
        if self.parse(out) != apply_undo(data, ops):
            raise FormatError("taking ocpc's entries out would change what the rest of it means")
        return out


TOML = TomlFormat()


def _document(text: str) -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:  # tomllib accepted it: a tomlkit limit, said as such
        raise FormatError(f"cannot be edited by tomlkit ({exc})") from exc


def _container(doc: tomlkit.TOMLDocument, path: tuple[str, ...]) -> Container:
    node: Any = doc
    for part in path:
        node = node[part]
        if not isinstance(node, (Table, InlineTable)):  # dotted keys, or a table split in pieces
            raise FormatError(
                f"cannot add to its '{'.'.join(path)}' without changing what the rest of it means "
                f"(tomlkit edits only [table] headers and inline tables there)"
            )
    return node


def _item(value: Any, *, inline: bool) -> Any:
    """A tomlkit item for ``value``: a dict becomes a table (a super-table when it only holds
    tables, so ``{"ocpc": {...}}`` is written as ``[model_providers.ocpc]``), or an inline
    table inside an inline table."""
    if not isinstance(value, dict):
        return tomlkit.item(value)
    if inline:
        table: Any = tomlkit.inline_table()
        for key, sub in value.items():
            table[key] = _item(sub, inline=True)
        return table
    nested = bool(value) and all(isinstance(sub, dict) for sub in value.values())
    table = tomlkit.table(is_super_table=nested)
    for key, sub in value.items():
        table[key] = _item(sub, inline=False)
    return table


def _keep_final_newline(before: str, after: str) -> str:
    """tomlkit leaves a blank line where it appended (or took out) a table at the end; a file
    that ended in one newline keeps ending in one."""
    if before.endswith("\n") and not before.endswith("\n\n") and after.endswith("\n\n"):
        return after.rstrip("\n") + "\n"
    return after


def _jsonable(value: Any) -> Any:
    """The replaced value as install.json can hold it (dates as text: only said, never parsed)."""
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value
