"""The Aider adapter on its real captures (tests/data/aider-0.86.2/README.md says how they were made).
The real server's side: test_e2e_aider.py."""

from __future__ import annotations

import json

from oc_prefix_cache.chat.head import Head
from oc_prefix_cache.chat.head import message_text as _text
from oc_prefix_cache.harness import DEFAULT_ADAPTERS, Incoming, select
from oc_prefix_cache.harness.aider import AiderAdapter
from tests.helpers import DATA as TEST_DATA

DATA = TEST_DATA / "aider-0.86.2"
ENABLED = frozenset({"opencode", "claude-code", "pi", "codex", "qwen-code", "aider", "cline", "generic"})


def incoming(name: str) -> Incoming:
    data = json.loads((DATA / f"{name}.json").read_text())
    return Incoming(api="openai", headers={k.lower(): v for k, v in data["headers"].items()}, body=data["body_json"])


RUNS = {name: incoming(name) for name in ("A1", "A2", "B1", "diff-A1", "diff-B1", "T-turn1", "T-turn2")}


def message_text(message: dict[str, object]) -> str:
    text = _text(message)
    assert text is not None
    return text


def head(name: str) -> Head:
    found = AiderAdapter().head(RUNS[name].body)
    assert isinstance(found, Head), found
    return found


def test_aider_is_recognised_by_its_prompt_and_its_body_is_unchanged() -> None:
    adapters = (*DEFAULT_ADAPTERS, AiderAdapter())  # as registered, or before it is
    for request in RUNS.values():
        adapter = select(request, enabled=ENABLED, adapters=adapters)
        assert adapter.name == "aider" and adapter.session(request) is None
        assert adapter.normalise(request) == (request.body, ()) and adapter.normalise(request)[0] is request.body
    assert RUNS["A1"].user_agent.startswith("OpenAI/Python ")  # shared by many clients: not enough alone
    other = Incoming(
        api="openai",
        headers={"user-agent": "OpenAI/Python 2.20.0"},
        body={
            "messages": [
                {"role": "system", "content": "Act as an expert software developer."},
                {"role": "user", "content": "hi"},
            ]
        },
    )
    assert not AiderAdapter().matches(other)  # the opener alone is not Aider's
    assert not AiderAdapter().matches(Incoming(api="anthropic", headers={}, body=RUNS["A1"].body))


def test_aider_has_one_head_for_every_project_without_tools() -> None:
    a1, a2, b1 = head("A1"), head("A2"), head("B1")
    assert "tools" not in RUNS["A1"].body and a1.n_tools == 0 and a1.tools_json == "[]"
    assert (
        (a1.tools_json, a1.system_head, a1.marker)
        == (b1.tools_json, b1.system_head, b1.marker)
        == (a2.tools_json, a2.system_head, a2.marker)
    )
    assert a1.system_head == message_text(RUNS["A1"].body["messages"][0]).strip()  # whole format: all of it
    assert a1.system_head.startswith("Act as an expert software developer.")
    # with --edit-format diff the system text prints the platform and the date: the head ends before
    d1, e1 = head("diff-A1"), head("diff-B1")
    assert d1.system_head == e1.system_head and d1.marker == "\n- Platform: "
    assert "Current date" not in d1.system_head and "Current date" in message_text(RUNS["diff-A1"].body["messages"][0])


def test_aider_project_head_ends_after_its_fixed_messages_before_the_typed_text() -> None:
    a1, a2, b1 = head("A1"), head("A2"), head("B1")
    assert RUNS["A1"].body == RUNS["A2"].body and a1 == a2  # two sessions of one project: the same body
    messages = RUNS["A1"].body["messages"]
    texts = [message_text(m) for m in messages]
    assert a1.project_tail == texts[-2] and texts[-2].startswith("Ok, based on your requests")
    assert texts[-1].startswith("say ok\n\n")  # the typed text, then the format's reminder
    repo = next(t for t in texts if t and t.startswith("Here are summaries of some files"))
    assert "calc.py" in repo and texts.index(repo) < len(texts) - 2  # the repo map is inside the project head
    other = next(
        t
        for t in (message_text(m) for m in RUNS["B1"].body["messages"])
        if t and t.startswith("Here are summaries of some files")
    )
    assert "greet.js" in other and other != repo  # ... and is per project
    assert a1.project_tail == b1.project_tail  # the same fixed text ends it; the key is the text before
    assert "projA" not in a1.system_head and "calc.py" not in a1.system_head


def test_aider_second_turn_keeps_the_project_head_and_the_history_after_it() -> None:
    turn1, turn2 = (RUNS[name].body["messages"] for name in ("T-turn1", "T-turn2"))
    assert head("T-turn2").project_tail == head("T-turn1").project_tail == message_text(turn1[-2])
    assert turn2[: len(turn1) - 1] == turn1[:-1]  # up to the typed text, turn 2 repeats turn 1
    assert message_text(turn2[len(turn1) - 1]) == "say ok"  # the reminder is only on the newest message
    assert message_text(turn2[-1]).startswith("say it again\n\n")


def test_aider_without_a_repo_map_or_examples_ends_the_project_head_at_the_system_text() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Act as an expert software developer.\n"},
            {"role": "user", "content": "I am not sharing any files that you can edit yet."},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": "hi"},
        ],
    }
    found = AiderAdapter().head(body)
    assert isinstance(found, Head) and found.project_tail == "Ok."
    alone = AiderAdapter().head({"messages": [body["messages"][0], body["messages"][-1]]})
    assert isinstance(alone, Head) and alone.project_tail == "" and alone.system_head.endswith("developer.")
