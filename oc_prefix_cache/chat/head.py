"""What part of a chat request is the stable head: pure functions, no I/O.

The head is the tools array plus the first system message's text up to the earliest
volatile marker (``<env>`` by default: OpenCode puts the working directory and today's
date there). Everything before the marker is identical across sessions and projects;
everything after it is not. We always work on the parsed JSON, never on raw bytes:
a cut inside an escape sequence would be a different string.

Later turns of a conversation are recognised by their message digests (chat/conversation.py):
a body whose messages start with the previous body's messages is the same conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ParsedBody, parse
from oc_prefix_cache.errors import BadRequestBody

MAX_BODY_BYTES = 8 * 1024 * 1024  # OpenCode's bodies are ~30 KB; a long session a few MB


@dataclass(frozen=True)
class Head:
    """The stable part of one request, as text, before the server tokenizes it."""

    tools_json: str  # the tools array, re-serialised compactly in its given order
    system_head: str  # system text before the marker
    marker: str  # the marker that ended it
    model: str  # the body's "model" field ("" when absent)
    n_tools: int
    #: where the project head ends, when not at the end of the system text: the text it ends with
    #: (a harness's per-project part that follows the system message; "" none)
    project_tail: str = ""
    #: False when nothing after the head is the same for a project's sessions (OpenHands: the time
    #: to the microsecond follows it): no project head is cut, which would be saved for every session
    #: and never read
    project: bool = True
    #: where a shorter project head ends, on the way to the project head (the text it ends with, or
    #: the whole system text for its end): a level more sessions share, so that a change after it
    #: (Claude Code's git status, new with every commit) re-processes only what follows ("" none)
    project_base: str = ""


@dataclass(frozen=True)
class Skip:
    """Why a body has no head worth caching (OpenCode's title request, say)."""

    reason: str


@dataclass(frozen=True)
class ChatBody:
    """A parsed request body with the pieces the prepare path needs."""

    data: dict[str, Any]
    messages: list[dict[str, Any]]
    digests: tuple[str, ...] = ()  # one per message, of its exact text (conversation.parse)

    @property
    def message_digests(self) -> tuple[str, ...]:
        return self.digests


def parse_body(raw: bytes) -> ChatBody:
    """Parse a chat-completions body; raise ``BadRequestBody`` with what is wrong."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequestBody(f"body of {len(raw)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestBody(f"body is not JSON: not UTF-8 ({exc})") from exc
    return from_parsed(parse(text))


def continuing(messages: list[Any], head: Head) -> bool:
    """Whether a request carries earlier turns of its own conversation: an assistant message after
    the harness's fixed preamble (Aider's example exchange and repo map, through the head's
    ``project_tail`` when that is a whole message, hold assistant messages that are no turns)."""
    preamble = next(
        (
            i + 1
            for i, m in enumerate(messages)
            if head.project_tail and isinstance(m, dict) and message_text(m) == head.project_tail
        ),
        0,
    )
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages[preamble:])


def from_parsed(parsed: ParsedBody) -> ChatBody:
    return ChatBody(data=parsed.data, messages=parsed.messages, digests=parsed.digests)


def request_sets_adapters(body: dict[str, Any]) -> bool:
    """True when a chat body carries its own non-empty ``lora`` field.

    llama-server then runs that request under other adapter scales than the server's
    (adapters it does not list drop to scale 0), so its KV contents differ from a head
    saved under the server's adapters: such a request must not be prepared from or into
    the shared head.
    """
    return bool(body.get("lora"))


def extract_head(body: ChatBody, markers: tuple[str, ...]) -> Head | Skip:
    if request_sets_adapters(body.data):
        return Skip("the request sets its own LoRA adapters (a 'lora' field): its KV differs from the head's")
    tools = body.data.get("tools")
    if not isinstance(tools, list) or not tools:
        return Skip("no tools in the request (a title or utility request)")
    if not body.messages or body.messages[0].get("role") != "system":
        return Skip("the first message is not a system message")
    text = message_text(body.messages[0])
    if text is None:
        return Skip("the system message has no text content")
    found = earliest_marker(text, markers)
    if found is None:
        return Skip(f"no volatile marker ({', '.join(markers)}) in the system message")
    position, marker = found
    model = body.data.get("model")
    return Head(
        tools_json=json.dumps(tools, ensure_ascii=False, separators=(",", ":")),
        system_head=text[:position],
        marker=marker,
        model=model if isinstance(model, str) else "",
        n_tools=len(tools),
    )


def message_text(message: dict[str, Any]) -> str | None:
    """A message's text: a plain string, or the text parts of a content list joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        texts = [p for p in parts if isinstance(p, str)]
        return "".join(texts) if texts else None
    return None


def earliest_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(m), m) for m in markers if m and m in text]
    return min(hits) if hits else None


def extends(previous: tuple[str, ...], current: tuple[str, ...]) -> bool:
    """True when ``current`` is the same conversation as ``previous``, gone on."""
    return bool(previous) and len(current) >= len(previous) and current[: len(previous)] == previous


def harness_of(user_agent: str) -> str:
    """The harness name/version: the first product token (``opencode/1.18.33``)."""
    token = user_agent.strip().split(" ", 1)[0] if user_agent.strip() else ""
    return token or "unknown"


def locate_head(prompt: str, head: Head) -> int | None:
    """Character offset in the rendered prompt where the head ends (the marker).

    We look for the system head followed by its marker, so a marker that happens to
    appear inside a tool description does not cut the head short.
    """
    needle = head.system_head + head.marker
    index = prompt.find(needle)
    return None if index < 0 else index + len(head.system_head)


def tokens_before(pieces: list[tuple[int, bytes]], byte_offset: int) -> list[int]:
    """The longest token prefix whose bytes end at or before ``byte_offset``.

    Tokens come from tokenizing the whole rendered prompt, so the head is a strict
    token prefix of the real request (tokenizing the cut text alone may merge
    differently at the cut).
    """
    out: list[int] = []
    end = 0
    for token_id, raw in pieces:
        end += len(raw)
        if end > byte_offset:
            break
        out.append(token_id)
    return out
