"""``ocpc gateway``: smg over several boxes, and ocpc's front before it (docs/scale.md).

One foreground command, two parts, both stopped by Ctrl-C or SIGTERM: smg (the Shepherd Model
Gateway, the ``gateway`` extra) as a child process in its own process group, on loopback, routing
by the routing key (``manual``: a new conversation to the box with the fewest, then kept there;
bench/results/boxes-policy-2026-12-06.json: ``consistent_hashing`` put 7 of 8 conversations on one
box in one run, 1 and 3 of 4 in another); and the front (doors/front.py), on loopback, where the
agents point. ocpc does not route: smg picks the box, ocpc keys the conversation and keeps each
box's cache warm.

smg's API key is the deployment's token (doors/token.py). smg takes it only as ``--api-key`` on its
command line, which ``ps`` shows to every user, so smg is started through ``smg_entry`` (this
package's ``python -m oc_prefix_cache.commands.smg_entry TOKEN_FILE -- ARGS``), which reads the file
and hands smg its arguments in-process: the command line names the file, never the token.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from oc_prefix_cache.commands.proxy_env import PROXY_VARS
from oc_prefix_cache.errors import ConfigError, ProcessError
from oc_prefix_cache.llama.server_process import free_port
from oc_prefix_cache.llama.supervisor import Supervised
from oc_prefix_cache.settings import LOOPBACK_HOSTS, Settings

#: The policies ocpc's front is made for (both route by the conversation's key: ``manual`` pins each
#: new key to the box with the fewest keys, then keeps it there; ``consistent_hashing`` hashes it);
#: the others route without it.
POLICIES = ("manual", "consistent_hashing", "cache_aware", "round_robin", "random", "power_of_two")


@dataclass(frozen=True, kw_only=True)
class GatewayPlan:
    boxes: tuple[str, ...]  # each box's door, http://host:port
    policy: str
    smg_host: str
    smg_port: int
    prometheus_port: int

    @property
    def smg_url(self) -> str:
        return f"http://{self.smg_host}:{self.smg_port}"

    def smg_args(self) -> list[str]:
        """smg's own arguments, without its API key (``smg_entry`` adds it from the token file)."""
        return [
            "launch",
            "--host",
            self.smg_host,
            "--port",
            str(self.smg_port),
            "--worker-urls",
            *self.boxes,
            "--policy",
            self.policy,
            # a new conversation goes to the box with the fewest conversations, and stays (manual)
            *(["--assignment-mode", "min_group"] if self.policy == "manual" else []),
            # the one header ocpc's front keys a conversation by (harness/routing_key.py)
            "--routing-key-headers",
            "x-smg-routing-key",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.prometheus_port),
            "--log-level",
            "warn",
        ]

    def shell_command(self, token_path: Path) -> str:
        """The command a user runs to start smg themselves (``ocpc gateway --print-smg``): through
        ``smg_entry``, so the key is read from the file and never on smg's command line (``ps``)."""
        entry = [sys.executable, "-m", "oc_prefix_cache.commands.smg_entry", str(token_path), "--"]
        return " ".join(shlex.quote(part) for part in [*entry, *self.smg_args()])


def plan(boxes: Sequence[str], *, policy: str, smg_host: str, smg_port: int | None) -> GatewayPlan:
    """Check what the user gave, before anything starts."""
    if not boxes:
        raise ConfigError("give each box's door: --box http://HOST:PORT (its `ocpc launch --listen`), once per box")
    for url in boxes:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ConfigError(f"--box {url!r}: give the box's door as http://HOST:PORT")
    if policy not in POLICIES:
        raise ConfigError(
            f"--policy {policy!r}: one of {', '.join(POLICIES)} (ocpc's key routes with manual or consistent_hashing)"
        )
    return GatewayPlan(
        boxes=tuple(url.rstrip("/") for url in boxes),
        policy=policy,
        smg_host=smg_host,
        smg_port=smg_port or free_port(),
        prometheus_port=free_port(),
    )


def smg_process(settings: Settings, gateway: GatewayPlan) -> Supervised:
    if importlib.util.find_spec("smg") is None:  # said before anything starts
        raise ConfigError("smg is not installed: pip install 'oc-prefix-cache[gateway]'")
    argv = [
        sys.executable,
        "-m",
        "oc_prefix_cache.commands.smg_entry",
        str(settings.token_path),
        "--",
        *gateway.smg_args(),
    ]
    # smg's HTTP client honours the proxy variables; its boxes are reached directly, whatever they say
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    return Supervised(
        name="smg",
        argv=argv,
        env=env,
        health_url=f"{gateway.smg_url}/health",
        log_path=settings.log_dir / f"smg-{gateway.smg_port}.log",
        die_with_parent=True,
    )


def run(
    settings: Settings,
    *,
    gateway: GatewayPlan | None,
    gateway_url: str,
    host: str,
    port: int,
    say: Callable[[str], None],
) -> int:
    """smg (unless ``gateway`` is None: the user runs it at ``gateway_url``) and the front; until a
    signal or smg's exit."""
    from oc_prefix_cache.doors.front import Front
    from oc_prefix_cache.doors.proxy_server import ProxyServer
    from oc_prefix_cache.doors.token import TokenFile

    if host not in LOOPBACK_HOSTS:
        raise ConfigError(f"--host {host!r}: the front listens on loopback, where the agents are")
    tokens = TokenFile(settings.token_path)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    child = smg_process(settings, gateway) if gateway is not None else None
    door: ProxyServer | None = None
    try:
        if child is not None and gateway is not None:
            say(
                f"starting smg on {gateway.smg_url} ({gateway.policy}, {len(gateway.boxes)} boxes; "
                f"log: {child.log_path})"
            )
            child.start(timeout=60.0)
        door = ProxyServer(Front(settings=settings, gateway=gateway_url, tokens=tokens), host=host, port=port)
        door.start()
        say(f"ready: point the agents at {door.url} (smg at {gateway_url}); Ctrl-C stops")
        while not stop.wait(0.5):
            if child is not None and not child.alive():
                say(f"smg exited; see {child.log_path}")
                return 1
        return 0
    except ProcessError as exc:
        say(f"smg did not start: {exc}")
        return 1
    finally:
        if door is not None:
            door.stop()
        if child is not None:
            child.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
