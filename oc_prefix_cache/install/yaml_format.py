"""YAML configs (Aider's ``.aider.conf.yml``): top-level entries edited as text at the exact
spans PyYAML reports, and every result read back with PyYAML's safe loader.

Why not a round-trip library (ruamel.yaml): Aider's config is one flat mapping, and the file
users start from is Aider's sample, every line of it a comment: a round-trip loader reads it
as no document at all and would write the comments away, and on other files it re-indents
what it re-emits. Text edits keep every byte that is not ocpc's: a new entry is a line added
at the end, a replaced value is swapped in its own span (its comment stays), and uninstall
takes exactly those out. PyYAML is the reader Aider itself uses (configargparse's
YAMLConfigFileParser, SafeLoader), so the check that the result means what was planned is a
check of what Aider will read; anything it does not confirm is refused before writing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import yaml

from oc_prefix_cache.errors import FormatError, InstallError
from oc_prefix_cache.install.edits import Edit, UndoOp, apply_undo, expected_after, plan_undo

HEADER = "# added by `ocpc install --harness {harness}`; `ocpc uninstall --harness {harness}` takes it out\n"


class YamlFormat:
    name = "yaml"

    def __init__(self, harness: str) -> None:
        self.harness = harness

    def parse(self, text: str) -> dict[str, Any]:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FormatError(f"is not valid YAML ({' '.join(str(exc).split())})") from exc
        if data is None:  # empty, or only comments (Aider's sample file)
            return {}
        if not isinstance(data, dict):
            raise FormatError(f"is a YAML {type(data).__name__}, not a mapping of settings")
        return data

    def apply(self, text: str, edits: list[Edit]) -> tuple[str, list[dict[str, Any]]]:
        before = self.parse(text)
        pairs = _top_level_pairs(text)
        spans: list[tuple[int, int, str]] = []  # start, end, new text
        changes: list[dict[str, Any]] = []
        added: list[str] = []
        for edit in edits:
            if edit.path or edit.kind == "append" or isinstance(edit.value, (dict, list)):
                raise InstallError("YAML installs set top-level scalar entries only")
            change: dict[str, Any] = {"kind": edit.kind, "path": [], "key": edit.key, "value": edit.value}
            if edit.kind == "replace":
                node = _value_node(pairs, edit.key)
                start, end = node.start_mark.index, node.end_mark.index
                change.update(old=before[edit.key], old_text=text[start:end])
                spans.append((start, end, scalar(edit.value)))
            else:
                line = f"{edit.key}: {scalar(edit.value)}\n"
                change.update(snippet=line)
                added.append(line)
            changes.append(change)
        out = text
        for start, end, new in sorted(spans, reverse=True):
            out = out[:start] + new + out[end:]
        if added:
            header = HEADER.format(harness=self.harness)
            out += ("\n" if out and not out.endswith("\n") else "") + header + "".join(added)
            changes.append({"kind": "comment", "path": [], "key": "", "value": None, "snippet": header})
        if self.parse(out) != expected_after(before, edits):
            raise FormatError(
                "cannot take ocpc's entries at its end without changing what it means "
                "(a flow mapping, an indented top level or a document end marker?)"
            )
        return out, changes

    def undo(self, text: str, changes: list[dict[str, Any]], kept: list[str]) -> str:
        data = self.parse(text)
        ops, notes = plan_undo(data, [c for c in changes if c["kind"] != "comment"])
        kept += notes
        ops = [replace(op, old=self.parse(f"x: {op.old_text}\n")["x"]) if op.old_text else op for op in ops]
        pairs = _top_level_pairs(text)
        cuts: list[tuple[int, int, str]] = [_undo_span(text, pairs, op) for op in ops]
        out = text
        for start, end, new in sorted(cuts, reverse=True):
            out = out[:start] + new + out[end:]
        for change in changes:
            if change["kind"] == "comment" and out.count(change["snippet"]) == 1:
                out = out.replace(change["snippet"], "")
        if self.parse(out) != apply_undo(data, ops):
            raise FormatError("taking ocpc's entries out would change what the rest of it means")
        return out


def scalar(value: Any) -> str:
    """``value`` as a YAML scalar: plain when PyYAML reads it back as the same value, else
    double-quoted (JSON's escaping is valid YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    try:
        plain_ok = yaml.safe_load(f"k: {text}\n") == {"k": text} and "#" not in text and text == text.strip()
    except yaml.YAMLError:
        plain_ok = False
    return text if plain_ok and text else json.dumps(text)


def _top_level_pairs(text: str) -> list[tuple[yaml.Node, yaml.Node]]:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise FormatError(f"is not valid YAML ({' '.join(str(exc).split())})") from exc
    if root is None:
        return []
    if not isinstance(root, yaml.MappingNode) or root.flow_style:
        raise FormatError("is not a block mapping of settings (one `key: value` per line)")
    return list(root.value)


def _value_node(pairs: list[tuple[yaml.Node, yaml.Node]], key: str) -> yaml.Node:
    for key_node, value_node in pairs:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            if not isinstance(value_node, yaml.ScalarNode):
                raise InstallError(f"its '{key}' is not a single value; set it by hand")
            return value_node
    raise InstallError(f"its '{key}' is not a top-level entry")


def _undo_span(text: str, pairs: list[tuple[yaml.Node, yaml.Node]], op: UndoOp) -> tuple[int, int, str]:
    """The text to cut (or swap back) for one step: a restored value's span, or a deleted
    entry's whole line, which must hold nothing else."""
    node = _value_node(pairs, op.key)
    if op.op == "restore":
        return (
            node.start_mark.index,
            node.end_mark.index,
            str(op.old_text if op.old_text is not None else scalar(op.old)),
        )
    key_node = next(k for k, v in pairs if v is node)
    start = text.rfind("\n", 0, key_node.start_mark.index) + 1
    end = text.find("\n", node.end_mark.index)
    end = len(text) if end < 0 else end + 1
    if text[start : key_node.start_mark.index].strip() or text[node.end_mark.index : end].strip():
        raise InstallError(f"'{op.key}' shares its line with something else; take it out by hand")
    return start, end, ""
