"""The Cline CLI adapter on its real captures (tests/data/cline-3.0.65/README.md says how they were
made). The real server's side: test_e2e_cline.py."""

from __future__ import annotations

import json

from oc_prefix_cache.chat.head import Head, message_text
from oc_prefix_cache.harness import DEFAULT_ADAPTERS, GenericAdapter, Incoming, select
from oc_prefix_cache.harness.cline import ClineAdapter
from tests.helpers import DATA as TEST_DATA

DATA = TEST_DATA / "cline-3.0.65"
ENABLED = frozenset({"opencode", "claude-code", "pi", "codex", "qwen-code", "aider", "cline", "generic"})


def incoming(name: str) -> Incoming:
    data = json.loads((DATA / f"{name}.json").read_text())
    return Incoming(api="openai", headers={k.lower(): v for k, v in data["headers"].items()}, body=data["body_json"])


RUNS = {name: incoming(name) for name in ("A1", "A2", "B1", "S1-subagent")}
ADAPTERS = (*DEFAULT_ADAPTERS, ClineAdapter())  # as registered, or before it is


def head(name: str) -> Head:
    found = ClineAdapter().head(RUNS[name].body)
    assert isinstance(found, Head), found
    return found


def test_cline_is_recognised_by_its_prompt_and_its_body_is_unchanged() -> None:
    request = RUNS["A1"]
    assert request.user_agent.startswith("ai-sdk/openai-compatible/")  # the AI SDK's: not Cline's alone
    adapter = select(request, enabled=ENABLED, adapters=ADAPTERS)
    assert adapter.name == "cline" and adapter.session(request) is None
    assert adapter.normalise(request) == (request.body, ()) and adapter.normalise(request)[0] is request.body
    assert select(request, enabled=ENABLED - {"cline"}, adapters=ADAPTERS).name == "generic"  # switched off
    other = Incoming(
        api="openai",
        headers=request.headers,
        body={**request.body, "messages": [{"role": "system", "content": "You are a helper."}]},
    )
    assert not ClineAdapter().matches(other)
    assert not ClineAdapter().matches(Incoming(api="openai", headers={"user-agent": "curl/8"}, body=request.body))


def test_cline_has_one_head_for_every_project_cut_before_env() -> None:
    a1, a2, b1 = head("A1"), head("A2"), head("B1")
    assert RUNS["A1"].body == RUNS["A2"].body and a1 == a2  # two sessions of one project: the same body
    assert (a1.tools_json, a1.system_head) == (b1.tools_json, b1.system_head) and a1.n_tools == 25
    assert a1.marker == "<env>" and a1.system_head.startswith("You are Cline, an AI coding agent.")
    system = message_text(RUNS["A1"].body["messages"][0])
    assert system is not None and "/home/dev/projA" in system and "/home/dev" not in a1.system_head
    assert system.index("Working Directory: /home/dev/projA") > len(a1.system_head)  # per-project text after it
    assert "Date:" not in a1.system_head
    assert a1.project_tail == ""  # the project head is the whole system text (the planner's default)
    assert [m["role"] for m in RUNS["A1"].body["messages"]] == ["system", "user"]
    assert RUNS["A1"].body["messages"][1]["content"] == "say ok"  # the typed text alone follows


def test_the_generic_adapter_cuts_the_same_head_by_default() -> None:
    generic = GenericAdapter().head(RUNS["A1"].body)
    assert isinstance(generic, Head) and generic.marker == head("A1").marker
    assert generic.system_head.lstrip() == head("A1").system_head


def test_a_cline_subagent_has_its_model_written_prompt_and_passes_without_a_head() -> None:
    request = RUNS["S1-subagent"]
    assert message_text(request.body["messages"][0]) == "You are a helper. Answer briefly."
    assert len(request.body["tools"]) == 7 and not any(k.startswith("x-") for k in request.headers)
    assert select(request, enabled=ENABLED, adapters=ADAPTERS).name == "generic"
    assert not isinstance(GenericAdapter().head(request.body), Head)
