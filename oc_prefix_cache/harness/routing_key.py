"""The conversation key as a gateway's routing key: one header that both routes and names.

Many boxes (docs/scale.md): the agents talk to ``ocpc gateway``'s front, which runs the adapters
(they need the agent's own headers, its ``User-Agent`` and session ids, which the gateway, smg, does
not forward) and sends the conversation's key on as ``X-SMG-Routing-Key``. smg hashes that value to
pick the box (consistent hashing: every turn of a conversation on one box) and forwards that one
header to it, so the box's ocpc reads the same key back and knows the conversation, also for an
agent that sends no session header (Aider, Cline), and knows which adapter cut its head.

The value is ``ocpc1.<adapter>.<flags>.<digest>``: the adapter's name, the key's flags (``s``: a
shared key, told apart by message chains on the box; ``r``: the harness rewrites earlier turns;
``-``: neither) and the xxh3-128 of the key's name. A digest and not the name: a session id may be
anything an agent sends (smg refuses a key over 128 bytes and falls back to a random box), and two
names give one digest only by a 128-bit collision. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.chat.head import Head, Skip
from oc_prefix_cache.harness.base import Adapter, Incoming

HEADER = "x-smg-routing-key"
_PREFIX = "ocpc1"
_VALUE_RE = re.compile(r"ocpc1\.(?P<adapter>[a-z][a-z0-9-]{0,31})\.(?P<flags>-|s|r|sr)\.(?P<digest>[0-9a-f]{32})")


@dataclass(frozen=True)
class Routed:
    """What a routing key says: the adapter that read the request, and its conversation's key."""

    adapter: str
    key: ConversationKey


def routing_key(adapter: str, key: ConversationKey) -> str | None:
    """The header's value for a request of ``adapter`` under ``key``; None for a request with no
    conversation to keep (a title: any box serves it, and no box keeps it)."""
    if not key.name:
        return None
    flags = ("s" if key.shared else "") + ("r" if key.rewrites_history else "")
    digest = xxhash.xxh3_128_hexdigest(key.name.encode("utf-8", "surrogatepass"))
    return f"{_PREFIX}.{adapter}.{flags or '-'}.{digest}"


def read_routing_key(value: str | None) -> Routed | None:
    """The routing key a front sent, or None for a value that is not ours (a key another client
    chose: the box then reads the request itself, as without a gateway)."""
    match = _VALUE_RE.fullmatch((value or "").strip())
    if match is None:
        return None
    flags = match.group("flags")
    name = f"routed-{match.group('digest')}"
    key = ConversationKey(
        name=name,
        shared="s" in flags,
        source="the routing key ocpc's front sent through the gateway",
        rewrites_history="r" in flags,
    )
    return Routed(adapter=match.group("adapter"), key=key)


@dataclass(frozen=True)
class RoutedAdapter:
    """A box's view of a request the front keyed: the named adapter cuts its head and normalises
    its body as it would have (normalising twice changes nothing: tests/unit/harness/
    test_routing_key.py), but the conversation is the one the front named: the headers it was
    read from did not cross the gateway."""

    inner: Adapter
    routed: ConversationKey

    @property
    def name(self) -> str:
        return self.inner.name

    def matches(self, incoming: Incoming) -> bool:
        return True

    def normalise(self, incoming: Incoming) -> tuple[dict[str, Any], tuple[str, ...]]:
        return self.inner.normalise(incoming)

    def head(self, chat: dict[str, Any]) -> Head | Skip:
        return self.inner.head(chat)

    def session(self, incoming: Incoming) -> str | None:
        return None if self.routed.shared else self.routed.name

    def key(self, incoming: Incoming, chat: dict[str, Any]) -> ConversationKey:
        return self.routed


def routed_adapter(value: str | None, adapters: Sequence[Adapter]) -> RoutedAdapter | None:
    """The adapter a routing key names, keyed as it says; None for no key of ours or an adapter
    this box does not have (switched off here: the box reads the request itself)."""
    routed = read_routing_key(value)
    if routed is None:
        return None
    inner = next((a for a in adapters if a.name == routed.adapter), None)
    return None if inner is None else RoutedAdapter(inner=inner, routed=routed.key)
