"""Anthropic Messages <-> OpenAI chat, exactly as llama-server b11434 does it: pure functions.

Why this exists: b11434 drops ``id_slot`` from ``/v1/messages`` bodies, so the proxy can pin an
Anthropic conversation to a slot only by sending it to ``/v1/chat/completions`` itself and
translating the answer back. That is safe only if both halves are the server's own conversion,
byte for byte; so every function here mirrors a named piece of the b11434 source (paths are in
``tools/server/``) rather than the public Anthropic spec:

* ``to_chat`` is ``server_chat_convert_anthropic_to_oai`` (server-chat.cpp). The server's
  ``/v1/messages`` handler runs that and then the very same ``oaicompat_chat_params_parse`` and
  ``handle_completions_impl`` as chat completions, so the same chat body renders the same prompt,
  samples with the same parameters and parses the output the same way.
* ``StreamTranslator`` rebuilds ``server_task_result_cmpl_partial::to_json_anthropic`` and
  ``server_task_result_cmpl_final::to_json_anthropic_stream`` (server-task.cpp) from the chat
  chunks, which carry the same message diffs; ``to_message`` is ``to_json_anthropic``.

Three facts exist only on the Anthropic side of the server and are not in a plain chat answer,
so ``upstream_body`` asks the server for them in extra, output-only fields (none of them changes
the prompt, the sampling or the parsing):

* ``timings_per_token``: every partial result then carries ``timings``. ``message_start`` needs
  ``cache_read_input_tokens`` (= ``cache_n``) and ``input_tokens`` (= ``prompt_n``, the tokens
  processed) at the first token; the chunk that ends each result is also how the translator
  groups chunks into the server's results.
* ``verbose`` + ``response_fields: ["stopping_word"]``: the final result's first chunk then carries
  ``__verbose.stopping_word``, the ``stop_sequence`` of ``message_delta`` (a chat answer only says
  ``finish_reason: "stop"`` for both an end-of-generation token and a stop word).

Not exact (documented, not hidden):

* ``tool_use.input`` is serialised by Python's ``json`` where the server uses nlohmann's ``dump``;
  strings, integers, booleans and nesting come out identical, floats both use the shortest
  round-trip form with the same exponent thresholds, but an input with duplicate object keys or
  integers beyond 64 bits would differ.
* The billing-header ``cch=`` rewrite works on UTF-8 bytes like the server; only a header with a
  multi-byte character inside its five ``cch`` characters would decode differently.
* Ids (``chatcmpl-...`` and tool call ids) are the ones the upstream chat request got; they are
  random per request on either path.
* A final result whose last token adds text or tool-call arguments makes the server open that
  block again (its final events start from fresh flags). ``StreamTranslator`` does the same, from
  the source; the rig's models never end that way, so only a hand-made stream tests it.

For the proxy: check the upstream status first. An error before the first token is an HTTP error
whose JSON is the same on both endpoints; pass it on untouched. Only a 200 stream goes through
``StreamTranslator`` (and only a 200 answer through ``to_message``).

Server behaviours mirrored on purpose, surprising as they are (the proxy author should know):
``tool_choice`` ``{"type": "tool", "name": X}`` becomes ``"required"`` (any tool, not X) and
``{"type": "none"}`` is ignored; ``thinking.type == "enabled"`` becomes
``thinking_budget_tokens`` and every other ``thinking``/``output_config`` value is dropped; a stop
sequence ends the turn with ``stop_reason: "end_turn"`` (never ``"stop_sequence"``) and the word in
``stop_sequence``; ``input_tokens`` counts only the tokens processed, not the reused ones; the
final result restarts content blocks that get text or tool-call diffs in the last token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from oc_prefix_cache.errors import TranslationError

BILLING_PREFIX = "x-anthropic-billing-header:"
DEFAULT_MAX_TOKENS = 4096  # the server's own default when max_tokens is missing
PASSED_THROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}  # anything else: "max_tokens"


# --------------------------------------------------------------------------------------------
# requests


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body b11434 builds from an Anthropic Messages ``body``.

    Unchanged sub-objects (text blocks, string messages) are shared with ``body``, not copied,
    just as the server passes them along; treat the result as read-only.
    """
    if "messages" not in body:
        raise TranslationError("'messages' is required")
    messages: list[Any] = []
    if "system" in body and body["system"] is not None:
        messages.append({"role": "system", "content": _system_text(body["system"])})
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages.extend(_convert_message(message))
    chat: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("tools"), list):
        chat["tools"] = [_convert_tool(tool) for tool in body["tools"]]
    choice = _tool_choice(body)
    if choice is not None:
        chat["tool_choice"] = choice
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_MAX_TOKENS
    for key in PASSED_THROUGH:
        if key in body:
            chat[key] = body[key]
    budget = _thinking_budget(body)
    if budget is not None:
        chat["thinking_budget_tokens"] = budget
    user_id = _text(_value(body, "metadata", {}), "user_id")
    if "metadata" in body and user_id:
        chat["__metadata_user_id"] = user_id  # the server keeps it; nothing reads it
    return chat


def upstream_body(chat: dict[str, Any], *, id_slot: int | None = None) -> dict[str, Any]:
    """``chat`` plus the output-only fields the translators need (see the module docstring)."""
    return {**chat, **_output_fields(id_slot)}


def upstream_bytes(chat_raw: bytes, *, id_slot: int | None = None) -> bytes:
    """``dump_json(upstream_body(chat))`` from ``chat_raw = dump_json(to_chat(...))``, without
    serialising the whole history a second time (about 2 ms per 500 KB on the proxy's path).
    ``to_chat`` never writes these fields, so appending them is the same as the dict update."""
    return chat_raw[:-1] + b"," + dump_json(_output_fields(id_slot))[1:].encode()


def _output_fields(id_slot: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"timings_per_token": True, "verbose": True, "response_fields": ["stopping_word"]}
    if id_slot is not None:
        out["id_slot"] = id_slot
    return out


def normalize_billing_header(text: str) -> str:
    """The server's ``normalize_anthropic_billing_header``: ``cch=XXXXX;`` becomes ``cch=fffff;``."""
    if not text.startswith(BILLING_PREFIX):
        return text
    raw = text.encode()
    index = raw.find(b"cch=", len(BILLING_PREFIX))
    if index < 0:
        return text
    start = index + 4
    if start + 5 < len(raw) and raw[start + 5 : start + 6] == b";":
        raw = raw[:start] + b"fffff" + raw[start + 5 :]
    return raw.decode(errors="replace")


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return normalize_billing_header(system)
    if isinstance(system, list):
        texts = (_text(block, "text") for block in system if _text(block, "type") == "text")
        return "".join(normalize_billing_header(text) for text in texts)
    return ""


def _convert_message(message: Any) -> list[Any]:
    """One Anthropic message as the server's chat messages (tool results follow the message)."""
    role = _text(message, "role")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    tool_calls: list[dict[str, Any]] = []
    tool_messages: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _text(block, "type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += _text(block, "thinking")
        elif kind == "image":
            parts.extend(_image_parts(_value(block, "source", {})))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block))
        elif kind == "tool_result":
            tool_messages.append(_tool_message(block))
    out: list[Any] = []
    if parts or tool_calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts if parts else ""}
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + tool_messages


def _image_parts(source: Any) -> list[dict[str, Any]]:
    kind = _text(source, "type")
    if kind == "base64":
        media_type = _text(source, "media_type", "image/jpeg")
        url = f"data:{media_type};base64,{_text(source, 'data')}"
    elif kind == "url":
        url = _text(source, "url")
    else:
        return []
    return [{"type": "image_url", "image_url": {"url": url}}]


def _tool_call(block: dict[str, Any]) -> dict[str, Any]:
    arguments = dump_json(_value(block, "input", {}))
    return {
        "id": _text(block, "id"),
        "type": "function",
        "function": {"name": _text(block, "name"), "arguments": arguments},
    }


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_result`` block: text parts joined with nothing; images keep the part list."""
    result = _value(block, "content", None)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": _text(block, "tool_use_id")}
    if isinstance(result, str):
        message["content"] = result
    elif isinstance(result, list):
        text = ""
        parts: list[dict[str, Any]] = []
        has_images = False
        for item in result:
            kind = _text(item, "type")
            if kind == "text":
                text += _text(item, "text")
                parts.append({"type": "text", "text": _text(item, "text")})
            elif kind == "image":
                has_images = True
                parts.extend(_image_parts(_value(item, "source", {})))
        message["content"] = parts if has_images else text
    else:
        message["content"] = ""
    return message


def _convert_tool(tool: Any) -> dict[str, Any]:
    schema = tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {}
    return {
        "type": "function",
        "function": {"name": _text(tool, "name"), "description": _text(tool, "description"), "parameters": schema},
    }


def _tool_choice(body: dict[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    kind = _text(choice, "type")
    if kind == "auto":
        return "auto"
    if kind in ("any", "tool"):
        return "required"  # the server forgets which tool was named
    return None


def _thinking_budget(body: dict[str, Any]) -> int | None:
    if "thinking" not in body:
        return None
    thinking = _value(body, "thinking", {})
    if _text(thinking, "type") != "enabled":
        return None
    budget = _value(thinking, "budget_tokens", 10000)
    return int(budget) if isinstance(budget, (int, float)) else 10000


def _value(obj: Any, key: str, default: Any) -> Any:
    """The server's ``json_value`` for a JSON-typed default: missing or null gives the default."""
    if isinstance(obj, dict) and obj.get(key) is not None:
        return obj[key]
    return default


def _text(obj: Any, key: str, default: str = "") -> str:
    """``json_value`` for a string: a missing, null or non-string value gives the default."""
    value = _value(obj, key, default)
    return value if isinstance(value, str) else default


def dump_json(value: Any) -> str:
    """Compact JSON in insertion order, non-ASCII kept: how the server's ``dump()`` writes."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# responses


def to_message(chat_response: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat completion (from an ``upstream_body`` request) as the Anthropic message."""
    choice = (chat_response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": _parse_input(function.get("arguments", "")),
            }
        )
    usage = chat_response.get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "id": chat_response.get("id", ""),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": chat_response.get("model", ""),
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason") or "", "max_tokens"),
        "stop_sequence": _stop_sequence(chat_response),
        "usage": {
            "cache_read_input_tokens": cached,
            "input_tokens": int(usage.get("prompt_tokens", 0)) - cached,
            "output_tokens": int(usage.get("completion_tokens", 0)),
        },
    }


def _parse_input(arguments: Any) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return {}


def _stop_sequence(chunk: dict[str, Any]) -> str | None:
    verbose = chunk.get("__verbose")
    word = verbose.get("stopping_word") if isinstance(verbose, dict) else None
    return word if isinstance(word, str) and word else None


def sse_event(name: str, data: Any) -> bytes:
    """One event exactly as the server's ``format_anthropic_sse`` writes it."""
    return f"event: {name}\ndata: {dump_json(data)}\n\n".encode()


@dataclass
class _ToolCall:
    id: str = ""
    name: str = ""


@dataclass
class _Message:
    """What the server's ``task_result_state`` has accumulated, as far as the events need it."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[_ToolCall] = field(default_factory=list)
    thinking_started: bool = False
    text_started: bool = False

    def apply(self, delta: dict[str, Any]) -> None:
        self.reasoning += delta.get("reasoning_content") or ""
        self.content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            index = int(call.get("index", 0))
            while len(self.tool_calls) <= index:
                self.tool_calls.append(_ToolCall())
            function = call.get("function") or {}
            if call.get("id"):
                self.tool_calls[index].id = call["id"]
            if function.get("name"):  # a changed name comes whole, not as a delta
                self.tool_calls[index].name = function["name"]


class StreamTranslator:
    """Upstream chat-completions SSE bytes in, the server's own Anthropic SSE bytes out.

    Feed what arrives, as it arrives; each call returns the bytes to send on (possibly none).
    The server writes each of its results (one per sampled token, then one final result) as a
    run of chunks in one write; ``timings`` (asked for by ``upstream_body``) marks the end of each
    run, and the events of a run depend on the whole run, so a run is translated once it is
    complete: that holds back nothing the server itself would have sent earlier.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._run: list[dict[str, Any]] = []
        self._message = _Message()
        self.usage: dict[str, int] | None = None  # message_start's usage, once known
        self.stop_reason: str | None = None

    def feed(self, data: bytes) -> bytes:
        self._pending += data.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while b"\n\n" in self._pending:
            frame, self._pending = self._pending.split(b"\n\n", 1)
            out.append(self._frame(frame))
        return b"".join(out)

    def close(self) -> bytes:
        """The end of the upstream stream: translate whatever run is still open."""
        tail = self.feed(b"\n\n") if self._pending.strip() else b""
        self._pending = b""
        return tail + self._flush()

    def _frame(self, frame: bytes) -> bytes:
        lines = frame.split(b"\n")
        data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
        if not data:
            return b":\n\n" if any(line.startswith(b":") for line in lines) else b""
        if data.strip() == b"[DONE]":
            return self._flush()
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):  # the server's own words for a failure mid-stream
            return self._flush() + sse_event(
                "error",
                {"code": 500, "message": f"upstream sent a non-JSON event: {data[:200]!r}", "type": "server_error"},
            )
        if "error" in chunk and "choices" not in chunk:
            return self._flush() + sse_event("error", chunk["error"])
        self._run.append(chunk)
        return self._flush() if "timings" in chunk else b""

    def _flush(self) -> bytes:
        run, self._run = self._run, []
        if not run:
            return b""
        if any(_is_final_chunk(chunk) for chunk in run):
            return b"".join(self._final(run))
        return b"".join(self._partial(run))

    def _partial(self, run: list[dict[str, Any]]) -> Iterable[bytes]:
        """``server_task_result_cmpl_partial::to_json_anthropic`` for one result."""
        deltas = [_delta(chunk) for chunk in run]
        for delta in deltas:
            self._message.apply(delta)
        has_reasoning = bool(self._message.reasoning)
        text_index = 1 if has_reasoning else 0
        for chunk, delta in zip(run, deltas, strict=False):
            if "role" in delta:
                yield self._message_start(chunk, run[-1].get("timings"))
            yield from self._partial_diff(delta, has_reasoning, text_index)

    def _partial_diff(self, delta: dict[str, Any], has_reasoning: bool, text_index: int) -> Iterable[bytes]:
        message = self._message
        if delta.get("reasoning_content"):
            if not message.thinking_started:
                yield _block_start(0, {"type": "thinking", "thinking": ""})
                message.thinking_started = True
            yield _block_delta(0, {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if not message.text_started:
                yield _block_start(text_index, {"type": "text", "text": ""})
                message.text_started = True
            yield _block_delta(text_index, {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            index = int(has_reasoning) + int(message.text_started) + int(call.get("index", 0))
            function = call.get("function") or {}
            if function.get("name"):
                yield _block_start(index, {"type": "tool_use", "id": call.get("id", ""), "name": function["name"]})
            if function.get("arguments"):
                yield _block_delta(index, {"type": "input_json_delta", "partial_json": function["arguments"]})

    def _message_start(self, chunk: dict[str, Any], timings: Any) -> bytes:
        timings = timings if isinstance(timings, dict) else {}
        self.usage = {
            "cache_read_input_tokens": int(timings.get("cache_n", 0)),
            "input_tokens": int(timings.get("prompt_n", 0)),
            "output_tokens": 0,
        }
        return sse_event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": chunk.get("id", ""),
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": chunk.get("model", ""),
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": dict(self.usage),
                },
            },
        )

    def _final(self, run: list[dict[str, Any]]) -> Iterable[bytes]:
        """``server_task_result_cmpl_final::to_json_anthropic_stream``: fresh block flags."""
        diffs = [_delta(chunk) for chunk in run if not _is_final_chunk(chunk) and _delta(chunk)]
        for delta in diffs:
            self._message.apply(delta)
        message = self._message
        has_thinking, has_text = bool(message.reasoning), bool(message.content)
        text_index = 1 if has_thinking else 0
        thinking_started = text_started = False
        tools_started: set[int] = set()
        for delta in diffs:
            if delta.get("reasoning_content"):
                if not thinking_started:
                    yield _block_start(0, {"type": "thinking", "thinking": ""})
                    thinking_started = True
                yield _block_delta(0, {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if not text_started:
                    yield _block_start(text_index, {"type": "text", "text": ""})
                    text_started = True
                yield _block_delta(text_index, {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                position = int(call.get("index", 0))
                index = int(has_thinking) + int(has_text) + position
                if position not in tools_started:
                    full = message.tool_calls[position]
                    yield _block_start(index, {"type": "tool_use", "id": full.id, "name": full.name})
                    tools_started.add(position)
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    yield _block_delta(index, {"type": "input_json_delta", "partial_json": arguments})
        yield from self._close_blocks(has_thinking, has_text)
        yield self._message_end(run)

    def _close_blocks(self, has_thinking: bool, has_text: bool) -> Iterable[bytes]:
        if has_thinking:
            yield _block_delta(0, {"type": "signature_delta", "signature": ""})
            yield _block_stop(0)
        if has_text:
            yield _block_stop(1 if has_thinking else 0)
        for position in range(len(self._message.tool_calls)):
            yield _block_stop(int(has_thinking) + int(has_text) + position)

    def _message_end(self, run: list[dict[str, Any]]) -> bytes:
        finish = next(
            (
                c["choices"][0].get("finish_reason")
                for c in run
                if c.get("choices") and c["choices"][0].get("finish_reason")
            ),
            None,
        )
        self.stop_reason = STOP_REASONS.get(finish or "", "max_tokens")
        output = _output_tokens(run)
        return sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": _run_stop_sequence(run)},
                "usage": {"output_tokens": output},
            },
        ) + sse_event("message_stop", {"type": "message_stop"})


def _run_stop_sequence(run: list[dict[str, Any]]) -> str | None:
    """The final result's first chunk carries ``__verbose`` (``upstream_body`` asked for it)."""
    return next((_stop_sequence(chunk) for chunk in run if "__verbose" in chunk), None)


def _output_tokens(run: list[dict[str, Any]]) -> int:
    """``n_decoded``: the usage chunk's ``completion_tokens`` or the final ``timings.predicted_n``."""
    for chunk in reversed(run):
        usage, timings = chunk.get("usage"), chunk.get("timings")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            return int(usage["completion_tokens"])
        if isinstance(timings, dict) and "predicted_n" in timings:
            return int(timings["predicted_n"])
    return 0


def _is_final_chunk(chunk: dict[str, Any]) -> bool:
    """The finish chunk (``finish_reason`` set) or the usage chunk (``choices: []``)."""
    choices = chunk.get("choices")
    if choices == [] and "usage" in chunk:
        return True
    first = choices[0] if isinstance(choices, list) and choices else None
    return isinstance(first, dict) and first.get("finish_reason") is not None


def _delta(chunk: dict[str, Any]) -> dict[str, Any]:
    choices = chunk.get("choices") or [{}]
    delta = choices[0].get("delta")
    return delta if isinstance(delta, dict) else {}


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> bytes:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
