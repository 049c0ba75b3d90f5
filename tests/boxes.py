"""Many boxes as a user starts them, for the tests: `ocpc token`, `ocpc launch --listen` per box and
`ocpc gateway` in front, each a real process of the installed CLI, each stopped by its PID.

Every box is its own ocpc home and its own loopback address (127.0.0.2, 127.0.0.3, ...), as two
machines would be; its llama-server stays on 127.0.0.1 (on a machine of its own it is that box's
loopback). ``Box.kill`` is a box dying (SIGKILL to its whole process group: ocpc, llama-server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import stop_group
from tests.helpers import SUITE_WAIT_S, TEST_SERVER_ARGS, wait_until

OCPC = [sys.executable, "-m", "oc_prefix_cache"]
MODEL_ALIAS = "local-model"  # every box serves the model under one name: smg routes by it


def direct() -> httpx.Client:
    """A client that never uses the proxy variables (the tests point them at a recording stub)."""
    return httpx.Client(trust_env=False, timeout=30)


@dataclass
class Box:
    """One `ocpc launch --listen` process: its home, its llama-server port, its door."""

    name: str
    home: Path
    address: str
    token_file: Path
    log: Path
    server_port: int = field(default_factory=free_port)
    door_port: int = 0
    proxy_port: int = field(default_factory=free_port)
    daemon_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.door_port = self.door_port or free_port(self.address)

    @property
    def door(self) -> str:
        return f"http://{self.address}:{self.door_port}"

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "OC_PREFIX_CACHE_HOME": str(self.home),
            "OC_PREFIX_CACHE_TOKEN_FILE": str(self.token_file),
            "OC_PREFIX_CACHE_PROXY_PORT": str(self.proxy_port),
            "OC_PREFIX_CACHE_DAEMON_PORT": str(self.daemon_port),
            **(extra or {}),
        }

    def start(
        self,
        model: Path,
        *,
        server_args: Sequence[str] = (),
        binary: Path | None = None,
        env: dict[str, str] | None = None,
        parallel: int = 1,
    ) -> None:
        argv = [*OCPC, "launch", "-m", str(model), "--port", str(self.server_port), "-np", str(parallel)]
        argv += ["--listen", f"{self.address}:{self.door_port}"]
        argv += ["--server-bin", str(binary)] if binary else []
        argv += ["--", *TEST_SERVER_ARGS, "--alias", MODEL_ALIAS, *server_args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, env=self.env(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(self._ready, what=f"box {self.name} ready (log: {self.log})", within=SUITE_WAIT_S)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with direct() as client:
                return client.get(f"{self.door}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict[str, Any]:
        with direct() as client:
            answer = client.get(f"{self.proxy}/ocpc/status")
            answer.raise_for_status()
            data: dict[str, Any] = answer.json()
            return data

    def network_rows(self) -> list[dict[str, Any]]:
        """The requests this box's network door served (those the gateway sent), oldest first."""
        return [r for r in self.status()["recent"] if r.get("door") == "network"]

    def kill(self) -> None:
        """The box dies: ocpc and its llama-server, at once, with no chance to park or say goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=20)  # type: ignore[arg-type]


@dataclass
class Gateway:
    """`ocpc gateway` over the boxes: smg and ocpc's front; agents point at ``url``."""

    home: Path
    token_file: Path
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, boxes: Sequence[Box], *, policy: str = "manual") -> None:
        argv = [*OCPC, "gateway", "--port", str(self.port), "--policy", policy]
        for box in boxes:
            argv += ["--box", box.door]
        env = {**os.environ, "OC_PREFIX_CACHE_HOME": str(self.home), "OC_PREFIX_CACHE_TOKEN_FILE": str(self.token_file)}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._ready, what=f"the gateway ready (log: {self.log})", within=SUITE_WAIT_S)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with direct() as client:
                return (
                    client.get(f"{self.url}/ocpc/status").status_code == 200
                    and client.get(f"{self.url}/v1/models").status_code == 200
                )
        except httpx.HTTPError:
            return False

    def status(self) -> dict[str, Any]:
        with direct() as client:
            data: dict[str, Any] = client.get(f"{self.url}/ocpc/status").json()
            return data

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=20)  # type: ignore[arg-type]


def deployment_in(folder: Path, n: int) -> tuple[list[Box], Gateway]:
    """``n`` boxes (box i on 127.0.0.(i+2), its home ``folder/box<i>``) and a gateway over them, one
    token for all of them (made here); nothing started yet."""
    token = folder / "secrets" / "token"
    make_token(token)
    boxes = [
        Box(
            name=f"box{i}",
            home=folder / f"box{i}",
            address=f"127.0.0.{i + 2}",
            token_file=token,
            log=folder / f"box{i}.log",
        )
        for i in range(n)
    ]
    return boxes, Gateway(home=folder / "gateway", token_file=token, log=folder / "gateway.log")


def make_token(path: Path) -> None:
    subprocess.run([*OCPC, "token"], env={**os.environ, "OC_PREFIX_CACHE_TOKEN_FILE": str(path)}, check=True)


def token_of(path: Path) -> str:
    return path.read_text().strip()


def pretty(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=1)
