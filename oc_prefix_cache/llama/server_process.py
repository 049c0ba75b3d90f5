"""Start and stop a real llama-server with the flags the cache needs.

Used by ``ocpc launch``, ``ocpc demo`` and the test rig, so all three run the server
the same way. ``restart`` keeps the port and slot folder: that is the "server restarted,
restore from disk" path the product exists for.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oc_prefix_cache.files import private_dir
from oc_prefix_cache.llama.supervisor import Supervised


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    binary: Path
    model: Path
    port: int
    slot_dir: Path | None  # None: run without --slot-save-path (to test that failure)
    host: str = "127.0.0.1"
    ctx_size: int = 16384  # total; per slot = ctx_size / parallel
    parallel: int = 1
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        args = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-c",
            str(self.ctx_size),
            "-np",
            str(self.parallel),
        ]
        if self.slot_dir is not None:
            args += ["--slot-save-path", str(self.slot_dir)]
        return args + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class LlamaServer:
    config: ServerConfig
    log_path: Path
    _proc: Supervised | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, *, timeout: float = 120.0, on_wait: Callable[[float], None] | None = None) -> None:
        if self.config.slot_dir is not None:
            private_dir(self.config.slot_dir)  # 0700; the server (umask 077) writes its files 0600
        self._proc = Supervised(
            name="llama-server",
            argv=self.config.argv(),
            health_url=f"{self.url}/health",
            log_path=self.log_path,
        )
        self._proc.start(timeout=timeout, on_wait=on_wait)

    def stop(self, *, grace: float = 10.0) -> None:
        if self._proc is not None:
            self._proc.stop(grace=grace)
            self._proc = None

    def restart(self, *, extra_args: Sequence[str] | None = None) -> None:
        """Stop and start again on the same port and slot folder (a real restart)."""
        self.stop()
        if extra_args is not None:
            self.config = ServerConfig(**{**self.config.__dict__, "extra_args": tuple(extra_args)})
        self.start()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()
