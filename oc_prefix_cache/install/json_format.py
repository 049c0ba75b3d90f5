"""JSON and JSON-with-comments configs (OpenCode, Claude Code, pi, Kilo, Qwen Code, Cline):
edited as text in place by ``jsonc``, so comments, order and spacing stay.

Each inserted member is recorded with its exact snippet and offset; uninstall cuts that
snippet where it is, or, when a tool re-serialised the file (Claude Code, Qwen Code and
Cline rewrite their own settings), finds the member by its path and removes it while it
still holds ocpc's value. A value ocpc replaced goes back to the user's while it is ocpc's.
"""

from __future__ import annotations

import json
from typing import Any

from oc_prefix_cache.errors import FormatError, JsoncError
from oc_prefix_cache.install import jsonc
from oc_prefix_cache.install.edits import Edit, change_still_ours, dotted, still_ours


class JsonFormat:
    name = "json"

    def parse(self, text: str) -> dict[str, Any]:
        try:
            config = jsonc.loads(text)
        except JsoncError as exc:
            raise FormatError(f"is not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise FormatError("is not a JSON object")
        return config

    def apply(self, text: str, edits: list[Edit]) -> tuple[str, list[dict[str, Any]]]:
        """The edited text, and one record entry per edit (enough to undo it either way)."""
        text = text if text.strip() else "{\n}\n"
        changes: list[dict[str, Any]] = []
        for edit in edits:
            change: dict[str, Any] = {"kind": edit.kind, "path": list(edit.path), "key": edit.key, "value": edit.value}
            if edit.same_when:
                change.update(same_when=list(edit.same_when))
            if edit.kind == "replace":
                text, old = jsonc.replace_value(text, edit.path, edit.key, json.dumps(edit.value))
                change.update(old=old)
            else:
                if edit.kind == "append":
                    text, insertion = jsonc.append_to_array(text, edit.path, edit.key, edit.value)
                else:
                    text, insertion = jsonc.insert_member(text, edit.path, edit.key, edit.value)
                change.update(offset=insertion.offset, snippet=insertion.snippet, container=edit.container)
            changes.append(change)
        self.parse(text)  # never write what we could not read back
        return text, changes

    def undo(self, text: str, changes: list[dict[str, Any]], kept: list[str]) -> str:
        try:
            for change in reversed(changes):
                text = _undo(text, change, kept)
            jsonc.loads(text)
        except JsoncError as exc:
            raise FormatError(f"would be left invalid JSON by removing ocpc's entries ({exc})") from exc
        return text


JSON = JsonFormat()


def _undo(text: str, change: dict[str, Any], kept: list[str]) -> str:
    """Undo one change: its exact snippet when it is there, else by its path."""
    path = tuple(change.get("path") or ())
    key = change.get("key")
    if change.get("kind") == "replace":
        return _undo_replace(text, path, str(key), change, kept)
    out = jsonc.remove(text, jsonc.Insertion(int(change["offset"]), str(change["snippet"])))
    if out is None:  # there more than once, not where we put it: do not guess which
        raise FormatError("changed where ocpc wrote")
    if key is not None and (out == text or _gained_trailing_comma(text, out)):
        # gone from where we put it (a snippet is never empty), or found where its comma is
        # not its own (it went into an empty object; a tool re-serialised the file since)
        return _remove_by_path(text, path, str(key), change, kept)
    return out


def _gained_trailing_comma(before: str, after: str) -> bool:
    """Whether cutting left a comma before a closing bracket that was not there before."""
    return jsonc.has_trailing_comma(after) and not jsonc.has_trailing_comma(before)


def _undo_replace(text: str, path: tuple[str, ...], key: str, change: dict[str, Any], kept: list[str]) -> str:
    current = jsonc.value_at(text, (*path, key))
    if current is jsonc.MISSING:
        return text
    if not still_ours(current, change["value"], change.get("same_when")):
        kept.append(f"kept {dotted(path, key)}: you changed it since install (it was {change['old']} before)")
        return text
    return jsonc.replace_value(text, path, key, str(change["old"]))[0]


def _remove_by_path(text: str, path: tuple[str, ...], key: str, change: dict[str, Any], kept: list[str]) -> str:
    """The snippet is not in the text as written (the file was re-serialised, or edited):
    remove what ocpc added where it now is, while it still holds ocpc's value."""
    value = change["value"]
    current = jsonc.value_at(text, (*path, key))
    if current is jsonc.MISSING:
        return text  # the user took it out already
    if change.get("kind") == "append":
        return jsonc.remove_element(text, (*path, key), value) if isinstance(current, list) else text
    if change_still_ours(change, current):
        return jsonc.remove_member(text, path, key)
    if change.get("container") and isinstance(current, dict) and isinstance(value, dict):
        for sub, ours in reversed(list(value.items())):
            if sub in current and still_ours(current[sub], ours, change.get("same_when")):
                text = jsonc.remove_member(text, (*path, key), sub)
            elif sub in current:
                kept.append(f"kept {dotted((*path, key), sub)}: you changed it since install")
        if jsonc.value_at(text, (*path, key)) == {}:
            text = jsonc.remove_member(text, path, key)
        return text
    kept.append(f"kept {dotted(path, key)}: you changed it since install")
    return text
