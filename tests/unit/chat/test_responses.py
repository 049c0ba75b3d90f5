"""The Responses -> chat conversion (oc_prefix_cache/responses.py), case by case as b11434's
``server_chat_convert_responses_to_chatcmpl`` does it; the real server's own rendering of the
same bodies is compared in test_proxy_server.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.responses import prepared, to_chat
from oc_prefix_cache.doors.relay import learn
from oc_prefix_cache.engine.tracker import Observation
from oc_prefix_cache.errors import TranslationError
from oc_prefix_cache.harness import CodexAdapter, Incoming
from tests.helpers import DATA

TOOL = {"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"}}


def test_a_codex_like_turn_becomes_the_servers_chat_body() -> None:
    body = {
        "model": "m",
        "instructions": "be codex",
        "stream": True,
        "tools": [TOOL, {"type": "web_search"}],
        "max_output_tokens": 99,
        "reasoning": {"effort": "low", "summary": "auto"},
        "id_slot": 1,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
            {"type": "message", "role": "user", "content": "fix it"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "done"}],
            },
        ],
    }
    chat = to_chat(body)
    assert list(chat) == ["model", "stream", "id_slot", "messages", "tools", "max_tokens", "reasoning_effort"]
    assert chat["id_slot"] == 1  # kept: a Responses request can be pinned as it is
    assert chat["messages"] == [
        {"role": "system", "content": "be codex"},
        {"role": "developer", "content": [{"text": "sandbox", "type": "text"}]},
        {"role": "user", "content": [{"text": "fix it", "type": "text"}]},
        {
            "role": "assistant",
            "content": [],
            "reasoning_content": "hm",
            "tool_calls": [{"function": {"arguments": "{}", "name": "shell"}, "id": "c1", "type": "function"}],
        },
        {"content": "ok", "role": "tool", "tool_call_id": "c1"},
        {"role": "assistant", "content": [{"text": "done", "type": "text"}]},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "shell", "description": "run", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert (chat["max_tokens"], chat["reasoning_effort"]) == (99, "low")
    assert body["input"][1]["content"] == "fix it"  # the client's body is not changed


def test_a_plain_string_input_and_the_servers_refusals() -> None:
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    for bad, words in [
        ({}, "'input' is required"),
        ({"input": "x", "previous_response_id": "r1"}, "previous_response_id"),
        ({"input": 3}, "string or array"),
        ({"input": [{"type": "mystery"}]}, "Cannot determine"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ({"input": "x", "tools": {}}, "'tools' must be an array"),
    ]:
        with pytest.raises(TranslationError, match=words):
            to_chat(bad)


def test_the_reuse_numbers_of_a_whole_responses_answer_come_from_its_usage() -> None:
    tail = (
        b'{"id":"resp_1","object":"response","output":[],"status":"completed","usage":{"input_tokens":900,'
        b'"output_tokens":5,"total_tokens":905,"input_tokens_details":{"cached_tokens":850}}}'
    )
    learned = learn(tail)
    assert learned is not None and (learned.cache_n, learned.prompt_n, learned.predicted_n) == (850, 50, 5)


# -- against the real server ---------------------------------------------------------------------------

CODEX = DATA / "codex-0.171.0"


def codex_body(run: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CODEX / f"{run}.json").read_text())["body_json"]
    return data


def server_prompt(url: str, log_dir: Path, body: dict[str, Any]) -> tuple[httpx.Response, str | None]:
    """POST to /v1/responses and read back the prompt the server logged for it (if it rendered one)."""
    for old in log_dir.iterdir():
        old.unlink()
    response = loopback.post(f"{url}/v1/responses", json=body, timeout=60)
    logged = sorted(log_dir.iterdir())
    return response, logged[0].read_text() if logged else None


@pytest.mark.rig
def test_the_servers_own_rendering_of_a_responses_request_is_the_prepared_chat_bodys(
    llama_server: Any, tmp_path: Path
) -> None:
    """What the proxy prepares is what the server runs: for Codex's captured requests (and a later
    turn with a tool call and its output), normalised, `/apply-template` of `prepared(body)` equals
    the prompt the server renders for the `/v1/responses` request itself (`--log-prompts-dir`; a
    small `-c` refuses the long bodies before any prefill). As Codex sends them, both refuse them
    with the same error."""
    log_dir = tmp_path / "prompts"
    server = llama_server("qwen35", ctx_size=2048, extra_args=("--log-prompts-dir", str(log_dir)))
    later = codex_body("A1")
    later["input"] = later["input"] + [
        {"type": "function_call", "name": "exec_command", "arguments": '{"cmd":"ls"}', "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\ncalc.py"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and now?"}]},
    ]
    codex = CodexAdapter()
    for name, raw in (("A1", codex_body("A1")), ("B1", codex_body("B1")), ("A1 later turn", later)):
        refused, _ = server_prompt(server.url, log_dir, raw)  # as Codex sends it: two system messages
        as_chat = loopback.post(f"{server.url}/apply-template", json=prepared(raw), timeout=30)
        assert refused.status_code == as_chat.status_code == 500, name
        assert "System message must be at the beginning" in refused.text and refused.json() == as_chat.json(), name
        body, _ = codex.normalise(Incoming(api="responses", headers={}, body=raw))
        _, theirs = server_prompt(server.url, log_dir, body)
        ours = loopback.post(f"{server.url}/apply-template", json=prepared(body), timeout=30)
        assert theirs is not None and ours.status_code == 200, name
        assert ours.json()["prompt"] == theirs, name


@pytest.mark.rig
def test_a_responses_request_runs_on_the_slot_its_id_slot_names(llama_server: Any) -> None:
    server = llama_server("qwen35", ctx_size=8192, parallel=2)
    body = {"model": "m", "input": "count to three", "max_output_tokens": 4, "id_slot": 1}
    answer = loopback.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    slots = {s["id"]: Observation.of(s) for s in loopback.get(f"{server.url}/slots", timeout=10).json()}
    assert slots[1].n_tokens and not slots[0].n_tokens, slots  # b11434 keeps id_slot through its conversion
    learned = learn(answer.content)
    assert learned is not None and learned.cache_n + learned.prompt_n > 0  # usage read from the whole answer
