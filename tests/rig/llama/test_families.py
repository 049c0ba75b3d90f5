"""Every model family, on the real server: the tiny hybrid, the tiny transformer and the real
Gemma 3 270M (sliding-window attention), each started with the flags `ocpc launch` picks.

Each family gets the cases a user meets every day: a new session, a server restart, a
conversation parked by another and brought back, a damaged file. Then the SWA model on a
server started without `--swa-full` (as a user's own server may be): ocpc knows or learns
that no restore can serve there and stands down, so it costs nothing against plain
llama-server; `ocpc doctor` names the flag.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache.commands.doctor import run_checks
from oc_prefix_cache.engine import observer as server_view_module
from oc_prefix_cache.llama.server_info import model_family
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.helpers import FULL, PROJ_A, PROJ_B, capture, chat
from tests.rig.engine.test_parking import FLAGS, Turns
from tests.rig.engine.test_prepare import Rig

pytestmark = pytest.mark.rig
FAMILIES = pytest.mark.parametrize("model", ["qwen35", "qwen3", "gemma3"])


@pytest.fixture
def family(llama_server, family_args):
    """(server, Turns) for a model, with the checkpoint flags of the parking tests and the
    family's own flags from the launcher."""
    made: list[Turns] = []

    def make(model: str, *, launch: bool = True, extra: tuple[str, ...] = ()) -> tuple[Any, Turns]:
        flags = FLAGS + (family_args(model) if launch else ()) + extra
        server = llama_server(model, ctx_size=32768, extra_args=flags)
        t = Turns(server.url)
        made.append(t)
        return server, t

    yield make
    for t in made:
        t.close()


def sized(conv: workload.Conversation, model: str) -> workload.Conversation:
    """Gemma's conversations CI-sized unless OCPC_FULL_TESTS=1 (workload.shortened: its head
    823 tokens, still past the 512-token window, and shorter tool results): this machine
    prefills it at ~100 tokens/s, and its cases were most of this file's time."""
    return workload.shortened(conv) if model == "gemma3" and not FULL else conv


def served(timings: Any, result: Any) -> bool:
    """The request reused its prefix: past Gemma's 512-token window (so not what the window
    alone keeps), and at least 90% of it from cache."""
    return result.prefix_tokens > 600 and timings.cache_n >= 0.9 * result.prefix_tokens


def test_the_rigs_models_are_one_of_each_family(models, family_args) -> None:
    assert {name: model_family(str(models[name])).value for name in ("qwen35", "qwen3", "gemma3")} == {
        "qwen35": "hybrid",
        "qwen3": "transformer",
        "gemma3": "swa",
    }
    assert family_args("gemma3") == ("--swa-full",)
    assert family_args("qwen35") == family_args("qwen3") == ()


@FAMILIES
def test_a_new_session_after_a_long_conversation_reuses_the_head(family, model: str) -> None:
    """The slot holds the head plus a conversation far longer than an SWA window (512 on
    Gemma 3): a new session must still reuse the head. The server cuts an SWA slot back
    only within its window or to a checkpoint, even with --swa-full, so there the head is
    restored, not taken for a hit (which re-processed all 2,303 tokens)."""
    server, t = family(model)
    parent = sized(workload.parent("ses_a"), model)
    for _ in range(3):
        t.turn(parent)
    new, timings = t.turn(sized(workload.other_project("ses_b"), model))
    assert served(timings, new), (new, timings)


@FAMILIES
def test_a_new_session_and_one_after_a_restart_reuse_the_head(family, model: str) -> None:
    server, t = family(model)
    first, _ = t.turn(sized(workload.parent("ses_a"), model))
    assert first.action == "warmed", first
    second, timings = t.turn(sized(workload.other_project("ses_b"), model))
    assert second.action in ("hit", "restored") and served(timings, second), (second, timings)
    server.restart()
    after, timings = t.turn(sized(workload.other_project("ses_c"), model))
    assert after.action == "restored" and "gated" in after.reason, after
    assert served(timings, after), (after, timings)
    assert t.engine.stats.counters["warmed"] == 1  # one prefill of the head, ever


@FAMILIES
def test_a_conversation_parked_by_another_project_comes_back_with_only_its_new_tokens(family, model: str) -> None:
    """Both tiers. At the server's default RAM cache the displaced conversation is stashed by the
    server and swapped back from RAM, except where the newcomer is a hit on the slot's shared head
    (a transformer keeps it): the slot keeps the head, so the conversation is parked to disk. With a
    RAM cache too small for it (1 MiB) it always goes to a disk park. Either way it comes back with
    only its new tokens. On Gemma (minutes of prefill here) only the disk tier unless
    OCPC_FULL_TESTS=1: its RAM swaps are what tests/rig/doors/test_agents.py's two slots run on."""
    for ram in (None, "1") if model != "gemma3" or FULL else ("1",):
        server, t = family(model, extra=("--cache-ram", ram) if ram else ())
        parent, other = sized(workload.parent(), model), sized(workload.other_project(), model)
        for _ in range(3):
            t.turn(parent)
        displacing, _ = t.turn(other)
        keeps_head = displacing.action == "hit" and displacing.source == "slot"
        source = "ram" if ram is None and not keeps_head else "park"
        gone = "goes to the server's RAM cache" if source == "ram" else "parked the slot's conversation"
        assert gone in displacing.reason, (ram, displacing)
        back, timings = t.turn(parent)
        assert back.source == source and back.action == ("hit" if source == "ram" else "restored"), (ram, back)
        t.assert_only_new_tokens(back, timings)
        server.stop()


@FAMILIES
def test_a_damaged_head_file_fails_its_gate_and_is_rebuilt(family, model: str) -> None:
    server, t = family(model)
    t.turn(sized(workload.parent("ses_a"), model))
    server.restart()
    [head] = t.settings.slot_dir.glob("oc-prefix-*.bin")
    data = bytearray(head.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):  # damage the KV data, not the header
        data[i] ^= 0xFF
    head.write_bytes(bytes(data))
    rebuilt, timings = t.turn(sized(workload.other_project("ses_b"), model))
    assert rebuilt.action == "warmed" and "gate failed" in rebuilt.reason, rebuilt
    assert t.engine.stats.counters["gate_failed"] == 1
    assert t.engine.stood_down() is None  # one damaged file is the file's fault, not the server's
    assert timings.cache_n >= 0.9 * rebuilt.prefix_tokens


# -- a sliding-window model on a server without --swa-full -------------------------------------


def test_on_an_swa_server_without_swa_full_ocpc_stands_down_at_once(family) -> None:
    """The flags are visible (the server's command line): ocpc knows, says so, and touches
    nothing: no warm, no save, no slot action; the requests are the server's alone."""
    server, t = family("gemma3", launch=False)
    rig = Rig(server.url)
    for body, session in ((capture(PROJ_A), "ses_a"), (capture(PROJ_B), "ses_b")):
        result = rig.prepare(body, session=session)
        assert result.action == "skipped" and "--swa-full" in result.reason, result
        chat(server.url, body)
    assert rig.transport.changes() == []  # not one restore, save, erase or evaluation
    assert rig.slot_files() == [] and not list(rig.settings.slot_dir.glob("oc-*.bin"))
    status = rig.engine.status()
    assert status["stood_down"] and "--swa-full" in status["stood_down"]
    assert status["counters"]["stand_down"] == 1  # said once
    rig.client.close()


def test_where_the_flags_cannot_be_seen_ocpc_learns_to_stand_down_and_a_restart_asks_again(family, monkeypatch) -> None:
    """A server whose command line ocpc cannot read: the first restore's probe fails (a
    rebuild: it might be the file), the second on the same server process is the server:
    ocpc stands down. A restart is a new process, judged afresh."""
    monkeypatch.setattr(server_view_module, "server_command", lambda *a, **k: None)
    server, t = family("gemma3", launch=False)
    sessions = iter(f"ses_{i}" for i in range(10))
    answers = []
    for _ in range(4):
        result, _ = t.turn(
            sized(workload.other_project(next(sessions)) if answers else workload.parent(next(sessions)), "gemma3")
        )
        answers.append(result)
        t.turn(sized(workload.explore_subagent(next(sessions)), "gemma3"))  # another head takes the slot in between
        if result.action == "skipped":
            break
    assert answers[-1].action == "skipped" and "standing down" in answers[-1].reason, answers
    assert t.engine.stood_down() is not None
    later, _ = t.turn(sized(workload.other_project(next(sessions)), "gemma3"))
    assert later.action == "skipped" and "standing down" in later.reason
    server.restart()
    t.engine.view.observe(0)  # the daemon's watcher notices the restart
    assert t.engine.stood_down() is None


def test_doctor_names_the_missing_flag_on_an_swa_server(llama_server, monkeypatch) -> None:
    server = llama_server("gemma3", extra_args=("--metrics",))
    settings = Settings.from_env({**dict(os.environ), "OC_PREFIX_CACHE_BASE_URL": server.url})
    checks = {c.name: c for c in run_checks(settings)}
    family_check = checks["cache-family"]
    assert family_check.status == "fail", family_check
    assert "sliding-window" in family_check.detail and "--swa-full" in family_check.fix


def test_doctor_is_content_with_an_swa_server_that_has_swa_full(llama_server) -> None:
    server = llama_server("gemma3", extra_args=("--swa-full",))
    settings = Settings.from_env({**dict(os.environ), "OC_PREFIX_CACHE_BASE_URL": server.url})
    check = {c.name: c for c in run_checks(settings)}["cache-family"]
    assert check.status == "ok" and "--swa-full is on" in check.detail, check


def test_a_server_that_dies_on_start_says_which_signal_and_what_to_try(rig, models, tmp_path: Path) -> None:
    """Q4_K weights without --no-repack: this CPU build dies while loading on these machines,
    by a signal that depends on the CPU (SIGSEGV on some, SIGILL on a CPU with AMX:
    process.REPACK_CRASH_SIGNALS; tests/unit/llama/test_process.py gives each one with a stub). The error
    must say which signal and name the flag (a machine where it loads is fine too: then there
    is nothing to say)."""
    import re

    from oc_prefix_cache.errors import ProcessError
    from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
    from oc_prefix_cache.llama.supervisor import REPACK_CRASH_SIGNALS

    config = ServerConfig(binary=rig.server, model=models["gemma3"], port=free_port(), slot_dir=None, ctx_size=4096)
    server = LlamaServer(config=config, log_path=tmp_path / "server.log")
    try:
        server.start(timeout=120)
    except ProcessError as exc:
        died = re.search(r"was killed by signal (\d+) \((\w+)\)", str(exc))
        assert died is not None and int(died.group(1)) in {int(s) for s in REPACK_CRASH_SIGNALS}, exc
        assert "--no-repack" in str(exc), exc
    finally:
        server.stop()
