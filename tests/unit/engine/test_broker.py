"""The slot broker (oc_prefix_cache/broker.py): one view of the slots for both front doors, the
daemon's leases, and the line of requests waiting for a slot. No server: the tracker's locks
are real, the slot count is given."""

from __future__ import annotations

import threading
import time

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.broker import IDLE_LOOKS_S, LEASE_GRACE_S, UNSTARTED_S, Ask, SlotBroker
from oc_prefix_cache.engine.tracker import Observation, SlotTracker
from tests.helpers import SUITE_WAIT_S

SERVER = "http://127.0.0.1:9"


def broker(n: int = 2) -> SlotBroker:
    return SlotBroker(server=SERVER, tracker=SlotTracker(), props=lambda deadline: {"total_slots": n})


def test_a_slot_lent_to_the_plugins_request_is_busy_for_the_proxy() -> None:
    """`ocpc launch -np 2`: the daemon took slot 0 for OpenCode's request and lent it until the
    report; a proxied conversation arriving meanwhile takes slot 1, not the plugin's running one."""
    b = broker()
    plugin = b.take(Ask("ses_oc", n_slots=b.n_slots()), deadline=Deadline.after(1))
    b.lend("p-1", plugin)
    proxied = b.take(Ask("claude-1", n_slots=2), deadline=Deadline.after(1))
    assert (plugin.slot, proxied.slot) == (0, 1)
    assert proxied.hold is not None and proxied.rule == "no-conversation"
    b.give_back(proxied)
    assert b.returned("p-1") and not b.returned("p-1")  # the report frees it, once
    assert b.table.snapshot()["0"]["busy"] == 0


def test_a_lease_whose_report_never_comes_is_taken_back_once_the_server_shows_the_slot_idle() -> None:
    b = broker()
    taken = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(1))
    b.lend("p-1", taken)
    now = time.monotonic()
    assert b.overdue(now=now) == 0 and b.overdue(now=now + LEASE_GRACE_S) == 1
    assert b.reclaim(lambda slot: True, now=now) == 0  # too soon: the plugin has not sent it yet
    assert b.reclaim(lambda slot: False, now=now + LEASE_GRACE_S) == 0  # the request still runs
    assert b.reclaim(lambda slot: True, now=now + LEASE_GRACE_S) == 0  # idle once: its report may be on its way
    assert b.reclaim(lambda slot: False, now=now + LEASE_GRACE_S + 0.5) == 0  # busy again: start over
    assert b.reclaim(lambda slot: True, now=now + LEASE_GRACE_S + 1) == 0
    assert b.reclaim(lambda slot: True, now=now + LEASE_GRACE_S + 1 + IDLE_LOOKS_S) == 1
    assert b.leases() == 0
    again = b.take(Ask("other", n_slots=2), deadline=Deadline.after(0.5))
    assert again.hold is not None  # the slot's lock was given back with it


def test_a_lease_after_a_long_prepare_is_not_reclaimed_before_the_request_is_sent() -> None:
    """The grace counts from the prepare's answer, not from when the slot was taken: after a
    20 s warm, the slot is idle until the plugin sends its request, and a reclaim then gave it
    to another session, whose prepare overwrote the warmed head (found by the ramp test)."""
    b = broker()
    taken = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(1))
    taken.at -= 20.0  # the prepare (a warm) took 20 s
    b.lend("p-1", taken)
    assert b.reclaim(lambda slot: True) == 0 and b.reclaim(lambda slot: True, now=time.monotonic() + IDLE_LOOKS_S) == 0
    assert b.leases() == 1


def test_a_lease_whose_request_has_not_started_in_its_slot_is_kept() -> None:
    """The plugin's request is pinned to the slot lent; on a loaded CPU server it starts only at
    the server's next batch, so the slot can look idle for seconds with the request in the queue.
    Two idle looks took such a lease back 15 s after its prepare (test_agents, while the server
    prefilled a 1,885-token warm in another slot), and the slot went to another conversation.
    While the slot shows no task newer than when it was lent, the lease is kept (up to
    ``UNSTARTED_S``); once a newer task ran there and the slot is idle, the report is due."""
    b = broker()
    b.tracker.observe(SERVER, 0, Observation(id_task=7, n_tokens=2000, n_processed=0, n_cached=0))
    taken = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(1))
    assert taken.slot == 0
    b.lend("p-1", taken)
    now = time.monotonic()
    looks = [now + LEASE_GRACE_S, now + LEASE_GRACE_S + IDLE_LOOKS_S + 1]
    assert [b.reclaim(lambda slot: True, now=t, task=lambda slot: 7) for t in looks] == [0, 0]
    assert b.leases() == 1  # not started: kept
    late = [now + UNSTARTED_S, now + UNSTARTED_S + IDLE_LOOKS_S + 1]
    assert [b.reclaim(lambda slot: True, now=t, task=lambda slot: 7) for t in late] == [0, 1]  # never sent
    again = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(1))
    b.lend("p-2", again)
    now = time.monotonic()
    looks = [now + LEASE_GRACE_S + 0.1, now + LEASE_GRACE_S + IDLE_LOOKS_S + 1]
    assert [b.reclaim(lambda slot: True, now=t, task=lambda slot: 9) for t in looks] == [0, 1]  # ran: report due


def test_a_conversations_next_prepare_takes_back_its_own_unreported_lease() -> None:
    """The plugin sends one turn at a time per session: a new prepare of the conversation means its
    last request ended. Without this, the next turn waited on its own lease's lock."""
    b = broker()
    first = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(1))
    b.lend("p-1", first)
    started = time.monotonic()
    second = b.take(Ask("ses_oc", n_slots=2), deadline=Deadline.after(2))
    assert time.monotonic() - started < 0.5
    assert second.slot == first.slot and second.rule == "own" and second.hold is not None
    assert b.leases() == 0


def test_with_every_slot_lent_a_request_waits_in_line_for_the_first_report() -> None:
    b = broker()
    lent = [b.take(Ask(f"ses_{i}", n_slots=2), deadline=Deadline.after(1)) for i in range(2)]
    for i, taken in enumerate(lent):
        b.lend(f"p-{i}", taken)
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(b.take(Ask("new", n_slots=2), deadline=Deadline.after(SUITE_WAIT_S)).slot)
    )
    waiter.start()
    time.sleep(0.3)
    assert not got  # both slots run a request: it waits
    b.returned("p-1")
    waiter.join(SUITE_WAIT_S)
    assert got == [lent[1].slot]


def test_a_single_slot_server_takes_the_configured_slot() -> None:
    b = broker(1)
    taken = b.take(Ask("x", n_slots=b.n_slots(), default_slot=0), deadline=Deadline.after(1))
    assert (taken.slot, taken.rule) == (0, "single")
    b.give_back(taken)
    b.give_back(taken)  # idempotent
    assert b.table.snapshot()["0"]["busy"] == 0


def test_a_slot_count_that_could_not_be_read_is_asked_again_soon() -> None:
    """A router's model still loading does not answer /props in time: the fallback of one slot
    held for the whole ttl (30 s) pinned every request to slot 0. It is asked again a second later."""
    from oc_prefix_cache.engine.broker import UNKNOWN_SLOTS_RETRY_S
    from oc_prefix_cache.errors import ServerUnreachable

    answers: list[dict[str, int] | None] = [None, {"total_slots": 2}]

    def props(deadline: Deadline) -> dict[str, int]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer is None:
            raise ServerUnreachable("llama-server is still loading the model")
        return answer

    b = SlotBroker(server=SERVER, tracker=SlotTracker(), props=props)
    assert b.n_slots() == 1 and b.slots_known() is None
    time.sleep(UNKNOWN_SLOTS_RETRY_S + 0.1)
    assert b.n_slots() == 2 and b.slots_known() == 2


def test_a_request_whose_client_left_stops_waiting_for_its_slots_lock() -> None:
    """`-np 1`: a request waits for the one slot's lock (no line there) and its client gives up
    (a cancelled turn). It must stop waiting then, not hold a worker until the slot frees or its
    deadline (240 s for the plugin), and then compete for the lock with the requests still live."""
    b = broker(1)
    running = b.take(Ask("running", n_slots=1), deadline=Deadline.after(1))
    gone = threading.Event()
    threading.Timer(0.3, gone.set).start()
    started = time.monotonic()
    left = b.take(Ask("left", n_slots=1), deadline=Deadline.after(20), gone=gone)
    assert time.monotonic() - started < 10  # not the deadline's 20 s (it looks every 0.25 s)
    assert left.hold is None and "went away" in left.why_not
    b.give_back(left)
    b.give_back(running)
    after = b.take(Ask("next", n_slots=1), deadline=Deadline.after(1))
    assert after.hold is not None  # the slot's lock is free: nothing of the gone request kept it
    b.give_back(after)
