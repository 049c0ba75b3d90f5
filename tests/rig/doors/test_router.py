"""Router mode: ocpc's proxy in front of a llama-server router (`--models-dir`, `--models-max 1`)
with the two tiny models and the real Gemma model. A conversation on model A; requests to B and C
make the router unload A (and then B); A's next turn processes only its new tokens, from the park
ocpc wrote while A sat idle. State is per model: each has its own Engine, slots and files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from oc_prefix_cache import loopback
from oc_prefix_cache.doors.proxy_server import ProxyServer, build_proxy
from oc_prefix_cache.doors.router import RouterProxy, is_router
from oc_prefix_cache.engine import park_ahead as ahead
from oc_prefix_cache.llama.server_info import child_process
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import Supervised
from oc_prefix_cache.settings import Settings
from tests import workload
from tests.helpers import DATA, SUITE_WAIT_S, TEST_SERVER_ARGS, chat
from tests.rig.engine.test_parking import MARKUP

pytestmark = pytest.mark.rig
FLAGS = (
    "--ctx-checkpoints",
    "32",
    "--checkpoint-min-step",
    "1024",
    "-ub",
    "512",
    "--metrics",
    "--swa-full",
    "--no-repack",
)


def model_status(url: str) -> dict[str, str]:
    data = loopback.get(f"{url}/models", timeout=10).json()
    return {m["id"]: m["status"]["value"] for m in data["data"]}


def start_router(
    rig: Any, models: dict[str, Path], tmp_path: Path, names: tuple[str, ...], *, parallel: int = 1
) -> tuple[Settings, Supervised, str]:
    """A llama-server router over ``names`` (`--models-max 1`, ``parallel`` slots per model), writing
    into an ocpc home of the test."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.gguf").symlink_to(models[name])
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
    settings.slot_dir.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Supervised(
        name="llama-server router",
        argv=[
            str(rig.server),
            "--models-dir",
            str(folder),
            "--models-max",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(16384 * parallel),
            "-np",
            str(parallel),
            "--slot-save-path",
            str(settings.slot_dir),
            *FLAGS,
        ],
        health_url=f"{url}/health",
        log_path=tmp_path / "router.log",
    )
    router.start(timeout=120)
    return settings, router, url


def test_a_conversation_comes_back_after_the_router_unloads_its_model(
    rig: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    settings, router, url = start_router(rig, models, tmp_path, ("qwen35", "qwen3", "gemma3"))
    proxy = None
    try:
        assert is_router(url)
        front = build_proxy(settings, server_url=url)
        assert isinstance(front, RouterProxy)
        proxy = ProxyServer(front, port=0, watch=True)
        proxy.start()
        a = workload.parent("ses_a")
        a.body["model"] = "qwen35"
        rows: list[dict[str, Any]] = []

        def turn(who: str, conv: workload.Conversation) -> dict[str, Any]:
            timings = chat(proxy.url, conv.next_body())
            row = {"who": who, "cache_n": timings.cache_n, "prompt_n": timings.prompt_n, "status": model_status(url)}
            rows.append(row)
            return row

        first = turn("A1", a)
        second = turn("A2", a)
        assert second["cache_n"] >= first["cache_n"] + first["prompt_n"] - MARKUP, rows  # the slot kept A
        a_state = front.proxy_for("qwen35").engine
        deadline = time.monotonic() + ahead.IDLE_S + SUITE_WAIT_S  # A sits idle: parked ahead by the watch
        while not a_state.stats.counters.get("parked_ahead") and time.monotonic() < deadline:
            time.sleep(0.25)
        assert a_state.stats.counters.get("parked_ahead", 0) >= 1, a_state.stats.counters

        for who, model in (("B (evicts A)", "gemma3"), ("C (evicts B)", "qwen3")):
            other = workload.other_project(f"ses_{model}")
            other.body["model"] = model
            turn(who, other)
            assert model_status(url)["qwen35"] == "unloaded", rows

        prompt_before = rows[1]["cache_n"] + rows[1]["prompt_n"]
        back = turn("A3 (reloaded)", a)
        total = back["cache_n"] + back["prompt_n"]
        print("\n" + "\n".join(json.dumps(r) for r in rows))
        assert back["status"]["qwen35"] == "loaded"
        assert back["prompt_n"] <= total - prompt_before + MARKUP, rows  # only the new tokens
        statuses = loopback.get(f"{proxy.url}/ocpc/status", timeout=10).json()["models"]
        assert set(statuses) >= {"qwen35", "gemma3", "qwen3"}
        assert all("#model=" in statuses[m]["server"] for m in ("qwen35", "gemma3", "qwen3")), statuses
    finally:
        if proxy is not None:
            proxy.stop()
        router.stop()


def test_launch_with_a_models_dir_runs_the_router_and_a_proxy_per_model(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from oc_prefix_cache.llama.supervisor import stop_group
    from tests.unit.commands.test_launch import wait_for
    from tests.unit.doors.test_proxy import capture

    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("qwen35", "qwen3"):
        (folder / f"{name}.gguf").symlink_to(models[name])
    port, daemon_port, proxy_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oc_prefix_cache",
                "launch",
                "--models-dir",
                str(folder),
                "--port",
                str(port),
                "--",
                "-c",
                "8192",
                *TEST_SERVER_ARGS,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "ready: llama-server" in log.read_text())
        headers, body = capture(DATA / "pi-0.73.1" / "A1.json")
        answer = loopback.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            headers=headers,
            timeout=120,
            json={**body, "model": "qwen3", "max_tokens": 2},
        )
        assert answer.status_code == 200, answer.text[:300]
        wait_for(
            lambda: (
                loopback.get(f"http://127.0.0.1:{proxy_port}/ocpc/status", timeout=5)
                .json()["models"]
                .get("qwen3", {})
                .get("recent")
            )
        )
        status = loopback.get(f"http://127.0.0.1:{proxy_port}/ocpc/status", timeout=5).json()
        assert status["models"]["qwen3"]["recent"][-1]["action"] == "warmed", status
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=SUITE_WAIT_S) == 0
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
    said = log.read_text()
    assert "llama-server's router, at most 1 loaded" in said, said


def test_the_plugins_daemon_keeps_a_engine_per_router_model(rig: Any, models: dict[str, Path], tmp_path: Path) -> None:
    """OpenCode's path: the daemon in front of a router prepares each model on its own Engine
    (keyed per model), and a report goes back to the Engine that made its prepare."""
    from oc_prefix_cache.deadline import Deadline
    from oc_prefix_cache.doors.daemon import Daemon

    settings, router, url = start_router(rig, models, tmp_path, ("qwen35", "qwen3"))
    daemon = Daemon(settings=settings, server_url=url, port=0)
    try:
        seen = {}
        for model in ("qwen35", "qwen3", "qwen35"):
            conv = workload.parent(f"ses_{model}")
            conv.body["model"] = model
            body = conv.next_body()
            raw = json.dumps(body).encode()
            answer = daemon.prepare(raw, conv.headers(), deadline=Deadline.after(120))
            timings = chat(url, body)
            daemon.report(
                fingerprint=answer["fingerprint"] or "",
                cache_n=timings.cache_n,
                prompt_n=timings.prompt_n,
                prepare_id=answer["prepare_id"],
                predicted_n=timings.predicted_n,
            )
            seen.setdefault(model, []).append((answer["action"], timings.cache_n, timings.prompt_n))
        status = daemon.status()
        print("\n" + json.dumps(seen))
        assert set(status["models"]) == {"qwen35", "qwen3"}
        assert seen["qwen35"][0][0] == "warmed" and seen["qwen3"][0][0] == "warmed", seen
        # qwen35 again after qwen3 evicted it: a new session restores its head from its own file
        assert seen["qwen35"][1][0] == "restored" and seen["qwen35"][1][2] < 0.1 * seen["qwen35"][1][1], seen
        for model in ("qwen35", "qwen3"):
            counters = status["models"][model]["counters"]
            assert counters.get("report_served", 0) >= 1 and not counters.get("report_missed"), (model, counters)
    finally:
        daemon.stop()
        router.stop()


def send(proxy_url: str, conv: workload.Conversation) -> tuple[dict[str, Any], Any]:
    """One turn of ``conv`` through the proxy with its session headers: the server's timings and
    the proxy's record of it (its prepare's answer, once the report is in)."""
    sent = {**conv.next_body(), "max_tokens": 4, "stream": False}
    sent.pop("stream_options", None)

    def recent() -> list[dict[str, Any]]:
        models = loopback.get(f"{proxy_url}/ocpc/status", timeout=10).json()["models"]
        return list(models.get(sent["model"], {}).get("recent") or [])

    seen = len(recent())
    answer = loopback.post(f"{proxy_url}/v1/chat/completions", json=sent, headers=conv.headers(), timeout=300)
    assert answer.status_code == 200, answer.text[:300]
    timings = answer.json()["timings"]
    deadline = time.monotonic() + SUITE_WAIT_S  # the report is recorded after the answer, in a worker
    while time.monotonic() < deadline:
        now = recent()
        if len(now) > seen:
            return timings, now[-1]
        time.sleep(0.1)
    raise AssertionError(f"no report of {conv.session}'s turn")


def wait_for(check: Any, what: str, timeout: float = SUITE_WAIT_S) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_model_the_router_loads_again_has_its_heads_restored_before_the_next_session(
    rig: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    """Router mode's warm start (router.LoadWatch): qwen35 on two slots is used (its heads saved),
    qwen3 evicts it, then one request loads it again. The slot that request takes is left to its
    own prepare; qwen35's other slot gets its head back from disk while nothing asks, so the next
    new session finds it there (its prepare answers ``hit``, the server reuses it). Then another
    client loads qwen35 (``POST /models/load``, no request at all): both slots are warmed. ocpc's
    own looks never load a model."""
    settings, router, url = start_router(rig, models, tmp_path, ("qwen35", "qwen3"), parallel=2)
    proxy = None
    rows: list[dict[str, Any]] = []

    def turn(who: str, conv: workload.Conversation) -> dict[str, Any]:
        timings, record = send(proxy.url, conv)  # type: ignore[union-attr]
        row = {
            "who": who,
            "action": record["action"],
            "slot": record.get("slot"),
            "prefix": record["prefix_tokens"],
            "cache_n": timings["cache_n"],
            "prompt_n": timings["prompt_n"],
            "status": model_status(url),
        }
        rows.append(row)
        return row

    def session(name: str, model: str = "qwen35") -> workload.Conversation:
        conv = workload.parent(name) if model == "qwen35" else workload.other_project(name)
        conv.body["model"] = model
        conv.body["messages"][-1]["content"] += f" ({name})"  # each session its own first message
        return conv

    def evict() -> None:
        turn("evictor", session(f"ses_qwen3_{len(rows)}", "qwen3"))
        assert model_status(url)["qwen35"] == "unloaded", rows

    try:
        front = build_proxy(settings, server_url=url)
        assert isinstance(front, RouterProxy)
        proxy = ProxyServer(front, port=0, watch=True)
        proxy.start()
        for name in ("ses_1", "ses_2"):  # two sessions, one per slot: each slot's head saved, current
            turn(name, session(name))
        assert {r["slot"] for r in rows} == {0, 1}, rows
        qwen35 = front.proxy_for("qwen35").engine
        evict()
        time.sleep(3)  # the watch looks at qwen35 every second meanwhile: with autoload=false
        assert model_status(url) == {"qwen35": "unloaded", "qwen3": "loaded"}, "ocpc's watch loaded a model"

        before = qwen35.stats.counters.get("warm_start", 0)
        loader = turn("ses_3 (loads qwen35)", session("ses_3"))
        wait_for(lambda: qwen35.stats.counters.get("warm_start", 0) > before, "the warm start after the load")
        time.sleep(0.5)  # the warm start's other lines (the slot it left to ses_3)
        assert qwen35.stats.counters.get("warm_start", 0) == before + 1, qwen35.stats.counters  # one slot: not ses_3's
        assert loader["action"] in ("restored", "warmed") and loader["cache_n"] >= 0.9 * loader["prefix"], rows
        known, argv = qwen35.tracker.argv(qwen35.server)
        assert known and argv and "--models-dir" in argv  # the router's flags, for the fingerprint
        entry = next(m for m in loopback.get(f"{url}/models", timeout=10).json()["data"] if m["id"] == "qwen35")
        child = child_process(entry)
        assert child is not None and qwen35.tracker.process(qwen35.server) == child  # the load's own witness
        nxt = turn("ses_4 (next session)", session("ses_4"))
        assert nxt["slot"] != loader["slot"], rows
        assert nxt["action"] == "hit" and nxt["cache_n"] >= 0.9 * nxt["prefix"], rows  # restored before it asked

        evict()
        before = qwen35.stats.counters.get("warm_start", 0)
        loopback.post(f"{url}/models/load", json={"model": "qwen35"}, timeout=60).raise_for_status()  # another client
        wait_for(lambda: qwen35.stats.counters.get("warm_start", 0) >= before + 2, "both slots warmed")
        first = turn("ses_5 (after another client's load)", session("ses_5"))
        assert first["action"] == "hit" and first["cache_n"] >= 0.9 * first["prefix"], rows
        assert not qwen35.stats.counters.get("warm_start_late"), qwen35.stats.counters
    finally:
        print("\n" + "\n".join(json.dumps(r) for r in rows))
        if proxy is not None:
            proxy.stop()
        router.stop()


def test_a_router_models_key_names_the_routers_port() -> None:
    """A router model's Engine is keyed ``<router>#model=<id>``; its port is the router's, so the
    router's command line (the fingerprint's KV flags, the launch's runtime file) is found."""
    from oc_prefix_cache.llama.server_info import port_of, same_server

    assert port_of("http://127.0.0.1:9000#model=qwen35") == 9000
    assert port_of("http://localhost#model=m") == 80
    assert same_server("http://127.0.0.1:9000#model=qwen35", "http://localhost:9000")
