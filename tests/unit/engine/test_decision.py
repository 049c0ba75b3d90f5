"""The decision table, exhaustively, without a server."""

from __future__ import annotations

import ast
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.engine import decision
from oc_prefix_cache.engine.decision import Action, FileState, RequestFacts, SlotFacts, decide

HEAD = "0123456789abcdef"
OTHER = "fedcba9876543210"

SLOT = SlotFacts(
    restarted=False, known=True, empty=False, holds_head=HEAD, exact=True, holds_conversation="", partial_cache=True
)
NEW = RequestFacts(
    skip=None, conversation="ses_b", continues_slot=False, continuing=False, head=HEAD, head_file=FileState.PROVEN
)
TURN = replace(NEW, conversation="ses_a", continues_slot=True, continuing=True)


def slot(**changes: object) -> SlotFacts:
    return replace(SLOT, **changes)


def request(base: RequestFacts = NEW, **changes: object) -> RequestFacts:
    return replace(base, **changes)


PROJ = "aaaaaaaaaaaaaaaa"


@pytest.mark.parametrize(
    ("facts", "req", "kind", "words", "target"),
    [
        # title request / no head
        (slot(), request(skip="no tools in the request", head=None), "skip", "no tools", "head"),
        # same conversation
        (slot(exact=False, holds_conversation="ses_a"), TURN, "hit", "same conversation", "slot"),
        (slot(restarted=True, known=False, empty=True), TURN, "restore", "after a restart", "head"),
        (
            slot(restarted=True, known=False, empty=True),
            request(TURN, park=FileState.PRESENT),
            "restore",
            "restore its park",
            "park",
        ),
        (
            slot(restarted=True, known=False, empty=True),
            request(TURN, head_file=FileState.MISSING),
            "warm",
            "first run",
            "head",
        ),
        # same conversation, but something else ran meanwhile (foreign request, bypass, second daemon)
        (slot(known=False, holds_head=None, exact=False), TURN, "skip", "cannot vouch", "head"),
        (
            slot(known=False, holds_head=None, exact=False),
            request(TURN, park=FileState.PROVEN),
            "skip",
            "cannot vouch",
            "head",
        ),
        # new session: exact head or project head, or a turn on top of the head
        (slot(), NEW, "hit", "exactly this head", "head"),
        (slot(exact_key=PROJ), request(project=PROJ, project_file=FileState.PROVEN), "hit", "project's head", "proj"),
        (slot(exact=False, holds_conversation="ses_a"), NEW, "restore", "new session", "head"),
        (slot(exact=False, holds_conversation="ses_a", partial_cache=False), NEW, "hit", "transformer", "head"),
        # new session: the project head on disk wins over the head, also over the head left in the slot (a
        # transformer would reuse only the head from another project's conversation: 343 tokens of OpenCode's
        # project text processed again; issue 18)
        (
            slot(holds_head=OTHER),
            request(project=PROJ, project_file=FileState.PRESENT),
            "restore",
            "project head",
            "proj",
        ),
        (
            slot(exact=False, holds_conversation="ses_a", partial_cache=False),
            request(project=PROJ, project_file=FileState.PROVEN),
            "restore",
            "project head",
            "proj",
        ),
        (slot(), request(project=PROJ, project_file=FileState.PROVEN), "restore", "project head", "proj"),
        # new session: another head, nothing known, a restart, a missing or unproven file
        (slot(holds_head=OTHER), NEW, "restore", "new session", "head"),
        (slot(known=False, holds_head=None, exact=False), NEW, "restore", "new session", "head"),
        (slot(restarted=True, known=False, holds_head=None, empty=True), NEW, "restore", "new session", "head"),
        (slot(holds_head=OTHER), request(head_file=FileState.MISSING), "warm", "first run", "head"),
        (slot(holds_head=OTHER), request(head_file=FileState.PRESENT), "restore", "new session", "head"),
        # another conversation's later turn: its park, else its head; never over state ocpc cannot vouch for
        (
            slot(exact=False, holds_conversation="ses_b"),
            request(TURN, continues_slot=False, park=FileState.PROVEN),
            "restore",
            "another conversation",
            "park",
        ),
        (
            slot(exact=False, holds_conversation="ses_b"),
            request(TURN, continues_slot=False),
            "restore",
            "not parked",
            "head",
        ),
        (
            slot(exact=False, holds_conversation="ses_b"),
            request(TURN, continues_slot=False, project=PROJ, project_file=FileState.PROVEN),
            "restore",
            "its project head",
            "proj",
        ),
        (slot(holds_conversation=""), request(TURN, continues_slot=False), "restore", "only a head", "head"),
        (
            slot(known=False, holds_head=None, empty=True),
            request(TURN, continues_slot=False),
            "restore",
            "empty slot",
            "head",
        ),
    ],
)
def test_the_table(facts: SlotFacts, req: RequestFacts, kind: str, words: str, target: str) -> None:
    action = decide(facts, req)
    assert action.kind == kind, action
    assert words in action.reason, action
    if kind in ("restore", "hit"):
        assert action.target == target, action


def test_a_known_conversation_is_parked_before_anything_replaces_or_truncates_it() -> None:
    occupied = slot(exact=False, holds_conversation="ses_b", occupant_parkable=True)
    assert decide(occupied, NEW).park_first  # hybrid: the head is restored over it
    assert decide(replace(occupied, partial_cache=False), NEW).park_first  # transformer: the new request truncates it
    assert decide(occupied, request(TURN, continues_slot=False, park=FileState.PROVEN)).park_first
    assert not decide(replace(occupied, occupant_parkable=False), NEW).park_first  # too short to be worth it
    assert not decide(replace(occupied, known=False), NEW).park_first  # unknown contents are never "parked"


def test_a_known_conversation_too_short_to_park_is_stashed_in_ram_before_a_restore_wipes_it() -> None:
    """A conversation whose unsaved tail is under the park minimum is not worth a file, but the
    server's RAM cache keeps it for one token: before, a restore wiped it unstashed and its next
    turn re-processed its turns on its head (four such turns in a K = 16 window)."""
    short = slot(exact=False, holds_conversation="ses_a", occupant_parkable=False, occupant_stashable=True)
    for req in (
        NEW,
        request(conversation="ses_c", continues_slot=False, continuing=True, park=FileState.PROVEN),
        request(conversation="ses_c", continues_slot=False, continuing=True, head_file=FileState.PRESENT),
    ):
        action = decide(short, req)
        assert action.kind == "restore" and action.clear_first and not action.park_first, (req, action)
    # without room in the RAM cache, or across a restart, nothing to stash it for
    assert not decide(replace(short, occupant_stashable=False), NEW).clear_first
    assert not decide(replace(short, restarted=True), NEW).clear_first


def test_a_project_head_is_saved_once_when_missing() -> None:
    fresh = request(project=PROJ, project_file=FileState.MISSING)
    assert decide(slot(holds_head=OTHER), fresh).save_project
    assert decide(slot(), fresh).save_project  # the slot holds exactly the head: extend it
    assert not decide(slot(holds_head=OTHER), request(project=PROJ, project_file=FileState.PROVEN)).save_project
    assert not decide(slot(holds_head=OTHER), NEW).save_project  # no project head could be cut


BASE = "bbbbbbbbbbbbbbbb"


def test_after_a_commit_a_new_session_starts_from_the_project_heads_shorter_level() -> None:
    """Claude Code's git status moves with each commit: the whole project head is new, its
    shorter level (the environment) is not. The level is restored (or hit) and the rest saved on it;
    with neither on disk, both are saved on the head."""
    moved = replace(NEW, project=PROJ, project_file=FileState.MISSING, base=BASE, base_file=FileState.PROVEN)
    action = decide(slot(holds_head=OTHER), moved)
    assert (action.kind, action.target, action.save_project, action.prove) == ("restore", "base", True, False)
    action = decide(slot(exact_key=BASE), moved)
    assert (action.kind, action.target, action.save_project) == ("hit", "base", True)
    present = decide(slot(holds_head=OTHER), replace(moved, base_file=FileState.PRESENT))
    assert present.target == "base" and present.prove
    # the whole project head still wins when it is there
    both = replace(moved, project_file=FileState.PRESENT)
    assert decide(slot(holds_head=OTHER), both).target == "proj"
    assert decide(slot(exact_key=PROJ), both).kind == "hit"
    # neither level on disk: the head, and both saved on it (prepare saves the shorter level first)
    fresh = replace(moved, base_file=FileState.MISSING)
    action = decide(slot(holds_head=OTHER), fresh)
    assert (action.target, action.save_project) == ("head", True)
    # a conversation going on without a park: the project head, else its shorter level, else the head
    going_on = replace(moved, continuing=True, conversation="ses_c", continues_slot=False)
    assert decide(slot(empty=True, known=False, holds_head=None), going_on).target == "base"


def test_restores_prove_unless_the_file_is_proven_on_this_server() -> None:
    assert decide(slot(holds_head=OTHER), request(head_file=FileState.PRESENT)).prove is True
    assert decide(slot(holds_head=OTHER), request(head_file=FileState.PROVEN)).prove is False


def test_a_restart_is_never_a_hit() -> None:
    """Defect 1 at the table: whatever else is true, a restarted slot is never 'hit'."""
    for values in itertools.product([True, False], repeat=6):
        known, empty, exact, partial, continues, continuing = values
        facts = slot(restarted=True, known=known, empty=empty, exact=exact, partial_cache=partial)
        assert decide(facts, request(continues_slot=continues, continuing=continuing)).kind != "hit"


def test_a_slot_the_server_shows_busy_is_never_restored_into() -> None:
    """The defect: decide never read ``busy``, so a new session restored its head into a slot
    running another client's request; the server deferred the restore to that request's end,
    then wiped what it left, unparked (and landed even after ocpc's call timed out)."""
    for req in (
        NEW,
        request(continuing=True, conversation="ses_c", park=FileState.PROVEN),
        request(head_file=FileState.MISSING),
    ):
        action = decide(slot(busy=True, exact=False, holds_head=OTHER), req)
        assert action.kind == "skip" and "processing another request" in action.reason


slot_facts = st.builds(
    SlotFacts,
    restarted=st.booleans(),
    known=st.booleans(),
    empty=st.booleans(),
    holds_head=st.sampled_from([None, HEAD, OTHER]),
    exact=st.booleans(),
    holds_conversation=st.sampled_from(["", "ses_a", "ses_b"]),
    partial_cache=st.booleans(),
    exact_key=st.sampled_from([None, HEAD, "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"]),
    occupant_parkable=st.booleans(),
    busy=st.booleans(),
    occupant_in_ram=st.booleans(),
    occupant_stashable=st.booleans(),
)
request_facts = st.builds(
    RequestFacts,
    skip=st.sampled_from([None, None, "no tools"]),
    conversation=st.sampled_from(["ses_a", "ses_b"]),
    continues_slot=st.booleans(),
    continuing=st.booleans(),
    head=st.sampled_from([HEAD, OTHER, None]),
    head_file=st.sampled_from(list(FileState)),
    park=st.sampled_from(list(FileState)),
    project=st.sampled_from([None, "aaaaaaaaaaaaaaaa"]),
    project_file=st.sampled_from(list(FileState)),
    base=st.sampled_from([None, "bbbbbbbbbbbbbbbb"]),
    base_file=st.sampled_from(list(FileState)),
    in_ram=st.booleans(),
    ram_here=st.booleans(),
)


@settings(max_examples=3000)  # the table is small and pure: search it hard, in well under a second per 1000
@given(slot_facts, request_facts)
def test_properties(facts: SlotFacts, req: RequestFacts) -> None:
    action = decide(facts, req)
    assert isinstance(action, Action) and action.reason
    if req.skip is not None or req.head is None:
        assert action.kind == "skip"
    if action.kind == "hit":  # only what ocpc can vouch for, never across a restart
        assert facts.known and not facts.restarted
    if action.kind == "warm":
        assert req.head_file is FileState.MISSING
    if action.kind == "restore":
        state = {"head": req.head_file, "proj": req.project_file, "base": req.base_file, "park": req.park}[
            action.target
        ]
        assert state is not FileState.MISSING
        assert action.prove == (state is FileState.PRESENT)
    wipes = action.kind in ("restore", "warm") or action.clear_first
    if req.continuing and wipes and not facts.restarted:
        # a later turn never wipes state ocpc cannot vouch for; a known other conversation is
        # parked first when it is worth it, unless the server's RAM cache holds it whole
        assert facts.empty or facts.known
        if facts.known and facts.holds_conversation and facts.occupant_parkable:
            # (a swap from RAM, its one token first included, is a request the server stashes the occupant for)
            assert (
                action.park_first
                or facts.occupant_in_ram
                or (facts.occupant_stashable and (action.target == "ram" or action.clear_first))
            )
    if (
        action.kind == "restore"
        and facts.known
        and facts.occupant_stashable
        and not facts.occupant_in_ram
        and not facts.restarted
    ):  # a restore's occupant the RAM cache would keep is stashed there first
        assert action.clear_first and not action.park_first
    if action.clear_first:  # to swap this conversation in from RAM, or to stash the occupant before a restore
        assert (action.kind == "hit" and action.target == "ram" and req.in_ram and not req.ram_here) or (
            action.kind == "restore" and facts.occupant_stashable and not action.park_first
        )
    if action.target == "ram":
        assert req.in_ram and req.continuing
    if action.park_first:
        assert facts.known and facts.occupant_parkable and not facts.restarted
    if facts.busy:  # a slot action on a busy slot lands after that request and wipes it
        assert action.kind == "skip"
    if action.target == "park":
        assert req.park is not FileState.MISSING and req.continuing
    if action.target == "proj" and action.kind == "restore":
        # a park belongs to a later turn; for a later turn it beats the project head
        assert req.project_file is not FileState.MISSING
        assert not (req.continuing and req.park is not FileState.MISSING)
    if action.target == "base":  # the shorter level only when the whole project head is not there
        assert req.base is not None and (req.project is None or req.project_file is FileState.MISSING)
        assert action.kind == "hit" or req.base_file is not FileState.MISSING
        assert not (req.continuing and req.park is not FileState.MISSING)


def test_the_decision_module_does_no_io() -> None:
    """Pure by construction: it imports nothing that could touch a disk, a socket or a clock."""
    tree = ast.parse(Path(decision.__file__).read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum", "typing"}, imported
