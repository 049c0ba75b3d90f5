"""Codex CLI (``codex_exec/<version>``, ``codex_cli_rs/<version>`` over ``/v1/responses``): no body
change, a head and a project head.

Measured on Codex CLI 0.171.0 (``@openai/codex`` on npm; tests/data/codex-0.171.0/README.md says
how it was captured). Its Responses body has no ``instructions``; its ``input`` starts with two
``developer`` messages (the base prompt, ~17k characters; then the skills list and the sandbox and
approval rules), then a ``user`` message holding ``<environment_context>`` (working directory,
shell, the date, the time zone, workspace roots), then the typed text. As chat (``chat/responses.py``,
the server's own conversion) that is two system messages, the environment and the prompt.

* **Head**: the tools and the developer text (merged, below): base prompt, skills, sandbox rules,
  the same for one install and mode; it names no project.
* **Project head**: up to the end of the ``<environment_context>`` message (``project_tail``): the
  same for a project all day, so a new session in it processes only its typed text.
* **Session**: the ``thread-id`` header (a subagent runs on its own thread), else ``session-id``,
  else the body's ``prompt_cache_key``.
* **Body**: one change, ``merge-developer-messages``: the second leading ``developer`` message is
  merged into the first (its parts appended after a blank line). Unchanged, b11434 answers HTTP 500
  on the Qwen3.5 template ("System message must be at the beginning"), since each developer
  message becomes a system message. Otherwise the body goes as it came (the proxy adds only
  ``id_slot``, which b11434 keeps).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import SYSTEM_ROLES, Incoming, cut_head, session_or_first_exchange, unchanged

ENVIRONMENT = "<environment_context>"


@dataclass(frozen=True)
class CodexAdapter:
    name: str = "codex"
    off: frozenset[str] = field(default_factory=frozenset)  # normalisations switched off, by name

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "responses" and incoming.user_agent.startswith(("codex_", "codex-"))

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        if "merge-developer-messages" in self.off:
            return unchanged(incoming)
        merged = _merge_developer_messages(incoming.body)
        return (merged, ("merge-developer-messages",)) if merged is not None else unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        head = cut_head(chat, markers=(), whole_without_marker=True)
        if isinstance(head, Skip):
            return head
        tail = _environment(chat)
        return replace(head, project_tail=tail) if tail else head

    def session(self, incoming: Incoming) -> str | None:
        key = incoming.body.get("prompt_cache_key")
        return (
            incoming.header("thread-id")
            or incoming.header("session-id")
            or (key if isinstance(key, str) and key else None)
        )

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """``thread-id`` (or ``session-id``, or the body's ``prompt_cache_key``), always sent; without them
        its instructions and first user message (shared)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)


def _environment(chat: dict[str, Any]) -> str:
    """The text of the ``<environment_context>`` message that follows the developer messages, when
    the typed text follows it ("" otherwise)."""
    messages = chat.get("messages")
    if not isinstance(messages, list):
        return ""
    at = next(
        (i for i, m in enumerate(messages) if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)),
        len(messages),
    )
    if at == 0 or at + 1 >= len(messages) or messages[at].get("role") != "user":
        return ""
    parts = messages[at].get("content")
    if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
        return ""
    text = parts[0].get("text")
    return text if isinstance(text, str) and text.startswith(ENVIRONMENT) else ""


def _merge_developer_messages(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body with its leading ``developer`` messages merged into the first (None: fewer than two)."""
    items = body.get("input")
    if not isinstance(items, list):
        return None
    lead = 0
    while lead < len(items) and _developer_parts(items[lead]) is not None:
        lead += 1
    if lead < 2:
        return None
    parts: list[Any] = list(_developer_parts(items[0]) or [])
    for item in items[1:lead]:
        parts += [{"type": "input_text", "text": "\n\n"}, *(_developer_parts(item) or [])]
    return {**body, "input": [{**items[0], "content": parts}, *items[lead:]]}


def _developer_parts(item: Any) -> list[Any] | None:
    """A developer message's content parts, all text (None: not such a message)."""
    if not isinstance(item, dict) or item.get("role") != "developer" or item.get("type", "message") != "message":
        return None
    content = item.get("content")
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in content):
        return content
    return None
