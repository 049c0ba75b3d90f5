"""A llama-server that dies on start: the error says how, and what to try, for every signal the
same crash gives on some CPU (a stub that kills itself stands in: the real server on this
machine can die only one way)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from oc_prefix_cache.errors import ProcessError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import REPACK_CRASH_SIGNALS, Supervised


def dies_by(tmp_path: Path, sig: signal.Signals, *args: str) -> str:
    """Start a stub 'llama-server' that kills itself with ``sig``; the start error's text."""
    stub = tmp_path / "llama-server"
    stub.write_text(f"#!/bin/sh\nulimit -c 0\nkill -{sig.name[3:]} $$\nsleep 60\n")
    stub.chmod(0o755)
    child = Supervised(
        name="llama-server",
        argv=[str(stub), "-m", "model.gguf", *args],
        health_url=f"http://127.0.0.1:{free_port()}/health",
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(ProcessError) as info:
        child.start(timeout=30)
    return str(info.value)


@pytest.mark.parametrize("sig", REPACK_CRASH_SIGNALS, ids=lambda s: s.name)
def test_a_repack_crash_names_the_signal_and_no_repack_whatever_the_signal(tmp_path: Path, sig: signal.Signals) -> None:
    """Gemma's Q4_K weights without --no-repack: SIGSEGV on some CPUs, SIGILL on a CPU with AMX.
    Before, only SIGSEGV named the flag: on an AMX machine the user was told nothing."""
    said = dies_by(tmp_path, sig)
    assert f"killed by signal {int(sig)} ({sig.name})" in said, said
    assert "try again with --no-repack" in said, said


def test_sigill_with_no_repack_given_points_at_a_build_for_another_cpu(tmp_path: Path) -> None:
    said = dies_by(tmp_path, signal.SIGILL, "--no-repack")
    assert "killed by signal 4 (SIGILL)" in said and "try again with --no-repack" not in said, said
    assert "another CPU" in said and "rebuild" in said, said


def test_sigsegv_with_no_repack_given_suggests_nothing_it_already_has(tmp_path: Path) -> None:
    said = dies_by(tmp_path, signal.SIGSEGV, "-nr")
    assert "killed by signal 11 (SIGSEGV)" in said and "--no-repack" not in said.split("last log lines")[0], said


def test_sigbus_points_at_the_mapped_model_file(tmp_path: Path) -> None:
    said = dies_by(tmp_path, signal.SIGBUS)
    assert "killed by signal 7 (SIGBUS)" in said and "--no-mmap" in said and "--no-repack" not in said, said
