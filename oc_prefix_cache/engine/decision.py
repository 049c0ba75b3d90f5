"""The decision: (what the slot holds, what is on disk, the request's facts) -> one action.

Pure: no I/O, no clock, no server. The prepare path gathers the facts (observing the
slot, rendering the request, reading the index), calls ``decide``, and the executor
carries the action out behind the gates. Every rule is here, in one table, tested
exhaustively without a server (tests/unit/engine/test_decision.py).

The rules, in order:
1. A request with no head worth caching (a title request, no tools, its own LoRA) is
   skipped: the slot is left as it is (the prepare parks a conversation it displaces).
   So is any request for a slot the server shows processing a request ocpc does not hold:
   the server defers slot actions until that request ends, and then they would wipe it.
2. The same conversation going on, in a slot that still holds it (nothing else ran since
   ocpc last saw it, no restart): ``hit``, nothing to do.
3. A new session (no earlier assistant turn):
   - the slot holds exactly this project's head, or this head: ``hit`` (in the second case
     the project head is cut and saved on top, once a day);
   - a project head has two levels when the harness says where a shorter one ends (Claude
     Code: before the git status): with the whole project head missing (a commit changed the
     git status) the shorter level is used like the project head, and the rest is saved on it;
   - a plain transformer (which reuses any common prefix) holding this head plus a turn:
     ``hit``;
   - else restore the project head's file, else its shorter level's, else the head's (behind
     the gates unless proven on this server process), or warm the head once when there is none.
4. A conversation going on that the slot does not hold:
   - after a restart, in an empty slot, or in a slot that holds only a head or another
     conversation ocpc knows: restore its park (only its new tokens are processed), else
     its project head (same day), else its shorter level, else its head;
   - but first: when the server's own RAM prompt cache should still hold it (engine/ram_contents.py),
     ``hit`` with nothing done: the server stashes the slot's occupant and swaps this one in
     from RAM itself, faster than any slot action (and the report proves it did); where it
     would not swap (an empty slot, or one that would keep over half of what it holds: the
     server then keeps the shared prefix), one unrelated token is evaluated there first, for
     which the server stashes the occupant, and then it swaps (``clear_first``); the occupant
     is parked to disk first only when the RAM cache has no room to keep it;
   - in a slot whose contents ocpc cannot vouch for: leave it alone (``skip``); a restore
     would wipe live state ocpc cannot park, and the server's own cache decides. What the
     request leaves there is its own, so its report binds the slot to it (``adopt``): without
     that, a slot forgotten once (a prepare failed open under load) stayed unknown for every
     later turn of every conversation going on, and ocpc served none of them.
5. Before anything replaces (or, on a transformer, truncates) another conversation that
   ocpc knows is in the slot, and whose unsaved tail is worth it, that conversation is
   parked first (``park_first``), unless the server's RAM cache already holds it whole (it
   copies idle slots there whenever a request starts) with room to keep it: its next turn
   comes back from RAM. Where the RAM cache has room for it, a restore's occupant is not parked
   to disk but stashed there by the server: one unrelated token evaluated first (``clear_first``;
   not before a warm, whose evaluation could load another conversation's cached prompt over it),
   also an occupant whose unsaved tail is too short to be worth a park (a stash is one token).
   If the park fails, nothing is displaced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class FileState(Enum):
    MISSING = "missing"  # no usable file for this key in the slot folder
    PRESENT = "present"  # a file, not yet proven on this server process: restore behind the gates
    PROVEN = "proven"  # passed the gates on this server process (same size and mtime)


@dataclass(frozen=True)
class SlotFacts:
    """What ocpc may believe about the slot right now."""

    restarted: bool  # the server restarted since ocpc last looked at this slot
    known: bool  # ocpc can vouch for what the slot holds (its last record still matches /slots)
    empty: bool  # the slot holds no tokens (a fresh server, an erased slot)
    holds_head: str | None  # head fingerprint under what the slot holds, when known
    exact: bool  # ... and the slot holds exactly a prefix ocpc made (no request ran since)
    holds_conversation: str  # the conversation in the slot, when known ("" none or unknown)
    partial_cache: bool  # hybrid/recurrent/SWA model: rolls back only to checkpoints
    busy: bool = False  # the server shows a request processing in it (not one ocpc holds)
    exact_key: str | None = None  # the key of the prefix held exactly (head fingerprint or project key)
    occupant_parkable: bool = False  # a known other conversation whose unsaved tail is worth parking
    occupant_in_ram: bool = False  # a known conversation the server's RAM cache holds whole, with room to keep it
    # a known other conversation the server's RAM cache would take (a request run over it), with room to
    # keep it, whatever its unsaved tail: a stash costs one token, not a file
    occupant_stashable: bool = False


@dataclass(frozen=True)
class RequestFacts:
    skip: str | None  # why the request has no head worth caching, or None
    conversation: str  # this request's conversation id ("" when it has none)
    continues_slot: bool  # its messages extend the body of the conversation the slot holds
    continuing: bool  # it carries earlier assistant turns (not a new session's first request)
    head: str | None  # its head fingerprint (None when skipped)
    head_file: FileState
    park: FileState = FileState.MISSING  # this conversation's parked file
    project: str | None = None  # its project head's key, when one can be cut (new sessions)
    project_file: FileState = FileState.MISSING
    base: str | None = None  # the key of its project head's shorter level, when one can be cut
    base_file: FileState = FileState.MISSING
    in_ram: bool = False  # the server's own RAM prompt cache should hold this conversation (engine/ram_contents.py)
    ram_here: bool = True  # ... and would load it into this slot as the slot stands (else: clear it first)


@dataclass(frozen=True)
class Action:
    kind: str  # "hit" | "skip" | "restore" | "warm"
    reason: str
    prove: bool = False  # restore: the probe gate must pass (the file is not proven here yet)
    park_first: bool = False  # park the conversation the slot holds before replacing it
    # what the request reuses: "head" | "proj" | "base" (the project head's shorter level) | "park" |
    # "slot" (its own live state) | "ram"
    target: str = "head"
    # after loading, save the project head on top (from the head: its shorter level first, when missing)
    save_project: bool = False
    # one unrelated token evaluated in the slot first: the server stashes the occupant in its RAM cache
    # for it (a restore, a slot action, would wipe it unstashed), and target "ram" is then swapped in
    clear_first: bool = False
    # skip: the request runs pinned over contents ocpc cannot vouch for and leaves only its own prompt and
    # reply there, so its report may bind the slot to its conversation (ocpc learns the slot again)
    adopt: bool = False


def decide(slot: SlotFacts, request: RequestFacts) -> Action:
    if slot.restarted:  # whatever was known belonged to the old server process
        slot = replace(
            slot,
            known=False,
            holds_head=None,
            exact=False,
            holds_conversation="",
            exact_key=None,
            occupant_parkable=False,
        )
    if request.skip is not None or request.head is None:
        return Action("skip", request.skip or "no head")
    if slot.busy:  # a restore, warm or park would be deferred past that request, then wipe its state
        return Action(
            "skip",
            "the slot is processing another request: left to the server (a slot action "
            "now would land after that request and wipe what it leaves)",
        )
    if request.continues_slot and slot.known:
        return Action("hit", "same conversation: the slot still holds it", target="slot")
    park_first = slot.known and slot.occupant_parkable and not slot.occupant_in_ram
    stash = slot.known and slot.occupant_stashable and not slot.occupant_in_ram  # a restart: known is False
    if not request.continuing:
        return _new_session(slot, request, park_first=park_first, stash=stash)
    if slot.empty or (slot.known and slot.holds_conversation != request.conversation):
        where = (
            "in an empty slot"
            if slot.empty and not slot.known
            else "in a slot that holds only a head"
            if not slot.holds_conversation
            else "in a slot that holds another conversation"
        )
        why = f"a conversation going on {where}" if not slot.restarted else "a conversation going on after a restart"
        if request.in_ram and slot.known and not slot.restarted:  # the server swaps it in from RAM itself
            stays = slot.occupant_in_ram or slot.occupant_stashable  # the server stashes the occupant itself
            if request.ram_here:
                return Action(
                    "hit",
                    f"{why}: the server's RAM cache holds it (the server stashes the slot's "
                    "conversation and loads this one)",
                    target="ram",
                    park_first=park_first and not stays,
                )
            return Action(
                "hit",
                f"{why}: the server's RAM cache holds it; the slot is empty or shares too much "
                "with it for the server to swap (it would keep the shared prefix): one unrelated token "
                "first",
                target="ram",
                clear_first=True,
                park_first=park_first and not stays,
            )
        if request.park is not FileState.MISSING:
            return _restore(
                f"{why}: restore its park",
                prove=request.park is FileState.PRESENT,
                park_first=park_first,
                stash=stash,
                target="park",
            )
        if request.project is not None and request.project_file is not FileState.MISSING:
            return _restore(
                f"{why}, not parked: restore its project head",
                prove=request.project_file is FileState.PRESENT,
                park_first=park_first,
                stash=stash,
                target="proj",
            )
        if request.base is not None and request.base_file is not FileState.MISSING:
            return _restore(
                f"{why}, not parked: restore its project head's shorter level",
                prove=request.base_file is FileState.PRESENT,
                park_first=park_first,
                stash=stash,
                target="base",
            )
        return _load_head(request, why=f"{why}, not parked", park_first=park_first, stash=stash, save_project=False)
    return Action(
        "skip",
        "a conversation going on in a slot whose contents ocpc cannot vouch for: "
        "left to the server's own cache (its report tells ocpc what the slot holds then)",
        adopt=True,
    )


def _new_session(slot: SlotFacts, request: RequestFacts, *, park_first: bool, stash: bool) -> Action:
    """A new session: its project head when the slot holds it or a file does (a restore costs
    milliseconds; the head alone would leave the project's text to process), else its head."""
    wants_project = request.project is not None and request.project_file is FileState.MISSING
    if slot.known and slot.exact and request.project is not None and slot.exact_key == request.project:
        return Action("hit", "the slot holds exactly this project's head", target="proj")
    if request.project is not None and request.project_file is not FileState.MISSING:
        proven = request.project_file is FileState.PROVEN
        return _restore(
            "a new session: restore its project head" + (" (proven here)" if proven else ""),
            prove=not proven,
            park_first=park_first,
            stash=stash,
            target="proj",
        )
    if request.base is not None:  # the project head moved on (a commit): start from its shorter level
        if slot.known and slot.exact and slot.exact_key == request.base:
            return Action(
                "hit",
                "the slot holds exactly this project head's shorter level",
                target="base",
                save_project=wants_project,
            )
        if request.base_file is not FileState.MISSING:
            proven = request.base_file is FileState.PROVEN
            return _restore(
                "a new session: restore its project head's shorter level" + (" (proven here)" if proven else ""),
                prove=not proven,
                park_first=park_first,
                stash=stash,
                target="base",
                save_project=wants_project,
            )
    if slot.known and slot.holds_head == request.head:
        if slot.exact and slot.exact_key in (None, request.head):
            return Action("hit", "the slot holds exactly this head", save_project=wants_project)
        if not slot.partial_cache:
            return Action(
                "hit",
                "the slot holds this head plus a turn; the transformer reuses the common prefix",
                park_first=park_first,
                save_project=wants_project,
            )
    return _load_head(request, why="a new session", park_first=park_first, stash=stash, save_project=wants_project)


def _load_head(request: RequestFacts, *, why: str, park_first: bool, stash: bool, save_project: bool) -> Action:
    if request.head_file is FileState.MISSING:  # a warm's own evaluation could load another
        # conversation's cached prompt over a stashed occupant: it parks first, never stashes
        return Action("warm", f"{why}: first run of this head", park_first=park_first, save_project=save_project)
    proven = request.head_file is FileState.PROVEN
    return _restore(
        f"{why}: restore the head" + (" (file proven on this server)" if proven else ""),
        prove=not proven,
        park_first=park_first,
        stash=stash,
        save_project=save_project,
    )


def _restore(
    why: str, *, park_first: bool, stash: bool, prove: bool, target: str = "head", save_project: bool = False
) -> Action:
    """A restore, and what becomes of the occupant it displaces. A restore is a slot action,
    which wipes the slot unstashed: where the server's RAM cache would take the occupant (room
    to keep it), one unrelated token first makes the server stash it there (``clear_first``)
    instead of a park to disk (``park_first``). That holds for an occupant whose unsaved tail is
    too short to be worth a park too: a stash costs one token, and its next turn then comes back
    from RAM instead of re-processing its turns on its head (at K = 16 agents on 2 slots, four
    turns in a 180 s window did that: pi's, whose first turn left 101 tokens past its head)."""
    if stash:
        return Action(
            "restore",
            f"{why}; the slot's conversation goes to the server's RAM cache first",
            prove=prove,
            target=target,
            save_project=save_project,
            clear_first=True,
        )
    return Action("restore", why, prove=prove, park_first=park_first, target=target, save_project=save_project)
