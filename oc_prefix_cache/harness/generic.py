"""Any other agent: OpenCode's rules with configurable markers, and no body changes at all.

Most agents (Codex, Aider, Crush, Qwen Code...) only take a base URL. Without knowing their
prompts we can still cache a head when the operator names the marker where the volatile part of
the system prompt starts (``OC_PREFIX_CACHE_MARKERS``); without a marker in the prompt the
request simply passes (``Skip``). The session comes from the common affinity headers when an
agent sends them. This adapter is the fallback of ``select``: it never changes a byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, first_header, head_by_markers, session_or_first_exchange, unchanged


@dataclass(frozen=True)
class GenericAdapter:
    markers: tuple[str, ...] = ("<env>",)
    name: str = "generic"
    session_headers: tuple[str, ...] = ("x-session-affinity", "x-session-id")

    def matches(self, incoming: Incoming) -> bool:
        return True

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return head_by_markers(chat, self.markers)

    def session(self, incoming: Incoming) -> str | None:
        return first_header(incoming, self.session_headers)

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """Its session header, else its system text and first user message (shared)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)
