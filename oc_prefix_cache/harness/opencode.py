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

from oc_prefix_cache.harness.base import Incoming
from oc_prefix_cache.harness.generic import GenericAdapter


@dataclass(frozen=True)
class OpenCodeAdapter(GenericAdapter):
    """The generic marker rule (``OC_PREFIX_CACHE_MARKERS``, ``<env>`` by default: the same rule
    the plugin's path uses) with OpenCode's own session header first; it only differs in whom
    it matches."""

    name: str = "opencode"
    session_headers: tuple[str, ...] = ("x-session-id", "x-session-affinity")

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "openai" and incoming.user_agent.startswith("opencode/")
