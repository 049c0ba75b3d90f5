"""OpenCode (``opencode/<version>`` over ``/v1/chat/completions``): today's rules, unchanged.

* Head: the tools, then the system text up to ``<env>``. OpenCode puts the working directory and
  today's date in its ``<env>`` block; everything before it is the same in every project, and the
  Qwen3.5 template renders the tools first, so the two form one token prefix.
* Body: never changed. The OpenCode plugin forwards the exact bytes it was given, and the proxy
  must be able to do the same, so this adapter has nothing to normalise.
* Session: ``x-session-id``. A subagent (``task`` tool) is its own session with its own id and
  carries ``x-parent-session-id``; it is a separate conversation, so the parent id is not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..head import Head, Skip
from .base import Incoming, first_header, head_by_markers, unchanged

MARKERS = ("<env>",)
SESSION_HEADERS = ("x-session-id", "x-session-affinity")


@dataclass(frozen=True)
class OpenCodeAdapter:
    name: str = "opencode"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "openai" and incoming.user_agent.startswith("opencode/")

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return head_by_markers(chat, self.markers)

    def session(self, incoming: Incoming) -> str | None:
        return first_header(incoming, SESSION_HEADERS)
