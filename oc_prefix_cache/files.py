"""Files ocpc writes for itself: an exclusive cross-process lock, atomic writes, and the
one place its folders and files get their modes.

Atomic: a temp file in the same folder, fsync, rename, fsync of the folder, so a reader
sees the old content or the new, never half, even across a crash.

Private by default: every folder ocpc makes for its state is 0700 and every file it writes
there 0600, whatever the umask (a park's token ids decode to the whole prompt with the
model's tokenizer; logs hold session ids). ``private_dir`` makes folders, ``private_opener``
creates files, ``write_private`` replaces them atomically; disk/privacy.py tightens what an
earlier ocpc left behind. A folder that already exists is never changed here: it may be the
user's (their HOME, ~/.local/share).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from oc_prefix_cache.errors import LockTimeout

PRIVATE_DIR = 0o700  # ocpc's folders
PRIVATE_FILE = 0o600  # ocpc's files, slot files too


def private_dir(path: Path) -> Path:
    """``path`` as a folder (like ``mkdir -p``); every folder made here, parents too, is 0700
    whatever the umask. A folder that exists already is left as it is."""
    missing: list[Path] = []
    at = path
    while not os.path.lexists(at) and at.parent != at:
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR)
        except FileExistsError:
            continue  # made meanwhile by another process (ocpc's, so private too) or not a folder
        os.chmod(folder, PRIVATE_DIR)  # a umask may have taken the owner's bits; it never adds
    if not path.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder", str(path))
    return path


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a file it creates is 0600 (an existing one keeps its mode)."""
    return os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)


def chmod_private(path: Path, *, folder: bool = False, owner: int | None = None) -> None:
    """Make ``path`` itself 0700 (a folder) or 0600 (a file): opened without following a
    symlink (one swapped in meanwhile fails), changed only while it is still that kind and
    owned by ``owner`` (default: this process's user). OSError when it cannot be."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(path, flags | (os.O_DIRECTORY if folder else 0))
    try:
        st = os.fstat(fd)
        kind_ok = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
        if not kind_ok or st.st_uid != (os.geteuid() if owner is None else owner):
            raise OSError(errno.EPERM, "not ocpc's to change (another kind or owner)", str(path))
        if stat.S_IMODE(st.st_mode) != (PRIVATE_DIR if folder else PRIVATE_FILE):
            os.fchmod(fd, PRIVATE_DIR if folder else PRIVATE_FILE)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """``write_atomic`` for ocpc's own state: the file 0600, any folder made for it 0700."""
    private_dir(path.parent)
    write_atomic(path, data)


@contextmanager
def file_lock(path: Path, *, timeout: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing) for the block.

    flock locks belong to the open file, so two threads that each open the path exclude
    each other just like two processes do. With ``timeout``, give up after that many
    seconds with ``LockTimeout`` instead of waiting for ever. A lock file is ocpc's: 0600,
    in a folder made 0700.
    """
    private_dir(path.parent)
    with open(path, "a+", opener=private_opener) as handle:
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
    Without it the new file is 0600 (``mkstemp``'s mode); ocpc's own state goes through
    ``write_private``, which also makes its folder 0700.
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
