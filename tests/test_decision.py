"""The decision table, exhaustively, without a server."""

from __future__ import annotations

import ast
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oc_prefix_cache import decision
from oc_prefix_cache.decision import Action, FileState, RequestFacts, SlotFacts, decide

HEAD = "0123456789abcdef"
OTHER = "fedcba9876543210"

SLOT = SlotFacts(restarted=False, known=True, empty=False, holds_head=HEAD, exact=True,
                 holds_conversation="", partial_cache=True)
NEW = RequestFacts(skip=None, conversation="ses_b", continues_slot=False, continuing=False, head=HEAD,
                   head_file=FileState.PROVEN)
TURN = replace(NEW, conversation="ses_a", continues_slot=True, continuing=True)


def slot(**changes: object) -> SlotFacts:
    return replace(SLOT, **changes)


def request(base: RequestFacts = NEW, **changes: object) -> RequestFacts:
    return replace(base, **changes)


@pytest.mark.parametrize(("facts", "req", "kind", "words"), [
    # title request / no head
    (slot(), request(skip="no tools in the request", head=None), "skip", "no tools"),
    # same conversation
    (slot(exact=False, holds_conversation="ses_a"), TURN, "hit", "same conversation"),
    (slot(restarted=True, known=False, empty=True), TURN, "restore", "after a restart"),
    (slot(restarted=True, known=False, empty=True), request(TURN, head_file=FileState.MISSING), "warm", "first run"),
    # same conversation, but something else ran meanwhile (foreign request, bypass, second daemon)
    (slot(known=False, holds_head=None, exact=False), TURN, "skip", "left to the server"),
    # new session: exact head, or a turn on top of it
    (slot(), NEW, "hit", "exactly this head"),
    (slot(exact=False, holds_conversation="ses_a"), NEW, "restore", "new session"),
    (slot(exact=False, holds_conversation="ses_a", partial_cache=False), NEW, "hit", "transformer"),
    # new session: another head, nothing known, a restart, a missing or unproven file
    (slot(holds_head=OTHER), NEW, "restore", "new session"),
    (slot(known=False, holds_head=None, exact=False), NEW, "restore", "new session"),
    (slot(restarted=True, known=False, holds_head=None, empty=True), NEW, "restore", "new session"),
    (slot(holds_head=OTHER), request(head_file=FileState.MISSING), "warm", "first run"),
    (slot(holds_head=OTHER), request(head_file=FileState.PRESENT), "restore", "new session"),
    # another conversation's later turn
    (slot(exact=False, holds_conversation="ses_b"), request(TURN, continues_slot=False), "skip", "live state"),
    (slot(holds_conversation=""), request(TURN, continues_slot=False), "restore", "only a head"),
    (slot(known=False, holds_head=None, empty=True), request(TURN, continues_slot=False), "restore", "empty slot"),
])
def test_the_table(facts: SlotFacts, req: RequestFacts, kind: str, words: str) -> None:
    action = decide(facts, req)
    assert action.kind == kind, action
    assert words in action.reason, action


def test_restores_prove_unless_the_file_is_proven_on_this_server() -> None:
    assert decide(slot(holds_head=OTHER), request(head_file=FileState.PRESENT)).prove is True
    assert decide(slot(holds_head=OTHER), request(head_file=FileState.PROVEN)).prove is False


def test_a_restart_is_never_a_hit() -> None:
    """Defect 1 at the table: whatever else is true, a restarted slot is never 'hit'."""
    for values in itertools.product([True, False], repeat=6):
        known, empty, exact, partial, continues, continuing = values
        facts = slot(restarted=True, known=known, empty=empty, exact=exact, partial_cache=partial)
        assert decide(facts, request(continues_slot=continues, continuing=continuing)).kind != "hit"


slot_facts = st.builds(
    SlotFacts, restarted=st.booleans(), known=st.booleans(), empty=st.booleans(),
    holds_head=st.sampled_from([None, HEAD, OTHER]), exact=st.booleans(),
    holds_conversation=st.sampled_from(["", "ses_a", "ses_b"]), partial_cache=st.booleans())
request_facts = st.builds(
    RequestFacts, skip=st.sampled_from([None, None, "no tools"]), conversation=st.sampled_from(["ses_a", "ses_b"]),
    continues_slot=st.booleans(), continuing=st.booleans(), head=st.sampled_from([HEAD, OTHER, None]),
    head_file=st.sampled_from(list(FileState)))


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
        assert req.head_file is not FileState.MISSING
        assert action.prove == (req.head_file is FileState.PRESENT)
    if req.continuing and action.kind in ("restore", "warm") and not facts.restarted:
        # a later turn never wipes live state: only an empty slot or a bare head is replaced
        assert facts.empty or (facts.known and not facts.holds_conversation)


def test_the_decision_module_does_no_io() -> None:
    """Pure by construction: it imports nothing that could touch a disk, a socket or a clock."""
    tree = ast.parse(Path(decision.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum", "typing"}, imported
