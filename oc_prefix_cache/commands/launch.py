"""``ocpc launch``: llama-server with the flags the cache needs, and the daemon beside it.

One command, one foreground process tree: llama-server runs in its own process group
(SIGTERM, then SIGKILL after a grace period), the daemon in a thread of this process.
Ctrl-C or SIGTERM stops both; a lock file per port refuses a second launch; a runtime
file (``server-<port>.json``) tells ``doctor`` and ``status`` how the server was started.
Each default flag says why in ``cache_flags`` (and in docs/configuration.md).
llama-server (a router too, and the servers it spawns) runs under umask 077, so its slot
files are 0600; ocpc's own folders are made 0700 and what an earlier ocpc left open to other
users is tightened before anything starts (disk/privacy.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.doors.daemon import Daemon
from oc_prefix_cache.engine.gates import CHECKPOINT_FILES_BUILD, build_number
from oc_prefix_cache.engine.wiring import Engine
from oc_prefix_cache.errors import ConfigError, OcpcError, ProcessError
from oc_prefix_cache.files import private_dir, private_opener, write_private
from oc_prefix_cache.llama.families import SWA_FULL, Family
from oc_prefix_cache.llama.server_info import runtime_path
from oc_prefix_cache.llama.supervisor import Supervised
from oc_prefix_cache.settings import Settings

if TYPE_CHECKING:
    from oc_prefix_cache.doors.front import Front
    from oc_prefix_cache.doors.proxy import Proxy
    from oc_prefix_cache.doors.proxy_server import ProxyServer
    from oc_prefix_cache.doors.router import RouterProxy


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # every spelling, the first is what we pass
    value: str | None
    why: str

    def args(self, name: str | None = None) -> list[str]:
        """The flag as arguments, under ``name`` (a spelling this build knows) or its first."""
        name = name or self.names[0]
        return [name] if self.value is None else [name, self.value]


def family_flags(family: Family, *, swa_full: bool = True) -> list[Flag]:
    """What the model's cache family needs for a restore to serve (llama/families.py). An SWA model
    gets a full-size SWA cache: the same slot files, more KV memory (docs/configuration.md
    gives the cost for gpt-oss); ``ocpc launch --no-swa-full`` opts out, and ocpc then stands
    down on that server."""
    if family is Family.SWA and swa_full:
        return [
            Flag(
                (SWA_FULL,),
                None,
                "a sliding-window model: without a full-size SWA cache the server "
                "re-processes the whole prompt after every restore",
            )
        ]
    return []


def cache_flags(
    *,
    settings: Settings,
    host: str,
    port: int,
    parallel: int,
    checkpoint_min_step: int,
    ubatch: int,
    cache_ram_mib: int,
    ctx_checkpoints: int,
) -> list[Flag]:
    return [
        Flag(("--host",), host, "loopback only: the server and its slot API are not for the network"),
        Flag(("--port",), str(port), "the server's port"),
        Flag(
            ("--slot-save-path",),
            str(settings.slot_dir) + os.sep,
            "slot files go to ocpc's folder (OC_PREFIX_CACHE_SLOT_DIR), where the daemon checks them",
        ),
        Flag(
            ("-np", "--parallel"),
            str(parallel),
            "one slot holds the head; `ocpc install` turns OpenCode's title request off (--keep-title keeps it)",
        ),
        Flag(
            ("--ctx-checkpoints", "-ctxcp", "--swa-checkpoints"),
            str(ctx_checkpoints),
            "hybrid/SWA models roll back only to a checkpoint: keep enough of them",
        ),
        Flag(
            ("--checkpoint-min-step", "-cms"),
            str(checkpoint_min_step),
            "no larger than the head (7-20k tokens), so conversations get checkpoints past it",
        ),
        Flag(("-ub", "--ubatch-size"), str(ubatch), "checkpoints fall on ubatch boundaries near a prompt's end"),
        Flag(("--cache-ram", "-cram"), str(cache_ram_mib), "RAM prompt cache: a returning session can resume from RAM"),
        Flag(("--metrics",), None, "prompt_tokens_cached_total in /metrics, for `ocpc status`"),
    ]


def supported_options(help_text: str) -> set[str]:
    """Every option spelling a build's ``--help`` mentions."""
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", help_text))


def server_help(binary: Path) -> str:
    try:
        proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProcessError(f"cannot run {binary} --help: {exc}") from exc
    return proc.stdout + proc.stderr


def build_argv(
    binary: Path,
    model: Path,
    flags: Sequence[Flag],
    supported: set[str],
    extra: Sequence[str],
    *,
    models_dir: bool = False,
) -> tuple[list[str], list[str]]:
    """The argv, and notes on flags this build lacks or the user overrode. ``models_dir``:
    ``model`` is a folder of models for llama-server's router (its flags reach every model)."""
    argv: list[str] = [str(binary), "--models-dir" if models_dir else "-m", str(model)]
    notes: list[str] = []
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("-")}
    for flag in flags:
        if given & set(flag.names):
            notes.append(f"{flag.names[0]}: yours (from the extra arguments)")
            continue
        name = next((n for n in flag.names if n in supported), None)
        if name is None:
            notes.append(f"{flag.names[0]}: this build does not know it; skipped ({flag.why})")
            continue
        argv += flag.args(name)
    return argv + list(extra), notes


def build_advice(version: str) -> str | None:
    """What the build number means for the cache; None when it is new enough."""
    number = build_number(version.split()[0] if version else "") or _build_from_version(version)
    if number is None:
        return (
            "llama-server build unknown (an sdist or local build): assuming no checkpoint persistence; "
            "hybrid/SWA models then reuse only exact-prefix restores, which ocpc always makes"
        )
    if number < CHECKPOINT_FILES_BUILD:
        return (
            f"llama-server b{number} is older than b{CHECKPOINT_FILES_BUILD}: slot files carry no context "
            "checkpoints; hybrid/SWA models reuse only exact-prefix restores (what ocpc saves)"
        )
    return None


def _build_from_version(version: str) -> int | None:
    """``0.6.0-dev (build 11434, commit abc)`` -> 11434; build 0 means unknown."""
    match = re.search(r"build (\d+)", version)
    if match is None or int(match.group(1)) == 0:
        return None
    return int(match.group(1))


@contextmanager
def launch_lock(settings: Settings, port: int) -> Iterator[None]:
    """One launch per port: a held flock, with the holder's pid inside for the message."""
    path = settings.home / f"launch-{port}.lock"
    private_dir(path.parent)
    with open(path, "a+", opener=private_opener) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(
                f"ocpc launch is already running on port {port} (pid {holder}); stop it first or pick another --port"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


def run(
    settings: Settings,
    *,
    binary: Path,
    argv: list[str],
    port: int,
    host: str,
    say: Callable[[str], None],
    on_wait: Callable[[float], None],
    on_ready: Callable[[], None],
    load_timeout: float = 900.0,
    listen: tuple[str, int] | None = None,
) -> int:
    """Start both, wait for a signal or the server's exit, stop both. Returns an exit code."""
    from oc_prefix_cache.disk.privacy import tighten_at_start

    tighten_at_start(settings)  # before the first file is written: what an earlier ocpc left
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        (hurry if stop.is_set() else stop).set()  # a second signal skips parking

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # HUP: the terminal closed
    previous = {sig: signal.signal(sig, on_signal) for sig in signals}

    def waiting(seconds: float) -> None:
        if stop.is_set():  # Ctrl-C while the model loads: do not wait minutes for it
            raise ProcessError("stopped while llama-server was loading")
        on_wait(seconds)

    url = f"http://{host}:{port}"
    server = Supervised(
        name="llama-server",
        argv=argv,
        health_url=f"{url}/health",
        log_path=settings.log_dir / f"llama-server-{port}.log",
        die_with_parent=True,
    )
    daemon: Daemon | None = None
    proxy: ProxyServer | None = None
    door: ProxyServer | None = None
    try:
        with launch_lock(settings, port):
            private_dir(settings.slot_dir)  # 0700: the slot files' only guard from a server ocpc did not start
            say(f"starting llama-server on {url} (log: {server.log_path})")
            try:
                server.start(timeout=load_timeout, on_wait=waiting)
            finally:
                on_ready()
            _write_runtime(settings, port, server.pid, binary, argv, url)
            daemon = Daemon(settings=settings, server_url=url, server_binary=binary)
            daemon.start()
            routed = "--models-dir" in argv
            if routed:
                say(
                    "a llama-server router: the daemon and the proxy prepare each model on its own, and warm its "
                    "slots when the router loads it (doors/router.py)"
                )
            else:
                warm_in_background(daemon.engine, say=say)
            proxy = start_proxy(settings, daemon, say=say, routed=routed)
            said_proxy = f", ocpc proxy on {proxy.url}" if proxy else ""
            if listen is not None:
                door = start_network_door(settings, daemon, listen, beside=proxy.proxy if proxy else None)
                said_proxy += f", the box's network door on {door.url} (the deployment's token required)"
            say(f"ready: llama-server pid {server.pid}, ocpc daemon on {daemon.url}{said_proxy}; Ctrl-C stops all")
            while not stop.wait(0.5):
                if not server.alive():
                    say(f"llama-server exited; see {server.log_path}")
                    return 1
            say("stopping")
            if server.alive():
                park_before_stop(daemon.engine, skip=hurry, say=say)
            return 0
    finally:
        for front in (door, proxy):
            if front is not None:
                front.stop()
        if daemon is not None:
            daemon.stop()
        server.stop()
        runtime_path(settings, port).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


PARK_ON_STOP_S = 10.0  # a graceful stop waits at most this long for parks
WARM_START_S = 300.0  # a warm start gives up after this long (a request waits on the slot meanwhile)


def warm_in_background(engine: Engine, *, say: Callable[[str], None], seconds: float = WARM_START_S) -> None:
    """Restore what each slot held last before the first request asks (Engine.warm_start): a
    request that comes meanwhile waits for its slot, within its own deadline, and finds it warm."""

    def work() -> None:
        for line in engine.warm_start(deadline=Deadline.after(seconds)):
            say(f"warm start: {line}")

    threading.Thread(target=work, name="ocpc-warm-start", daemon=True).start()


def park_before_stop(
    engine: Engine, *, skip: threading.Event, say: Callable[[str], None], seconds: float = PARK_ON_STOP_S
) -> None:
    """Park the conversations the server holds before it stops, so each resumes after the
    restart with only its new tokens. Bounded; a second Ctrl-C (or signal) skips it."""
    say(f"parking live conversations (at most {seconds:g} s; Ctrl-C again to skip)")
    results: list[dict[str, object]] = []
    worker = threading.Thread(
        target=lambda: results.extend(engine.park_live(deadline=Deadline.after(seconds))),
        name="ocpc-park-on-stop",
        daemon=True,
    )
    worker.start()
    while worker.is_alive() and not skip.wait(0.1):
        pass
    if worker.is_alive():
        say("parking skipped")
        return
    parked = [r for r in results if r.get("parked")]
    say(
        f"parked {len(parked)} conversation(s)"
        + "".join(
            f"; slot {r['slot']}: {r['why']}" if "slot" in r else f"; {r['conversation']} (RAM): {r['why']}"
            for r in results
        )
    )


def start_proxy(
    settings: Settings, daemon: Daemon, *, say: Callable[[str], None], routed: bool = False
) -> ProxyServer | None:
    """``ocpc proxy`` beside the daemon, on the daemon's Engine: one tracker for both front doors
    (``routed``: in front of a router, a Engine per model of its own, doors/router.py).

    A proxy that cannot start (its port taken) is reported and left out: the server and the daemon
    OpenCode uses go on without it.
    """
    from oc_prefix_cache.doors.proxy import Proxy
    from oc_prefix_cache.doors.proxy_server import ProxyServer
    from oc_prefix_cache.doors.router import RouterProxy

    try:
        front: Proxy | RouterProxy = Proxy(settings=settings, engine=daemon.engine)
        if routed:  # the daemon's Engine of each model (its watch covers them all)
            front = RouterProxy(
                settings=settings,
                server_url=daemon.server_url,
                make=lambda model: Proxy(
                    settings=settings, engine=daemon.model_engine(model) if model else daemon.engine
                ),
            )
        proxy = ProxyServer(front)
        proxy.start()
    except (OcpcError, OSError) as exc:
        say(f"the ocpc proxy did not start: {exc}; llama-server and the daemon (OpenCode) go on without it")
        return None
    return proxy


def start_network_door(
    settings: Settings, daemon: Daemon, listen: tuple[str, int], *, beside: Proxy | RouterProxy | Front | None
) -> ProxyServer:
    """The box's door for a gateway (many boxes, docs/scale.md): the proxy on the daemon's Engine,
    on ``listen``, serving the agents' API to requests with the deployment's token and nothing else
    (doors/guard.py). Unlike the loopback proxy it is not optional: a box told to listen that
    cannot is an error, not a box that silently serves nobody."""
    from oc_prefix_cache.doors.proxy import NetworkDoor, Proxy
    from oc_prefix_cache.doors.proxy_server import ProxyServer
    from oc_prefix_cache.doors.token import TokenFile

    host, port = listen
    network = NetworkDoor.on(host, TokenFile(settings.token_path))
    peer = beside if isinstance(beside, Proxy) else None
    door = ProxyServer(
        Proxy(settings=settings, engine=daemon.engine, network=network, beside=peer), host=host, port=port
    )
    door.start()
    return door


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as given to ``--listen``; ``ConfigError`` otherwise."""
    host, colon, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"--listen {value!r}: give HOST:PORT, the address this box's door listens on (e.g. 10.0.0.5:8766)"
        )
    return host, int(port)


def _write_runtime(settings: Settings, port: int, pid: int | None, binary: Path, argv: list[str], url: str) -> None:
    data = {
        "pid": pid,
        "launcher_pid": os.getpid(),
        "binary": str(binary),
        "argv": argv,
        "url": url,
        "started": int(time.time()),
    }
    write_private(runtime_path(settings, port), json.dumps(data, indent=1).encode())
