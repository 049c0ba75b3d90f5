"""Kilo Code CLI (``Kilo-Code/<version>`` over ``/v1/chat/completions``): no body change, OpenCode's cut.

Measured on Kilo Code CLI 7.7.9 (``@kilocode/cli-linux-x64`` on npm, the binary that ``@kilocode/cli``
installs; tests/data/kilo-code-7.7.9/README.md says how it was captured). Kilo is a fork of OpenCode
and its system prompt (~13.6k characters) has the same shape: the base prompt, then an ``<env>``
block (git repo or not, platform, today's date, the global config folder), then the board and skills
text, with a project's ``AGENTS.md`` inserted after ``<env>`` (``Instructions from: <its absolute
path>``). Everything a session varies is in the first user message, *after* the typed text: an
``<environment_details>`` part with the message time to the second and the working directory.

* **Head**: the tools, then the system text before ``<env>`` (the same for every project).
* **Project head**: the whole system text (its default: the same for a project all day); the
  environment part follows the typed text and names the second, so it cannot be cached ahead.
* **Session**: ``x-session-id`` (``x-session-affinity`` carries the same id). A subagent (the
  ``task`` tool) has its own id and an ``x-parent-session-id``; its system text is the main agent's
  but it has two tools fewer (no ``task``, ``todowrite``), so it gets its own head. The title
  request (``title-<session id>``) has no tools: no head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, cut_head, first_header, session_or_first_exchange, unchanged

MARKERS = ("<env>",)


@dataclass(frozen=True)
class KiloCodeAdapter:
    name: str = "kilo-code"
    markers: tuple[str, ...] = MARKERS
    session_headers: tuple[str, ...] = ("x-session-id", "x-session-affinity")

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "openai" and incoming.user_agent.startswith("Kilo-Code/")

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return cut_head(chat, markers=self.markers)

    def session(self, incoming: Incoming) -> str | None:
        return first_header(incoming, self.session_headers)

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """``x-session-id``, always sent; without it its system text and first user message (shared)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)
