"""chat/anthropic.py proved against llama-server b11434 itself, not against our reading of it.

How each half is proved on the real server:

* Requests: the server's rendering of an Anthropic request is read from ``--log-prompts-dir``
  (written before the prompt is processed; a small ``-c`` then refuses the long captured bodies at
  once with "exceeds the available context size", so no prefill runs). It must equal
  ``/apply-template`` of ``to_chat(body)``, character for character, and the server's own token
  count (``n_prompt_tokens`` of that error, ``/v1/messages/count_tokens``) must equal ours.
  A body the template refuses must be refused with the same error on both paths.
* Responses: the same request goes to ``/v1/messages`` (the server's conversion) and, as
  ``upstream_body(to_chat(body))``, to ``/v1/chat/completions`` + ``StreamTranslator``; with greedy
  sampling, the slot erased before each and no RAM prompt cache, the event bytes must be the same
  except for the random ids. ``to_message`` is compared the same way without streaming.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.anthropic import (
    StreamTranslator,
    dump_json,
    normalize_billing_header,
    sse_event,
    to_chat,
    to_message,
    upstream_body,
    upstream_bytes,
)
from oc_prefix_cache.errors import TranslationError
from oc_prefix_cache.harness import ClaudeCodeAdapter, Incoming
from tests.helpers import DATA

CC_BODIES = [DATA / "claude-code-2.1.332" / f"{run}.json" for run in ("A1", "A2", "A2-continue", "A3-attr0")]
SUB_BODIES = sorted((DATA / "claude-code-2.1.332-subagent").glob("000*.json"))
IM_END, TOOL_CALL = 151645, 151657  # token ids in the tiny models' (Qwen) vocabulary
BUDGET = {"max_tokens": 12, "thinking": {"type": "enabled", "budget_tokens": 3}}  # 3 thinking tokens, then text
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"model": "m", "temperature": 0, "top_k": 1, "stream": True, "system": "You are terse."}

BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
FEATURES: dict[str, Any] = {
    "model": "m",
    "system": [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "document", "text": "not a text block: left out"},
    ],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there", "cache_control": {}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "calling"},
                {
                    "type": "tool_use",
                    "id": "t1",
                    "name": "get",
                    "input": {"k": "v", "n": 1.5, "u": "é\n", "l": [1, None]},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"type": "text", "text": "and?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "bare"}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": "plain", "is_error": True},
                {"type": "tool_result", "tool_use_id": "t3"},
            ],
        },
        {"role": "assistant", "content": "a string"},
        {"role": "user", "content": "last", "extra": "kept"},
    ],
    "tools": [
        {
            "name": "get",
            "description": "get a thing",
            "input_schema": {"type": "object", "properties": {"k": {"type": "string"}}},
        },
        {"name": "bare", "cache_control": {"type": "ephemeral"}},
    ],
    "tool_choice": {"type": "tool", "name": "get"},
    "stop_sequences": ["zz"],
    "max_tokens": 1,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 3,
    "thinking": {"type": "enabled", "budget_tokens": 64},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "u-1"},
    "id_slot": 0,
    "stream": False,
}


def capture(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    data = json.loads(path.read_text())
    headers = data["headers"]
    pairs = headers.items() if isinstance(headers, dict) else headers
    return {str(k).lower(): str(v) for k, v in pairs}, data["body_json"]


def normalised(path: Path) -> dict[str, Any]:
    headers, body = capture(path)
    out, _ = ClaudeCodeAdapter().normalise(Incoming(api="anthropic", headers=headers, body=body))
    return out


# -- the conversion, rule by rule (server-chat.cpp, server_chat_convert_anthropic_to_oai) ------------------


def test_to_chat_follows_the_server_rule_by_rule() -> None:
    chat = to_chat(FEATURES)
    assert chat["messages"] == [
        # text blocks concatenated with nothing between them; the billing header's cch= rewritten
        {"role": "system", "content": BILLING.replace("cch=a5145;", "cch=fffff;") + "Be brief."},
        FEATURES["messages"][0],  # text blocks pass as they are (cache_control too)
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "calling"}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"k":"v","n":1.5,"u":"é\\n","l":[1,null]}'},
                }
            ],
            "reasoning_content": "hmm",
        },
        # the message's own text comes first, its tool results after it
        {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t2", "type": "function", "function": {"name": "bare", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "t2", "content": "plain"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        FEATURES["messages"][5],
        FEATURES["messages"][6],
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": "get a thing",
                "parameters": FEATURES["tools"][0]["input_schema"],
            },
        },
        {"type": "function", "function": {"name": "bare", "description": "", "parameters": {}}},
    ]
    rest = {k: v for k, v in chat.items() if k not in ("messages", "tools")}
    assert rest == {
        "tool_choice": "required",
        "stop": ["zz"],
        "max_tokens": 1,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 3,
        "stream": False,
        "thinking_budget_tokens": 64,
        "__metadata_user_id": "u-1",
    }  # no id_slot, no output_config: the server drops them


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"tool_choice": {"type": "auto"}}, {"tool_choice": "auto"}),
        ({"tool_choice": {"type": "any"}}, {"tool_choice": "required"}),
        ({"tool_choice": {"type": "none"}}, {}),  # ignored by the server: the default (auto) applies
        ({"tool_choice": "auto"}, {}),
        ({"thinking": {"type": "enabled"}}, {"thinking_budget_tokens": 10000}),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, {}),
        ({"thinking": {"type": "disabled"}}, {}),
        ({"metadata": {"user_id": ""}}, {}),
        ({"system": None}, {}),
    ],
)
def test_to_chat_options(extra: dict[str, Any], expected: dict[str, Any]) -> None:
    chat = to_chat({"messages": [{"role": "user", "content": "x"}], **extra})
    assert {k: v for k, v in chat.items() if k != "messages"} == {"max_tokens": 4096, **expected}
    assert chat["messages"] == [{"role": "user", "content": "x"}]


def test_to_chat_refuses_what_the_server_refuses_and_keeps_the_body_intact() -> None:
    with pytest.raises(TranslationError, match="'messages' is required"):
        to_chat({"model": "m"})
    before = json.dumps(FEATURES)
    to_chat(FEATURES)
    assert json.dumps(FEATURES) == before


def test_billing_header_rewrite_is_the_servers() -> None:
    example = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code"
    assert normalize_billing_header(example) == example.replace("cch=a5145;", "cch=fffff;")
    # Claude Code 2.1.332 sends no cch=: the server leaves its fingerprint alone
    header = "x-anthropic-billing-header: cc_version=2.1.332.9a2; cc_entrypoint=sdk-cli;"
    assert normalize_billing_header(header) == header
    assert normalize_billing_header("cch=a5145;") == "cch=a5145;"


def test_upstream_body_adds_output_only_fields() -> None:
    chat = to_chat({"messages": [{"role": "user", "content": "x"}]})
    body = upstream_body(chat, id_slot=1)
    assert body == {
        **chat,
        "timings_per_token": True,
        "verbose": True,
        "response_fields": ["stopping_word"],
        "id_slot": 1,
    }
    assert "id_slot" not in upstream_body(chat)


@pytest.mark.parametrize("path", CC_BODIES + SUB_BODIES, ids=lambda p: p.name)
def test_the_proxys_upstream_bytes_equal_the_dumped_upstream_body(path: Path) -> None:
    """The proxy appends the output-only fields to the chat's bytes instead of dumping the
    whole history twice; the bytes must be exactly the dumped ``upstream_body``."""
    chat = to_chat(capture(path)[1])
    for slot in (None, 0, 3):
        expected = dump_json(upstream_body(chat, id_slot=slot)).encode()
        assert upstream_bytes(dump_json(chat).encode(), id_slot=slot) == expected


# -- the stream translator: faults the real server does not produce on demand ---------------------------------


def test_translator_passes_errors_and_pings_and_survives_garbage() -> None:
    translator = StreamTranslator()
    error = {"code": 500, "message": "boom", "type": "server_error"}
    assert translator.feed(b":\n\n") == b":\n\n"
    crlf = b'data: {"error": ' + json.dumps(error).encode() + b"}\r\n\r\n"
    assert translator.feed(crlf) == sse_event("error", error)
    garbage = translator.feed(b"data: <html>\n\n")
    assert garbage.startswith(b'event: error\ndata: {"code":500,') and b"non-JSON" in garbage
    assert translator.feed(b"data: [DONE]\n\n") == b""
    assert translator.close() == b""


def test_translator_flushes_an_unfinished_run_at_close() -> None:
    """A stream cut before its final result: what arrived is still translated, nothing invented."""
    translator = StreamTranslator()
    role = {
        "choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
        "id": "chatcmpl-1",
        "model": "m",
    }
    text = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "hi"}}], "id": "chatcmpl-1"}
    assert translator.feed(b"data: " + json.dumps(role).encode() + b"\n\ndata: " + json.dumps(text).encode()) == b""
    out = translator.close()
    assert out.count(b"event: ") == 3 and b"message_start" in out and b'"text":"hi"' in out
    assert b"message_stop" not in out and translator.usage == {
        "cache_read_input_tokens": 0,
        "input_tokens": 0,
        "output_tokens": 0,
    }


def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None, **extra: Any) -> bytes:
    """One upstream chat chunk as the server writes it."""
    data = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta or {}}],
        "id": "chatcmpl-1",
        "model": "m",
        "object": "chat.completion.chunk",
        **extra,
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def events_of(translator: StreamTranslator, *pieces: bytes) -> list[dict[str, Any]]:
    out = b"".join(translator.feed(piece) for piece in pieces) + translator.close()
    return [json.loads(frame.split(b"data: ", 1)[1]) for frame in out.split(b"\n\n") if frame]


def test_final_result_diffs_restart_their_blocks_like_the_server() -> None:
    """When the last token's parse adds text or tool-call arguments, b11434's final result opens
    the block again (``to_json_anthropic_stream`` starts with fresh flags). The rig's tiny models
    never end that way, so this follows the source on a hand-made stream."""
    timings = {"cache_n": 3, "prompt_n": 7, "predicted_n": 2}
    translator = StreamTranslator()
    events = events_of(
        translator,
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "a"}, timings=timings),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ]
            },
            timings=timings,
        ),
        chunk({"content": "b"}, __verbose={"stopping_word": ""}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
        chunk(finish="tool_calls", timings=timings),
        b"data: [DONE]\n\n",
    )
    assert [(e["type"], e.get("index"), e.get("content_block") or e.get("delta")) for e in events[1:]] == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "a"}),
        ("content_block_start", 1, {"type": "tool_use", "id": "call-1", "name": "f"}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": "{"}),
        ("content_block_start", 0, {"type": "text", "text": ""}),  # again: the server's quirk
        ("content_block_delta", 0, {"type": "text_delta", "text": "b"}),
        ("content_block_start", 1, {"type": "tool_use", "id": "call-1", "name": "f"}),  # again
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": "}"}),
        ("content_block_stop", 0, None),
        ("content_block_stop", 1, None),
        ("message_delta", None, {"stop_reason": "tool_use", "stop_sequence": None}),
        ("message_stop", None, None),
    ]
    assert events[0]["message"]["usage"] == {"cache_read_input_tokens": 3, "input_tokens": 7, "output_tokens": 0}
    assert events[-2]["usage"] == {"output_tokens": 2} and translator.stop_reason == "tool_use"


def test_text_index_counts_reasoning_of_the_whole_result() -> None:
    """Within one result, ``anthropic_has_reasoning`` is the state after all its diffs."""
    events = events_of(
        StreamTranslator(),
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "x"}),
        chunk({"reasoning_content": "r"}, timings={"cache_n": 0, "prompt_n": 1}),
    )
    assert [(e["type"], e["index"]) for e in events[1:]] == [
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_start", 0),
        ("content_block_delta", 0),
    ]


# -- the real server -----------------------------------------------------------------------------------------


def prompt_of_server(url: str, log_dir: Path, body: dict[str, Any]) -> tuple[httpx.Response, str | None]:
    """POST to /v1/messages and read back the prompt the server logged for it (if it rendered one)."""
    for old in log_dir.iterdir():
        old.unlink()
    response = loopback.post(f"{url}/v1/messages", json=body, timeout=60)
    logged = sorted(log_dir.iterdir())
    assert len(logged) <= 1
    return response, logged[0].read_text() if logged else None


def tokens(url: str, prompt: str) -> int:
    response = loopback.post(f"{url}/tokenize", json={"content": prompt, "add_special": True}, timeout=30)
    return len(response.json()["tokens"])


@pytest.mark.rig
def test_rendering_equals_the_servers_own_on_the_captures(llama_server: Any, tmp_path: Path) -> None:
    log_dir = tmp_path / "prompts"
    server = llama_server("qwen35", ctx_size=2048, extra_args=("--log-prompts-dir", str(log_dir)))
    cases = [(p.name, "raw", capture(p)[1]) for p in CC_BODIES + SUB_BODIES]
    cases += [(p.name, "normalised", normalised(p)) for p in CC_BODIES + SUB_BODIES]
    cases += [("features", "raw", FEATURES), ("features-streamed", "raw", {**FEATURES, "stream": True})]
    cases += [
        (
            "image",
            "raw",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            },
                            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}},
                            {"type": "text", "text": "?"},
                        ],
                    }
                ]
            },
        )
    ]
    rendered = refused = 0
    for name, form, body in cases:
        response, server_prompt = prompt_of_server(server.url, log_dir, body)
        ours = loopback.post(f"{server.url}/apply-template", json=to_chat(body), timeout=30)
        label = f"{name} ({form})"
        if server_prompt is None:  # refused before rendering finished: the very same error
            assert (response.status_code, response.json()) == (ours.status_code, ours.json()), label
            refused += 1
            continue
        assert ours.status_code == 200, label
        assert ours.json()["prompt"] == server_prompt, label
        count = loopback.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=30).json()
        assert count["input_tokens"] == tokens(server.url, server_prompt), label
        if response.status_code == 400:  # too long for -c 2048: the server's count, no prefill
            assert response.json()["error"]["n_prompt_tokens"] == count["input_tokens"], label
            as_chat = loopback.post(f"{server.url}/v1/chat/completions", json=upstream_body(to_chat(body)), timeout=30)
            assert (as_chat.status_code, as_chat.json()) == (400, response.json()), label  # pass it on as it is
        rendered += 1
    # every raw Claude Code body is refused ("System message must be at the beginning"); every
    # normalised one renders; so do the feature bodies; images need an mmproj on both paths
    assert (rendered, refused) == (len(CC_BODIES + SUB_BODIES) + 2, len(CC_BODIES + SUB_BODIES) + 1)


def erase(url: str) -> None:
    loopback.post(f"{url}/slots/0", params={"action": "erase"}, json={}, timeout=30).raise_for_status()


def via_server(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    with loopback.stream("POST", f"{url}/v1/messages", json=body, timeout=120) as response:
        return response.status_code, b"".join(response.iter_raw())


def via_translator(url: str, body: dict[str, Any]) -> tuple[int, bytes, bytes]:
    """The chat path; returns the translation and the upstream bytes as they came."""
    translator = StreamTranslator()
    out, raw = [], []
    sent = upstream_body(to_chat(body))
    with loopback.stream("POST", f"{url}/v1/chat/completions", json=sent, timeout=120) as response:
        for piece in response.iter_raw():
            raw.append(piece)
            out.append(translator.feed(piece))
    out.append(translator.close())
    return response.status_code, b"".join(out), b"".join(raw)


def without_ids(events: bytes) -> bytes:
    return re.sub(rb'"id":"[^"]*"', b'"id":"-"', events)


def event_names(events: bytes) -> list[str]:
    return re.findall(r"^event: (\S+)$", events.decode(), flags=re.M)


def assert_same_stream(url: str, body: dict[str, Any], *, warm: bool = False) -> bytes:
    """Both paths from the same slot state: erased (cold), or holding this very request (warm)."""
    if not warm:
        erase(url)
    status, server = via_server(url, body)
    if not warm:
        erase(url)
    status_chat, ours, raw = via_translator(url, body)
    assert (status_chat, without_ids(ours).decode()) == (status, without_ids(server).decode())
    one_byte = StreamTranslator()
    fed = b"".join(one_byte.feed(raw[i : i + 1]) for i in range(len(raw))) + one_byte.close()
    assert fed == ours  # how the bytes are cut up does not matter
    return server


def start_usage(events: bytes) -> dict[str, int]:
    """``message_start.message.usage`` of an Anthropic event stream."""
    first = events.split(b"\n\n", 1)[0].split(b"data: ", 1)[1]
    usage: dict[str, int] = json.loads(first)["message"]["usage"]
    return usage


def assert_same_message(url: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "stream": False}
    erase(url)
    server = loopback.post(f"{url}/v1/messages", json=body, timeout=120)
    erase(url)
    chat = loopback.post(f"{url}/v1/chat/completions", json=upstream_body(to_chat(body)), timeout=120)
    assert (chat.status_code, server.status_code) == (200, 200)
    ours, theirs = to_message(chat.json()), server.json()
    assert ours.pop("id").startswith("chatcmpl-") and theirs.pop("id").startswith("chatcmpl-")
    for block in ours["content"] + theirs["content"]:
        block.pop("id", None)
    assert ours == theirs
    return theirs


@pytest.mark.rig
def test_text_thinking_stop_and_usage_match_the_server(llama_server: Any) -> None:
    server = llama_server("qwen35", ctx_size=4096, extra_args=("--cache-ram", "0"))
    ask = {**GREEDY, "messages": [{"role": "user", "content": "say ok"}]}
    thinking = assert_same_stream(server.url, {**ask, "max_tokens": 8})
    assert event_names(thinking)[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert b'"type":"thinking_delta"' in thinking and b'"stop_reason":"max_tokens"' in thinking
    # a thinking budget ends the reasoning early: a thinking block, then a text block
    budget = assert_same_stream(server.url, {**ask, **BUDGET})
    assert b'"index":1,"delta":{"type":"text_delta"' in budget and b'"type":"signature_delta"' in budget
    text = assert_same_stream(server.url, {**ask, **NO_THINK, "max_tokens": 8})
    assert b'"content_block":{"type":"text","text":""}' in text and b"thinking" not in text
    # a stop sequence: end_turn with the word (never "stop_sequence" on this server)
    word = re.findall(rb'"thinking":"([^"]+)"', thinking)[1].decode()
    stopped = assert_same_stream(server.url, {**ask, "max_tokens": 8, "stop_sequences": [word]})
    assert f'"stop_reason":"end_turn","stop_sequence":"{word}"'.encode() in stopped
    # usage: cold, then warm from the same slot content on both paths (the earlier request's)
    cold = assert_same_stream(server.url, {**ask, **NO_THINK, "max_tokens": 4})
    warm = assert_same_stream(server.url, {**ask, **NO_THINK, "max_tokens": 4}, warm=True)
    usage_cold, usage_warm = start_usage(cold), start_usage(warm)
    assert usage_cold["cache_read_input_tokens"] == 0 and usage_cold["input_tokens"] > 0
    assert usage_warm["cache_read_input_tokens"] > 0
    assert usage_warm["cache_read_input_tokens"] + usage_warm["input_tokens"] == usage_cold["input_tokens"]
    for case in (
        {**ask, "max_tokens": 8},
        {**ask, **BUDGET},
        {**ask, **NO_THINK, "max_tokens": 8, "stop_sequences": ["xxxxxxxx"]},
    ):
        assert_same_message(server.url, case)


@pytest.mark.rig
def test_tool_use_end_turn_and_errors_match_the_server(llama_server: Any) -> None:
    """Biases make the random model end at once (<|im_end|>) or open a tool call (<tool_call>)."""
    server = llama_server(
        "qwen35",
        ctx_size=4096,
        extra_args=("--cache-ram", "0", "--logit-bias", f"{IM_END}+30", "--logit-bias", f"{TOOL_CALL}+20"),
    )
    ask = {**GREEDY, "messages": [{"role": "user", "content": "set it"}]}
    flag = [
        {
            "name": "set_flag",
            "description": "Set a flag",
            "input_schema": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
        }
    ]
    free = [
        {
            "name": "set_unit",
            "description": "Set the unit",
            "input_schema": {"type": "object", "properties": {"unit": {"type": "string"}}, "required": ["unit"]},
        }
    ]
    forced = {"tool_choice": {"type": "tool", "name": "set_flag"}}  # the server: "required"
    call = assert_same_stream(server.url, {**ask, **NO_THINK, **forced, "tools": flag, "max_tokens": 100})
    assert b'"content_block":{"type":"tool_use"' in call and b'"type":"input_json_delta"' in call
    assert b'"stop_reason":"tool_use"' in call
    message = assert_same_message(server.url, {**ask, **NO_THINK, **forced, "tools": flag, "max_tokens": 100})
    assert message["content"] == [{"type": "tool_use", "name": "set_flag", "input": {"flag": False}}]
    cut = assert_same_stream(
        server.url, {**ask, **NO_THINK, "tool_choice": {"type": "any"}, "tools": free, "max_tokens": 20}
    )
    assert b'"stop_reason":"max_tokens"' in cut and b"tool_use" in cut
    ended = assert_same_stream(server.url, {**ask, "tools": flag, "max_tokens": 20})
    assert event_names(ended) == ["message_start", "message_delta", "message_stop"]
    assert b'"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":1}' in ended
    assert_same_message(server.url, {**ask, "tools": flag, "max_tokens": 20})
    # a required call while the model is still reasoning: the server's parser fails mid-stream
    failed = assert_same_stream(server.url, {**ask, "tool_choice": {"type": "any"}, "tools": flag, "max_tokens": 20})
    assert event_names(failed) == ["message_start", "error"] and b'"type":"server_error"' in failed
    body = {**ask, "tool_choice": {"type": "any"}, "tools": flag, "max_tokens": 20, "stream": False}
    erase(server.url)
    theirs = loopback.post(f"{server.url}/v1/messages", json=body, timeout=60)
    erase(server.url)
    ours = loopback.post(f"{server.url}/v1/chat/completions", json=upstream_body(to_chat(body)), timeout=60)
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()) == (500, theirs.json())
