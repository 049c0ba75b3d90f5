"""What one llama-server is, and what one of its slots shows now.

Every prepare, report, park ahead and warm start begins with one of these looks: the slot
through ``GET /slots`` (into the tracker, which compares it with what ocpc left there), and the
server's identity (model file, build, KV-relevant flags; what its files are filed under). The
server's process is read once per process and serves as a second restart witness: a restart
shows in ``/proc/PID/stat`` in microseconds, where the slots of a fresh server can look like
the old one's for a moment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.content_digest import ContentDigests
from oc_prefix_cache.engine.tracker import Observation, Seen, SlotTracker
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.families import CacheFacts
from oc_prefix_cache.llama.fingerprint import ServerIdentity
from oc_prefix_cache.llama.server_info import LoraMemo, child_process, gather_identity, process_start, server_command

log = logging.getLogger("ocpc.prepare")


#: How long a request waits for a file's first content digest before going on unprepared.
DIGEST_WAIT_S = 2.0


class ServerView:
    """The looks at one server (thread-safe: its state lives in the shared ``SlotTracker``).

    ``read_slot``: one slot's ``/slots`` entry (``Executor.observe``); ``learn``: told each
    identity's cache facts (the RAM tier learns what the server's RAM entries carry); ``digests``:
    the content digests of the server's files (disk/content_digest.py, given by engine/wiring.py)."""

    def __init__(
        self,
        *,
        client: SlotClient,
        tracker: SlotTracker,
        read_slot: Callable[[int, Deadline | None], Observation],
        binary: Path | None,
        runtime: dict[str, Any] | None,
        learn: Callable[[CacheFacts], None],
        digests: ContentDigests | None = None,
    ) -> None:
        self.client = client
        self.server = client.server_id
        self.tracker = tracker
        self.lora = LoraMemo()  # the server's last LoRA answer, for a read that times out under load
        self._read_slot, self._binary, self._runtime, self._learn = read_slot, binary, runtime, learn
        self._digests = digests

    def observe(self, slot: int, *, deadline: Deadline | None = None) -> Seen:
        """``GET /slots`` into the tracker, with the server process as a second restart witness
        (reading /proc/PID/stat: microseconds)."""
        process = self.tracker.process(self.server)
        gone = process is not None and process_start(process[0]) != process[1]
        return self.tracker.observe(
            self.server,
            slot,
            self._read_slot(slot, deadline),
            process_gone=gone,
            process_alive=process is not None and not gone,
            witness=process,
        )

    def process_gone(self) -> bool:
        """Whether the server process ocpc knew has ended (False when none is known)."""
        process = self.tracker.process(self.server)
        return process is not None and process_start(process[0]) != process[1]

    def witnessed(self) -> bool:
        """Whether ocpc watches the server's process (so a restore needs no task after it)."""
        process = self.tracker.process(self.server)
        return process is not None and process_start(process[0]) == process[1]

    def identity(self, deadline: Deadline) -> ServerIdentity:
        """What identifies this server now (server_info.gather_identity; LoRA answers kept per process).
        The binary is the one ``ocpc launch`` started, else the running process's own (``/proc``): a
        build from an sdist or from source says ``b0-unknown`` whatever its version, so its file is
        what tells two builds apart (its files, its self-test: engine/capability.py)."""
        argv = self.argv()
        server = gather_identity(
            self.client,
            binary=self._binary or self._process_binary(),
            argv=argv,
            deadline=deadline,
            lora=self.lora,
            epoch=self.tracker.epoch(self.server),
            # a file not digested yet is read in the background: this request waits a moment, no more
            digests=self._digests.within(min(DIGEST_WAIT_S, max(0.0, deadline.remaining())))
            if self._digests is not None
            else None,
        )
        self._learn(server.cache)
        return server

    def _process_binary(self) -> Path | None:
        """The server process's executable (None when ocpc cannot see its process: another machine,
        another user's process)."""
        process = self.tracker.process(self.server)
        if process is not None and process_start(process[0]) != process[1]:  # restarted, not yet noticed
            found = server_command(self.server, runtime=self._runtime)
            process = found[1] if found is not None else None
        if process is None:
            return None
        try:
            return Path(os.readlink(f"/proc/{process[0]}/exe"))
        except OSError:
            return None

    def argv(self) -> list[str] | None:
        """The server's command line (for its KV-relevant flags) and its process (the restart
        witness), looked up once per server process."""
        known, argv = self.tracker.argv(self.server)
        if known:
            return argv
        epoch = self.tracker.epoch(self.server)
        argv, process = server_command(self.server, runtime=self._runtime) or (None, None)
        if self.client.model is not None:  # a router: the process found is the router's; the model's
            process = self._child()  # own is its child (a new process on every load)
        self.tracker.set_argv(self.server, argv, epoch=epoch, process=process)
        return argv

    def _child(self) -> tuple[int, int] | None:
        """Behind a router: the child process serving this model now (server_info.child_process)."""
        try:
            return child_process(self.client.model_entry(deadline=Deadline.after(2.0)))
        except OcpcError as exc:
            log.info("cannot find the child process of %s: %s", self.server, exc)
            return None
