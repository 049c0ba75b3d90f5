"""The Kilo Code CLI adapter on its real captures (tests/data/kilo-code-7.7.9/README.md says how they
were made). The real server's side: test_e2e_kilo_code.py."""

from __future__ import annotations

import json

from oc_prefix_cache.chat.head import Head, Skip, message_text
from oc_prefix_cache.harness import DEFAULT_ADAPTERS, Incoming, OpenCodeAdapter, select
from oc_prefix_cache.harness.kilo_code import KiloCodeAdapter
from oc_prefix_cache.settings import ADAPTER_NAMES
from tests.helpers import DATA as TEST_DATA

DATA = TEST_DATA / "kilo-code-7.7.9"
KILO = {
    run: (
        lambda data: Incoming(
            api="openai", headers={k.lower(): v for k, v in data["headers"].items()}, body=data["body_json"]
        )
    )(json.loads((DATA / f"{run}.json").read_text()))
    for run in ("A1", "A2", "B1", "S1", "S1-subagent", "S1-title")
}
# every adapter the package knows, with this one (a no-op duplicate once it is in DEFAULT_ADAPTERS)
ADAPTERS = (*DEFAULT_ADAPTERS, KiloCodeAdapter())
ENABLED = ADAPTER_NAMES | {"kilo-code"}


def test_kilo_code_is_recognised_and_its_body_left_alone() -> None:
    for run, request in KILO.items():
        adapter = select(request, enabled=ENABLED, adapters=ADAPTERS)
        assert adapter.name == "kilo-code", run
        assert adapter.normalise(request) == (request.body, ()) and adapter.normalise(request)[0] is request.body
        assert adapter.session(request) == request.headers["x-session-id"] == request.headers["x-session-affinity"]
    assert not OpenCodeAdapter().matches(KILO["A1"])  # a fork of OpenCode, but its own User-Agent
    assert select(KILO["A1"], enabled=ENABLED - {"kilo-code"}, adapters=ADAPTERS).name == "generic"  # switched off
    sessions = {KiloCodeAdapter().session(KILO[run]) for run in ("A1", "A2", "B1", "S1", "S1-subagent")}
    assert len(sessions) == 5  # a new session id per run, and the subagent its own


def test_kilo_code_shares_its_head_across_projects() -> None:
    a1, b1 = (KiloCodeAdapter().head(KILO[run].body) for run in ("A1", "B1"))
    assert isinstance(a1, Head) and isinstance(b1, Head)
    assert (a1.tools_json, a1.system_head, a1.marker) == (b1.tools_json, b1.system_head, "<env>")
    assert a1.n_tools == 21 and a1.system_head.startswith("You are Kilo")
    for volatile in ("/home/dev", "projA", "projB", "Instructions from", "Today's date"):  # nothing per project or day
        assert volatile not in a1.system_head, volatile
    # B's AGENTS.md comes after <env>, named by its path: per-project text, after the head
    b1_system = message_text(KILO["B1"].body["messages"][0]) or ""
    assert b1_system.index("<env>") == len(a1.system_head)
    assert b1_system.index("Instructions from: /home/dev/projB/AGENTS.md") > len(a1.system_head)


def test_kilo_code_shares_its_project_head_across_sessions_of_a_project() -> None:
    """The project head is the whole system text (no project_tail): the same in A1 and A2, another in
    B1 (its AGENTS.md). The first user message is the typed text, then an environment part naming the
    message time to the second: volatile, and after the typed text, so nothing to cut ahead."""
    a1, a2 = (KILO[run].body for run in ("A1", "A2"))
    heads = [KiloCodeAdapter().head(body) for body in (a1, a2)]
    assert all(isinstance(h, Head) and h.project_tail == "" for h in heads)
    assert heads[0] == heads[1]
    assert a1["tools"] == a2["tools"] and a1["messages"][0] == a2["messages"][0]  # the project head
    assert a1["messages"][0] != KILO["B1"].body["messages"][0]
    typed, environment = a1["messages"][1]["content"]
    assert typed["text"] == '"say ok"' and environment["text"].startswith("\n\n<environment_details>\nMessage time: ")
    assert a1["messages"][1] != a2["messages"][1]  # the message time


def test_kilo_code_subagent_has_its_own_head_and_the_title_request_none() -> None:
    main, sub, title = (KILO[run] for run in ("S1", "S1-subagent", "S1-title"))
    assert sub.headers["x-parent-session-id"] == main.headers["x-session-id"]
    assert title.headers["x-session-id"] == "title-" + main.headers["x-session-id"]
    main_head, sub_head = KiloCodeAdapter().head(main.body), KiloCodeAdapter().head(sub.body)
    assert isinstance(main_head, Head) and isinstance(sub_head, Head)
    assert sub_head.system_head == main_head.system_head and sub_head.tools_json != main_head.tools_json
    assert main_head.n_tools - sub_head.n_tools == 2  # no task, no todowrite
    skip = KiloCodeAdapter().head(title.body)
    assert isinstance(skip, Skip) and "no tools" in skip.reason


def test_kilo_code_cuts_where_the_generic_adapter_does() -> None:
    """With the default marker the generic adapter gives the same heads and sessions: an unregistered
    proxy serves Kilo the same way, only under the name "generic"."""
    from oc_prefix_cache.harness import GenericAdapter

    for run, request in KILO.items():
        assert KiloCodeAdapter().head(request.body) == GenericAdapter().head(request.body), run
        assert KiloCodeAdapter().session(request) == GenericAdapter().session(request), run
