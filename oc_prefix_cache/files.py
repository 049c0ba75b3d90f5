"""Files ocpc writes for itself: an exclusive cross-process lock, and atomic writes.

Atomic: a temp file in the same folder, fsync, rename, fsync of the folder, so a reader
sees the old content or the new, never half, even across a crash.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
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


def write_atomic(path: Path, data: bytes, *, like: os.stat_result | None = None) -> None:
    """Replace ``path`` with ``data`` atomically; OSError on failure, nothing half-written.

    ``like``: the replaced file's stat, whose mode and (when allowed) owner the new file gets
    before the rename, so there is no moment at which a user's 0644 config is 0600 or root's.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            if like is not None:
                os.fchmod(out.fileno(), like.st_mode & 0o7777)
                try:
                    os.fchown(out.fileno(), like.st_uid, like.st_gid)
                except PermissionError:
                    pass  # only root can give a file away; then it was ours to begin with
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)


def made_once(path: Path, make: Callable[[], None], *, lock: Path) -> Path:
    """``path``, made by ``make`` the first time (under ``lock``, so two processes that both
    find it missing make it once); ``make`` must write it atomically (a temp name, then a
    rename), so a half-made file is never taken for a made one."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock):
        if not path.is_file():
            make()
    return path
