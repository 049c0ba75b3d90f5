"""Capabilities by probing, not by build number (issue 37): the self-test at first contact with a
server binary and model, slot-file versions this ocpc has not read, and standing down.

On the real server and the real Gemma model (it loads on every build of the matrix): a version
this ocpc reads only as "unknown" is used once the gates prove it on the live server; a file of a
version the server cannot restore makes ocpc stand down after one attempt, and `ocpc doctor` names
the cause; the self-test runs again when the binary or the model file changes, and only then.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.commands.doctor import run_checks
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.slotfile import file_digest, read_header
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.engine.capability import Capabilities, Capability
from oc_prefix_cache.llama.server_info import ResolvedServer
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.rig.build import ensure_matrix_server
from oc_prefix_cache.rig.real_models import REAL_MODELS
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.helpers import TEST_SERVER_ARGS
from tests.rig.engine.test_parking import FLAGS, Turns
from tests.rig.test_matrix import rig_settings

pytestmark = pytest.mark.rig


@pytest.fixture
def gemma_on(models: dict[str, Path], family_args: Any, tmp_path: Path, rig: Any) -> Any:
    """Start Gemma on a given binary (default: the pinned build) with `ocpc launch`'s flags."""
    started: list[LlamaServer] = []

    def start(binary: Path | None = None, model: Path | None = None) -> LlamaServer:
        config = ServerConfig(
            binary=binary or rig.server,
            model=model or models["gemma3"],
            port=free_port(),
            slot_dir=tmp_path / "ocpc" / "slots",
            ctx_size=16384,
            extra_args=(*REAL_MODELS["gemma3"].server_args, *TEST_SERVER_ARGS, *FLAGS, *family_args("gemma3")),
        )
        server = LlamaServer(config=config, log_path=tmp_path / f"llama-server-{len(started)}.log")
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


def settings_with(**env: str) -> Settings:
    return Settings.from_env({**os.environ, **env})


def test_a_version_this_ocpc_reads_as_unknown_is_used_once_the_gates_prove_it(gemma_on: Any) -> None:
    """The reader configured without version 4, against b11434 (which writes 4): the header still
    parses, the self-test proves a restore serves, and ocpc uses the build; every restore of a
    file of that version goes through the probe on the live server."""
    server = gemma_on()
    t = Turns(server.url, settings_with(OC_PREFIX_CACHE_SLOT_VERSIONS="2,3"))
    first, _ = t.turn(workload.shortened(workload.parent("ses_a")))
    assert first.action == "warmed", first
    capability = t.engine.status()["capability"]
    assert capability["version"] == 4 and not capability["known_format"] and capability["restores_serve"], capability
    server.restart()
    after, timings = t.turn(workload.shortened(workload.other_project("ses_b")))
    assert after.action == "restored" and "gated" in after.reason, after
    assert timings.cache_n >= 0.9 * after.prefix_tokens > 600, (after, timings)
    assert not t.engine.stood_down()
    t.close()


def test_a_file_of_a_version_the_server_cannot_restore_stands_ocpc_down_after_one_attempt(
    gemma_on: Any, tmp_path: Path
) -> None:
    """A real head file whose version field says 99, a version neither this ocpc nor the server
    knows: the first restore's gates fail, ocpc stands down at once (not after a rebuild and a
    second failure), every later request of that server process costs one look at its slots, and
    `ocpc doctor` names the version and what to do."""
    server = gemma_on()
    settings = settings_with(OC_PREFIX_CACHE_DAEMON_PORT=str(free_port()), OC_PREFIX_CACHE_BASE_URL=server.url)
    daemon = Daemon(settings=settings, server_url=server.url)
    daemon.start()
    try:
        t = Turns(server.url, settings)
        t.engine = daemon.engine  # the daemon's Engine: doctor reads what it learned
        t.turn(workload.shortened(workload.parent("ses_a")))
        [head] = settings.slot_dir.glob("oc-prefix-*.bin")
        assert read_header(head).version == 4
        data = bytearray(head.read_bytes())
        data[4:8] = struct.pack("<I", 99)
        head.write_bytes(bytes(data))
        store = Store(index_path=settings.index_path, lock_path=settings.lock_path)
        store.update(
            lambda index: index.entries.update(
                {  # its digest as saved: the server is what refuses it
                    key: replace(entry, xxh64=file_digest(head))
                    for key, entry in index.entries.items()
                    if entry.file == head.name
                }
            )
        )
        server.restart()
        refused, _ = t.turn(workload.shortened(workload.other_project("ses_b")))
        assert refused.action == "skipped" and "version 99" in refused.reason, refused
        assert "content changed" not in refused.reason  # the server refused it, not the digest
        counters = daemon.engine.status()["counters"]
        assert counters.get("gate_failed:unknown_version") == 1 and counters.get("warmed") == 1, counters
        later, _ = t.turn(workload.shortened(workload.other_project("ses_c")))
        assert later.action == "skipped" and "standing down" in later.reason, later
        assert daemon.engine.status()["counters"].get("warmed") == 1  # no warm it could not keep
        checks = {c.name: c for c in run_checks(settings, server=ResolvedServer(url=server.url, why="test"))}
        check = checks["self-test"]
        assert check.status == "fail" and "version 99" in check.detail and check.fix, check
    finally:
        daemon.stop()


def test_the_self_test_runs_again_only_when_the_binary_or_the_models_content_changes(
    gemma_on: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    settings = Settings.from_env(dict(os.environ))

    def first_session(server: LlamaServer) -> dict[str, Any]:
        t = Turns(server.url, settings)
        t.turn(workload.shortened(workload.parent("ses_a")))
        counters = dict(t.engine.status()["counters"])
        t.close()
        server.stop()
        return counters

    assert first_session(gemma_on()).get("selftest:usable") == 1
    assert "selftest:usable" not in first_session(gemma_on())  # the same binary and model: kept
    older = ensure_matrix_server(rig_settings(), "11393")
    binary = tmp_path / "bin" / "llama-server"  # another binary (another file, another build)
    binary.parent.mkdir()
    shutil.copy2(older, binary)
    assert first_session(gemma_on(binary=binary)).get("selftest:usable") == 1
    model = tmp_path / "gemma-copy.gguf"  # the same weights in another file (another path and mtime):
    shutil.copy(models["gemma3"], model)  # the same identity (by content, issue 39), the result kept
    assert "selftest:usable" not in first_session(gemma_on(model=model))
    changed = tmp_path / "gemma-changed.gguf"  # one byte of its weights changed: another model
    changed.write_bytes(models["gemma3"].read_bytes())
    with open(changed, "r+b") as handle:
        handle.seek(-64, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-64, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x01]))
    assert first_session(gemma_on(model=changed)).get("selftest:usable") == 1
    kept = Capabilities(settings.capabilities_path).all()
    assert len(kept) == 3 and {c.version for c in kept} == {3, 4} and all(c.usable for c in kept), kept
    assert json.loads(settings.capabilities_path.read_text())["version"] == 1
    assert oct(settings.capabilities_path.stat().st_mode & 0o777) == "0o600"


def test_a_capability_record_reads_back_and_says_what_to_do() -> None:
    bad = Capability(
        key="k",
        build="b0-unknown|llama-server|1|2",
        model="m.gguf",
        version=5,
        known_format=False,
        header_ok=True,
        restores_serve=False,
        reason="restored 32 tokens, reused 0",
    )
    assert Capability.from_json(json.loads(json.dumps(bad.to_json()))) == bad
    assert not bad.usable and "another llama-server build" in bad.advice()
    unreadable = Capability(
        key="k", build="b", model="m", version=7, known_format=False, header_ok=False, restores_serve=False, reason=""
    )
    assert "upgrade ocpc" in unreadable.advice()
