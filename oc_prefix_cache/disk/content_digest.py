"""Content digests of the files behind a server's identity: its model shards, its binary, its adapters.

A slot file means the same thing wherever the model's bytes are the same: a copy of the model
at another path, with another mtime (another disk, another machine, a ``cp`` without ``-p``),
runs the same weights, so its parks and heads must stay usable. Naming a file by its path, size
and mtime (ocpc before FORMAT 4) orphaned every file on such a copy; naming it by its content
does not, and a changed byte is another identity.

Digesting is not free (xxh3_128 streams at disk speed: ~0.3 s for a 250 MB model, tens of
seconds for a large one read cold), so each file is digested once and the answer kept, keyed by
(absolute path, size, mtime_ns): in memory for the process, and in a small JSON file under the
ocpc home (``digests.json``) for the next one. A file whose size or mtime moved is digested
again; a cache file that is missing or unreadable is no loss beyond the time to digest again.
One object per cache file per process (``shared``), so a daemon with several engines (a router's
models) digests each file once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import xxhash

from oc_prefix_cache.errors import DigestPending
from oc_prefix_cache.files import write_private

log = logging.getLogger("ocpc.store")

CHUNK = 8 << 20  # 8 MiB reads: at disk speed, without holding a model in memory
FILE_VERSION = 1


class BoundedDigests:
    """``ContentDigests`` asked within a bound (``within``): what a request's identity reads."""

    def __init__(self, owner: ContentDigests, seconds: float) -> None:
        self.owner, self.seconds = owner, seconds

    def digest(self, path: str | Path) -> str | None:
        return self.owner.digest_within(path, self.seconds)


def file_content_digest(path: Path) -> str:
    """xxh3_128 (32 hex digits) of the whole file; OSError when it cannot be read."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ContentDigests:
    """The content digest of a file by its path, computed once per (path, size, mtime_ns).

    Thread-safe. ``digest`` answers from memory after the first time (a ``stat``); a file
    digested by another process is found in the cache file; only a file new to both is read,
    one at a time (two requests asking for one file read it once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._guard = threading.Lock()  # the memory
        self._reading = threading.Lock()  # one file read at a time: a second caller waits, then finds it
        self._memory: dict[tuple[str, int, int], str] = {}
        self._jobs: dict[str, Future[str | None]] = {}  # files being digested for ``digest_within``
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ocpc-digest")
        self.computed = 0  # files read in full by this object (tests; status)

    def within(self, seconds: float) -> BoundedDigests:
        """This cache as a request may ask it: a file not digested yet is digested in the
        background, waited for ``seconds`` at most (then ``DigestPending``: the request goes on
        without a prepare, as plain llama-server would serve it, and a later one finds it)."""
        return BoundedDigests(self, seconds)

    def digest_within(self, path: str | Path, seconds: float) -> str | None:
        name = os.path.abspath(path)
        with self._guard:
            job = self._jobs.get(name)
            if job is None or (job.done() and job.exception() is not None):
                job = self._jobs[name] = self._background.submit(self.digest, name)
        try:
            found = job.result(timeout=max(0.0, seconds))
        except FutureTimeout:
            raise DigestPending(
                f"{name} is being read for its content digest (first sight of this file: a large model takes "
                "a while); requests go on without ocpc until it is known"
            ) from None
        with self._guard:
            if self._jobs.get(name) is job:
                del self._jobs[name]  # the next ask stats the file again (memory answers at once)
        return found

    def digest(self, path: str | Path) -> str | None:
        """The file's content digest, or None when it cannot be read here."""
        name = os.path.abspath(path)
        try:
            stat = os.stat(name)
        except OSError:
            return None
        key = (name, stat.st_size, stat.st_mtime_ns)
        with self._guard:
            found = self._memory.get(key)
        if found is not None:
            return found
        with self._reading:
            with self._guard:
                found = self._memory.get(key)
            if found is None:
                found = self._read().get(key)
            if found is None:
                try:
                    found = file_content_digest(Path(name))
                except OSError as exc:
                    log.info("cannot digest %s: %s", name, exc)
                    return None
                self.computed += 1
                self._keep(key, found)
            with self._guard:
                self._memory[key] = found
            return found

    def _read(self) -> dict[tuple[str, int, int], str]:
        """The cache file's records; empty when it is missing or not ours to understand."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict):
            return {}
        out = {}
        for name, raw in files.items():
            if not isinstance(raw, dict):
                continue
            size, mtime, digest = raw.get("size"), raw.get("mtime_ns"), raw.get("xxh3_128")
            if isinstance(size, int) and isinstance(mtime, int) and isinstance(digest, str) and digest:
                out[(str(name), size, mtime)] = digest
        return out

    def _keep(self, key: tuple[str, int, int], digest: str) -> None:
        """Write the cache file with ``key`` (one record per path: its latest size and mtime);
        records of files no longer there are dropped. A failure costs the next process a read."""
        records: dict[str, dict[str, Any]] = {}
        for (name, size, mtime), found in self._read().items():
            if os.path.exists(name):
                records[name] = {"size": size, "mtime_ns": mtime, "xxh3_128": found}
        name, size, mtime = key
        records[name] = {"size": size, "mtime_ns": mtime, "xxh3_128": digest}
        payload = {"version": FILE_VERSION, "files": dict(sorted(records.items()))}
        try:
            write_private(self.path, (json.dumps(payload, indent=1) + "\n").encode())
        except OSError as exc:
            log.warning("could not keep file digests in %s (they are computed again next time): %s", self.path, exc)


_SHARED: dict[Path, ContentDigests] = {}
_SHARED_GUARD = threading.Lock()


def shared(path: Path) -> ContentDigests:
    """The process's one ``ContentDigests`` for the cache file ``path``."""
    key = Path(os.path.abspath(path))
    with _SHARED_GUARD:
        found = _SHARED.get(key)
        if found is None:
            found = _SHARED[key] = ContentDigests(key)
        return found
