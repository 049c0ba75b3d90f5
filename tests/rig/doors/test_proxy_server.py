"""`ocpc proxy` in front of the real llama-server (rig): slot affinity with -np 2, a client that
goes away mid-stream (the server's task is cancelled), and the server's own errors passed on."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.doors.proxy import Bounds
from tests.helpers import PROJ_A, PROJ_B, SUITE_WAIT_S, UA, capture
from tests.unit.doors.test_proxy import post

pytestmark = pytest.mark.rig
END_AT_ONCE = ("--logit-bias", "151645+30")


def turn(body: dict[str, Any], n: int) -> dict[str, Any]:
    """The conversation after ``n - 1`` more exchanges, streamed with a short answer."""
    messages = list(body["messages"])
    for i in range(2, n + 1):
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"and now step {i}"}]
    return {**body, "messages": messages, "stream": True, "max_tokens": 4}


def test_two_openai_conversations_alternate_on_their_own_slots(llama_server: Any, proxy_for: Any) -> None:  # noqa: F811
    server = llama_server("qwen35", ctx_size=65536, parallel=2, extra_args=END_AT_ONCE)
    proxy = proxy_for(server.url)
    conversations = {"P": (capture(PROJ_A), "ses-parent"), "Q": (capture(PROJ_B), "ses-other-prompt")}
    rows = []
    for n in (1, 2, 3):
        for name, (body, session) in conversations.items():
            response = post(proxy.url, turn(body, n), headers={"user-agent": UA, "x-session-id": session}, timeout=300)
            assert response.status_code == 200 and b'"timings"' in response.content
            record = proxy.status()["recent"][-1]
            rows.append(
                {
                    "conversation": name,
                    "turn": n,
                    **{k: record[k] for k in ("slot", "rule", "action", "cache_n", "prompt_n")},
                }
            )
    print("\n" + "\n".join(json.dumps(row) for row in rows))
    slots = {name: {r["slot"] for r in rows if r["conversation"] == name} for name in conversations}
    assert len(slots["P"]) == 1 and len(slots["Q"]) == 1 and slots["P"] != slots["Q"], rows
    for row in rows:
        if row["turn"] > 1:  # only the new exchange is processed, the rest is reused from its own slot
            assert row["rule"] == "own" and row["prompt_n"] < 60 and row["cache_n"] > 7000, row


def test_conversations_without_a_session_id_keep_their_own_slots(llama_server: Any, proxy_for: Any) -> None:  # noqa: F811
    """Two conversations with no session id (a harness that sends none, such as pi), named by their
    first messages. The slot choice and the prepare must give each one name: when they did not, a
    conversation's next turn missed its own slot, took the other, and its prepare waited to its
    deadline for a park of its own slot that nobody was going to write."""
    server = llama_server("qwen35", ctx_size=65536, parallel=2, extra_args=END_AT_ONCE)
    proxy = proxy_for(server.url, bounds=Bounds(prepare_s=20))
    rows = []
    for n in (1, 2, 3):
        for name, body in (("P", capture(PROJ_A)), ("Q", capture(PROJ_B))):
            started = time.monotonic()
            response = post(proxy.url, turn(body, n), headers={"user-agent": UA}, timeout=300)
            assert response.status_code == 200 and b'"timings"' in response.content
            record = proxy.status()["recent"][-1]
            rows.append(
                {
                    "conversation": name,
                    "turn": n,
                    "s": round(time.monotonic() - started, 1),
                    **{k: record[k] for k in ("slot", "rule", "action", "ready_ms", "cache_n", "prompt_n")},
                }
            )
    print("\n" + "\n".join(json.dumps(row) for row in rows))
    slots = {name: {r["slot"] for r in rows if r["conversation"] == name} for name in ("P", "Q")}
    assert len(slots["P"]) == 1 and len(slots["Q"]) == 1 and slots["P"] != slots["Q"], rows
    for row in rows:
        if row["turn"] > 1:
            assert (row["rule"], row["action"]) == ("own", "hit") and row["ready_ms"] < 5000, row
            assert row["prompt_n"] < 60 and row["cache_n"] > 7000, row


def test_a_client_that_goes_away_mid_stream_cancels_the_servers_task(llama_server: Any, proxy_for: Any) -> None:  # noqa: F811
    server = llama_server("qwen35", ctx_size=4096)  # no logit bias: it would generate all 3000 tokens
    proxy = proxy_for(server.url)
    body = {
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
    }
    with loopback.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=60) as response:
        chunks = response.iter_raw()
        for _ in range(3):
            next(chunks)
    started = time.monotonic()
    idle = False
    while time.monotonic() - started < SUITE_WAIT_S:  # uncancelled, its 3000 tokens end too: the count tells
        slot = loopback.get(server.url + "/slots", timeout=5).json()[0]
        if not slot["is_processing"]:
            idle = True
            break
        time.sleep(0.1)
    log = Path(server.log_path).read_text(errors="replace")
    cancelled = re.search(r"cancel task, id_task = (\d+)", log)
    assert idle and cancelled, "the server kept generating for the client that left:\n" + log[-3000:]
    stopped = re.search(rf"task {cancelled.group(1)} \| stop processing: n_tokens = (\d+)", log)
    assert stopped and int(stopped.group(1)) < 3000, log[-3000:]  # it never generated its 3000 tokens
    print(
        f"\nslot idle {time.monotonic() - started:.2f} s after the client left; {cancelled.group(0)}, "
        f"stopped at {stopped.group(1)} tokens"
    )
    assert proxy.counters()["client_disconnected"] == 1
    assert post(proxy.url, {**body, "stream": False, "max_tokens": 2}).status_code == 200  # nothing stuck


def test_the_servers_own_errors_come_back_unchanged(llama_server: Any, proxy_for: Any) -> None:  # noqa: F811
    server = llama_server("qwen35", ctx_size=2048)
    proxy = proxy_for(server.url)
    for raw, path in (
        (b"{garbage", "/v1/chat/completions"),
        (b'{"messages": 3}', "/v1/chat/completions"),
        (b"[1, 2]", "/v1/messages"),
        (b'{"model": "m"}', "/v1/messages"),
    ):
        direct = loopback.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        through = post(proxy.url, raw, path=path)
        assert (through.status_code, through.content) == (direct.status_code, direct.content), (raw, through.text)
        assert through.status_code >= 400


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_answers_through_the_proxy_equal_the_servers_own(
    llama_server: Any,
    proxy_for: Any,  # noqa: F811
    stream: bool,
) -> None:
    """The proxy sends an Anthropic request as a chat completion and translates the answer back:
    what the client gets equals the server's own /v1/messages answer but for the random ids."""
    server = llama_server("qwen35", ctx_size=4096, extra_args=("--cache-ram", "0"))
    proxy = proxy_for(server.url)
    body = {
        "model": "m",
        "max_tokens": 6,
        "temperature": 0,
        "top_k": 1,
        "stream": stream,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Say hello."}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    headers = {"user-agent": "claude-cli/2.1.332 (external, sdk-cli)", "x-claude-code-session-id": "s1"}
    answers = []
    for url in (server.url, proxy.url):
        loopback.post(f"{server.url}/slots/0?action=erase", timeout=30)
        response = post(url, body, path="/v1/messages?beta=true", headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(re.sub(rb'"(id)":"[^"]*"', b'"id":"X"', response.content))
    assert answers[0] == answers[1]
    assert proxy.status()["recent"][-1]["path"] == "/v1/chat/completions"  # it did go as a chat completion


def test_a_plugin_prepare_waits_for_the_proxys_held_slot_then_fails_open(llama_server: Any, proxy_for: Any) -> None:  # noqa: F811
    """One Engine and tracker for both front doors (as `ocpc launch` runs them): while the proxy
    holds slot 0 for a streaming answer, the daemon's prepare for the OpenCode plugin waits only
    within its own budget, then answers `failed`, and the plugin's request goes on."""
    from oc_prefix_cache.deadline import Deadline

    server = llama_server("qwen35", ctx_size=16384)
    proxy = proxy_for(server.url)
    body = {"messages": [{"role": "user", "content": "count"}], "stream": True, "max_tokens": 4000, "ignore_eos": True}
    with loopback.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as response:
        chunks = response.iter_raw()
        next(chunks)  # the answer is streaming: the proxy holds the slot
        started = time.monotonic()
        result = proxy.proxy.engine.prepare(
            json.dumps(capture(PROJ_A)).encode(), {"user-agent": UA}, deadline=Deadline.after(3.0)
        )
        waited = time.monotonic() - started
        still = loopback.get(server.url + "/slots", timeout=5).json()[0]["is_processing"]
        assert sum(1 for _ in zip(range(20), chunks, strict=False)) == 20  # the answer still flows
    assert still, f"the answer ended before the prepare waited ({result}, {waited:.2f} s): the test proved nothing"
    # it failed open within its own budget (waiting for the held slot, or for a server busy with the
    # stream it serves), and changed nothing under the proxy's answer, which went on
    assert result.action == "failed" and waited < 4.0, (result, waited)


def test_a_server_restarted_with_fewer_slots_never_gets_a_request_pinned_past_its_last(
    llama_server: Any, proxy_for: Any
) -> None:  # noqa: F811
    """Issue 36, defect 8: the slot count was trusted for 30 s. A server restarted with fewer
    slots wraps an ``id_slot`` past its last (b11434), so a conversation that had slot 3 was
    pinned to "3" and ran in slot 1, over the conversation there, unparked. A restart ends what
    the proxy believed of the slot count."""
    server = llama_server("qwen3", ctx_size=4 * 16384, parallel=4, extra_args=END_AT_ONCE)
    proxy = proxy_for(server.url)  # the default bound: the count would be trusted for 30 s
    sessions = [f"ses-{i}" for i in range(4)]
    body = capture(PROJ_A)

    def send(session: str, n: int) -> dict[str, Any]:
        response = post(proxy.url, turn(body, n), headers={"user-agent": UA, "x-session-id": session}, timeout=300)
        assert response.status_code == 200 and b'"timings"' in response.content
        return dict(proxy.status()["recent"][-1])

    first = {session: send(session, 1)["slot"] for session in sessions}
    assert sorted(first.values()) == [0, 1, 2, 3], first
    server.config = type(server.config)(**{**server.config.__dict__, "parallel": 2})
    server.restart()
    after = [send(session, 2) for session in sorted(sessions, key=lambda s: first[s])]  # slot 0's first, slot 3's last
    print(
        "\n"
        + "\n".join(
            json.dumps({k: r[k] for k in ("conversation", "slot", "rule", "action", "cache_n", "prompt_n")})
            for r in after
        )
    )
    assert all(r["slot"] in (0, 1) for r in after), after  # never pinned past the server's last slot
    slots = loopback.get(f"{server.url}/slots", timeout=10).json()
    assert len(slots) == 2
