"""Render a request the way the server will, and cut its exact head tokens.

``/apply-template`` renders the body exactly as chat completions would; tokenizing the
whole rendered prompt and cutting at the marker gives a strict token prefix of the real
request (tokenizing the cut text alone could merge differently at the cut).
Shared by the prepare path and ``doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OcpcError
from .head import ChatBody, Head, head_body, locate_head, tokens_before
from .slot_client import SlotClient

PROBE_TOKENS = 4  # tokens of the real prompt after the head, for the reuse probe


@dataclass(frozen=True)
class RenderedHead:
    head_text: str  # the rendered prompt up to the marker
    tokens: tuple[int, ...]
    probe: tuple[int, ...]  # the next tokens of this request after the head
    tools_in_head: bool  # False when the template renders tools after the marker
    prompt_tokens: int  # the whole rendered request


def render_head(client: SlotClient, body: ChatBody, head: Head) -> RenderedHead:
    prompt = client.apply_template(head_body(body))
    offset = locate_head(prompt, head)
    if offset is None:
        raise OcpcError("the chat template changed the system text; cannot find the head in the prompt")
    pieces = client.tokenize_pieces(prompt)
    tokens = tokens_before(pieces, len(prompt[:offset].encode()))
    if not tokens:
        raise OcpcError("the head is empty after rendering; nothing to cache")
    probe = tuple(t for t, _ in pieces[len(tokens): len(tokens) + PROBE_TOKENS]) or (tokens[-1],)
    tools_at = prompt.find(f'"name": "{_first_tool_name(body)}"')
    return RenderedHead(head_text=prompt[:offset], tokens=tuple(tokens), probe=probe,
                        tools_in_head=0 <= tools_at < offset, prompt_tokens=len(pieces))


def _first_tool_name(body: ChatBody) -> str:
    tools = body.data.get("tools") or []
    first = tools[0] if tools and isinstance(tools[0], dict) else {}
    function = first.get("function") if isinstance(first.get("function"), dict) else first
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else "\x00"
