"""OpenAI Responses -> OpenAI chat, exactly as llama-server b11434 does it: one pure function.

Why this exists: Codex CLI speaks only the Responses API (``POST /v1/responses``). b11434's handler
converts the body with ``server_chat_convert_responses_to_chatcmpl`` (server-chat.cpp) and then
runs the very same ``oaicompat_chat_params_parse`` as chat completions; the conversion copies
every field it does not handle, ``id_slot`` included, so a Responses request can be pinned to a
slot as it is. The proxy therefore forwards the client's Responses body (``id_slot`` added) and
needs the chat body only to prepare: to render the prompt with ``/apply-template``, find the head,
and recognise the conversation. ``to_chat`` mirrors that function branch for branch, with its
errors (``TranslationError``: the server refuses the body too, and it goes on unprepared).

Object key order follows the server's (``nlohmann::ordered_json``: insertion order), since the
template may serialise what it is given (the tools, as ``tojson``).
"""

from __future__ import annotations

import copy
from typing import Any

from oc_prefix_cache.chat.conversation import RENDERED_FIELDS
from oc_prefix_cache.errors import TranslationError


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body b11434 builds from a Responses ``body``."""
    if "input" not in body:
        raise TranslationError("'input' is required")
    if isinstance(body.get("previous_response_id"), str) and body["previous_response_id"]:
        raise TranslationError("llama.cpp does not support 'previous_response_id'.")
    out = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system", "content": instructions if isinstance(instructions, str) else ""})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _convert_item(copy.deepcopy(item) if isinstance(item, dict) else item, messages)
    else:
        raise TranslationError("'input' must be a string or array of objects")
    out["messages"] = messages
    if "tools" in body:
        out.pop("tools")
        tools = _tools(body["tools"])
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        out.pop("max_output_tokens")
        out["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = out.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
    return out


def _convert_item(item: Any, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise TranslationError("Cannot determine type of 'item'")
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if isinstance(item.get("content"), str):  # an input message's text: as an input_text part
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = [_input_part(part) for part in item["content"]]
        messages.append(item)
    elif role == "assistant" and kind == "message":
        content = _output_parts(item.get("content"))
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(content)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = content
            messages.append(item)
    elif (
        all(isinstance(item.get(k), str) for k in ("arguments", "call_id", "name", "type")) and kind == "function_call"
    ):
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("tool_calls"), list):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (
        isinstance(item.get("call_id"), str)
        and isinstance(item.get("output"), (str, list))
        and kind == "function_call_output"
    ):
        output = item["output"]
        if isinstance(output, list):
            output = [_tool_output(part) for part in output]
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif isinstance(item.get("summary"), list) and kind == "reasoning":
        parts = item.get("content")
        if not isinstance(parts, list):
            raise TranslationError("item['content'] is not an array")
        if not parts:
            raise TranslationError("item['content'] is empty")
        if not isinstance(parts[0], dict) or not isinstance(parts[0].get("text"), str):
            raise TranslationError("item['content']['text'] is not a string")
        if merge:
            messages[-1]["reasoning_content"] = parts[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": parts[0]["text"]})
    else:
        raise TranslationError("Cannot determine type of 'item'")


def _input_part(part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_text":
        if "text" not in part:
            raise TranslationError("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":
        if "image_url" not in part:
            raise TranslationError("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    if kind == "input_file":
        raise TranslationError("'input_file' is not supported by llamacpp at this moment")
    raise TranslationError("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("output_text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise TranslationError("'Output text' requires 'text'")
            out.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise TranslationError("'Refusal' requires 'refusal'")
            out.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise TranslationError("'type' must be one of 'output_text' or 'refusal'")
    return out


def _tool_output(part: Any) -> Any:
    if not isinstance(part, dict) or "type" not in part:
        raise TranslationError("Output of tool call missing 'type' field")
    if part["type"] == "input_text":
        return {**part, "type": "text"}
    if part["type"] == "input_image":
        if "image_url" not in part:
            raise TranslationError("'image_url' is required")
        return {**part, "type": "image_url", "image_url": {"url": part["image_url"]}}
    raise TranslationError("Output of tool call should be 'Input text' or 'Input image'")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise TranslationError("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue  # non-function Responses tools have no chat equivalent: the server skips them
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def prepared(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Responses request is prepared as: ``to_chat`` with only what renders (the
    model, the messages, ``RENDERED_FIELDS``). Codex sends a ``client_metadata`` with a new turn
    id every turn; kept, it would make every next turn look like another conversation's. The
    request itself goes upstream as it came."""
    chat = to_chat(body)
    return {k: v for k, v in chat.items() if k in ("model", "messages", *RENDERED_FIELDS)}
