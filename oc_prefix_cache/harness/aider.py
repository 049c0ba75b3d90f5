"""Aider (``aider-chat`` on PyPI; litellm and the OpenAI Python SDK, ``--model openai/<name>``) over
chat completions: no body change, a head without tools and a project head through its fixed
messages.

Measured on Aider 0.86.2 (tests/data/aider-0.86.2/README.md says how it was captured). Aider sends
no tools: it asks for edits in a text format (``whole`` for a model it does not know, ``diff`` with
``--edit-format diff``), and its messages are, in this order (``ChatChunks.all_messages``):

1. the system prompt (the edit format's rules; with ``diff``, also the platform block: platform,
   shell, language, **the date**, "inside a git repository"; no path, no project name);
2. the format's example conversation, then "I switched to a new code base..." / "Ok.";
3. read-only files, when any ("Ok, I will use these files as references.");
4. the **repo map**, rebuilt for every message: "Here are summaries of some files present in my
   git repository..." / "Ok, I won't try and edit those files without asking first.": per project
   (its files and their symbols; in a repository whose map does not fit ``--map-tokens`` its ranking
   also follows the file names and identifiers mentioned in the chat);
5. the chat files (their contents, or "Don't try and edit any existing code without asking me..."
   / "Ok, based on your requests I will suggest which files need to be edited...");
6. the conversation (user and assistant turns), the typed text last, with the format's reminder
   (~190 tokens in ``whole``) appended to that user message, after the typed text.

* **Recognised** by its prompt, not its ``User-Agent`` (``OpenAI/Python <v>``, which many clients
  send): the system text opens with an Aider coder's "Act as an expert ..." (or the help coder's
  line), and a later user message is one of Aider's fixed ones (step 2, 3, 4 or 5).
* **Head**: the system text alone (no tools), before ``\\n- Platform`` when the format prints the
  platform block (``diff``: the date is in it), else the whole system text: the same for every
  project of one edit format.
* **Project head**: through the last of Aider's fixed acknowledgements that follow one another
  from the examples on (steps 2-5: examples, read-only files, repo map, chat files), i.e. up to the
  conversation; a new session in the same project and repository state then processes only its
  typed text and the reminder.
* **Session**: none sent: matched by its messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip, earliest_marker, message_text
from oc_prefix_cache.harness.base import Incoming, system_text, unchanged

MARKERS = ("\n- Platform: ", "\n- Platform information unavailable")
OPENERS = ("Act as an expert ", "You are an expert on the AI coding tool called Aider.")
SWITCHED = "I switched to a new code base. Please don't consider the above files or try to edit them any longer."
#: Aider's fixed user messages (base_prompts.py and base_coder.py, 0.86.2), by their start
FIXED_USER = (
    SWITCHED,
    "Here are some READ ONLY files, provided for your reference.",
    "Here are summaries of some files present in my git repository.",
    "I have *added these files to the chat* so you can go ahead and edit them.",
    "I am not sharing any files that you can edit yet.",
    "Don't try and edit any existing code without asking me to add the files to the chat!",
)
#: and the assistant replies that follow them
ACKS = frozenset(
    {
        "Ok.",
        "Ok, I will use these files as references.",
        "Ok, I will use these images as references.",
        "Ok, I won't try and edit those files without asking first.",
        "Ok, any changes I propose will be to those files.",
        (
            "Ok, based on your requests I will suggest which files need to be edited and then stop and wait for "
            "your approval."
        ),
    }
)


@dataclass(frozen=True)
class AiderAdapter:
    name: str = "aider"
    markers: tuple[str, ...] = MARKERS

    def matches(self, incoming: Incoming) -> bool:
        if incoming.api != "openai":
            return False
        text = system_text(incoming.body)
        if not text or not text.startswith(OPENERS):
            return False
        messages = incoming.body.get("messages")
        return isinstance(messages, list) and any(
            isinstance(m, dict) and m.get("role") == "user" and (message_text(m) or "").startswith(FIXED_USER)
            for m in messages[1:]
        )

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return unchanged(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        if chat.get("lora"):
            return Skip("the request sets its own LoRA adapters (a 'lora' field): its KV differs from the head's")
        messages = chat.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return Skip("the body has no 'messages' list of objects")
        if messages[0].get("role") != "system":
            return Skip("the first message is not a system message")
        text = message_text(messages[0])
        if not text or not text.strip():
            return Skip("the system message has no text content")
        found = earliest_marker(text, self.markers)
        system_head, marker = (text[: found[0]].lstrip(), found[1]) if found else (text.strip(), "")
        tools = chat.get("tools")
        tools = tools if isinstance(tools, list) else []
        model = chat.get("model")
        return Head(
            tools_json=json.dumps(tools, ensure_ascii=False, separators=(",", ":")),
            system_head=system_head,
            marker=marker,
            model=model if isinstance(model, str) else "",
            n_tools=len(tools),
            project_tail=fixed_end(messages),
        )

    def session(self, incoming: Incoming) -> str | None:
        return None  # it sends no session id

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """No session id is sent. What separates its sessions: its edit format's rules (the system
        text before the platform block and its date), the project (the files its repo map lists:
        their names, not their symbols, which change with every edit) and the first message the
        person typed, without the edit format's reminder Aider appends to the newest message. Never
        the system prompt and example exchange alone: they are the same in every project, and
        keyed by them every Aider session on a machine was one conversation (issue 36). Shared: two
        sessions in one project that begin with the same words send byte-identical bodies
        (tests/data/aider-0.86.2: A1 and A2). Aider rewrites its history (a turn that edited files
        moves before the chat files, whose contents changed): ``rewrites_history``."""
        messages = chat.get("messages")
        messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        texts = [message_text(m) or "" for m in messages]
        start, end = fixed_block(messages)
        files = sorted(
            {name for text in texts[start : end + 1] if text.startswith(REPO_MAP) for name in repo_files(text)}
        )
        system = texts[0] if messages and messages[0].get("role") == "system" else ""
        found = earliest_marker(system, self.markers)  # the edit format's rules, not the date after them
        rules = system[: found[0]] if found else system
        typed = first_typed(messages, texts, after=end)
        return ConversationKey.content(
            self.name,
            rules,
            *files,
            without_reminder(typed, system),
            source="its edit format, the files of its repo map and its first typed text",
            rewrites_history=True,
        )


REPO_MAP = "Here are summaries of some files present in my git repository."


def repo_files(text: str) -> list[str]:
    """The file names a repo map lists (its lines at the margin after the opening paragraph; a
    file's symbols follow it indented or behind ``│``/``⋮``)."""
    body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
    return [line.rstrip(":") for line in body.splitlines() if line and not line[0].isspace() and line[0] not in "│⋮"]


def first_typed(messages: list[dict[str, Any]], texts: list[str], *, after: int) -> str:
    """The first user message after Aider's fixed block that is none of its fixed messages."""
    for i in range(after + 1 if after else 1, len(messages)):
        if messages[i].get("role") == "user" and not texts[i].startswith(FIXED_USER + UPDATES):
            return texts[i]
    return ""


#: What Aider says after applying edits, before the next typed text (base_coder.py, 0.86.2)
UPDATES = ("I updated the files.", "I committed the changes with git hash", "I added these files to the chat:")


def fixed_block(messages: list[dict[str, Any]]) -> tuple[int, int]:
    """Where Aider's fixed messages start (the "I switched to a new code base" message, else the first
    after the system prompt) and the index of the last of their acknowledgements (0: none)."""
    texts = [message_text(m) or "" for m in messages]
    roles = [m.get("role") for m in messages]
    start = next((i for i, t in enumerate(texts) if roles[i] == "user" and t == SWITCHED), 1)
    at, end = start, 0
    while (
        at + 1 < len(messages)
        and roles[at] == "user"
        and roles[at + 1] == "assistant"
        and texts[at].startswith(FIXED_USER)
        and texts[at + 1] in ACKS
    ):
        end = at + 1
        at += 2
    return start, end


#: A reminder shorter than this is not cut off the typed text (a coincidence, not the format's rules).
MIN_REMINDER_CHARS = 32


def without_reminder(typed: str, system: str) -> str:
    """The typed text without the edit format's reminder Aider appends to the newest user message
    (``"\n\n"`` and the format's reminder, which its system prompt also holds), so the first
    message keys the same on the first turn, which carries it, and on later ones, which do not."""
    at = typed.find("\n\n")
    while at >= 0:
        rest = typed[at + 2 :]
        if len(rest) >= MIN_REMINDER_CHARS and rest in system:
            return typed[:at]
        at = typed.find("\n\n", at + 1)
    return typed


def fixed_end(messages: list[dict[str, Any]]) -> str:
    """The text of the last of Aider's fixed acknowledgements that follow the system message pair by
    pair (the examples count as one block, ended by "I switched to a new code base"), when a user
    message follows it ("" when there is none)."""
    texts = [message_text(m) or "" for m in messages]
    roles = [m.get("role") for m in messages]
    at = 1
    switched = next((i for i, t in enumerate(texts) if roles[i] == "user" and t == SWITCHED), None)
    if switched is not None:
        at = switched
    end = 0
    while (
        at + 1 < len(messages) - 1
        and roles[at] == "user"
        and roles[at + 1] == "assistant"
        and texts[at].startswith(FIXED_USER)
        and texts[at + 1] in ACKS
    ):
        end = at + 1
        at += 2
    return texts[end] if end and roles[-1] == "user" else ""
