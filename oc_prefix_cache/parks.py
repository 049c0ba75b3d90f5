"""Parked conversations and project heads: what they are on disk, and how a request finds its own.

Two longer prefixes sit on top of a harness's head:
- a **project head** (``oc-proj-<key>.bin``): a project's whole system prompt (the head,
  then the ``<env>`` block, AGENTS.md, MCP instructions, skills) up to where the first user
  message starts. It is the same for every session in that project on the same day, so it
  expires at the end of its day.
- a **parked conversation** (``oc-conv-<key>.bin``): a conversation saved at the end of its
  last prompt's messages (before the generation prompt), so its next request strictly
  extends it. One file per conversation; parking again replaces it.

Both are filed under the server's identity (``fingerprint.server_key``: model files, build,
template, n_ctx, KV flags, adapters): llama-server restores a same-shape file from other
weights silently, so a file is only ever looked up under the identity it was made with.
A request finds its park by session id when its harness sends one, else as the longest
parked message chain its own messages extend. Pure: the index is read elsewhere.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import xxhash

from .store import Entry, Index


@dataclass(frozen=True)
class Park:
    key: str  # 16 hex: the file is oc-conv-<key>.bin
    n_tokens: int
    session: str
    chain: tuple[str, ...]  # digests of the messages the park covers
    head: str
    text_chars: int = 0  # characters of the rendered prompt it covers (0: unknown)
    text_xxh64: str = ""


def park_key(*, identity: str, conversation: str) -> str:
    return xxhash.xxh64_hexdigest(f"conv\x00{identity}\x00{conversation}".encode())


def project_key(*, identity: str, head: str, project_text: str) -> str:
    return xxhash.xxh64_hexdigest(f"proj\x00{identity}\x00{head}\x00{project_text}".encode())


def find_park(index: Index, *, identity: str, session: str, digests: tuple[str, ...]) -> Park | None:
    """This conversation's park: by session when it has one, else by the longest message
    chain that ``digests`` extend. Only parks made under ``identity`` count."""
    best: tuple[int, int, str, Entry] | None = None
    for key, entry in index.entries.items():
        if entry.kind != "conv" or entry.identity != identity:
            continue
        chain = tuple(entry.chain)
        if session:
            if entry.session != session:
                continue
            rank = (1, entry.last_used)  # the latest park of that session
        else:
            if entry.session or not chain or len(chain) > len(digests) or digests[: len(chain)] != chain:
                continue
            rank = (len(chain), entry.last_used)
        if best is None or rank > best[:2]:
            best = (*rank, key, entry)
    if best is None:
        return None
    _, _, key, entry = best
    return Park(key=key, n_tokens=entry.prefix_tokens, session=entry.session, chain=tuple(entry.chain),
                head=entry.head, text_chars=entry.text_chars, text_xxh64=entry.text_xxh64)


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
