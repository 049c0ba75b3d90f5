"""The OpenHands adapter on its real captures (tests/data/openhands-1.16.0/README.md says how they were
made). The real server's side: test_e2e_openhands.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from oc_prefix_cache.chat.head import Head, message_text
from oc_prefix_cache.harness import DEFAULT_ADAPTERS, GenericAdapter, Incoming, select
from oc_prefix_cache.harness.openhands import OpenHandsAdapter
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.settings import ADAPTER_NAMES
from tests.helpers import DATA as TEST_DATA
from tests.unit.harness.test_harness import head_tokens, rendered

DATA = TEST_DATA / "openhands-1.16.0"
RUNS = {
    run: (
        lambda data: Incoming(
            api="openai", headers={k.lower(): v for k, v in data["headers"].items()}, body=data["body_json"]
        )
    )(json.loads((DATA / f"{run}.json").read_text()))
    for run in ("A1", "A2", "B1", "T-turn1", "T-turn2", "S1", "S1-subagent", "S1-after")
}
ADAPTERS = (*DEFAULT_ADAPTERS, OpenHandsAdapter())  # as registered, or before it is
ENABLED = ADAPTER_NAMES | {"openhands"}


def head(run: str) -> Head:
    found = OpenHandsAdapter().head(RUNS[run].body)
    assert isinstance(found, Head), found
    return found


def system(run: str) -> str:
    text = message_text(RUNS[run].body["messages"][0])
    assert text is not None
    return text


def test_openhands_is_recognised_by_its_prompt_and_its_body_is_unchanged() -> None:
    for run, request in RUNS.items():
        adapter = select(request, enabled=ENABLED, adapters=ADAPTERS)
        assert adapter.name == "openhands", run
        assert adapter.normalise(request) == (request.body, ()) and adapter.normalise(request)[0] is request.body
    assert RUNS["A1"].user_agent.startswith("OpenAI/Python ")  # the OpenAI SDK's: not OpenHands' alone
    assert select(RUNS["A1"], enabled=ENABLED - {"openhands"}, adapters=ADAPTERS).name == "generic"  # switched off
    other = Incoming(
        api="openai",
        headers=RUNS["A1"].headers,
        body={**RUNS["A1"].body, "messages": [{"role": "system", "content": "You are a helper."}]},
    )
    assert not OpenHandsAdapter().matches(other)
    assert not OpenHandsAdapter().matches(Incoming(api="anthropic", headers={}, body=RUNS["A1"].body))


def test_the_head_ends_where_the_context_begins_and_is_shared_by_a_projects_sessions() -> None:
    """The system message is the agent's prompt, then the appended context opening with the time to the
    microsecond; the head is the tools and the prompt. The tools name the working directory
    (file_editor's description), so project B has a head of its own."""
    a1, a2, b1 = head("A1"), head("A2"), head("B1")
    assert a1 == a2 and a1.marker == "<CURRENT_DATETIME>" and a1.n_tools == 6
    assert a1.system_head == RUNS["A1"].body["messages"][0]["content"][0]["text"]  # the first text part
    assert a1.system_head.startswith("You are OpenHands agent, a helpful AI assistant")
    for volatile in ("/home/dev", "projA", "2026-", "Linux"):
        assert volatile not in a1.system_head, volatile
    assert a1.system_head == b1.system_head and a1.tools_json != b1.tools_json
    assert a1.tools_json.replace("/home/dev/projA", "/home/dev/projB") == b1.tools_json  # only the directory
    assert "Your current working directory is: /home/dev/projA" in a1.tools_json
    # what follows the head: the time (new every session), B's AGENTS.md, the working directory
    assert (
        system("A1") != system("A2")
        and system("A1")[len(a1.system_head) :] == RUNS["A1"].body["messages"][0]["content"][1]["text"]
    )
    after = system("B1")[len(b1.system_head) :]
    assert after.startswith("<CURRENT_DATETIME>\nThe current date and time is: 2026-")
    assert (
        after.index("</CURRENT_DATETIME>")
        < after.index("<REPO_CONTEXT>")
        < after.index("Use tabs.")
        < after.index("Your current working directory is: /home/dev/projB")
    )
    assert RUNS["A1"].body["messages"][1]["content"] == [{"type": "text", "text": "say ok"}]  # the typed text alone


def test_no_project_head_is_cut_when_the_time_follows_the_head() -> None:
    """Everything after the head differs per session (the time first), so no project head: one would be
    saved for every session and read by none. Without the time a project head is cut as usual."""
    assert all(head(run).project is False for run in ("A1", "B1", "S1", "S1-subagent"))
    body = json.loads(json.dumps(RUNS["B1"].body))
    suffix = body["messages"][0]["content"][1]
    suffix["text"] = suffix["text"][suffix["text"].index("<REPO_CONTEXT>") :]  # an SDK agent without the time
    without = OpenHandsAdapter().head(body)
    assert isinstance(without, Head) and without.marker == "<REPO_CONTEXT>" and without.project is True
    assert without.system_head == head("B1").system_head
    plain = json.loads(json.dumps(body))
    plain["messages"][0]["content"] = plain["messages"][0]["content"][:1]  # no context at all
    whole = OpenHandsAdapter().head(plain)
    assert isinstance(whole, Head) and whole.marker == "" and whole.system_head == head("B1").system_head.strip()


def test_a_session_is_its_prompt_cache_key_and_turns_extend() -> None:
    turn1, turn2 = RUNS["T-turn1"], RUNS["T-turn2"]
    adapter = OpenHandsAdapter()
    assert adapter.session(turn1) == adapter.session(turn2) == turn1.body["prompt_cache_key"]
    assert turn2.body["messages"][: len(turn1.body["messages"])] == turn1.body["messages"]
    assert turn1.body["tools"] == turn2.body["tools"] and head("T-turn1") == head("T-turn2")
    assert [m["role"] for m in turn2.body["messages"]] == ["system", "user", "assistant", "tool"]
    assert len({adapter.session(RUNS[run]) for run in ("A1", "A2", "B1")}) == 3  # a new key per session
    assert "stream" not in turn1.body and turn1.body["reasoning_effort"] == "high"  # whole answers


def test_a_subagent_shares_its_parents_key_but_not_its_session() -> None:
    """The `task` tool's subagent runs on its parent's LLM, hence its prompt_cache_key; it has no `task`
    tool and its own suffix (its type's prompt after the time): no session, its own head."""
    main, sub, after = RUNS["S1"], RUNS["S1-subagent"], RUNS["S1-after"]
    assert sub.body["prompt_cache_key"] == main.body["prompt_cache_key"]
    adapter = OpenHandsAdapter()
    assert adapter.session(main) == adapter.session(after) == main.body["prompt_cache_key"]
    assert adapter.session(sub) is None
    main_head, sub_head = head("S1"), head("S1-subagent")
    assert sub_head.system_head == main_head.system_head and sub_head.n_tools == main_head.n_tools - 1
    assert "You are a general-purpose agent." in system("S1-subagent")[len(sub_head.system_head) :]
    assert after.body["messages"][:2] == main.body["messages"][:2]  # the parent goes on after the result


def test_the_generic_adapter_gives_no_head() -> None:
    """Without the adapter OpenHands' requests pass without a head: none of its markers is OpenCode's."""
    assert not isinstance(GenericAdapter().head(RUNS["A1"].body), Head)


@pytest.mark.rig
def test_the_head_is_a_strict_token_prefix_and_turns_extend_on_the_real_server(llama_server: Any) -> None:
    """Rendered by the server (tiny qwen35): the head is the same token prefix of every request of a
    project's main agent (the two text parts render one after the other), the subagent's and project
    B's are their own, and turn 1 without its generation prompt is a token prefix of turn 2."""
    server = llama_server("qwen35", ctx_size=2048)
    adapter = OpenHandsAdapter()
    with SlotClient(server.url) as client:
        cuts = {run: head_tokens(client, adapter, RUNS[run]) for run in RUNS}
        head = cuts["A1"][0]
        for run in ("A1", "A2", "T-turn1", "T-turn2", "S1", "S1-after"):
            tokens, whole = cuts[run]
            assert tokens == head and whole[: len(head)] == head and len(whole) > len(head), run
        for run in ("B1", "S1-subagent"):
            tokens, whole = cuts[run]
            assert tokens != head and whole[: len(tokens)] == tokens and len(whole) > len(tokens), run
        print(
            f"\nhead {len(head)} tokens of {len(cuts['A1'][1])} (A1); B1 {len(cuts['B1'][0])} of "
            f"{len(cuts['B1'][1])}; subagent {len(cuts['S1-subagent'][0])} of {len(cuts['S1-subagent'][1])}"
        )
        _, first = rendered(client, RUNS["T-turn1"].body, generation_prompt=False)
        _, second = rendered(client, RUNS["T-turn2"].body)
        assert second[: len(first)] == first and len(second) > len(first)
