"""Warm before the first request: `ocpc launch` restores what each slot held last, so the first
request after a restart finds its head in place (its prepare answers `hit`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.disk.index import Entry, Index
from oc_prefix_cache.engine.warm_start import choose
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import SUITE_WAIT_S
from tests.test_launch import wait_for
from tests.test_proxy import capture

DATA = Path(__file__).parent / "data"
S = "http://127.0.0.1:9000"


def entry(kind: str, key: str, *, head: str = "", build: str = "b1") -> Entry:
    prefix = {"head": "oc-prefix", "proj": "oc-proj", "conv": "oc-conv"}[kind]
    return Entry(
        file=f"{prefix}-{key}.bin",
        bytes=1,
        prefix_tokens=1,
        created=0,
        last_used=0,
        model="m.gguf",
        server_build=build,
        harness="pi",
        kind=kind,
        head=head or key,
    )


def test_each_slot_gets_its_last_head_or_project_head_or_its_parks_head() -> None:
    h, p, c, old = "a" * 16, "b" * 16, "c" * 16, "d" * 16
    index = Index(
        entries={
            h: entry("head", h),
            p: entry("proj", p, head=h),
            c: entry("conv", c, head=h),
            old: entry("head", old, build="b0"),
        },
        current={
            f"{S}#slot0": h,
            f"{S}#slot1": p,
            f"{S}#slot2": c,
            f"{S}#slot3": old,
            "http://127.0.0.1:9001#slot4": h,
        },
    )
    picks, passed = choose(index, server=S, n_slots=6, model="m.gguf", build="b1", now=10)
    assert [(x.slot, x.key) for x in picks] == [(0, p), (1, p), (2, p)]  # the project head cut on h
    index.entries[p].expires = 5  # a project head of yesterday: the head alone
    picks, _ = choose(index, server=S, n_slots=3, model="m.gguf", build="b1", now=10)
    assert [(x.slot, x.key) for x in picks] == [(0, h), (2, h)]
    assert passed == [
        "slot 3: its file was written for another model or build",
        "slot 4: nothing recorded",
        "slot 5: nothing recorded",
    ]


@pytest.mark.rig
def test_after_launch_restarts_the_server_the_first_new_session_finds_its_head(models: Any, tmp_path: Path) -> None:
    port, daemon_port, proxy_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    cmd = [
        sys.executable,
        "-m",
        "oc_prefix_cache",
        "launch",
        "--port",
        str(port),
        "-m",
        str(models["qwen35"]),
        "--",
        "-c",
        "8192",
        "--logit-bias",
        "151645+30",
    ]
    rows = []
    for run, name in ((1, "A1"), (2, "A2")):
        log = tmp_path / f"launch{run}.log"
        with open(log, "wb") as out:
            launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda log=log: "ready: llama-server" in log.read_text())
            if run == 2:
                wait_for(lambda log=log: "warm start: slot 0:" in log.read_text())
            headers, body = capture(DATA / "pi-0.73.1" / f"{name}.json")
            answer = loopback.post(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            assert answer.status_code == 200, answer.text[:300]
            wait_for(lambda: _recent(proxy_port) and _recent(proxy_port)[-1]["cache_n"] is not None)
            rows.append(_recent(proxy_port)[-1])
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=SUITE_WAIT_S) == 0
        finally:
            if launcher.poll() is None:
                stop_group(launcher, grace=5)
    said = (tmp_path / "launch2.log").read_text()
    print("\n" + json.dumps(rows) + "\n" + "\n".join(line for line in said.splitlines() if "warm start" in line))
    assert rows[0]["action"] == "warmed", rows
    assert "warm start: slot 0: slot 0 held this head last: restored" in said, said
    assert rows[1]["action"] == "hit" and rows[1]["cache_n"] >= 0.9 * rows[1]["prefix_tokens"], rows


def _recent(port: int) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = loopback.get(f"http://127.0.0.1:{port}/ocpc/status", timeout=5).json()["recent"]
    return data
