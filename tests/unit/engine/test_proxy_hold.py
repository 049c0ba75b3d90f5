"""The proxy holds a slot across its prepare and its forward (``SlotTracker.hold``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.errors import LockTimeout
from tests.helpers import SUITE_WAIT_S

SERVER = "http://127.0.0.1:1"


@pytest.mark.parametrize("lock_dir", [None, "files"])
def test_a_hold_is_reentered_inside_and_excludes_everyone_else(tmp_path: Path, lock_dir: str | None) -> None:
    tracker = SlotTracker(lock_dir=tmp_path if lock_dir else None)
    hold = tracker.hold(SERVER, 0, deadline=Deadline.after(1))
    with hold.inside(), tracker.slot_lock(SERVER, 0, deadline=Deadline.after(0.2)):
        pass  # the prepare inside the hold takes its lock at once
    started = time.monotonic()
    with pytest.raises(LockTimeout):  # the same thread outside the hold waits like anyone
        with tracker.slot_lock(SERVER, 0, deadline=Deadline.after(0.2)):
            pass
    assert 0.15 < time.monotonic() - started < 1.0
    with tracker.slot_lock(SERVER, 1, deadline=Deadline.after(0.2)):
        pass  # other slots are free

    got: list[float] = []

    def other() -> None:
        with tracker.slot_lock(SERVER, 0, deadline=Deadline.after(SUITE_WAIT_S)):  # until the release
            got.append(time.monotonic())

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.2)
    assert not got
    released = time.monotonic()
    threading.Thread(target=hold.release).start()  # released from another thread, as the proxy does
    thread.join(SUITE_WAIT_S)
    assert got and got[0] >= released
    hold.release()  # twice: nothing


def test_a_hold_survives_a_restart_noticed_meanwhile(tmp_path: Path) -> None:
    tracker = SlotTracker(lock_dir=tmp_path)
    hold = tracker.hold(SERVER, 0, deadline=Deadline.after(1))
    tracker.restarted(SERVER, "test")
    with pytest.raises(LockTimeout):
        with tracker.slot_lock(SERVER, 0, deadline=Deadline.after(0.1)):
            pass
    hold.release()
    with tracker.slot_lock(SERVER, 0, deadline=Deadline.after(0.5)):
        pass
