"""The decision: (what the slot holds, what is on disk, the request's facts) -> one action.

Pure: no I/O, no clock, no server. The prepare path gathers the facts (observing the
slot, rendering the request, looking at the slot folder), calls ``decide``, and the
executor carries the action out behind the gates. Every rule is here, in one table,
tested exhaustively without a server (tests/test_decision.py).

The rules, in order:
1. A request with no head worth caching (a title request, no tools, its own LoRA) is
   skipped: the slot is left as it is.
2. The same conversation going on, in a slot that still holds it (nothing else ran since
   ocpc last saw it, no restart): ``hit``, nothing to do.
3. A new session (no earlier assistant turn):
   - the slot holds exactly this head, or (on a plain transformer, which reuses any common
     prefix) this head followed by something else: ``hit``;
   - else restore the head's file (behind the gates unless proven on this server process),
     or warm it once when there is none.
4. A conversation going on that the slot does not hold:
   - after a restart, or in a slot that holds nothing known to be live, restore its
     head: there is nothing to lose, and only its tail is processed again;
   - else leave the slot alone (``skip``): it holds another conversation, or state ocpc
     cannot vouch for, that a restore would wipe; the server's own cache decides.
Before anything replaces a slot's contents, ``park_first`` says whether the conversation
in it must be parked first (see ``Occupant``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class FileState(Enum):
    MISSING = "missing"  # no file for this key in the slot folder
    PRESENT = "present"  # a file, not yet proven on this server process: restore behind the gates
    PROVEN = "proven"  # passed the gates on this server process (same size and mtime)


@dataclass(frozen=True)
class SlotFacts:
    """What ocpc may believe about the slot right now."""

    restarted: bool  # the server restarted since ocpc last looked at this slot
    known: bool  # ocpc can vouch for what the slot holds (its last record still matches /slots)
    empty: bool  # the slot holds no tokens (a fresh server, an erased slot)
    holds_head: str | None  # head fingerprint under what the slot holds, when known
    exact: bool  # ... and the slot holds exactly that head (no request ran since ocpc's step)
    holds_conversation: str  # the conversation in the slot, when known ("" none or unknown)
    partial_cache: bool  # hybrid/recurrent/SWA model: rolls back only to checkpoints


@dataclass(frozen=True)
class RequestFacts:
    skip: str | None  # why the request has no head worth caching, or None
    conversation: str  # this request's conversation id ("" when it has none)
    continues_slot: bool  # its messages extend the body of the conversation the slot holds
    continuing: bool  # it carries earlier assistant turns (not a new session's first request)
    head: str | None  # its head fingerprint (None when skipped)
    head_file: FileState


@dataclass(frozen=True)
class Action:
    kind: str  # "hit" | "skip" | "restore" | "warm"
    reason: str
    prove: bool = False  # restore: the probe gate must pass (the file is not proven here yet)
    park_first: bool = False  # park the conversation the slot holds before replacing it


def decide(slot: SlotFacts, request: RequestFacts) -> Action:
    if slot.restarted:  # whatever was known belonged to the old server process
        slot = replace(slot, known=False, holds_head=None, exact=False, holds_conversation="")
    if request.skip is not None or request.head is None:
        return Action("skip", request.skip or "no head")
    if request.continues_slot and slot.known and not slot.restarted:
        return Action("hit", "same conversation: the slot still holds it")
    if not request.continuing:
        if slot.known and slot.holds_head == request.head:
            if slot.exact:
                return Action("hit", "the slot holds exactly this head")
            if not slot.partial_cache:
                return Action("hit", "the slot holds this head plus a turn; the transformer reuses the common prefix")
        return _load_head(request, why="a new session")
    if slot.restarted or slot.empty:
        return _load_head(request, why="a conversation going on after a restart" if slot.restarted
                          else "a conversation going on in an empty slot")
    if slot.known and not slot.holds_conversation:
        return _load_head(request, why="a conversation going on in a slot that holds only a head")
    return Action("skip", "a conversation going on in a slot that holds other live state: "
                  "left to the server's own cache")


def _load_head(request: RequestFacts, *, why: str) -> Action:
    if request.head_file is FileState.MISSING:
        return Action("warm", f"{why}: first run of this head")
    proven = request.head_file is FileState.PROVEN
    return Action("restore", f"{why}: restore the head" + (" (file proven on this server)" if proven else ""),
                  prove=not proven)


def slot_facts(*, restarted: bool, known: bool, empty: bool, holds_head: str | None, exact: bool,
               holds_conversation: str, partial_cache: bool) -> SlotFacts:
    """Keyword-only constructor, for call sites that read like the table."""
    return SlotFacts(restarted=restarted, known=known, empty=empty, holds_head=holds_head, exact=exact,
                     holds_conversation=holds_conversation, partial_cache=partial_cache)
