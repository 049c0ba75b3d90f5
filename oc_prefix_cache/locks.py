"""An exclusive, cross-process file lock (flock): one writer at a time, daemons included."""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import LockTimeout


@contextmanager
def file_lock(path: Path, *, timeout: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing) for the block.

    flock locks belong to the open file, so two threads that each open the path exclude
    each other just like two processes do. With ``timeout``, give up after that many
    seconds with ``LockTimeout`` instead of waiting for ever.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        if timeout is None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        else:
            _flock_within(handle, path, timeout)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _flock_within(handle: IO[str], path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{path} is held by another ocpc process for over {timeout:.0f} s") from None
            time.sleep(0.05)
