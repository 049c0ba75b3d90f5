"""The conversation fast path and the slot tracker: pure, no server."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oc_prefix_cache.chat.conversation import Trail, follow, parse
from oc_prefix_cache.engine.tracker import Holding, Observation, SlotTracker
from oc_prefix_cache.errors import BadRequestBody
from tests.helpers import PROJ_A, PROJ_A_TURN2, PROJ_B, capture_bytes


def text(name: str) -> str:
    return capture_bytes(name).decode()


def digests_after(trail: Trail, body: str) -> tuple[str, ...] | None:
    followed = follow(trail, body.encode())
    return None if followed is None else followed.digests


def test_a_next_turn_is_recognised_from_its_text_and_yields_every_digest() -> None:
    first, second = parse(text(PROJ_A)), parse(text(PROJ_A_TURN2))
    assert digests_after(Trail.of(first, session="s"), text(PROJ_A_TURN2)) == second.digests
    assert second.digests[:2] == first.digests


def test_other_projects_and_earlier_turns_are_not_a_continuation() -> None:
    first = Trail.of(parse(text(PROJ_A)), session="s")
    assert digests_after(first, text(PROJ_B)) is None
    assert digests_after(Trail.of(parse(text(PROJ_A_TURN2)), session="s"), text(PROJ_A)) is None


def test_a_changed_tool_or_model_after_the_messages_is_not_a_continuation() -> None:
    first = Trail.of(parse(text(PROJ_A)), session="s")
    data = json.loads(text(PROJ_A_TURN2))
    data["tools"] = data["tools"][:3]
    assert digests_after(first, json.dumps(data, ensure_ascii=False, separators=(",", ":"))) is None


def test_the_same_body_again_is_the_same_conversation() -> None:
    first = parse(text(PROJ_A))
    assert digests_after(Trail.of(first, session="s"), text(PROJ_A)) == first.digests


def test_garbage_between_the_messages_is_not_taken() -> None:
    raw = text(PROJ_A)
    first = parse(raw)
    forged = raw[: first.msg_end] + ',{"role":"user","content":"x"} , nope' + raw[first.msg_end :]
    assert digests_after(Trail.of(first, session="s"), forged) is None


def test_parse_matches_json_and_reports_clear_errors() -> None:
    raw = text(PROJ_A_TURN2)
    parsed = parse(raw)
    assert parsed.data == json.loads(raw)
    assert raw[parsed.msg_end] == "]"
    for bad in ("", "[]", "{", '{"messages": {}}', '{"messages": [1, 2]}', '{"a": 1} x', '{"messages": [}'):
        with pytest.raises(BadRequestBody):
            parse(bad)


messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=20)}),
    max_size=4,
)


@given(messages, messages, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_follow_agrees_with_a_full_parse(first: list, added: list, separators: tuple, tools_after: bool) -> None:
    """Whatever the messages, follow() says 'continues' exactly when the full parse of the
    new body shows the old messages as a prefix, with everything else unchanged."""

    def body(msgs: list) -> str:
        data = {"model": "m", "messages": msgs} | ({"tools": [{"x": 1}]} if tools_after else {})
        return json.dumps(data, ensure_ascii=False, separators=separators)

    old, new = parse(body(first)), body(first + added)
    assert digests_after(Trail.of(old, session=""), new) == parse(new).digests


def observation(task: int | None, tokens: int | None = 100) -> Observation:
    return Observation(id_task=task, n_tokens=tokens, n_processed=0, n_cached=0)


def test_the_tracker_forgets_a_holding_when_anything_changes_the_slot() -> None:
    tracker = SlotTracker()
    url = "http://127.0.0.1:1"
    tracker.observe(url, 0, observation(5))
    held = Holding(kind="head", key="k", head="k", n_tokens=100, exact=True, left=observation(5))
    tracker.leave(url, 0, held)
    assert tracker.observe(url, 0, observation(5)).holding == held
    assert tracker.observe(url, 0, observation(5, tokens=90)).holding is None  # a restore by someone else
    tracker.leave(url, 0, held)
    assert tracker.observe(url, 0, observation(7)).holding is None  # another task ran


def test_the_tracker_notices_restarts_and_drops_proofs_and_holdings() -> None:
    tracker = SlotTracker()
    url = "http://127.0.0.1:1"
    tracker.observe(url, 0, observation(9))
    tracker.prove(url, ("f", 1, 2), epoch=0)
    tracker.leave(url, 0, Holding(kind="head", key="k", head="k", n_tokens=1, exact=True, left=observation(9)))
    seen = tracker.observe(url, 0, observation(None, None))  # a fresh server: no task yet
    assert seen.restarted and seen.holding is None and seen.epoch == 1
    assert not tracker.proven(url, ("f", 1, 2))
    tracker.observe(url, 0, observation(3))
    assert not tracker.observe(url, 0, observation(4)).restarted
    assert tracker.observe(url, 0, observation(2)).restarted  # ids only grow within a process
    tracker.prove(url, ("f", 1, 2), epoch=1)  # work from before the restart does not count
    assert not tracker.proven(url, ("f", 1, 2))


def test_after_request_ties_the_slot_to_a_request_by_its_token_count() -> None:
    done = Observation(id_task=3, n_tokens=7502, n_processed=0, n_cached=0)
    assert done.after_request(prompt=7499, generated=4)
    assert not done.after_request(prompt=7499, generated=40)
    assert done.after_request(prompt=7499, generated=None)  # an older plugin sends no count
    assert not Observation(id_task=3, n_tokens=7502, n_processed=0, n_cached=0, busy=True).after_request(
        prompt=7499, generated=4
    )


def test_proofs_are_bounded() -> None:
    tracker = SlotTracker()
    for i in range(SlotTracker.MAX_PROOFS + 10):
        tracker.prove("u", (f"f{i}", 1, 1), epoch=0)
    assert len(tracker.snapshot()["u"]) and tracker.snapshot()["u"]["proven"] <= SlotTracker.MAX_PROOFS


def test_a_smaller_task_id_on_the_same_server_process_is_not_a_restart() -> None:
    """The defect: any drop in a slot's id_task was taken for a restart, but the server runs a
    deferred older task (a slot action) after a newer one; every proof and record was dropped
    for nothing. With the process witnessed alive, a drop is a deferred task; without a
    witness it is still a restart (a fresh server counts from 0)."""

    tracker = SlotTracker()
    url = "http://127.0.0.1:1"
    tracker.observe(url, 0, Observation(id_task=40, n_tokens=10, n_processed=1, n_cached=9))
    tracker.prove(url, ("oc-prefix-x.bin", 1, 1), epoch=0)
    late = Observation(id_task=31, n_tokens=10, n_processed=1, n_cached=9)
    tracker.leave(url, 0, Holding(kind="head", key="h", head="h", n_tokens=10, exact=True, left=late))
    seen = tracker.observe(url, 0, late, process_alive=True)
    assert not seen.restarted and seen.holding is not None
    assert tracker.proven(url, ("oc-prefix-x.bin", 1, 1))
    seen = tracker.observe(url, 0, Observation(id_task=2, n_tokens=0, n_processed=0, n_cached=0))
    assert seen.restarted  # no witness: a smaller id is a restart


def test_two_looks_that_see_one_process_end_make_one_restart() -> None:
    """A router's model loaded again: the warm start's look and the watch's both judged the old
    child gone. The second was taken for another restart and dropped what was recorded after the
    first (the warm start's restore): the next session restored it again instead of a hit."""
    tracker = SlotTracker()
    url = "http://127.0.0.1:1#model=m"
    fresh = Observation(id_task=None, n_tokens=None, n_processed=None, n_cached=None)
    tracker.set_argv(url, ["llama-server"], epoch=0, process=(100, 1))
    assert tracker.observe(url, 0, fresh, process_gone=True, witness=(100, 1)).restarted  # the first look
    tracker.set_argv(url, ["llama-server"], epoch=1, process=(200, 2))  # the new child, witnessed
    tracker.leave(url, 0, Holding(kind="head", key="h", head="h", n_tokens=10, exact=True, left=fresh), epoch=1)
    seen = tracker.observe(url, 0, fresh, process_gone=True, witness=(100, 1))  # the other look, judged on 100
    assert not seen.restarted and seen.holding is not None and tracker.epoch(url) == 1


def test_a_turn_whose_tools_or_template_options_changed_does_not_continue_the_slot() -> None:
    """The full path's test of "the slot holds this conversation" compared message digests only:
    a turn with a tool added (an MCP server connected) or thinking switched on rendered a
    different prompt before its first message, yet was answered `hit` on the slot (issue 18)."""
    from oc_prefix_cache.engine.prepare import _continues

    body = json.loads(capture_bytes(PROJ_A))
    later = json.loads(capture_bytes(PROJ_A_TURN2))
    first = Trail.of(parse(json.dumps(body)), session="s")
    assert _continues(first, Trail.of(parse(json.dumps(later)), session="s"))
    changed = [
        {**later, "tools": later["tools"] + [{"type": "function", "function": {"name": "mcp_x", "parameters": {}}}]},
        {**later, "chat_template_kwargs": {"enable_thinking": False}},
        {**later, "reasoning_effort": "high"},
    ]
    for body_ in changed:
        assert not _continues(first, Trail.of(parse(json.dumps(body_)), session="s"))
    sampling = {**later, "temperature": 0.1, "max_tokens": 77}  # renders the same prompt
    assert _continues(first, Trail.of(parse(json.dumps(sampling)), session="s"))
