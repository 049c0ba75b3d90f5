"""Render a request the way the server will and cut its exact head tokens (no fingerprint).

For ``doctor`` and the tests: how many tokens a head covers on this server's template,
and how many of them are tools. The prepare path uses engine/planner.py, which also fingerprints
the head and avoids re-tokenizing a known head.
"""

from __future__ import annotations

from dataclasses import dataclass

from oc_prefix_cache.chat.head import ChatBody, Head, locate_head, tokens_before
from oc_prefix_cache.engine.planner import PROBE_TOKENS, first_tool_name
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.client import SlotClient


@dataclass(frozen=True)
class RenderedHead:
    head_text: str  # the rendered prompt up to the marker
    tokens: tuple[int, ...]
    probe: tuple[int, ...]  # the next tokens of this request after the head
    tools_in_head: bool  # False when the template renders tools after the marker
    prompt_tokens: int  # the whole rendered request


def render_head(client: SlotClient, body: ChatBody, head: Head) -> RenderedHead:
    prompt = client.apply_template(body.data)
    offset = locate_head(prompt, head)
    if offset is None:
        raise OcpcError("the chat template changed the system text; cannot find the head in the prompt")
    pieces = client.tokenize_pieces(prompt)
    tokens = tokens_before(pieces, len(prompt[:offset].encode()))
    if not tokens:
        raise OcpcError("the head is empty after rendering; nothing to cache")
    probe = tuple(t for t, _ in pieces[len(tokens) : len(tokens) + PROBE_TOKENS])
    tools_at = prompt.find(f'"name": "{first_tool_name(body.data)}"')
    return RenderedHead(
        head_text=prompt[:offset],
        tokens=tuple(tokens),
        probe=probe,
        tools_in_head=0 <= tools_at < offset,
        prompt_tokens=len(pieces),
    )
