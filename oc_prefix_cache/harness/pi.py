"""pi (``@mariozechner/pi-coding-agent``, OpenAI JS SDK over ``/v1/chat/completions``).

Measured on pi 0.73.1 (shared/captures/pi-0.73.1):

* **Detection**: the OpenAI JS SDK's ``User-Agent: OpenAI/JS <version>`` is shared by many tools,
  so it is not enough alone; pi's system prompt always ends with its footer
  ``\\nCurrent date: YYYY-MM-DD\\nCurrent working directory: <cwd>`` (built last by
  ``dist/core/system-prompt.js``, after any project context or skills). Both together are pi.
* **Head**: the tools, then the system text up to the first of ``\\n\\n# Project Context\\n\\n``,
  ``\\n\\nThe following skills provide specialized instructions`` and ``\\nCurrent date: ``:
  the project instructions, the skills and the date/cwd footer are per project, per user or per
  day. (The three "Pi documentation" paths name the pi install: one install shares one head.)
  ``compat.cacheControlFormat: "anthropic"`` adds ``cache_control`` to the last tool and turns the
  system content into a block list; the template renders neither difference, so the head's key
  leaves ``cache_control`` out of the tools and both configurations share one head.
* **Body**: never changed. pi's bodies are byte-identical across sessions of one project on one
  day, and its turns extend each other as sent.
* **Session**: with ``compat.sendSessionAffinityHeaders: true`` pi sends its session id (a
  UUIDv7 that ``-c`` keeps) as ``x-session-affinity`` and ``session_id``; without them None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import (
    Incoming,
    cut_head,
    first_header,
    session_or_first_exchange,
    system_text,
    unchanged,
)

MARKERS = (
    "\n\n# Project Context\n\n",
    "\n\nThe following skills provide specialized instructions",
    "\nCurrent date: ",
)
FOOTER = re.compile(r"\nCurrent date: \d{4}-\d{2}-\d{2}\nCurrent working directory: [^\n]*\Z")
SESSION_HEADERS = ("x-session-affinity", "session_id")


@dataclass(frozen=True)
class PiAdapter:
    name: str = "pi"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        if incoming.api != "openai" or not incoming.user_agent.startswith("OpenAI/JS "):
            return False
        text = system_text(incoming.body)
        return text is not None and FOOTER.search(text) is not None

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return cut_head(chat, markers=self.markers, tools_view=_without_cache_control)

    def session(self, incoming: Incoming) -> str | None:
        return first_header(incoming, SESSION_HEADERS)

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """Its session headers (``sendSessionAffinityHeaders``), else its system text and first user message
        (shared)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)


def _without_cache_control(tools: list[Any]) -> list[Any]:
    return [{k: v for k, v in t.items() if k != "cache_control"} if isinstance(t, dict) else t for t in tools]
