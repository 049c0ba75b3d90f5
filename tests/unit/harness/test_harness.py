"""The harness adapters on the captured requests of each harness, and their heads on the real server.

The requests in tests/data/<harness>/ are copied unchanged from shared/captures/<harness>/ (a run's
``0001-POST-….json`` is saved as ``<run>.json``; the subagent captures keep their names).

Project B: the captures keep project B's bodies out of this folder on purpose (tests must not be
tuned to them), but their READMEs name every byte in which B1 differs from A1 (Claude Code: the
project name in the memory path and the cwd, and the commit hash; pi: the cwd). ``project_b``
applies exactly those differences to A1.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.chat.anthropic import to_chat
from oc_prefix_cache.chat.head import Head, Skip, locate_head, tokens_before
from oc_prefix_cache.harness import (
    DEFAULT_ADAPTERS,
    NAMES,
    Adapter,
    ClaudeCodeAdapter,
    GenericAdapter,
    Incoming,
    OpenCodeAdapter,
    PiAdapter,
    select,
)
from oc_prefix_cache.harness.claude_code import MEMORY_MARKER
from oc_prefix_cache.llama.client import SlotClient
from tests.helpers import DATA

CC = DATA / "claude-code-2.1.332"
CC_SUB = DATA / "claude-code-2.1.332-subagent"
CC_INST = DATA / "claude-code-2.1.332-installed"  # as `ocpc install --harness claude-code` sets it up
PI = DATA / "pi-0.73.1"
OC = DATA / "opencode-1.18.33"
OC_SUB = DATA / "opencode-1.18.33-subagent"
ALL = frozenset(NAMES)


def incoming(path: Path) -> Incoming:
    """A captured request as the proxy sees it (header names lower-cased)."""
    if path.parent == OC:
        headers = json.loads((OC / "headers_and_hashes.json").read_text())[path.name]["headers"]
        body = json.loads(path.read_text())
    else:
        data = json.loads(path.read_text())
        headers, body = dict(data["headers"]), data["body_json"]
    api = "anthropic" if "messages" in path.name or path.parent in (CC, CC_SUB, CC_INST) else "openai"
    return Incoming(api=api, headers={k.lower(): v for k, v in headers.items()}, body=body)


def project_b(request: Incoming) -> Incoming:
    """Run A1 as it would be in project B (the differences the capture READMEs list)."""
    text = json.dumps(request.body).replace("projA", "projB").replace("d27dc81", "75f6d74")
    return Incoming(api=request.api, headers=request.headers, body=json.loads(text))


def chat_of(adapter: Adapter, request: Incoming) -> dict[str, Any]:
    """The chat body the core renders: normalised, then converted when it is Anthropic."""
    body, _ = adapter.normalise(request)
    return to_chat(body) if request.api == "anthropic" else body


def head_of(adapter: Adapter, request: Incoming) -> Head:
    head = adapter.head(chat_of(adapter, request))
    assert isinstance(head, Head), head
    return head


CC_A1, CC_A2, CC_A2C, CC_ATTR0 = (incoming(CC / f"{run}.json") for run in ("A1", "A2", "A2-continue", "A3-attr0"))
CC_MAIN1, CC_SUB1, CC_SUB2, CC_MAIN2 = (incoming(p) for p in sorted(CC_SUB.glob("000*.json")))
PI_A1, PI_A2, PI_A2C = (incoming(PI / f"{run}.json") for run in ("A1", "A2", "A2-continue"))
PI_AFF1, PI_AFF2C = incoming(PI / "A1-affinity.json"), incoming(PI / "A2-continue-affinity.json")
IN_A1, IN_A2, IN_A2C, IN_B1, IN_COMMIT = (
    incoming(CC_INST / f"{run}.json") for run in ("A1", "A2", "A2-continue", "B1", "A3-commit")
)
IN_MAIN1, IN_SUB1, IN_SUB2, IN_MAIN2 = (incoming(p) for p in sorted(CC_INST.glob("A4-subagent-*.json")))
OC_A, OC_B, OC_A2 = (
    incoming(OC / f"{name}.json")
    for name in ("02_projA_turn1_main_request", "03_projB_turn1_main_request", "04_projA_turn2_main_request")
)
OC_TITLE, OC_MAIN1, OC_SUB1, OC_SUB2, OC_MAIN2 = (incoming(p) for p in sorted(OC_SUB.glob("000*.json")))


# -- selection and switching off ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "name"),
    [
        (CC_A1, "claude-code"),
        (CC_SUB1, "claude-code"),
        (PI_A1, "pi"),
        (PI_AFF1, "pi"),
        (PI_A2C, "pi"),
        (OC_A, "opencode"),
        (OC_TITLE, "opencode"),
        (OC_SUB1, "opencode"),
    ],
)
def test_each_capture_selects_its_harness(request_: Incoming, name: str) -> None:
    assert select(request_, enabled=ALL).name == name


def test_lookalikes_fall_to_generic() -> None:
    """pi's User-Agent is the OpenAI JS SDK's: another agent with it is not pi."""
    messages = [{"role": "system", "content": "You are another agent."}, PI_A1.body["messages"][1]]
    other_js = Incoming(api="openai", headers=PI_A1.headers, body={**PI_A1.body, "messages": messages})
    assert select(other_js, enabled=ALL).name == "generic"
    as_openai = Incoming(api="openai", headers=CC_A1.headers, body=to_chat(CC_A1.body))
    assert select(as_openai, enabled=ALL).name == "generic"
    no_agent = Incoming(api="anthropic", headers={}, body=CC_A1.body)
    assert select(no_agent, enabled=ALL).name == "generic"


@pytest.mark.parametrize("request_", [CC_A1, CC_SUB2, PI_AFF1, OC_A, OC_SUB1])
def test_switched_off_the_body_passes_unchanged(request_: Incoming) -> None:
    own = select(request_, enabled=ALL).name
    adapter = select(request_, enabled=ALL - {own})
    assert adapter.name == "generic"
    before = json.dumps(request_.body)
    body, changes = adapter.normalise(request_)
    assert body is request_.body and changes == ()
    assert json.dumps(request_.body) == before
    assert select(request_, enabled=frozenset()).normalise(request_)[0] is request_.body


def test_only_claude_code_changes_bodies() -> None:
    for request_ in (PI_A1, PI_AFF2C, OC_A, OC_MAIN2, OC_SUB2):
        adapter = select(request_, enabled=ALL)
        assert adapter.normalise(request_) == (request_.body, ()) and adapter.normalise(request_)[0] is request_.body
    assert GenericAdapter(markers=("x",)).normalise(CC_A1)[0] is CC_A1.body


def test_select_takes_a_configured_generic_and_adapter_list() -> None:
    generic = GenericAdapter(markers=("\nCurrent date: ",))
    assert select(PI_A1, enabled=frozenset(), fallback=generic) is generic
    assert select(PI_A1, enabled=ALL, adapters=[OpenCodeAdapter()]).name == "generic"
    assert [a.name for a in DEFAULT_ADAPTERS] == [
        "opencode",
        "claude-code",
        "pi",
        "codex",
        "qwen-code",
        "kilo-code",
        "aider",
        "cline",
        "openhands",
    ]
    assert isinstance(generic.head(PI_A1.body), Head)


# -- Claude Code's normalisations -----------------------------------------------------------------------------


IN_PLACE = ClaudeCodeAdapter(off=frozenset({"environment-to-system"}))


def test_claude_code_drops_the_billing_header_like_attribution_off() -> None:
    body, changes = IN_PLACE.normalise(CC_A1)
    assert changes == ("drop-billing-header", "system-entries-as-user")
    assert body["system"] == CC_ATTR0.body["system"]  # the CLAUDE_CODE_ATTRIBUTION_HEADER=0 run
    assert body["system"] is not CC_A1.body["system"] and len(CC_A1.body["system"]) == 3  # input untouched
    moved, changes = ClaudeCodeAdapter().normalise(CC_A1)
    assert changes == ("drop-billing-header", "environment-to-system")
    assert moved["system"] == ClaudeCodeAdapter().normalise(CC_ATTR0)[0]["system"]


def test_claude_code_moves_the_main_agents_environment_to_the_end_of_its_system_text() -> None:
    """Only the entry right after the first user message, on every turn alike; a subagent's
    prompt (no memory marker) keeps its entries in place, so its head takes in nothing per project."""
    for request_ in (CC_A1, CC_A2C, CC_MAIN2):
        body, changes = ClaudeCodeAdapter().normalise(request_)
        raw = request_.body["messages"]
        env = raw[1]["content"] if isinstance(raw[1]["content"], str) else raw[1]["content"][0]["text"]
        assert env.startswith("# Environment\n") and "environment-to-system" in changes
        assert body["system"][-1] == {"type": "text", "text": "\n\n" + env}
        assert len(body["messages"]) == len(raw) - 1 and body["messages"][0] == raw[0] | {
            "content": [{k: v for k, v in b.items() if k != "cache_control"} for b in raw[0]["content"]]
        }
        assert not any(m["role"] == "system" for m in body["messages"])
    for request_ in (CC_SUB1, CC_SUB2):
        assert "environment-to-system" not in ClaudeCodeAdapter().normalise(request_)[1]
    off = ClaudeCodeAdapter(off=frozenset({"environment-to-system", "strip-cache-control"}))
    assert off.normalise(CC_A1)[1] == ("drop-billing-header", "system-entries-as-user")


def test_claude_code_project_head_ends_after_the_first_messages_reminders() -> None:
    """In every layout the project head ends after the first message's leading reminders, just
    before the typed text; its shorter level ends before the git status (the system text's end when
    the git status is the first reminder)."""
    for adapter in (ClaudeCodeAdapter(), IN_PLACE):
        chat = chat_of(adapter, CC_A1)
        head = adapter.head(chat)
        assert isinstance(head, Head) and head.project_tail.startswith("<system-reminder>\nAttribution")
        assert chat["messages"][1]["content"][-1]["text"] == "say ok"  # the typed text comes after it
        assert head.project_base == chat["messages"][0]["content"]  # the git status is the first reminder
    moved = head_of(ClaudeCodeAdapter(), CC_A1).project_base
    invoked = "You have been invoked in the following environment"
    assert invoked in moved and invoked not in head_of(IN_PLACE, CC_A1).project_base
    sub = head_of(IN_PLACE, CC_SUB1)
    assert sub.project_tail.startswith("<system-reminder>\nAttribution") and MEMORY_MARKER not in sub.system_head


def test_claude_code_as_installed_sends_no_system_turns_and_its_environment_before_the_typed_text() -> None:
    """With ``CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system`` (written by ``ocpc install``) Claude Code
    lays the prompt out itself as for a model without system turns: nothing for the adapter to move,
    only ``cache_control`` to strip; the environment, model, deferred tools, agent types and skills come
    as reminders before the git status, the date, the attribution and the typed text."""
    for request_ in (IN_A1, IN_A2, IN_A2C, IN_B1, IN_COMMIT, IN_MAIN1, IN_SUB1, IN_SUB2, IN_MAIN2):
        body, changes = IN_PLACE.normalise(request_)
        assert changes in ((), ("strip-cache-control",)), changes
        assert not any(m["role"] == "system" for m in request_.body["messages"])
        assert not request_.body["system"][0]["text"].startswith("x-anthropic-billing-header")
        assert body == ClaudeCodeAdapter().normalise(request_)[0]  # environment-to-system finds nothing to move
    reminders = [b["text"] for b in IN_A1.body["messages"][0]["content"]]
    starts = (
        "# Environment",
        "You are powered by the model",
        "The following deferred tools",
        "Available agent types",
        "The following skills",
        "As you answer the user's questions",
        "Today's date is 2026-12-03.",
        "Attribution for git commits",
    )
    assert len(reminders) == len(starts) + 1
    for reminder, start in zip(reminders, starts, strict=False):
        assert reminder.startswith(f"<system-reminder>\n{start}"), (reminder[:60], start)
    assert reminders[-1] == "say ok"


def test_claude_code_as_installed_has_two_project_levels() -> None:
    """The project head ends after the attribution reminder; its shorter level after the skills, before
    the git status: the same in one project after a commit, another in another project. A subagent gets
    them too (its own head has no per-project text)."""
    a1, a2, b1, commit = (head_of(IN_PLACE, r) for r in (IN_A1, IN_A2, IN_B1, IN_COMMIT))
    assert a1 == a2 and a1.project_tail.startswith("<system-reminder>\nAttribution")
    assert a1.project_base.startswith("<system-reminder>\nThe following skills")
    assert replace(a1, project_tail="", project_base="") == replace(b1, project_tail="", project_base="")
    chat_a, chat_commit, chat_b = (chat_of(IN_PLACE, r) for r in (IN_A1, IN_COMMIT, IN_B1))

    def upto(chat: dict[str, Any], end: str) -> str:
        parts = [p["text"] for p in chat["messages"][1]["content"]]
        return "".join(parts[: parts.index(end) + 1])

    assert upto(chat_a, a1.project_base) == upto(chat_commit, commit.project_base)  # the environment stays
    assert upto(chat_a, a1.project_tail) != upto(chat_commit, commit.project_tail)  # the git status moved
    assert upto(chat_a, a1.project_base) != upto(chat_b, b1.project_base)  # another project's environment
    sub = head_of(IN_PLACE, IN_SUB1)
    assert MEMORY_MARKER not in sub.system_head and "/home/dev" not in sub.system_head + sub.tools_json
    assert sub.project_base.startswith("<system-reminder>\nThe following skills") and sub.project_tail


def test_claude_code_system_entries_become_user_text_in_place() -> None:
    for request_ in (CC_A1, CC_A2C, CC_SUB2):
        body, _ = IN_PLACE.normalise(request_)
        before, after = request_.body["messages"], body["messages"]
        assert len(after) == len(before) and not any(m["role"] == "system" for m in after)
        for old, new in zip(before, after, strict=False):
            if old["role"] == "system":
                text = old["content"] if isinstance(old["content"], str) else old["content"][0]["text"]
                assert new == {"role": "user", "content": text}
        again, changes = IN_PLACE.normalise(Incoming(api="anthropic", headers={}, body=body))
        assert again is body and changes == ()  # already normal: nothing more to do


@pytest.mark.parametrize(("turn1", "turn2"), [(CC_A2, CC_A2C), (CC_MAIN1, CC_MAIN2), (CC_SUB1, CC_SUB2)])
def test_claude_code_turns_extend_message_by_message(turn1: Incoming, turn2: Incoming) -> None:
    """Raw, turn 2 rewrites turn 1's environment entry (block list -> string, cache_control moved)."""
    first, second = (ClaudeCodeAdapter().normalise(t)[0]["messages"] for t in (turn1, turn2))
    assert turn2.body["messages"][: len(turn1.body["messages"])] != turn1.body["messages"]
    assert second[: len(first)] == first and len(second) > len(first)
    chat1, chat2 = (to_chat(ClaudeCodeAdapter().normalise(t)[0]) for t in (turn1, turn2))
    assert chat2["messages"][: len(chat1["messages"])] == chat1["messages"]


# -- sessions ---------------------------------------------------------------------------------------------------


def test_sessions() -> None:
    main = "f1b42806-53e4-4fab-addc-d62436d681d3"
    cc = ClaudeCodeAdapter()
    assert cc.session(CC_MAIN1) == cc.session(CC_MAIN2) == main
    assert cc.session(CC_SUB1) == cc.session(CC_SUB2) == f"{main}:aa86a61dd2d2754c8"  # its own conversation
    assert cc.session(CC_A2) == cc.session(CC_A2C) != cc.session(CC_A1)
    headless = Incoming(api="anthropic", headers={}, body=CC_A1.body)
    assert cc.session(headless) == "b40e3850-96b7-4cdc-bcee-acc2c7bce9ee"  # from metadata.user_id
    assert cc.session(Incoming(api="anthropic", headers={}, body={"metadata": {"user_id": "{"}})) is None
    pi = PiAdapter()
    assert pi.session(PI_A1) is None  # pi sends no id unless sendSessionAffinityHeaders is on
    assert pi.session(PI_AFF1) == "01a22be1-5b88-7004-99f2-059d97024cba"
    assert pi.session(PI_AFF2C) not in (None, pi.session(PI_AFF1))
    oc = OpenCodeAdapter()
    assert oc.session(OC_MAIN1) == oc.session(OC_MAIN2) == OC_MAIN1.headers["x-session-id"]
    assert oc.session(OC_SUB1) == OC_SUB1.headers["x-session-id"] != oc.session(OC_MAIN1)
    assert OC_SUB1.headers["x-parent-session-id"] == oc.session(OC_MAIN1)
    assert GenericAdapter().session(OC_SUB1) == OC_SUB1.headers["x-session-affinity"]
    assert GenericAdapter().session(PI_A1) is None


# -- heads: the same across sessions and projects, on the text -------------------------------------------------


def test_claude_code_head_is_shared_and_ends_at_the_memory_marker() -> None:
    cc = ClaudeCodeAdapter()
    heads = [
        replace(head_of(cc, r), project_tail="", project_base="")  # the project levels are per project
        for r in (CC_A1, CC_A2, CC_A2C, CC_ATTR0, project_b(CC_A1), CC_MAIN1, CC_MAIN2)
    ]
    assert all(h == heads[0] for h in heads)
    assert heads[0].system_head.endswith(MEMORY_MARKER) and heads[0].n_tools == 12
    assert heads[0].system_head.startswith("You are a Claude agent, built on Anthropic's Claude Agent SDK.")
    sub = [head_of(cc, r) for r in (CC_SUB1, CC_SUB2)]
    assert sub[0] == sub[1] and sub[0].n_tools == 10 and MEMORY_MARKER not in sub[0].system_head
    assert sub[0].system_head.startswith("You are a Claude agent")  # no per-project part: the whole prompt


def test_pi_head_is_shared_and_stops_before_the_date() -> None:
    pi = PiAdapter()
    heads = [head_of(pi, r) for r in (PI_A1, PI_A2, PI_A2C, project_b(PI_A1), PI_AFF1, PI_AFF2C)]
    assert all(h == heads[0] for h in heads)
    assert heads[0].marker == "\nCurrent date: "
    assert heads[0].system_head.endswith("(e.g., tui.md for TUI API details)")
    assert "cache_control" not in heads[0].tools_json and heads[0].n_tools == 4
    for marker in ("\n\n# Project Context\n\n", "\n\nThe following skills provide specialized instructions"):
        messages = [
            {
                "role": "system",
                "content": PI_A1.body["messages"][0]["content"].replace(
                    "\nCurrent date: ", marker + "per-project text\nCurrent date: "
                ),
            },
            PI_A1.body["messages"][1],
        ]
        head = pi.head({**PI_A1.body, "messages": messages})
        assert isinstance(head, Head) and head.marker == marker
        assert (head.tools_json, head.system_head) == (heads[0].tools_json, heads[0].system_head)
    developer = [{**PI_A1.body["messages"][0], "role": "developer"}, PI_A1.body["messages"][1]]
    assert pi.head({**PI_A1.body, "messages": developer}) == heads[0]


def test_opencode_head_is_shared_and_skips_the_title_request() -> None:
    oc = OpenCodeAdapter()
    assert head_of(oc, OC_A) == head_of(oc, OC_B) == head_of(oc, OC_A2)
    main, sub = head_of(oc, OC_MAIN1), head_of(oc, OC_SUB1)
    assert main == head_of(oc, OC_MAIN2) and sub == head_of(oc, OC_SUB2)
    assert main.system_head == sub.system_head and main.tools_json != sub.tools_json  # the subagent has fewer tools
    assert isinstance(oc.head(OC_TITLE.body), Skip)
    assert GenericAdapter().head(OC_A.body) == head_of(oc, OC_A)


def test_heads_skip_what_has_no_head() -> None:
    cc, pi = ClaudeCodeAdapter(), PiAdapter()
    no_tools = {k: v for k, v in CC_A1.body.items() if k != "tools"}
    assert isinstance(cc.head(to_chat(no_tools)), Skip)
    assert isinstance(cc.head(to_chat({**CC_A1.body, "system": None})), Skip)
    assert isinstance(pi.head({**PI_A1.body, "messages": [PI_A1.body["messages"][1]]}), Skip)
    plain = [{"role": "system", "content": "no footer here"}, PI_A1.body["messages"][1]]
    assert isinstance(pi.head({**PI_A1.body, "messages": plain}), Skip)
    assert isinstance(pi.head({**PI_A1.body, "lora": [{"id": 0, "scale": 1}]}), Skip)
    assert isinstance(cc.head({**to_chat(CC_A1.body), "lora": [{"id": 0, "scale": 1}]}), Skip)


# -- heads on the real server: identical tokens, a strict prefix of every request ------------------------------


def rendered(client: SlotClient, chat: dict[str, Any], *, generation_prompt: bool = True) -> tuple[str, list[int]]:
    body = chat if generation_prompt else {**chat, "add_generation_prompt": False}
    prompt = client.apply_template(body)
    return prompt, [token for token, _ in client.tokenize_pieces(prompt)]


def head_tokens(client: SlotClient, adapter: Adapter, request: Incoming) -> tuple[list[int], list[int]]:
    """The head's tokens cut as the core cuts them, and the whole request's tokens."""
    chat = chat_of(adapter, request)
    head = adapter.head(chat)
    assert isinstance(head, Head)
    prompt = client.apply_template(chat)
    offset = locate_head(prompt, head)
    assert offset is not None
    pieces = client.tokenize_pieces(prompt)
    return tokens_before(pieces, len(prompt[:offset].encode())), [token for token, _ in pieces]


@pytest.mark.rig
def test_heads_are_strict_token_prefixes_on_the_real_server(llama_server: Any) -> None:
    server = llama_server("qwen35", ctx_size=2048)
    with SlotClient(server.url) as client:
        groups: list[tuple[Adapter, list[Incoming]]] = [
            (ClaudeCodeAdapter(), [CC_A1, CC_A2, project_b(CC_A1), CC_A2C, CC_MAIN2]),
            (ClaudeCodeAdapter(), [CC_SUB1, CC_SUB2]),
            (PiAdapter(), [PI_A1, PI_A2, project_b(PI_A1), PI_AFF1, PI_AFF2C]),
            (OpenCodeAdapter(), [OC_A, OC_A2, OC_B]),
            (OpenCodeAdapter(), [OC_MAIN1, OC_MAIN2]),
        ]
        for adapter, requests in groups:
            cuts = [head_tokens(client, adapter, r) for r in requests]
            head = cuts[0][0]
            for tokens, whole in cuts:
                assert tokens == head, adapter.name
                assert whole[: len(head)] == head and len(whole) > len(head), adapter.name
        # the Qwen3.5 template renders the tools first: the head holds all of them, then the system text
        for adapter, request_ in ((ClaudeCodeAdapter(), CC_A1), (PiAdapter(), PI_A1), (OpenCodeAdapter(), OC_A)):
            prompt = client.apply_template(chat_of(adapter, request_))
            head = adapter.head(chat_of(adapter, request_))
            assert isinstance(head, Head)
            assert prompt.index("</tools>") < (locate_head(prompt, head) or 0), adapter.name


@pytest.mark.rig
def test_a_turn_renders_as_a_strict_extension_of_the_last(llama_server: Any) -> None:
    """Turn 1 without its generation prompt is a token prefix of turn 2: the conversation's
    tokens stay in the slot. Both forms of Claude Code's environment entry render the same."""
    server = llama_server("qwen35", ctx_size=2048)
    with SlotClient(server.url) as client:
        pairs: list[tuple[Adapter, Incoming, Incoming]] = [
            (ClaudeCodeAdapter(), CC_A2, CC_A2C),
            (ClaudeCodeAdapter(), CC_MAIN1, CC_MAIN2),
            (ClaudeCodeAdapter(), CC_SUB1, CC_SUB2),
            (PiAdapter(), PI_A2, PI_A2C),
            (OpenCodeAdapter(), OC_MAIN1, OC_MAIN2),
        ]
        for adapter, turn1, turn2 in pairs:
            _, first = rendered(client, chat_of(adapter, turn1), generation_prompt=False)
            _, second = rendered(client, chat_of(adapter, turn2))
            assert second[: len(first)] == first and len(second) > len(first), (adapter.name, len(first))
        # pi's anthropic cache-control format changes the JSON, not the prompt
        assert rendered(client, PI_A1.body) == rendered(client, PI_AFF1.body)


@pytest.mark.rig
def test_claude_code_project_levels_are_strict_token_prefixes_on_the_real_server(llama_server: Any) -> None:
    """As installed: head < shorter level < project head < request, as tokens of the real server; a
    second session shares the project head (its own text is all that is left: 9 tokens), a session
    after a commit shares only the shorter level (it processes the git status, the date and the
    attribution: ~300 tokens instead of ~3,200 from the head), another project shares the head."""
    from oc_prefix_cache.chat.head import message_text
    from oc_prefix_cache.engine.planner import HeadPlanner
    from oc_prefix_cache.llama.families import CacheFacts, Family
    from oc_prefix_cache.llama.fingerprint import FileIdentity, ServerIdentity

    identity = ServerIdentity(
        model_digest="0123456789abcdef0123456789abcdef",
        build_id="b0-unknown",
        model_path="/m/model.gguf",
        model_files=(FileIdentity("model.gguf", 100, 1),),
        build="b0-unknown|x|1|2",
        chat_template_digest="t",
        n_ctx=16384,
        total_slots=1,
        kv_types="f16/f16",
        cache=CacheFacts(Family.HYBRID),
    )
    server = llama_server("qwen35", ctx_size=16384)
    planner = HeadPlanner()
    with SlotClient(server.url) as client:

        def plan(request_: Incoming) -> Any:
            chat = chat_of(IN_PLACE, request_)
            full = planner.plan(
                client,
                chat,
                head_of(IN_PLACE, request_),
                server=identity,
                harness="claude-cli/2.1.332",
                system_text=message_text(chat["messages"][0]),
            )
            whole = [token for token, _ in client.tokenize_pieces(full.prompt)]
            assert list(full.request_tokens) == whole  # the tokens the server will see
            for shorter, longer in (
                (full.tokens, full.base),
                (full.base, full.project),
                (full.project, full.request_tokens),
            ):
                assert len(shorter) < len(longer) and longer[: len(shorter)] == shorter
            return full

        a1, a2, commit, b1, sub = (plan(r) for r in (IN_A1, IN_A2, IN_COMMIT, IN_B1, IN_SUB1))
    assert (a1.project, a1.project_text, a1.base_text) == (a2.project, a2.project_text, a2.base_text)
    assert len(a2.request_tokens) - len(a2.project) < 20
    assert commit.base == a1.base and commit.base_text == a1.base_text and commit.project != a1.project
    after_commit = len(commit.request_tokens) - len(commit.base)
    assert after_commit < 0.15 * (len(commit.request_tokens) - len(commit.tokens)), after_commit
    assert b1.tokens == a1.tokens and b1.base != a1.base
    assert sub.tokens != a1.tokens and sub.base and sub.project  # a subagent: its own head, its own levels
