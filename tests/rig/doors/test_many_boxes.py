"""Many boxes (issue 39): two `ocpc launch --listen` boxes and `ocpc gateway` (smg from the installed
`gateway` extra, ocpc's front before it), each a real process, with real agents' binaries.

Claude Code sends a session header (``x-claude-code-session-id``) and Aider none; smg forwards
neither, nor their ``User-Agent``. The front keys each conversation (harness/routing_key.py), smg
routes by that key, and each box reads it back: every request of a conversation lands on one box,
and its later requests are served from that box's cache. A box's door refuses a request without
the deployment's token (401), whatever its address: these doors are on 127.0.0.2 and 127.0.0.3.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.boxes import MODEL_ALIAS, Box, Gateway, deployment_in, direct, pretty, token_of
from tests.e2e.test_e2e_aider import BIN as AIDER_BIN
from tests.e2e.test_e2e_aider import aider_home, finish, start_aider, wait_for
from tests.e2e.test_e2e_claude_code import BIN as CLAUDE_BIN
from tests.e2e.test_e2e_claude_code import END_AT_ONCE, claude_env, make_project, run_claude
from tests.helpers import DATA

pytestmark = pytest.mark.rig

TINY_ARGS = ("-c", "32768", *END_AT_ONCE)


@pytest.fixture
def deployment(models: dict[str, Path], tmp_path: Path) -> Iterator[tuple[list[Box], Gateway]]:
    boxes, gateway = deployment_in(tmp_path, 2)
    try:
        for box in boxes:
            box.start(models["qwen35"], server_args=TINY_ARGS)
        gateway.start(boxes)
        yield boxes, gateway
    finally:
        gateway.stop()
        for box in boxes:
            box.stop()


def test_two_agents_through_the_gateway_each_stay_on_one_box_and_are_served_from_its_cache(
    deployment: tuple[list[Box], Gateway], tmp_path: Path
) -> None:
    boxes, gateway = deployment
    claude, aider = CLAUDE_BIN.install(), AIDER_BIN.install()
    project_c = make_project(
        tmp_path / "projC", {"README.md": "# C\n", "calc.py": "def add(a, b):\n    return a + b\n"}
    )
    project_a = make_project(tmp_path / "projA", {"README.md": "# A\n", "greet.py": "print('hi')\n"})

    # Claude Code: one session, and the same session continued (its session id: a header smg drops)
    env = claude_env(gateway.url)
    run_claude(claude, env, project_c, "-p", "say ok")
    run_claude(claude, env, project_c, "--continue", "-p", "say ok again")
    # Aider: one interactive session of two turns (no session id at all)
    home = aider_home(tmp_path / "aider-home", gateway.url, boxes[0].server)
    session = start_aider(aider, home, project_a, tmp_path / "aider.log")
    try:
        for turn, text in enumerate(("say ok", "say ok again")):
            assert session.stdin is not None
            session.stdin.write(text + "\n")
            session.stdin.flush()
            wait_for(lambda n=turn + 1: _aider_requests(boxes) >= n, what=f"aider's turn {turn + 1} answered")
    finally:
        finish(session)

    rows = [{**r, "box": box.name} for box in boxes for r in box.network_rows()]
    front = gateway.status()
    print(pretty(rows))
    print(pretty(front["recent"]))
    by_conversation: dict[str, set[str]] = {}
    for row in rows:
        if row["conversation"]:
            by_conversation.setdefault(row["conversation"], set()).add(row["box"])
    keyed = {r["adapter"] for r in front["recent"] if r["key"]}
    assert {"claude-code", "aider"} <= keyed, front["recent"]
    # every conversation on one box: the routing key the front sent, read back by the box
    assert all(len(where) == 1 for where in by_conversation.values()), by_conversation
    assert all(c.startswith("routed-") for c in by_conversation), by_conversation
    for adapter in ("claude-code", "aider"):
        mine = [r for r in rows if r["adapter"] == adapter and r["conversation"]]
        assert len(mine) >= 2, (adapter, pretty(rows))
        # its later requests served from that box's cache: the earlier prompt is not processed again
        later = mine[-1]
        assert later["cache_n"] >= 0.5 * (later["cache_n"] + later["prompt_n"]), (adapter, later)
    for box in boxes:
        counters = box.status()["counters"]
        assert not [k for k in counters if k.startswith(("fail_open", "upstream_failed"))], counters


def _aider_requests(boxes: list[Box]) -> int:
    return sum(1 for box in boxes for r in box.network_rows() if r["adapter"] == "aider" and r["conversation"])


def test_a_box_door_off_loopback_refuses_a_request_without_the_token(deployment: tuple[list[Box], Gateway]) -> None:
    boxes, _ = deployment
    box = boxes[0]
    body = {"model": "local-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with direct() as client:
        for headers in ({}, {"authorization": "Bearer wrong-token-of-enough-length"}, {"authorization": "Basic x"}):
            answer = client.post(f"{box.door}/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 401, (headers, answer.text)
            assert answer.headers.get("www-authenticate", "").startswith("Bearer")
        good = {"authorization": f"Bearer {token_of(box.token_file)}"}
        assert client.post(f"{box.door}/v1/chat/completions", json=body, headers=good).status_code == 200
        # with the token, still nothing but the agents' API on the network
        for method, path in (
            ("GET", "/slots"),
            ("GET", "/ocpc/status"),
            ("GET", "/props"),
            ("POST", "/slots/0?action=erase"),
        ):
            answer = client.request(method, f"{box.door}{path}", headers=good)
            assert answer.status_code == 403, (method, path, answer.text)
        # the door answers to its own address only (a rebound name is not it)
        answer = client.post(f"{box.door}/v1/chat/completions", json=body, headers={**good, "host": "evil.example"})
        assert answer.status_code == 403
        # and the probe needs nothing
        assert client.get(f"{box.door}/health").status_code == 200
    with pytest.raises(httpx.HTTPError):  # the slot API is not on the network address at all
        with direct() as client:
            client.get(f"http://{box.address}:{box.server_port}/slots")


#: One first request of every agent ocpc supports, as captured (OpenCode's as its plugin-less proxy
#: path sends it), and the adapter that must read it on the box.
EVERY_AGENT = (
    ("aider-0.86.2/A1.json", "aider"),
    ("claude-code-2.1.332-installed/A1.json", "claude-code"),
    ("cline-3.0.65/A1.json", "cline"),
    ("codex-0.171.0/A1.json", "codex"),
    ("kilo-code-7.7.9/A1.json", "kilo-code"),
    ("opencode-1.18.33/02_projA_turn1_main_request.json", "opencode"),
    ("openhands-1.16.0/A1.json", "openhands"),
    ("pi-0.73.1/A1-affinity.json", "pi"),
    ("qwen-code-0.24.4/A1-memory.json", "qwen-code"),
)


def test_every_agents_request_goes_through_the_gateway_keyed_and_prepared_on_a_box(
    deployment: tuple[list[Box], Gateway],
) -> None:
    """Each agent's captured first request, with its own headers, sent to the front: smg forwards it
    (Codex's Responses body without the field smg's schema refuses), the box it lands on reads the
    adapter and the conversation from the routing key alone, and answers 200."""
    boxes, gateway = deployment
    with direct() as client:
        client.timeout = httpx.Timeout(600)
        for relative, _ in EVERY_AGENT:
            body, headers, path = capture_request(relative)
            answer = client.post(f"{gateway.url}{path}", json=body, headers=headers)
            assert answer.status_code == 200, (relative, answer.text[:500])
    rows = [r for box in boxes for r in box.network_rows()]
    served = {r["adapter"] for r in rows if r["conversation"].startswith("routed-") and r["action"] in PREPARED}
    assert served >= {adapter for _, adapter in EVERY_AGENT}, pretty(rows)
    counters = gateway.status()["counters"]
    assert counters.get("normalised:gateway-responses-fields") == 1, counters


PREPARED = ("warmed", "restored", "hit", "skipped", "loaded")


def capture_request(relative: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """A capture's body (its model the boxes' alias, its output cut short), headers and path."""
    path = DATA / relative
    data = json.loads(path.read_text())
    if "body_json" not in data:  # opencode-1.18.33: the body alone, its headers beside it
        listed = json.loads((path.parent / "headers_and_hashes.json").read_text())[path.name]["headers"]
        data = {"body_json": data, "headers": listed, "path": "/v1/chat/completions"}
    body = dict(data["body_json"])
    body["model"] = MODEL_ALIAS
    for field in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        if field in body:
            body[field] = 16
    pairs = data["headers"].items() if isinstance(data["headers"], dict) else data["headers"]
    dropped = ("host", "content-length", "accept-encoding", "connection", "authorization", "x-api-key")
    headers = {str(k): str(v) for k, v in pairs if str(k).lower() not in dropped}
    return body, headers, data["path"].split("?")[0]
