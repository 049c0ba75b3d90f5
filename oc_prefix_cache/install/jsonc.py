"""Read and minimally edit JSON-with-comments (opencode.jsonc) without losing a byte.

We never re-serialise a user's config: comments, key order and formatting stay. To
read, comments and trailing commas are blanked out (keeping every offset) and the text
is parsed as JSON; to edit, a snippet is inserted right after an object's opening brace.
Uninstall removes exactly the snippets install inserted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.errors import JsoncError


def blank_comments(text: str) -> str:
    """Replace comments and trailing commas with spaces; offsets stay the same."""
    return _blank_trailing_commas(_blank_only_comments(text))


def has_trailing_comma(text: str) -> bool:
    """Whether a comma stands before a closing bracket: JSONC, but not JSON (JSON.parse,
    which Claude Code, Cline and pi read their files with, refuses it)."""
    clean = _blank_only_comments(text)
    return _blank_trailing_commas(clean) != clean


def _blank_only_comments(text: str) -> str:
    out = list(text)
    i, n = 0, len(text)
    in_string = False
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
            i += 1
        elif c == '"':
            in_string = True
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise JsoncError("unterminated /* comment")
            end += 2
            out[i:end] = [ch if ch == "\n" else " " for ch in text[i:end]]
            i = end
        else:
            i += 1
    return "".join(out)


def _blank_trailing_commas(text: str) -> str:
    out = list(text)
    in_string = False
    i = 0
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            in_string = c != '"'
        elif c == '"':
            in_string = True
        elif c == ",":
            j = i + 1
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            if j < len(text) and text[j] in "]}":
                out[i] = " "
        i += 1
    return "".join(out)


def loads(text: str) -> Any:
    if not text.strip():
        return {}
    try:
        return json.loads(blank_comments(text))
    except json.JSONDecodeError as exc:
        raise JsoncError(f"not valid JSON(C) at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc


@dataclass(frozen=True)
class Insertion:
    """A snippet put into the text at ``offset``: enough to take it out again."""

    offset: int
    snippet: str


def object_open(text: str, path: tuple[str, ...]) -> int:
    """Offset just after the ``{`` of the object at ``path`` (``()`` is the root)."""
    clean = blank_comments(text)
    decoder = json.JSONDecoder()
    start = clean.index("{") if "{" in clean else -1
    if start < 0:
        raise JsoncError("the config is not a JSON object")
    for key in path:
        start = _find_key_value(clean, start, key, decoder)
        if clean[start] != "{":
            raise JsoncError(f"'{key}' is not an object")
    return start + 1


def _find_key_value(clean: str, obj_start: int, key: str, decoder: json.JSONDecoder) -> int:
    """Offset of the value of ``key`` directly inside the object at ``obj_start``."""
    i = obj_start + 1
    while True:
        i = _skip_ws(clean, i)
        if clean[i] == "}":
            raise JsoncError(f"no key '{key}'")
        name, i = decoder.raw_decode(clean, i)
        i = _skip_ws(clean, i)
        if clean[i] != ":":
            raise JsoncError("malformed object")
        value_start = _skip_ws(clean, i + 1)
        if name == key:
            return value_start
        _, i = decoder.raw_decode(clean, value_start)
        i = _skip_ws(clean, i)
        if clean[i] == ",":
            i += 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def insert_member(text: str, path: tuple[str, ...], key: str, value: Any) -> tuple[str, Insertion]:
    """Insert ``"key": value`` as the first member of the object at ``path``."""
    at = object_open(text, path)
    clean = blank_comments(text)
    empty = clean[_skip_ws(clean, at)] == "}"
    indent = "  " * (len(path) + 1)
    rendered = json.dumps(value, indent=2).replace("\n", "\n" + indent)
    snippet = f"\n{indent}{json.dumps(key)}: {rendered}{'' if empty else ','}"
    return text[:at] + snippet + text[at:], Insertion(at, snippet)


def append_to_array(text: str, path: tuple[str, ...], key: str, item: Any) -> tuple[str, Insertion]:
    """Insert ``item`` as the first element of the array ``key`` in the object at ``path``."""
    clean = blank_comments(text)
    obj = object_open(text, path) - 1
    start = _find_key_value(clean, obj, key, json.JSONDecoder())
    if clean[start] != "[":
        raise JsoncError(f"'{key}' is not an array")
    at = start + 1
    empty = clean[_skip_ws(clean, at)] == "]"
    snippet = json.dumps(item) + ("" if empty else ", ")
    return text[:at] + snippet + text[at:], Insertion(at, snippet)


def remove(text: str, insertion: Insertion) -> str | None:
    """Take a snippet out again: at its offset, or wherever it now is if it is there once.

    A snippet that is gone (the user removed it) leaves the text as it is; None when it
    is there more than once and not at its offset: then we do not guess which.
    """
    at = insertion.offset
    if text[at : at + len(insertion.snippet)] != insertion.snippet:
        count = text.count(insertion.snippet)
        if count == 0:
            return text
        if count > 1:
            return None
        at = text.index(insertion.snippet)
    return text[:at] + text[at + len(insertion.snippet) :]


# --- structural edits: for uninstall when a snippet no longer matches byte for byte -------
# A tool that re-serialises the file (Claude Code rewrites its settings.json when a setting
# changes in its UI) keeps the members but not ocpc's exact snippet; these find a member by
# its path instead, and cut only it (and one comma), leaving comments and the rest as is.

MISSING: Any = object()  # ``value_at`` when the path is not there


@dataclass(frozen=True)
class _Span:
    key: str | None  # the member's name; None for an array element
    value: Any
    start: int  # the member's key (or the element) starts here
    value_start: int
    end: int  # just after its value
    comma: int | None  # the comma that follows it, when one does (trailing commas are not seen)


def value_at(text: str, path: tuple[str, ...]) -> Any:
    """The parsed value at ``path`` (object keys from the root), or ``MISSING``."""
    value = loads(text)
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return MISSING
        value = value[key]
    return value


def _container(clean: str, path: tuple[str, ...]) -> int:
    """Offset of the ``{`` or ``[`` of the value at ``path``."""
    if not path:
        return object_open(clean, ()) - 1
    at = object_open(clean, path[:-1]) - 1
    start = _find_key_value(clean, at, path[-1], json.JSONDecoder())
    if clean[start] not in "{[":
        raise JsoncError(f"'{path[-1]}' is neither an object nor an array")
    return start


def _spans(clean: str, open_at: int) -> list[_Span]:
    """The members of the object (or elements of the array) opening at ``open_at``."""
    decoder = json.JSONDecoder()
    close = "}" if clean[open_at] == "{" else "]"
    spans: list[_Span] = []
    i = _skip_ws(clean, open_at + 1)
    while clean[i] != close:
        start, key = i, None
        if close == "}":
            key, i = decoder.raw_decode(clean, i)
            i = _skip_ws(clean, i)
            if clean[i] != ":":
                raise JsoncError("malformed object")
            i = _skip_ws(clean, i + 1)
        value_start = i
        value, end = decoder.raw_decode(clean, i)
        i = _skip_ws(clean, end)
        comma = None
        if clean[i] == ",":
            comma = i
            i = _skip_ws(clean, i + 1)
        spans.append(_Span(key, value, start, value_start, end, comma))
    return spans


def _cut(text: str, open_at: int, spans: list[_Span], index: int) -> str:
    """Remove ``spans[index]`` with the whitespace before it and one comma, so the
    container stays valid: its own comma when one follows, else the one before it."""
    span = spans[index]
    if span.comma is not None and index == 0:  # the next one moves up into its place
        after = span.comma + 1
        while after < len(text) and text[after] in " \t\r\n":
            after += 1
        return text[: span.start] + text[after:]
    start = span.start
    while start > open_at + 1 and text[start - 1] in " \t\r\n":
        start -= 1
    if span.comma is not None:
        return text[:start] + text[span.comma + 1 :]
    trailing = _skip_ws(text, span.end)
    if trailing < len(text) and text[trailing] == ",":  # a JSONC trailing comma: it goes with it
        return text[:start] + text[trailing + 1 :]
    if index == 0:
        return text[:start] + text[span.end :]
    before = spans[index - 1].comma
    assert before is not None  # a member that is followed by another has its comma
    return text[:before] + text[before + 1 : start] + text[span.end :]


def remove_member(text: str, path: tuple[str, ...], key: str) -> str:
    """Remove the member ``key`` of the object at ``path`` (the last one, if repeated: the
    one a JSON parser keeps). The text is returned unchanged when there is no such member."""
    clean = blank_comments(text)
    open_at = _container(clean, path)
    if clean[open_at] != "{":
        raise JsoncError(f"{'.'.join(path) or 'the root'} is not an object")
    spans = _spans(clean, open_at)
    found = [i for i, span in enumerate(spans) if span.key == key]
    return _cut(text, open_at, spans, found[-1]) if found else text


def remove_element(text: str, path: tuple[str, ...], item: Any) -> str:
    """Remove the first element equal to ``item`` from the array at ``path`` (unchanged
    when there is none)."""
    clean = blank_comments(text)
    open_at = _container(clean, path)
    if clean[open_at] != "[":
        raise JsoncError(f"'{path[-1] if path else 'the root'}' is not an array")
    spans = _spans(clean, open_at)
    found = [i for i, span in enumerate(spans) if span.value == item]
    return _cut(text, open_at, spans, found[0]) if found else text


def replace_value(text: str, path: tuple[str, ...], key: str, raw: str) -> tuple[str, str]:
    """Put the JSON text ``raw`` in place of the value of ``key`` in the object at ``path``;
    returns the new text and the value's old JSON text (to put back on uninstall)."""
    clean = blank_comments(text)
    open_at = _container(clean, path)
    spans = [s for s in _spans(clean, open_at) if s.key == key] if clean[open_at] == "{" else []
    if not spans:
        raise JsoncError(f"no key '{key}'")
    start, end = spans[-1].value_start, spans[-1].end
    return text[:start] + raw + text[end:], text[start:end]
