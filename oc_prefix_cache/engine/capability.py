"""What a llama-server build can do with slot files, learned by asking it, not from its number.

Builds from an sdist or from source all report ``b0-unknown``; distro packages lag by months;
last night's master writes a slot-file version no ocpc release has read. So at first contact with
a server binary and model, ocpc runs a short self-test on the live server before it spends a
warm on it (a 12 s prefill on b10502 once bought a head that could not be kept): it evaluates a
few dozen tokens of the request's own head in the slot the prepare holds, saves them, reads the
file's header, restores it, and evaluates one more token after them. The result is kept, per
server binary and model (``fingerprint.server_key``: their content, so a change to either, or to
the KV flags, is another key, and a copy of them elsewhere the same one), in ``capabilities.json``
beside the index (a result kept under the key of ocpc before FORMAT 4 is taken over: ``adopt``):

* the file's **version** and whether this ocpc knows its layout (disk/slotfile.py);
* whether the header **parses** and holds exactly the tokens saved;
* whether the restore **serves**: the next evaluation reused what was restored (``cache_n``).

A build whose restore serves is used, whatever its version number. One whose restore does not
serve makes ocpc stand down on that server and model (engine/standdown.py) at once, and on every later
start of it until the binary or the model file changes: it says so once (the log, ``ocpc status``,
``ocpc doctor``, with the build, its format and what to do), and each request then costs one look
at the slots. Pure except for ``SelfTest.run`` (the server) and ``Capabilities`` (one file).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.slotfile import KNOWN_VERSIONS, SELFTEST_NAME, read_header
from oc_prefix_cache.errors import OcpcError, SlotFileError, SlotSaveDisabled
from oc_prefix_cache.files import write_private
from oc_prefix_cache.llama.client import SlotClient

log = logging.getLogger("ocpc.capability")

#: Tokens of the request's head the self-test evaluates, saves and restores: enough to tell a
#: restore that serves from one that does not, little enough to cost a fraction of a second.
SELFTEST_TOKENS = 32
FILE_VERSION = 1


@dataclass(frozen=True)
class Capability:
    """What one server binary and model did with a slot file of its own."""

    key: str  # the server binary, model and KV flags it was measured for (fingerprint.server_key)
    build: str  # what the server says of itself (build_info, and the binary when known)
    model: str
    version: int | None  # the slot-file version it writes (None: its file did not parse)
    known_format: bool  # a version whose header layout this ocpc has read (slotfile.KNOWN_VERSIONS)
    header_ok: bool  # the header parsed and held exactly the tokens saved
    restores_serve: bool  # the restored tokens were reused by the next evaluation
    reason: str  # what the self-test saw, in words
    measured_ms: float = 0.0
    at: int = 0  # unix seconds

    @property
    def usable(self) -> bool:
        return self.header_ok and self.restores_serve

    def advice(self) -> str:
        """What to do about a build whose slot files ocpc cannot use."""
        if self.usable:
            return ""
        if not self.header_ok:
            return (
                f"slot-file version {self.version} has a header this ocpc cannot read: upgrade ocpc, or run a "
                f"llama-server that writes version {', '.join(map(str, sorted(KNOWN_VERSIONS)))}"
            )
        return (
            "this build restores a slot file without reusing it: check the model's family flags "
            "(`ocpc doctor`), or run another llama-server build; requests go to it as they would without ocpc"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Capability | None:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError:
            return None


class SelfTest:
    """The self-test on a live server, in a slot its caller holds (the prepare's slot lock)."""

    def __init__(self, *, client: SlotClient, slot_dir: Path, known: frozenset[int] = KNOWN_VERSIONS) -> None:
        self.client = client
        self.slot_dir = slot_dir
        self.known = known

    def run(
        self, tokens: tuple[int, ...], slot: int, *, key: str, build: str, model: str, deadline: Deadline
    ) -> Capability:
        """Evaluate ``tokens`` (some of the request's head) and one more, save, read, restore, and
        evaluate them again: the slot is left holding them (the caller forgets what it held)."""
        started = time.perf_counter()
        n = min(SELFTEST_TOKENS, len(tokens) - 1)
        name = SELFTEST_NAME.format(pid=os.getpid(), tag=os.urandom(4).hex())
        path = self.slot_dir / name

        def result(version: int | None, known: bool, header: bool, serves: bool, why: str) -> Capability:
            return Capability(
                key=key,
                build=build,
                model=model,
                version=version,
                known_format=known,
                header_ok=header,
                restores_serve=serves,
                reason=why,
                measured_ms=round((time.perf_counter() - started) * 1000, 1),
                at=int(time.time()),
            )

        if n < 2:
            raise OcpcError("the head is too short for the self-test")
        prefix, more = list(tokens[:n]), tokens[n]
        try:
            self.client.evaluate(prefix, slot=slot, deadline=deadline)
            # a save that fails is the server's setup (no --slot-save-path, a full disk), not what its
            # build can do: it raises, the prepare fails open with the fix, and nothing is kept
            try:
                self.client.save(slot, name, deadline=deadline)
            except SlotSaveDisabled:
                raise
            except OcpcError as exc:
                raise OcpcError(f"could not save slot {slot} for ocpc's self-test ({exc})") from exc
            if not path.is_file():
                raise OcpcError(
                    f"the server saved {name} elsewhere than {self.slot_dir}: ocpc's slot folder must "
                    "be its --slot-save-path"
                )
            try:
                header = read_header(path, known=self.known)
            except SlotFileError as exc:
                return result(None, False, False, False, f"its slot file does not parse: {exc}")
            if tuple(header.tokens) != tuple(prefix):
                return result(
                    header.version,
                    header.known,
                    False,
                    False,
                    f"its slot file (version {header.version}) does not hold the {n} tokens saved",
                )
            try:
                self.client.restore(slot, name, deadline=deadline)
            except OcpcError as exc:
                return result(
                    header.version,
                    header.known,
                    True,
                    False,
                    f"it could not restore its own slot file (version {header.version}): {exc}",
                )
            timings = self.client.evaluate([*prefix, more], slot=slot, deadline=deadline)
            serves = timings.cache_n >= n
            why = (
                f"saved and restored {n} tokens (slot-file version {header.version}"
                f"{'' if header.known else ', a version this ocpc has not read'}); the next request reused "
                f"{timings.cache_n} of them"
            )
            return result(header.version, header.known, True, serves, why)
        finally:
            path.unlink(missing_ok=True)


class Capabilities:
    """``capabilities.json``: what each server binary and model did in its self-test. Thread-safe;
    a file that cannot be read is taken for empty (the self-test runs again: it costs little)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._guard = threading.Lock()
        self._memory: dict[str, Capability] = {}

    def get(self, key: str) -> Capability | None:
        with self._guard:
            if key in self._memory:
                return self._memory[key]
        found = self._read().get(key)
        if found is not None:
            with self._guard:
                self._memory[key] = found
        return found

    def adopt(self, key: str, legacy: str) -> Capability | None:
        """The result under ``key``, else the one kept under ``legacy`` (the same binary and model
        under FORMAT 3's key: ocpc before the upgrade measured it), kept under ``key`` from now on."""
        found = self.get(key)
        if found is not None or legacy == key:
            return found
        old = self.get(legacy)
        if old is None:
            return None
        adopted = replace(old, key=key)
        self.put(adopted)
        return adopted

    def put(self, capability: Capability, *, keep: bool = True) -> None:
        """Remember ``capability``; ``keep``: also on disk (its binary is known, so a change of
        binary is a change of key)."""
        with self._guard:
            self._memory[capability.key] = capability
        if not keep:
            return
        try:
            data = self._read()
            data[capability.key] = capability
            payload = {"version": FILE_VERSION, "servers": {k: v.to_json() for k, v in sorted(data.items())}}
            write_private(self.path, (json.dumps(payload, indent=1) + "\n").encode())
        except OSError as exc:
            log.warning("could not keep the self-test's result in %s (it runs again next time): %s", self.path, exc)

    def all(self) -> list[Capability]:
        with self._guard:
            memory = dict(self._memory)
        return list({**self._read(), **memory}.values())

    def _read(self) -> dict[str, Capability]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        servers = data.get("servers") if isinstance(data, dict) else None
        if not isinstance(servers, dict):
            return {}
        out = {}
        for key, raw in servers.items():
            found = Capability.from_json(raw) if isinstance(raw, dict) else None
            if found is not None and found.key == key:
                out[key] = found
        return out
