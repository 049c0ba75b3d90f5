"""What every harness adapter is, and the few pieces they share: pure functions, no I/O.

The proxy sees requests from agents it cannot change. Each agent (harness) has its own idea of
where the stable part of its prompt ends, what in its body varies for no reason, and how it names
a conversation; an adapter holds exactly that knowledge for one harness, so the prepare core can
stay harness-blind. Adapters never touch the network and never mutate what they are given.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import ChatBody, Head, Skip, earliest_marker, extract_head, message_text

SYSTEM_ROLES = ("system", "developer")  # llama.cpp maps "developer" to "system" before rendering


@dataclass(frozen=True)
class Incoming:
    """What the proxy knows about a request before preparing it."""

    api: str  # "openai" (/v1/chat/completions) | "anthropic" (/v1/messages)
    headers: Mapping[str, str]  # lower-cased names
    body: dict[str, Any]  # the parsed request body, in its own API's format

    def header(self, name: str) -> str | None:
        """A header's value, or None when it is missing or blank."""
        value = self.headers.get(name.lower())
        return value.strip() if isinstance(value, str) and value.strip() else None

    @property
    def user_agent(self) -> str:
        return self.header("user-agent") or ""


@runtime_checkable
class Adapter(Protocol):
    @property
    def name(self) -> str:
        """ "opencode" | "claude-code" | "pi" | "generic" (read-only, so frozen adapters fit)."""
        ...

    def matches(self, incoming: Incoming) -> bool: ...

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        """The body to forward (same API format) and the names of the changes made; () and the
        very same object when nothing changed (the proxy then forwards the original bytes)."""
        ...

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        """The stable head of an OpenAI chat body (for Anthropic: after ``anthropic.to_chat`` of
        the normalised body)."""
        ...

    def session(self, incoming: Incoming) -> str | None:
        """The conversation's session id, when the harness sends one (None: it sends none)."""
        ...

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """The conversation's key: its session id where the harness sends one, else what really
        separates the harness's sessions (its project text and the first message the person
        typed; never a canned example), shared (``ConversationKey``). ``chat``: the body as chat
        completions."""
        ...


def unchanged(incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``normalise`` for an adapter that changes nothing: the very same object."""
    return incoming.body, ()


def head_by_markers(chat: dict[str, Any], markers: tuple[str, ...]) -> Head | Skip:
    """chat/head.py's rule as it is today (OpenCode's): tools + first system text before a marker."""
    messages = chat.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return Skip("the body has no 'messages' list of objects")
    return extract_head(ChatBody(data=chat, messages=messages), markers)


def cut_head(
    chat: dict[str, Any],
    *,
    markers: tuple[str, ...],
    include_marker: bool = False,
    whole_without_marker: bool = False,
    tools_view: Callable[[list[Any]], list[Any]] | None = None,
) -> Head | Skip:
    """A head by the harness's own rule, where chat/head.py's fixed rule does not fit.

    ``include_marker`` keeps the marker text in the head (Claude Code: the marker is static and the
    volatile path follows it). ``whole_without_marker`` takes the whole system text when no marker
    is there (a prompt with no volatile part, such as a Claude Code subagent's), stripped as the
    templates strip it. ``tools_view`` maps the tools to what the key should see (only fields the
    template does not render may be dropped). Leading whitespace is left out: templates trim it,
    and the head is found in the rendered prompt by its text either way.
    """
    if chat.get("lora"):
        return Skip("the request sets its own LoRA adapters (a 'lora' field): its KV differs from the head's")
    tools = chat.get("tools")
    if not isinstance(tools, list) or not tools:
        return Skip("no tools in the request (a title or utility request)")
    messages = chat.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if not isinstance(first, dict) or first.get("role") not in SYSTEM_ROLES:
        return Skip("the first message is not a system message")
    text = message_text(first)
    if not text:
        return Skip("the system message has no text content")
    found = earliest_marker(text, markers)
    if found is None and not whole_without_marker:
        return Skip(f"no volatile marker ({', '.join(markers)}) in the system message")
    if found is None:
        system_head, marker = text.strip(), ""
    elif include_marker:
        system_head, marker = text[: found[0] + len(found[1])].lstrip(), ""
    else:
        system_head, marker = text[: found[0]].lstrip(), found[1]
    shown = tools_view(tools) if tools_view else tools
    model = chat.get("model")
    return Head(
        tools_json=json.dumps(shown, ensure_ascii=False, separators=(",", ":")),
        system_head=system_head,
        marker=marker,
        model=model if isinstance(model, str) else "",
        n_tools=len(tools),
    )


def first_header(incoming: Incoming, names: Iterable[str]) -> str | None:
    return next((value for value in (incoming.header(name) for name in names) if value), None)


def system_text(body: dict[str, Any]) -> str | None:
    """The first message's text when it is a system (or developer) message, in a chat body."""
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, dict) and first.get("role") in SYSTEM_ROLES:
        return message_text(first)
    return None


REMINDER = "<system-reminder>"


def leading_reminders_end(chat: dict[str, Any]) -> str:
    """The last of the first user message's leading ``<system-reminder>`` parts, when that message
    follows the system message and typed text follows the reminders ("" otherwise). Claude Code
    and Qwen Code open a session's first message with reminders that are the same for a project
    (and day) and put the typed text last: a project head can end there."""
    reminders = leading_reminders(chat)
    return reminders[-1] if reminders else ""


def leading_reminders(chat: dict[str, Any]) -> list[str]:
    """The first user message's leading ``<system-reminder>`` parts, in order, when that message
    follows the system message and typed text follows them ([] otherwise)."""
    messages = chat.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return []
    first = messages[1]
    parts = first.get("content") if isinstance(first, dict) and first.get("role") == "user" else None
    if not isinstance(parts, list):
        return []
    texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in parts]
    leading = 0
    while leading < len(texts) and isinstance(texts[leading], str) and str(texts[leading]).startswith(REMINDER):
        leading += 1
    return [str(t) for t in texts[:leading]] if 0 < leading < len(texts) else []


def first_user_text(chat: dict[str, Any]) -> str | None:
    """The first user message as the agent wrote it (its content as canonical JSON: parts and
    all), or None when there is none."""
    messages = chat.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and message.get("role") == "user":
            return json.dumps(message.get("content"), ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return None


def session_or_first_exchange(harness: str, session: str | None, chat: dict[str, Any]) -> ConversationKey:
    """The key of a harness whose sessions are told apart by a session id when it sends one, else
    by its system text (where the project, its context files and often the date are) and the first
    user message (where the person's typed text is): the two messages every later turn re-sends
    as they were. Shared: two sessions of one project that began with the same words have the same."""
    if session:
        return ConversationKey.session(session)
    typed = first_user_text(chat)
    if typed is None:
        return ConversationKey(name="", shared=True, source="no user message")
    return ConversationKey.content(
        harness, system_text(chat) or "", typed, source="its system text and first user message (no session id sent)"
    )
