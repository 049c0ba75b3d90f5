"""Adapters for the agents added in issue 18 (Codex CLI, Qwen Code), on their real captures
(tests/data/*/README.md says how each was made). The real server's side: test_e2e_codex.py."""

from __future__ import annotations

import json
from pathlib import Path

from oc_prefix_cache.chat.head import Head
from oc_prefix_cache.chat.responses import prepared
from oc_prefix_cache.harness import CodexAdapter, Incoming, QwenCodeAdapter, select
from oc_prefix_cache.settings import ADAPTER_NAMES
from tests.helpers import DATA


def incoming(path: Path, api: str) -> Incoming:
    data = json.loads(path.read_text())
    return Incoming(api=api, headers={k.lower(): v for k, v in data["headers"].items()}, body=data["body_json"])


CODEX = {run: incoming(DATA / "codex-0.171.0" / f"{run}.json", "responses") for run in ("A1", "A2", "B1")}
QWEN = {run: incoming(DATA / "qwen-code-0.24.4" / f"{run}.json", "openai") for run in ("A1", "A2", "B1", "A1-memory")}


def test_codex_is_recognised_and_its_developer_messages_merged() -> None:
    """Unchanged, its two developer messages become two system messages, and b11434 answers HTTP 500 on
    the Qwen3.5 template ("System message must be at the beginning")."""
    request = CODEX["A1"]
    adapter = select(request, enabled=ADAPTER_NAMES)
    assert adapter.name == "codex" and adapter.session(request) == request.headers["thread-id"]
    body, changes = adapter.normalise(request)
    assert changes == ("merge-developer-messages",) and len(body["input"]) == len(request.body["input"]) - 1
    first, second = request.body["input"][:2]
    assert (
        body["input"][0]["content"] == first["content"] + [{"type": "input_text", "text": "\n\n"}] + second["content"]
    )
    assert body["input"][1:] == request.body["input"][2:] and request.body["input"][1] is second  # input untouched
    assert CodexAdapter(off=frozenset({"merge-developer-messages"})).normalise(request) == (request.body, ())
    assert adapter.normalise(Incoming(api="responses", headers={}, body=body)) == (body, ())  # already merged


def test_codex_shares_its_head_across_projects_and_its_project_head_within_one() -> None:
    heads = {run: CodexAdapter().head(prepared(CodexAdapter().normalise(r)[0])) for run, r in CODEX.items()}
    assert all(isinstance(h, Head) for h in heads.values())
    a1, a2, b1 = (heads[run] for run in ("A1", "A2", "B1"))
    assert isinstance(a1, Head) and isinstance(a2, Head) and isinstance(b1, Head)
    assert (a1.tools_json, a1.system_head) == (b1.tools_json, b1.system_head)  # one head for every project
    assert a1.project_tail.startswith("<environment_context>") and a1.project_tail == a2.project_tail
    assert a1.project_tail != b1.project_tail and "/home/dev/projB" in b1.project_tail
    assert "client_metadata" not in prepared(CODEX["A1"].body)  # a new turn id every turn: not prepared on


def test_qwen_code_is_recognised_and_cut_before_its_first_context_file() -> None:
    request = QWEN["A1"]
    assert select(request, enabled=ADAPTER_NAMES).name == "qwen-code"
    a1, b1 = (QwenCodeAdapter().head(QWEN[run].body) for run in ("A1", "B1"))
    assert isinstance(a1, Head) and isinstance(b1, Head)
    assert a1.system_head == b1.system_head and "/home/dev" not in a1.system_head and "projA" not in a1.system_head
    assert a1.project_tail.startswith("<system-reminder>\nThe current date is")
    messages = request.body["messages"][1]["content"]
    assert messages[-1]["text"] == "say ok" and messages[-2]["text"] == a1.project_tail
    memory = QwenCodeAdapter().head(QWEN["A1-memory"].body)  # the memory subagent: its own head
    assert isinstance(memory, Head) and memory.system_head != a1.system_head
