"""Recognise a conversation's next turn without parsing it again.

A coding agent re-sends the whole conversation on every turn: a 100k-token session is a
0.5 MB body, and parsing plus hashing all of it costs more than the 2 ms a turn may
spend here. But a next turn is the previous body with messages appended and everything
else (model, tools, options) unchanged, so it is recognised with byte compares: the
bytes up to the end of the previous ``messages`` are the same, the bytes after it are the
same, and what lies between parses as the new messages. Only those are decoded, parsed
and hashed (a message's digest is of its exact UTF-8 bytes either way).

The slow path (a new session, or a body that is not a plain extension) parses the body
once with the same scanner, which also yields where ``messages`` ends and one digest per
message (of its exact text) for matching parked conversations by their message chain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

from oc_prefix_cache.errors import BadRequestBody

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"
#: The fields besides ``messages`` that llama-server feeds its chat template
#: (``oaicompat_chat_params_parse``, b11434): a change in any of them changes the prompt.
RENDERED_FIELDS = (
    "tools",
    "tool_choice",
    "json_schema",
    "grammar",
    "response_format",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_format",
    "chat_template_kwargs",
    "reasoning_effort",
)


@dataclass(frozen=True)
class ParsedBody:
    """A chat body parsed once, with what later turns are recognised by."""

    data: dict[str, Any]
    text: str
    msg_end: int  # index of the ']' that closes the top-level "messages" array
    digests: tuple[str, ...]  # one per message, of its exact text

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.data["messages"]
        return messages


@dataclass(frozen=True)
class Trail:
    """The last body a conversation sent, as bytes: enough to recognise its next turn."""

    raw: bytes
    msg_end: int  # byte offset of the ']' that closes "messages"
    digests: tuple[str, ...]
    session: str
    frame: str = ""  # digest of the fields that render besides the messages (``RENDERED_FIELDS``)

    @classmethod
    def of(cls, body: ParsedBody, *, session: str) -> Trail:
        raw = body.text.encode()
        return cls(
            raw=raw,
            msg_end=len(body.text[: body.msg_end].encode()),
            digests=body.digests,
            session=session,
            frame=frame_of(body.data),
        )


def frame_of(data: dict[str, Any]) -> str:
    """What renders besides the messages, as one digest: two bodies whose messages extend each
    other render as an extension only when this is the same (changed tools, a thinking switch
    in ``chat_template_kwargs``: the prompt changes before the first message)."""
    rendered = [[key, data[key]] for key in RENDERED_FIELDS if key in data]
    return text_digest(json.dumps(rendered, ensure_ascii=False))


def parse(text: str) -> ParsedBody:
    """Parse a JSON chat body, noting where ``messages`` ends and each message's digest."""
    data: dict[str, Any] = {}
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "{":
        raise BadRequestBody("body is not a JSON object")
    i = _skip(text, i + 1)
    msg_end, digests = -1, tuple[str, ...]()
    while i < len(text) and text[i] != "}":
        key, i = _decode(text, i)
        if not isinstance(key, str):
            raise BadRequestBody("body has a non-string key")
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            raise BadRequestBody("body is not valid JSON (expected ':')")
        i = _skip(text, i + 1)
        if key == "messages" and i < len(text) and text[i] == "[":
            value, digests, msg_end, i = _messages(text, i)
        else:
            value, i = _decode(text, i)
        data[key] = value
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        elif i < len(text) and text[i] != "}":
            raise BadRequestBody("body is not valid JSON (expected ',' or '}')")
    if i >= len(text) or _skip(text, i + 1) != len(text):
        raise BadRequestBody("body is not valid JSON (trailing or missing data)")
    messages = data.get("messages")
    if msg_end < 0 or not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequestBody("body has no 'messages' list of objects")
    return ParsedBody(data=data, text=text, msg_end=msg_end, digests=digests)


def follow(trail: Trail, raw: bytes) -> Trail | None:
    """The trail of ``raw`` if it is ``trail``'s conversation gone on, else None.

    Cost: two byte compares of the previous body's length (memcmp; no decode of the whole
    body: a single non-ASCII character makes a decoded 0.5 MB body a 2 MB string), then
    decoding and parsing only the appended messages.
    """
    head, tail = trail.raw[: trail.msg_end], trail.raw[trail.msg_end :]
    if len(raw) < len(trail.raw) or not raw.startswith(head) or not raw.endswith(tail):
        return None
    end = len(raw) - len(tail)
    try:
        middle = raw[trail.msg_end : end].decode("utf-8").strip(_WS)
    except UnicodeDecodeError:
        return None
    digests = trail.digests
    if middle:
        if trail.digests:
            if not middle.startswith(","):
                return None
            middle = middle[1:]
        try:
            _, added, close, _ = _messages("[" + middle + "]", 0)
        except BadRequestBody:
            return None
        if close != len(middle) + 1:
            return None
        digests = trail.digests + added
    return Trail(raw=raw, msg_end=end, digests=digests, session=trail.session, frame=trail.frame)


def digest(text: str) -> str:
    return text_digest(text)


def text_digest(text: str) -> str:
    """xxh64 of a text that may come from a request, lone surrogates and all (a JS agent that cut
    a tool's output mid-emoji): a digest must never be what fails a request."""
    return xxhash.xxh64_hexdigest(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class ConversationKey:
    """What a harness adapter says names a request's conversation, before ocpc looks at what it
    knows (``engine/instances.py`` turns it into the conversation's own name).

    ``shared``: the key may name two conversations. A session id the agent sends names one
    conversation (``shared=False``): two requests with it belong together. A key made from what
    the agent sends (its project text and the first message the person typed) separates two
    projects and two different first questions, but not two sessions that began alike: Aider,
    Cline and Qwen Code send byte-identical first requests for the same question in the same
    project, so nothing in them can tell those sessions apart. Such a key is never taken for the
    conversation itself: ocpc tells the conversations under it apart by their message chains.
    """

    name: str  # "" for a request with no conversation to keep (a title, a summary)
    shared: bool
    source: str  # what it was made from, in words (logs, status, docs/harnesses.md)
    #: the harness rewrites earlier turns of a conversation (Aider moves a turn that edited files
    #: before its chat files): a next turn then need not repeat the last body (engine/instances.py)
    rewrites_history: bool = False

    @classmethod
    def session(cls, value: str, *, source: str = "the session id the agent sends") -> ConversationKey:
        return cls(name=value, shared=False, source=source)

    @classmethod
    def content(cls, harness: str, *parts: str, source: str, rewrites_history: bool = False) -> ConversationKey:
        """A shared key from the text that separates the harness's sessions."""
        text = json.dumps(parts, ensure_ascii=False)  # each part whole: no two lists of parts give one text
        digest = xxhash.xxh64_hexdigest(text.encode("utf-8", "surrogatepass"))  # a lone surrogate too
        return cls(name=f"{harness}-{digest}", shared=True, source=source, rewrites_history=rewrites_history)

    @classmethod
    def chain(cls, digests: tuple[str, ...]) -> ConversationKey:
        """The fallback: the first two messages as written (a request no adapter names a key for)."""
        return cls(name=chain_id(digests), shared=True, source="its first two messages as written")


#: Between a shared key and the number that tells one of its conversations from the others.
INSTANCE_SEP = "~"


def chain_id(digests: tuple[str, ...]) -> str:
    """A conversation without a session id, named by its first two messages (system, first user)
    as written. One name for the slot choice (the front doors' broker) and the prepare: when the
    two named it differently, a returning conversation did not find its own slot, took another,
    and its prepare waited to its deadline for a park of its own slot that nobody would write
    (4 agents on ``-np 4``: pi and an OpenCode agent stuck for the whole window)."""
    return "chain-" + xxhash.xxh64_hexdigest("".join(digests[:2]).encode())


def _messages(text: str, i: int) -> tuple[list[Any], tuple[str, ...], int, int]:
    """Parse the array at ``text[i] == '['``: values, per-element digests, index of ']', next index."""
    values: list[Any] = []
    digests: list[str] = []
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        value, end = _decode(text, i)
        values.append(value)
        digests.append(digest(text[i:end]))
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        elif i < len(text) and text[i] != "]":
            raise BadRequestBody("body is not valid JSON (expected ',' or ']' in messages)")
    if i >= len(text):
        raise BadRequestBody("body is not valid JSON (messages never end)")
    return values, tuple(digests), i, i + 1


def _decode(text: str, i: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError as exc:
        raise BadRequestBody(f"body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequestBody("body is nested too deeply to be a chat request") from exc


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i
