"""OpenCode-shaped multi-conversation traffic, built from the real captures.

A parent conversation grows by tool results (~1.6k tokens each); subagents run with fewer
tools (OpenCode's `general` agent: the same system prompt, `task` and `todowrite`
removed) or another prompt as well (`explore`: a file-search prompt); another project's
session starts; the parent comes back between them. Shared by the rig tests and
bench/sessions_bench.py. Bodies are OpenAI chat-completions bodies, as OpenCode sends
them (before the plugin), with OpenCode's headers.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CAPTURES = Path(__file__).parent / "data"
PARENT_FIRST = CAPTURES / "opencode-1.18.33" / "02_projA_turn1_main_request.json"
OTHER_PROJECT_FIRST = CAPTURES / "opencode-1.18.33" / "03_projB_turn1_main_request.json"
UA = "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"
EXPLORE_PROMPT = (
    "You are a file search specialist. You excel at thoroughly navigating and exploring "
    "codebases. Use glob and grep to find files, read to inspect them, and report what you found.\n\n"
)


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def tool_result(turn: int, *, lines: int = 45) -> str:
    """About 1.6k tokens of code-like text, different for every turn."""
    out = [f"# src/module_{turn}.py (read by the agent, turn {turn})"]
    for i in range(lines):
        out.append(f"def handler_{turn}_{i}(request, limit={i % 17}):  # line {i}")
        out.append(f"    return process(request.items[:limit], key='k{(turn * 31 + i) % 97}')")
    return "\n".join(out)


@dataclass
class Conversation:
    """One conversation: its session id and its growing body."""

    session: str
    body: dict[str, Any]
    parent: str = ""  # x-parent-session-id for subagents
    turns: int = 0
    sent: list[int] = field(default_factory=list)  # sizes of the bodies sent
    lines: int = 45  # of each tool result (45: ~1.6k tokens)

    def next_body(self) -> dict[str, Any]:
        """The body of this conversation's next request (the first, or one more tool round)."""
        if self.turns > 0:
            n = self.turns
            self.body["messages"] += [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call_{self.session}_{n}",
                            "type": "function",
                            "function": {
                                "name": "read",
                                "arguments": json.dumps({"filePath": f"/home/dev/src/module_{n}.py"}),
                            },
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": f"call_{self.session}_{n}",
                    "content": tool_result(n, lines=self.lines),
                },
            ]
        self.turns += 1
        return copy.deepcopy(self.body)

    def headers(self) -> dict[str, str]:
        out = {
            "User-Agent": UA,
            "x-session-id": self.session,
            "x-session-affinity": self.session,
            "Content-Type": "application/json",
        }
        if self.parent:
            out["x-parent-session-id"] = self.parent
        return out


def shorten_system(body: dict[str, Any], keep: tuple[int, int]) -> None:
    """Cut the middle out of every system text of a chat-completions or Anthropic body: its first
    and last ``keep`` characters stay, so the stable head stays a head and what the harnesses
    put last (OpenCode's <env>, pi's date and directory) stays last. The ``system`` field's
    blocks and the system-role messages (Claude Code sends one too) are cut alike."""
    first, last = keep

    def text(value: str) -> str:
        return value if len(value) <= first + last + 1 else value[:first] + "\n" + value[-last:]

    def cut(content: Any) -> Any:
        if isinstance(content, str):
            return text(content)
        if isinstance(content, list):
            return [
                {**part, "text": text(part["text"])} if isinstance(part, dict) and "text" in part else part
                for part in content
            ]
        return content

    if "system" in body:
        body["system"] = cut(body["system"])
    for message in body.get("messages", []):
        if message.get("role") == "system":
            message["content"] = cut(message["content"])


#: What `shortened` keeps of the system text: on Gemma the head stays 823 tokens (of 1,888), past its
#: 512-token sliding window, so what the window does to a restore is still tested.
SHORT_KEEP = (3600, 1500)


def shortened(conv: Conversation, *, keep: tuple[int, int] = SHORT_KEEP, lines: int = 12) -> Conversation:
    """``conv`` CI-sized for a model this machine prefills slowly (the real Gemma, ~100 tokens/s):
    the middle of its system text cut out (``shorten_system``) and tool results of ``lines``
    lines (12: ~450 tokens)."""
    shorten_system(conv.body, keep)
    conv.lines = lines
    return conv


def parent(session: str = "ses_parent") -> Conversation:
    return Conversation(session, _load(PARENT_FIRST))


def other_project(session: str = "ses_projB") -> Conversation:
    return Conversation(session, _load(OTHER_PROJECT_FIRST))


def general_subagent(
    session: str, *, parent_session: str = "ses_parent", task: str = "find where refunds are computed"
) -> Conversation:
    """OpenCode's `general` subagent: the parent's system prompt, tools minus task and todowrite."""
    body = _load(PARENT_FIRST)
    body["tools"] = [t for t in body["tools"] if t["function"]["name"] not in ("task", "todowrite")]
    body["messages"] = [body["messages"][0], {"role": "user", "content": task}]
    return Conversation(session, body, parent=parent_session)


def explore_subagent(
    session: str, *, parent_session: str = "ses_parent", task: str = "list the modules that handle requests"
) -> Conversation:
    """OpenCode's `explore` subagent: its own prompt (the <env> block kept), five tools."""
    body = _load(PARENT_FIRST)
    keep = ("bash", "glob", "grep", "read", "webfetch")
    body["tools"] = [t for t in body["tools"] if t["function"]["name"] in keep]
    system = body["messages"][0]["content"]
    body["messages"] = [
        {"role": "system", "content": EXPLORE_PROMPT + system[system.index("You are powered") :]},
        {"role": "user", "content": task},
    ]
    return Conversation(session, body, parent=parent_session)


def issue_scenario() -> list[tuple[str, Conversation]]:
    """The issue's workload: parent, subagent (another prompt) x2, parent, another project's
    new session, parent, a second subagent (fewer tools) x2, parent. Steps name who speaks."""
    p, s1, b, s2 = parent(), explore_subagent("ses_sub1"), other_project(), general_subagent("ses_sub2")
    order = [
        ("parent", p),
        ("parent", p),
        ("parent", p),
        ("explore", s1),
        ("explore", s1),
        ("parent", p),
        ("projB", b),
        ("parent", p),
        ("general", s2),
        ("general", s2),
        ("parent", p),
    ]
    return order


def round_robin(n: int = 4, turns: int = 3) -> list[tuple[str, Conversation]]:
    """``n`` conversations in ``n`` projects taking turns on one slot."""
    convs = [parent(f"ses_rr{i}") for i in range(n)]
    for i, conv in enumerate(convs):  # another project per conversation: its own <env>
        system = conv.body["messages"][0]["content"]
        conv.body["messages"][0]["content"] = system.replace("/home/dev/projA", f"/home/dev/proj{i}")
    return [(f"c{i}", conv) for _ in range(turns) for i, conv in enumerate(convs)]
