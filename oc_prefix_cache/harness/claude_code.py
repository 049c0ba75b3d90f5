"""Claude Code (``claude-cli/<version>`` over ``/v1/messages``): four normalisations and a cut in two levels.

Measured on Claude Code 2.1.332 (shared/captures/claude-code-2.1.332*), against llama-server b11434:

* **Head**: the tools, then the system text up to and including
  ``You have a persistent file-based memory at ` ``. The per-project memory path follows that
  marker and is the only per-project or per-user byte in the system prompt, so everything before
  it is shared by every session of one Claude Code version and mode. A system prompt without the
  marker (a subagent's, or ``--exclude-dynamic-system-prompt-sections``) has no per-project part:
  the whole system text is the head.
* **Body changes** (each named in the returned change list):

  - ``drop-billing-header``: the system block ``x-anthropic-billing-header: cc_version=<v>.<fp>;
    cc_entrypoint=...;`` is dropped. ``<fp>`` is a hash of characters of the conversation's first
    prompt, so it differs between sessions and would end the shared prefix 47 characters into
    the system prompt. It is billing metadata, not an instruction; Claude Code itself drops it
    with ``CLAUDE_CODE_ATTRIBUTION_HEADER=0`` (the normalised body then equals that run's).
    llama-server's own fix only rewrites a ``cch=`` field, which 2.1.332 does not send.
  - ``system-entries-as-user``: Claude Code puts ``role: "system"`` entries inside ``messages``
    (its environment block after the first prompt; agent lists later). llama-server passes them
    through and the Qwen3.5 template refuses any system message after the first (HTTP 500 "System
    message must be at the beginning"). Each becomes a user message with the same text, **in
    place**: hoisting it into the system prompt would put per-project text before the head and
    rewrite history every turn. Its content becomes one plain string whether it arrived as a
    block list (turn 1, with ``cache_control``) or as a string (later turns), so a turn renders as
    a strict extension of the one before.
  - ``strip-cache-control``: ``cache_control`` markers are removed from message blocks. Claude Code
    moves its breakpoint to the newest block every turn; llama-server ignores the field, so it
    changes nothing rendered, but without it each earlier message stays byte-identical across
    turns and message digests extend.
  - ``environment-to-system``: the main agent's ``# Environment`` entry (working directory,
    platform, model, deferred tools, agent types, skills, the date: ~2,100 tokens, the same for a
    project all day) follows the first user message, i.e. the typed text, so every new session
    processed it again. It moves to the end of the system text (only that entry, on every turn
    alike, so turns still extend each other; later system entries stay in place; a subagent's
    prompt, which has no memory marker, is left alone, so its head takes in nothing per project).
* **Project head**: everything before the typed text that is the same for a project: the head, the
  rest of the system text, then the first user message's leading ``<system-reminder>`` blocks. It
  ends after the last of those (``Head.project_tail``), so a new session in the project processes
  only what it typed, once nothing moved. As ``ocpc install --harness claude-code`` sets Claude
  Code up (``CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system,-per_turn_effort``: no system entries
  inside messages), those reminders hold the environment, model, deferred tools, agent types and
  skills, then the git status, the date and the commit attribution; without that setting only the
  git status and the attribution, with the environment as a system turn after the typed text.
* **Two levels**: the git status changes with every commit, and the date every day. So a shorter
  project head (``Head.project_base``) ends before the first of them: after the reminder before
  the git status, or at the end of the system text when the git status comes first. After a
  commit a new session restores that level and processes only the git status, the date, the
  attribution and its typed text, instead of the whole environment from the head.
* **Session**: ``x-claude-code-session-id`` (or the ``session_id`` inside ``metadata.user_id``),
  plus ``:<x-claude-code-agent-id>`` for a subagent. Subagents keep the main session id and, by
  default, run in the background at the same time as the main agent: they are separate
  conversations and must not share its slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from oc_prefix_cache.chat.anthropic import BILLING_PREFIX
from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Incoming, cut_head, leading_reminders, session_or_first_exchange

MEMORY_MARKER = "You have a persistent file-based memory at `"
ENVIRONMENT = "# Environment\n"
GIT_STATUS = "\n# gitStatus\n"
DATE_REMINDER = "<system-reminder>\nToday's date is "


@dataclass(frozen=True)
class ClaudeCodeAdapter:
    name: str = "claude-code"
    markers: tuple[str, ...] = (MEMORY_MARKER,)
    off: frozenset[str] = field(default_factory=frozenset)  # normalisations switched off, by name

    def matches(self, incoming: Incoming) -> bool:
        return incoming.api == "anthropic" and incoming.user_agent.startswith("claude-cli/")

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        body = incoming.body
        changes: list[str] = []
        system = body.get("system")
        if isinstance(system, list) and "drop-billing-header" not in self.off:
            kept = [block for block in system if not _is_billing_block(block)]
            if len(kept) != len(system):
                body = {**body, "system": kept}
                changes.append("drop-billing-header")
        if "environment-to-system" not in self.off:
            moved = _environment_to_system(body)
            if moved is not None:
                body = moved
                changes.append("environment-to-system")
        messages = body.get("messages")
        if isinstance(messages, list):
            normalised, message_changes = _normalise_messages(messages, off=self.off)
            if message_changes:
                body = {**body, "messages": normalised}
                changes.extend(message_changes)
        return (body, tuple(changes)) if changes else (incoming.body, ())

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        head = cut_head(chat, markers=self.markers, include_marker=True, whole_without_marker=True)
        if isinstance(head, Skip):
            return head
        tail, base = project_levels(chat)
        return replace(head, project_tail=tail, project_base=base) if tail else head

    def session(self, incoming: Incoming) -> str | None:
        session = incoming.header("x-claude-code-session-id") or _metadata_session(incoming.body)
        if session is None:
            return None
        agent = incoming.header("x-claude-code-agent-id")
        return f"{session}:{agent}" if agent else session

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        """``x-claude-code-session-id`` (or the body's metadata), with the subagent's id; without them its
        system text and first user message (shared)."""
        return session_or_first_exchange(self.name, self.session(incoming), chat)


def _normalise_messages(messages: list[Any], *, off: frozenset[str]) -> tuple[list[Any], list[str]]:
    changes: list[str] = []
    if any(_role(m) == "system" for m in messages) and "system-entries-as-user" not in off:
        messages = [_system_as_user(m) if _role(m) == "system" else m for m in messages]
        changes.append("system-entries-as-user")
    if "strip-cache-control" in off:
        return messages, changes
    stripped = [_without_cache_control(m) for m in messages]
    if any(new is not old for new, old in zip(stripped, messages, strict=False)):
        changes.append("strip-cache-control")
    return stripped, changes


def _environment_to_system(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body with the main agent's environment entry (right after the first user message)
    moved to the end of its system text; None when there is none to move (a subagent, a body
    of another shape)."""
    system, messages = body.get("system"), body.get("messages")
    if not isinstance(messages, list) or len(messages) < 2 or _role(messages[0]) != "user":
        return None
    if _role(messages[1]) != "system" or not _system_text(system).count(MEMORY_MARKER):
        return None
    text = _plain_text(messages[1].get("content"))
    if text is None or not text.startswith(ENVIRONMENT):
        return None
    moved = {"type": "text", "text": "\n\n" + text}
    if isinstance(system, list):
        new_system: Any = [*system, moved]
    else:
        new_system = f"{system}\n\n{text}"
    return {**body, "system": new_system, "messages": [messages[0], *messages[2:]]}


def project_levels(chat: dict[str, Any]) -> tuple[str, str]:
    """Where the project head ends (the last leading reminder of the first user message) and where
    its shorter level ends (the reminder before the first one that changes within a project: the
    git status or the date; the whole system text when that comes first): ("", "") when the first
    message has no leading reminders, (tail, "") when none of them changes."""
    reminders = leading_reminders(chat)
    if not reminders:
        return "", ""
    moving = next((i for i, text in enumerate(reminders) if _moves(text)), None)
    if moving is None:
        return reminders[-1], ""
    if moving > 0:
        return reminders[-1], reminders[moving - 1]
    messages = chat.get("messages")
    system = (
        _plain_text(messages[0].get("content"))
        if isinstance(messages, list) and isinstance(messages[0], dict)
        else None
    )
    return reminders[-1], system or ""


def _moves(reminder: str) -> bool:
    """A reminder that changes within a project: the git status (each commit), the date (each day)."""
    return GIT_STATUS in reminder or reminder.startswith(DATE_REMINDER)


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(b["text"] for b in system if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def _plain_text(content: Any) -> str | None:
    """A message's content as one string, when it is all text (a string or text blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    return None


def _role(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else None
    return role if isinstance(role, str) else None


def _is_billing_block(block: Any) -> bool:
    text = block.get("text") if isinstance(block, dict) else None
    return isinstance(text, str) and text.startswith(BILLING_PREFIX)


def _system_as_user(message: dict[str, Any]) -> dict[str, Any]:
    """A system entry as a user message: one string when it is all text, else its blocks."""
    content = message.get("content")
    text = _plain_text(content) if isinstance(content, list) else None
    return {"role": "user", "content": content if text is None else text}


def _without_cache_control(message: Any) -> Any:
    """The message without ``cache_control`` in its blocks; the same object when it has none."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list) or not any(isinstance(b, dict) and "cache_control" in b for b in content):
        return message
    blocks = [{k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b for b in content]
    return {**message, "content": blocks}


def _metadata_session(body: dict[str, Any]) -> str | None:
    """``metadata.user_id`` is a JSON string holding ``device_id``, ``account_uuid``, ``session_id``."""
    metadata = body.get("metadata")
    raw = metadata.get("user_id") if isinstance(metadata, dict) else None
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    return session if isinstance(session, str) and session else None
