"""Parked conversations and project heads: what they are on disk, and how a request finds its own.

Two longer prefixes sit on top of a harness's head:
- a **project head** (``oc-proj-<key>.bin``): a project's whole system prompt (the head,
  then the ``<env>`` block, AGENTS.md, MCP instructions, skills) up to where the first user
  message starts. It is the same for every session in that project on the same day, so it
  expires at the end of its day.
- a **parked conversation** (``oc-conv-<key>.bin``): a conversation saved at the end of its
  last prompt's messages (before the generation prompt), so its next request strictly
  extends it. One file per conversation; parking again replaces it.

Both are filed under the server's identity (``fingerprint.server_key``: the model's content,
build, template, n_ctx, KV flags, adapters): llama-server restores a same-shape file from other
weights silently, so a file is only ever looked up under the identity it was made with.
A request finds its park by session id when its harness sends one, else as the longest
parked message chain its own messages extend. Pure: the index is read elsewhere.

Parks made before identities were by content are filed under FORMAT 3's key
(``fingerprint.legacy_server_key``): a request that finds none under its own looks there, and
adopts what it finds (``adopted_park_key``, ``adopted_entry``; engine/ondisk.py links the file)
under the key its conversation parks under now, so its next park replaces it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, replace

from oc_prefix_cache.chat.conversation import text_digest
from oc_prefix_cache.disk.index import Entry, Index, chain_digest, prefix_digests


@dataclass(frozen=True)
class Park:
    key: str  # 16 hex: the file is oc-conv-<key>.bin
    n_tokens: int
    session: str
    messages: int  # how many of the conversation's messages the park covers
    head: str
    text_chars: int = 0  # characters of the rendered prompt it covers (0: unknown)
    text_xxh64: str = ""


def park_key(*, identity: str, conversation: str) -> str:
    return text_digest(f"conv\x00{identity}\x00{conversation}")


def project_key(*, identity: str, head: str, project_text: str) -> str:
    return text_digest(f"proj\x00{identity}\x00{head}\x00{project_text}")


def adopted_park_key(*, identity: str, conversation: str, old: str) -> str:
    """The key a park made under another identity takes under ``identity``: the one its
    conversation parks under there (``park_key``), so parking it again replaces it; a park
    without a conversation's name (ocpc before 0.2) keeps a key of its own."""
    return park_key(identity=identity, conversation=conversation or old)


def adopted_entry(entry: Entry, *, file: str, identity: str, head: str) -> Entry:
    """``entry`` under a new name: the same file's contents (so its size, tokens and digest),
    filed under ``identity`` (parks, project heads; "" for a head) over head ``head``."""
    return replace(
        entry,
        file=file,
        identity=identity if entry.kind != "head" else entry.identity,
        head=head,
        chain=list(entry.chain),
        extra=dict(entry.extra),
    )


def park_entry(
    *,
    model: str,
    build: str,
    identity: str,
    head: str,
    session: str,
    digests: Sequence[str],
    text_chars: int = 0,
    text_xxh64: str = "",
    conversation: str = "",
) -> Entry:
    """A park's index entry before its save fills in the file: O(1) in the conversation's length
    (its chain's length and digest, not a digest per message)."""
    return Entry(
        file="",
        bytes=0,
        prefix_tokens=0,
        created=0,
        last_used=0,
        model=model,
        server_build=build,
        harness="",
        identity=identity,
        head=head,
        session=session,
        chain_n=len(digests),
        chain_xxh64=chain_digest(digests),
        text_chars=text_chars,
        text_xxh64=text_xxh64,
        conversation=conversation,
    )


def find_park(index: Index, *, identity: str, session: str, digests: tuple[str, ...]) -> Park | None:
    """This conversation's park: by session when it has one, else by the longest message
    chain that ``digests`` extend (each park keeps its chain's length and digest; the request's
    chain is digested once, at those lengths). Only parks made under ``identity`` count."""
    parks = [
        (key, entry, entry.covers())
        for key, entry in index.entries.items()
        if entry.kind == "conv" and entry.identity == identity
    ]
    ours = (
        prefix_digests(digests, {n for _, e, (n, _) in parks if not e.session and 0 < n <= len(digests)})
        if not session
        else {}
    )
    best: tuple[int, int, str, Entry] | None = None
    for key, entry, (n, digest) in parks:
        if session:
            if entry.session != session:
                continue
            rank = (1, entry.last_used)  # the latest park of that session
        else:
            if entry.session or not n or ours.get(n) != digest:
                continue
            rank = (n, entry.last_used)
        if best is None or rank > best[:2]:
            best = (*rank, key, entry)
    if best is None:
        return None
    _, _, key, entry = best
    return Park(
        key=key,
        n_tokens=entry.prefix_tokens,
        session=entry.session,
        messages=entry.covers()[0],
        head=entry.head,
        text_chars=entry.text_chars,
        text_xxh64=entry.text_xxh64,
    )


def project_entry(index: Index, key: str, *, now: float) -> Entry | None:
    """The project head filed under ``key``, unless its day is over."""
    entry = index.entries.get(key)
    if entry is None or entry.kind != "proj" or (entry.expires and entry.expires <= now):
        return None
    return entry


def end_of_day(now: float) -> int:
    """Unix seconds of the next local midnight: a project head's ``<env>`` says today's date."""
    today = dt.datetime.fromtimestamp(now).date()
    midnight = dt.datetime.combine(today + dt.timedelta(days=1), dt.time())
    return int(midnight.timestamp())
