"""OpenHands CLI (``openhands`` on PyPI: the software-agent SDK's agent, litellm and the OpenAI Python
SDK) over chat completions: no body change, a head before the context it appends, no project head.

Measured on OpenHands 1.16.0 (SDK 1.21.0; tests/data/openhands-1.16.0/README.md says how it was
captured). Its ``User-Agent`` is the OpenAI Python SDK's (``OpenAI/Python <v>``, which many clients
send), so a request is OpenHands' when its system text opens with one of the SDK's agent prompts.
The system message is two text parts: the agent's prompt (~13.7k characters: the same for every
project of one install and model family), then the context the SDK appends
(``system_message_suffix.j2``), in this order: ``<CURRENT_DATETIME>`` (the local time **to the
microsecond**, new for every conversation), ``<REPO_CONTEXT>`` (the project's AGENTS.md and other
repository skills), ``<SKILLS>`` (the public and user skills), the CLI's own suffix (the working
directory, the operating system), ``<CUSTOM_SECRETS>``. The first user message is the typed text.

* **Head**: the tools, then the system text before the first of those context parts (the whole
  system text when there is none). The tools are per project: ``file_editor``'s description ends
  with the working directory, so one project's sessions share a head, another project has its own.
* **Project head**: none when the time of day opens the context (``Head.project``): everything after
  the head differs per conversation, so a project head would be saved for every session and read by
  none. A new session in a project processes the context part and its typed text (~100 tokens
  without an AGENTS.md).
* **Session**: ``prompt_cache_key``, the conversation id, for the main agent, whose tools hold the
  ``task`` tool. A subagent (``task``) shares its parent's LLM and so its ``prompt_cache_key``; it has
  no ``task`` tool and its own system suffix (the agent type's prompt after the time): it gets no
  session (matched by its messages), so it is not taken for its parent's conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, cut_head, session_or_first_exchange, system_text, unchanged

#: the parts of system_message_suffix.j2 in their order, then the CLI's suffix: the earliest ends the head
TIME = "<CURRENT_DATETIME>"
MARKERS = (TIME, "<REPO_CONTEXT>", "<SKILLS>", "Your current working directory is: ", "<CUSTOM_SECRETS>")
#: the SDK's agent prompts (system_prompt*.j2 open with the first; the planning agent's with the second)
OPENERS = ("You are OpenHands agent, a helpful AI assistant", "You are a Planning Agent that analyzes codebases")
DELEGATE = "task"  # the main agent's tool that starts a subagent


@dataclass(frozen=True)
class OpenHandsAdapter:
    name: str = "openhands"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        if incoming.api != "openai":
            return False
        text = system_text(incoming.body)
        return bool(text) and str(text).lstrip().startswith(OPENERS)

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        head = cut_head(chat, markers=self.markers, whole_without_marker=True)
        if isinstance(head, Skip) or head.marker != TIME:
            return head
        return replace(head, project=False)  # the time to the microsecond follows the head

    def session(self, incoming: Incoming) -> str | None:
        key = incoming.body.get("prompt_cache_key")
        if not isinstance(key, str) or not key.strip() or DELEGATE not in tool_names(incoming.body):
            return None  # a subagent (its parent's key) or no key: matched by its messages
        return key.strip()

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """The main agent's ``prompt_cache_key`` (the conversation id); a subagent (its parent's key) by its
        own system text and first user message (the task its parent gave it), shared."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)


def tool_names(body: dict[str, Any]) -> frozenset[str]:
    tools = body.get("tools")
    names = set()
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)
