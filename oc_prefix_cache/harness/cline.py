"""Cline CLI (``cline`` on npm, a Bun binary using the AI SDK's OpenAI-compatible provider) over chat
completions: no body change, a head before ``<env>``.

Measured on Cline CLI 3.0.65 (tests/data/cline-3.0.65/README.md says how it was captured). Its
``User-Agent`` is the AI SDK's (``ai-sdk/openai-compatible/<v> ai-sdk/provider-utils/<v>
runtime/bun/<v>``), which other AI-SDK agents share, so a request is Cline's when its system prompt
also opens with ``You are Cline, an AI coding agent.``. The system prompt (~4.3k characters, 25
tools) is the same for every project up to ``<env>``; the environment block that follows names the
platform, the date and the working directory, then static rules follow. The first user message is
the typed text alone.

* **Head**: the tools, then the system text before ``<env>`` (the generic rule, kept here so that
  Cline's head does not depend on the operator's generic markers).
* **Project head**: the rest of the system text (the planner's default): the same for a project
  all day, so a new session in it processes only its typed text.
* **Session**: Cline sends no session header: its conversations are matched by their messages.
  A ``spawn_agent`` subagent runs with the system prompt the model wrote (no Cline text, 7 tools),
  so it is not recognised here and passes without a head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, cut_head, session_or_first_exchange, system_text, unchanged

MARKERS = ("<env>",)
PROMPT_START = "You are Cline, an AI coding agent."


@dataclass(frozen=True)
class ClineAdapter:
    name: str = "cline"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        if incoming.api != "openai" or not incoming.user_agent.startswith("ai-sdk/"):
            return False
        text = system_text(incoming.body)
        return bool(text) and str(text).lstrip().startswith(PROMPT_START)

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return cut_head(chat, markers=self.markers)

    def session(self, incoming: Incoming) -> str | None:
        return None  # no session header: matched by its messages

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """No session id is sent: its system text (the project's environment block, the day) and the first
        user message (the typed task), shared: two sessions of one project that begin with the same task
        send byte-identical bodies (tests/data/cline-3.0.65: A1 and A2)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)
