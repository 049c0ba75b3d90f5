"""Qwen Code (``QwenCode/<version>`` over chat completions): no body change, a head and a project head.

Measured on Qwen Code 0.24.4 (``@qwen-code/qwen-code`` on npm; docs/harnesses.md says how it was
captured). Its system prompt (~25k characters in ``-p`` mode) is the same for every project up to
the first context file it includes (``--- Context from: <path relative to the project> ---``, e.g.
its output-language file); the memory section that follows names the project's memory folder.
The first user message opens with four ``<system-reminder>`` parts (the skills, the session
context with the date and the project's file tree, the deferred tools, the date again), then the
typed text. Qwen Code sends no session header: its conversations are matched by their messages.

* **Head**: the tools, then the system text before ``\\n\\n---\\n\\n--- Context from: `` (or, without a
  context file, before ``\\n\\n---\\n\\n# auto memory``).
* **Project head**: through the last leading reminder of the first user message (the same for a
  project all day), so a new session in it processes only its typed text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, cut_head, leading_reminders_end, session_or_first_exchange, unchanged

MARKERS = ("\n\n---\n\n--- Context from: ", "\n\n---\n\n# auto memory")


@dataclass(frozen=True)
class QwenCodeAdapter:
    name: str = "qwen-code"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "openai" and incoming.user_agent.startswith("QwenCode/")

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        head = cut_head(chat, markers=self.markers)
        if isinstance(head, Skip):
            return head
        tail = leading_reminders_end(chat)
        return replace(head, project_tail=tail) if tail else head

    def session(self, incoming: Incoming) -> str | None:
        return None  # no session header: matched by its messages

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """No session id is sent: its system text (the project's context files and memory folder) and the
        first user message (the session-context reminders with the file tree and the date, then the typed
        text), shared: two sessions of one project that begin with the same words send byte-identical
        bodies (tests/data/qwen-code-0.24.4: A1 and A2)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)
