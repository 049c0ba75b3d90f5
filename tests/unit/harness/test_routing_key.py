"""The conversation key as the gateway's routing key (harness/routing_key.py), as a class.

Through the gateway, a box sees no ``User-Agent`` and no session header (smg forwards neither): it
knows a conversation only by the routing key ocpc's front sent. So: the key survives the trip
(any name, any flags), two conversations the adapters tell apart get two routing keys, one
conversation keeps one across its turns, every value fits smg's 128 bytes, and the box, reading
a capture as smg delivers it (the agent's headers gone), finds the same adapter and key the front
found. And the box normalises a body the agent sent once, as the front keyed it: normalising is
idempotent for every capture, so the box and the front read one body alike.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.harness import NAMES, Incoming, door_adapters, select
from oc_prefix_cache.harness.routing_key import HEADER, read_routing_key, routed_adapter, routing_key
from tests.helpers import DATA
from tests.unit.chat.test_conversation_identity import API, PROJECTS, SESSIONS, TURNS, key_of


@given(
    name=st.text(min_size=1, max_size=300),
    shared=st.booleans(),
    rewrites=st.booleans(),
    adapter=st.sampled_from(sorted(NAMES)),
)
@settings(max_examples=500, deadline=None)
def test_a_key_survives_the_gateway_whole(name: str, shared: bool, rewrites: bool, adapter: str) -> None:
    key = ConversationKey(name=name, shared=shared, source="test", rewrites_history=rewrites)
    value = routing_key(adapter, key)
    assert value is not None and value.isascii() and len(value.encode()) <= 128  # smg's limit
    routed = read_routing_key(value)
    assert routed is not None and routed.adapter == adapter
    assert (routed.key.shared, routed.key.rewrites_history) == (shared, rewrites)
    assert routed.key.name == read_routing_key(routing_key(adapter, key)).key.name  # type: ignore[union-attr]


@given(a=st.text(min_size=1, max_size=60), b=st.text(min_size=1, max_size=60))
def test_two_names_never_share_a_routing_key(a: str, b: str) -> None:
    ka, kb = (ConversationKey(name=n, shared=False, source="test") for n in (a, b))
    assert (routing_key("pi", ka) == routing_key("pi", kb)) == (a == b)


@given(value=st.text(max_size=200))
def test_a_value_not_made_by_the_front_is_never_read_as_a_key(value: str) -> None:
    routed = read_routing_key(value)
    if routed is not None:
        assert value.strip() == routing_key(routed.adapter, _named(value))  # only the front's own form


def _named(value: str) -> ConversationKey:
    flags = value.strip().split(".")[2]
    return ConversationKey(name="", shared="s" in flags, source="", rewrites_history="r" in flags)


def test_a_request_without_a_conversation_gets_no_routing_key() -> None:
    assert routing_key("aider", ConversationKey(name="", shared=True, source="a title")) is None


@pytest.mark.parametrize("pair", [*PROJECTS, *SESSIONS], ids=lambda p: " vs ".join(p))
def test_conversations_the_adapters_tell_apart_get_two_routing_keys(pair: tuple[str, str]) -> None:
    (a_name, a_key, _), (b_name, b_key, _) = (key_of(x) for x in pair)
    assert (routing_key(a_name, a_key) == routing_key(b_name, b_key)) == ((a_name, a_key) == (b_name, b_key))


@pytest.mark.parametrize("turns", TURNS, ids=lambda p: " then ".join(p))
def test_one_conversation_keeps_one_routing_key_across_its_turns(turns: tuple[str, ...]) -> None:
    keys = {routing_key(*key_of(x)[:2]) for x in turns}
    assert len(keys) == 1, keys


@pytest.mark.parametrize("relative", sorted({x for pair in (*PROJECTS, *SESSIONS, *TURNS) for x in pair}))
def test_the_box_reads_what_the_front_keyed_without_the_agents_headers(relative: str) -> None:
    adapters, generic = door_adapters(markers=("<env>",), off=frozenset())
    body, headers, api = _capture(relative)
    front = select(Incoming(api=api, headers=headers, body=body), enabled=NAMES, adapters=adapters, fallback=generic)
    name, key, chat = key_of(relative)
    assert front.name == name
    value = routing_key(name, key)
    if value is None:
        return
    # as smg delivers it: the agent's own headers gone, the routing key there
    box_side = routed_adapter(value, (*adapters, generic))
    assert box_side is not None and box_side.name == name
    arrived = Incoming(api=api, headers={HEADER: value}, body=body)
    routed = read_routing_key(value)
    assert routed is not None and box_side.key(arrived, chat) == routed.key
    assert box_side.session(arrived) == (None if key.shared else routed.key.name)
    assert box_side.head(chat) == front.head(chat)
    # normalising twice is normalising once: the box normalises what the agent sent, as the front read it
    once, _ = front.normalise(Incoming(api=api, headers=headers, body=body))
    twice, changes = front.normalise(Incoming(api=api, headers=headers, body=once))
    assert twice == once and not changes, relative


def _capture(relative: str) -> tuple[dict[str, Any], dict[str, str], str]:
    path = DATA / relative
    data = json.loads(path.read_text())
    if "body_json" in data:
        body, headers_raw, url = data["body_json"], data["headers"], data["path"].split("?")[0]
    else:
        body, url = data, "/v1/chat/completions"
        headers_raw = json.loads((path.parent / "headers_and_hashes.json").read_text())[path.name]["headers"]
    pairs = headers_raw.items() if isinstance(headers_raw, dict) else headers_raw
    return body, {str(k).lower(): str(v) for k, v in pairs}, API[url]
