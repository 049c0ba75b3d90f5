"""Which conversation a request belongs to, when its key may name several (a shared key).

A harness adapter names a request's conversation by a ``ConversationKey`` (chat/conversation.py). A
session id names one conversation, and is the conversation's name as it is. A shared key (an
agent that sends no session id: Aider, Cline, Qwen Code, a subagent) may name two: two sessions
of one project that began with the same words send byte-identical first requests, and nothing in
them tells the two apart. Taking such a key for the conversation itself broke ocpc's second
promise: a new session was sent to the slot of a running one and waited for it, an occupant was
counted as "itself" and never parked, and two conversations wrote one park file (issue 36).

So a shared key is never a conversation's name. Each conversation under it gets a name of its own
(the key, ``~`` and a random number), found again on its next turn by its message chain: the
conversation whose last body the request goes on from. A request goes on from a body when its
bytes are that body with messages added (``conversation.follow``), or when it repeats that body's
messages with the last one cut short of a block its own system text holds, and more after it
(Aider appends its edit format's rules, which its system prompt also holds, to the newest message,
and leaves them out once it is history). It looks where ocpc last saw each conversation:

1. a slot of the server (the tracker's record of the last body that ran there);
2. the server's RAM prompt cache (what ocpc saw go there, engine/ram_tier.py);
3. its park on disk (the index keeps each park's message chain and its conversation's name), read
   only when no live state matched;

and takes the body the request is the very next turn of (one reply added: a conversation's record
is always its last request's body, so a request that adds more turns to a body is another
conversation that said the same so far), the longest where two conversations that began alike both
qualify, since only a conversation's own record holds all of its earlier turns. Never a conversation
with a request in flight (``in_flight``: a conversation sends one turn at a time, and two twins'
next turns, named at once, must not both take the first twin's name); never one of two that tie.

A request equal to a body (no message added) is a retry of that conversation only when it
carries earlier turns and that slot is idle: the same first request twice is two sessions, and a
busy slot may run its twin. An agent that rewrites its own history (``rewrites_history``: Aider
moves a turn that edited files before its chat files, whose contents changed) is taken for the one
conversation live under its key when nothing else matches and that one is idle. What no place
knows gets a new name: a new session, or one ocpc lost track of (then it pays what it would have
paid: its prepare still finds a park by its chain).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from oc_prefix_cache.chat.conversation import INSTANCE_SEP, ConversationKey, ParsedBody, Trail, follow, parse
from oc_prefix_cache.chat.head import message_text
from oc_prefix_cache.disk.index import Index, prefix_digests
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.errors import BadRequestBody

log = logging.getLogger("ocpc.prepare")

#: A block cut off a repeated message is taken for a reminder only from this length on.
MIN_REMINDER_CHARS = 32


@dataclass(frozen=True)
class Found:
    name: str
    messages: int  # how many messages of the request the place it was found in holds
    where: str  # "slot" | "ram" | "park" | "new" | "only one"
    exact: bool = True  # the request repeats that body's bytes (not a last message cut short)


@dataclass
class _Request:
    """The request being named, parsed at most once however many bodies it is held against."""

    raw: bytes
    continuing: bool
    _parsed: ParsedBody | None = None
    _unparsable: bool = False

    def parsed(self) -> ParsedBody | None:
        if self._parsed is None and not self._unparsable:
            try:
                self._parsed = parse(self.raw.decode("utf-8"))
            except (UnicodeDecodeError, BadRequestBody):
                self._unparsable = True
        return self._parsed


@dataclass
class _Best:
    """The best place found so far, and whether another place tied with it."""

    found: Found | None = None
    tied: bool = False
    seen: list[Found] = field(default_factory=list)

    def offer(self, found: Found | None) -> None:
        if found is None:
            return
        self.seen.append(found)
        if self.found is None or _rank(found) > _rank(self.found):
            self.found, self.tied = found, False
        elif _rank(found) == _rank(self.found) and found.name != self.found.name:
            self.tied = True


class Instances:
    """Names the conversations under shared keys for one server. Thread-safe (reads only)."""

    def __init__(
        self,
        *,
        server: str,
        tracker: SlotTracker,
        ram: RamTier,
        busy: Callable[[], set[int]],
        index: Callable[[], Index | None],
    ) -> None:
        self.server = server
        self.tracker = tracker
        self.ram = ram
        self._busy = busy
        self._index = index

    def name(
        self,
        key: ConversationKey,
        raw: bytes,
        *,
        continuing: bool,
        rewrites_history: bool = False,
        in_flight: Collection[str] = (),
    ) -> str:
        """The conversation's own name: a session id as it is; under a shared key, the conversation
        ``raw`` goes on, else a new one (``find``). ``continuing``: the request carries earlier
        turns of its own (not only a harness's canned examples)."""
        if not key.name or not key.shared:
            return key.name
        return self.find(key, raw, continuing=continuing, rewrites_history=rewrites_history, in_flight=in_flight).name

    @staticmethod
    def fresh(key: ConversationKey) -> str:
        """A new conversation's name under ``key`` (a session id is its own name)."""
        return key.name + INSTANCE_SEP + secrets.token_hex(4) if key.shared and key.name else key.name

    def find(
        self,
        key: ConversationKey,
        raw: bytes,
        *,
        continuing: bool,
        rewrites_history: bool = False,
        in_flight: Collection[str] = (),
    ) -> Found:
        prefix = key.name + INSTANCE_SEP
        request = _Request(raw=raw, continuing=continuing)
        best = _Best()
        for where, name, trail, idle in self._live(prefix):
            if name not in in_flight:
                best.offer(_went_on(where, name, trail, request, retry_ok=continuing and idle))
        if best.found is None:  # its park, when no live state of it is known
            for found in self._in_parks(prefix, request):
                if found.name not in in_flight:
                    best.offer(found)
        if best.found is not None and not best.tied:
            log.debug("%s: found in its %s (%d messages)", best.found.name, best.found.where, best.found.messages)
            return best.found
        if best.found is None and continuing and rewrites_history:
            live = {name for _, name, _, idle in self._live(prefix) if idle and name not in in_flight}
            if len(live) == 1:
                return Found(name=live.pop(), messages=0, where="only one")
        return Found(name=self.fresh(key), messages=0, where="new")

    def _live(self, prefix: str) -> list[tuple[str, str, Trail, bool]]:
        """(where, name, last body, idle) of each conversation under the key that ocpc saw live:
        in a slot, or in the server's RAM cache."""
        busy = self._busy()
        out: list[tuple[str, str, Trail, bool]] = []
        for slot in self.tracker.slots(self.server):
            holding, trail = self.tracker.holding(self.server, slot), self.tracker.trail(self.server, slot)
            if holding is not None and trail is not None and holding.conversation.startswith(prefix):
                out.append(("slot", holding.conversation, trail, slot not in busy))
        for name, trail in self.ram.kept(epoch=self.tracker.epoch(self.server)):
            if name.startswith(prefix):
                out.append(("ram", name, trail, True))
        return out

    def _in_parks(self, prefix: str, request: _Request) -> list[Found]:
        index = self._index()
        if index is None:
            return []
        parks = [
            (entry.conversation, entry.covers())
            for entry in index.entries.values()
            if entry.kind == "conv" and entry.conversation.startswith(prefix)
        ]
        parsed = request.parsed() if parks else None
        if parsed is None:
            return []
        ours = prefix_digests(parsed.digests, {n for _, (n, _) in parks if 0 < n <= len(parsed.digests)})
        found = (_next_turn_of("park", name, n, request) for name, (n, digest) in parks if n and ours.get(n) == digest)
        return [f for f in found if f is not None]


def _rank(found: Found) -> tuple[int, bool]:
    """Longest first; at one length, the body the request repeats byte for byte first."""
    return found.messages, found.exact


def _went_on(where: str, name: str, trail: Trail, request: _Request, *, retry_ok: bool) -> Found | None:
    """Where ``request`` goes on from ``trail``'s body (None: it does not). An equal body counts
    only as a retry (``retry_ok``)."""
    went_on = follow(trail, request.raw)
    if went_on is None:
        return _rewords_last(where, name, trail, request)
    n = len(trail.digests)
    if len(went_on.digests) == n:
        return Found(name, n, where) if retry_ok else None
    added = request.raw[trail.msg_end : len(request.raw) - (len(trail.raw) - trail.msg_end)]
    if added.count(b'"assistant"') <= 1:  # one reply added: its very next turn
        return Found(name, n, where)
    return _next_turn_of(where, name, n, request)  # a quoted "assistant" in a tool result, or turns ocpc missed


def _next_turn_of(where: str, name: str, n: int, request: _Request) -> Found | None:
    """``request`` as the very next turn of a body of its first ``n`` messages (one reply added), or
    None: a conversation's recorded body is always its last request's, so a request that adds more
    turns than one to it is another conversation that said the same so far, whose own record ocpc
    lost (taking that name would run it over the other's reply, unparked)."""
    parsed = request.parsed()
    if parsed is None:
        return None
    replies = sum(1 for m in parsed.messages[n:] if m.get("role") == "assistant")
    return Found(name, n, where) if replies <= 1 else None


def _rewords_last(where: str, name: str, trail: Trail, request: _Request) -> Found | None:
    """The next turn of an agent that appends a reminder to its newest message and leaves it out
    once the message is history (Aider: its edit format's rules after the typed text): every
    message of ``trail`` but the last repeated as it was, the last one without a block of at least
    ``MIN_REMINDER_CHARS`` that the request's own system text holds, and more after it (the reply,
    the next message)."""
    n = len(trail.digests)
    now = request.parsed() if n >= 2 else None
    if now is None or len(now.digests) <= n or now.digests[: n - 1] != trail.digests[: n - 1]:
        return None
    try:
        before = parse(trail.raw.decode("utf-8"))
    except (UnicodeDecodeError, BadRequestBody):
        return None
    last, again = before.messages[n - 1], now.messages[n - 1]
    if last.get("role") != "user" or again.get("role") != "user":
        return None
    shorter, longer = message_text(again) or "", message_text(last) or ""
    cut = longer[len(shorter) :]
    system = message_text(now.messages[0]) or "" if now.messages[0].get("role") in ("system", "developer") else ""
    if (
        not shorter
        or not longer.startswith(shorter)
        or not cut.startswith("\n\n")
        or len(cut) - 2 < MIN_REMINDER_CHARS
        or cut[2:] not in system
    ):
        return None
    replies = sum(1 for m in now.messages[n:] if m.get("role") == "assistant")
    return Found(name, n, where, exact=False) if replies <= 1 else None
