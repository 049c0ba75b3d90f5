"""Router mode: ocpc's proxy in front of a llama-server router (`--models-dir`, `--models-max 1`)
with the two tiny models and the real Gemma model. A conversation on model A; requests to B and C
make the router unload A (and then B); A's next turn processes only its new tokens, from the park
ocpc wrote while A sat idle. State is per model: each has its own Preparer, slots and files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache import ahead
from oc_prefix_cache.llama_process import free_port
from oc_prefix_cache.process import Supervised
from oc_prefix_cache.proxy_server import ProxyServer, build_proxy
from oc_prefix_cache.router import RouterProxy, is_router
from oc_prefix_cache.settings import Settings

from . import workload
from .helpers import chat
from .test_parking import MARKUP

pytestmark = pytest.mark.rig
FLAGS = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--metrics", "--swa-full",
         "--no-repack")


def model_status(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/models", timeout=10).json()
    return {m["id"]: m["status"]["value"] for m in data["data"]}


def start_router(rig: Any, models: dict[str, Path], tmp_path: Path,
                 names: tuple[str, ...]) -> tuple[Settings, Supervised, str]:
    """A llama-server router over ``names`` (`--models-max 1`), writing into an ocpc home of the test."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.gguf").symlink_to(models[name])
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
    settings.slot_dir.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Supervised(name="llama-server router", argv=[
        str(rig.server), "--models-dir", str(folder), "--models-max", "1", "--host", "127.0.0.1", "--port", str(port),
        "-c", "16384", "-np", "1", "--slot-save-path", str(settings.slot_dir), *FLAGS],
        health_url=f"{url}/health", log_path=tmp_path / "router.log")
    router.start(timeout=120)
    return settings, router, url


def test_a_conversation_comes_back_after_the_router_unloads_its_model(rig: Any, models: dict[str, Path],
                                                                      tmp_path: Path) -> None:
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
            row = {"who": who, "cache_n": timings.cache_n, "prompt_n": timings.prompt_n,
                   "status": model_status(url)}
            rows.append(row)
            return row

        first = turn("A1", a)
        second = turn("A2", a)
        assert second["cache_n"] >= first["cache_n"] + first["prompt_n"] - MARKUP, rows  # the slot kept A
        a_state = front.proxy_for("qwen35").preparer
        deadline = time.monotonic() + ahead.IDLE_S + 30  # A sits idle: parked ahead by the watch
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
        statuses = httpx.get(f"{proxy.url}/ocpc/status", timeout=10).json()["models"]
        assert set(statuses) >= {"qwen35", "gemma3", "qwen3"}
        assert all("#model=" in statuses[m]["server"] for m in ("qwen35", "gemma3", "qwen3")), statuses
    finally:
        if proxy is not None:
            proxy.stop()
        router.stop()


def test_launch_with_a_models_dir_runs_the_router_and_a_proxy_per_model(models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from oc_prefix_cache.process import stop_group

    from .test_launch import wait_for
    from .test_proxy import capture

    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("qwen35", "qwen3"):
        (folder / f"{name}.gguf").symlink_to(models[name])
    port, daemon_port, proxy_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OC_PREFIX_CACHE_DAEMON_PORT": str(daemon_port), "OC_PREFIX_CACHE_PROXY_PORT": str(proxy_port)}
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "oc_prefix_cache", "launch", "--models-dir", str(folder),
                                     "--port", str(port), "--", "-c", "8192"],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "ready: llama-server" in log.read_text(), timeout=120)
        headers, body = capture(Path(__file__).parent / "data" / "pi-0.73.1" / "A1.json")
        answer = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", headers=headers, timeout=120,
                            json={**body, "model": "qwen3", "max_tokens": 2})
        assert answer.status_code == 200, answer.text[:300]
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{proxy_port}/ocpc/status", timeout=5).json()["models"]
                 .get("qwen3", {}).get("recent"), timeout=30)
        status = httpx.get(f"http://127.0.0.1:{proxy_port}/ocpc/status", timeout=5).json()
        assert status["models"]["qwen3"]["recent"][-1]["action"] == "warmed", status
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            stop_group(launcher, grace=5)
    said = log.read_text()
    assert "llama-server's router, at most 1 loaded" in said, said


def test_the_plugins_daemon_keeps_a_preparer_per_router_model(rig: Any, models: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """OpenCode's path: the daemon in front of a router prepares each model on its own Preparer
    (keyed per model), and a report goes back to the Preparer that made its prepare."""
    from oc_prefix_cache.daemon import Daemon
    from oc_prefix_cache.deadline import Deadline

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
            daemon.report(fingerprint=answer["fingerprint"] or "", cache_n=timings.cache_n, prompt_n=timings.prompt_n,
                          prepare_id=answer["prepare_id"], predicted_n=timings.predicted_n)
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
