"""Gather the server's identity: /props, its flags, its adapters, and the files behind them.

The daemon runs on the same machine as llama-server (the slot folder is shared), so it
can read the model file the server names (its content digest: the identity; its GGUF header:
its cache family), and read the server's command line (from ``ocpc launch``'s runtime file, or
from /proc). The files are digested through the ``Digests`` the caller passes (engine/wiring.py
hands the engine's view disk/content_digest.py's cache), so each is read once, not per request.
Also here: which server ``status`` and ``doctor`` talk about (``resolve_server``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import xxhash

from oc_prefix_cache import loopback
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.errors import OcpcError, ServerError, ServerTimeout
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.families import CTX_CHECKPOINTS, SWA_FULL, CacheFacts, Family
from oc_prefix_cache.llama.fingerprint import (
    KV_FLAGS,
    Digests,
    ServerIdentity,
    adapter_settings,
    build_id,
    build_identity,
    kv_flag_for,
    kv_flag_for_env,
    kv_settings,
    model_digest,
    model_file_identities,
)
from oc_prefix_cache.llama.gguf_meta import read_gguf_info
from oc_prefix_cache.llama.supervisor import pid_alive
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.server")

DEFAULT_PORT = 8080  # llama-server's --port when not given


def gather_identity(
    client: SlotClient,
    *,
    binary: Path | None,
    argv: list[str] | None = None,
    deadline: Deadline | None = None,
    lora: LoraMemo | None = None,
    epoch: int = 0,
    digests: Digests | None = None,
) -> ServerIdentity:
    """/props, plus the active LoRA adapters. A server started without ``--lora`` flags has no
    adapter to activate (``POST /lora-adapters`` only rescales loaded ones), so it is not asked:
    ``GET /lora-adapters`` is a task on the server's queue, answered between batches, and under
    load it took over 5 s (3 of ~28 prepares failed open on it in issue 17's first ramp). With
    adapters loaded, ``lora`` keeps the last answer of server process ``epoch`` for a read that
    times out. ``digests``: see ``identity_from_props``."""
    props = client.props(deadline=deadline)
    identity = identity_from_props(props, binary=binary, argv=argv, digests=digests)
    if argv is not None and not any(arg.split("=", 1)[0] in LORA_FLAGS for arg in argv):
        return identity
    adapters = (
        lora.read(client, epoch=epoch, deadline=deadline)
        if lora is not None
        else client.lora_adapters(deadline=deadline)
    )
    return replace(
        identity,
        lora=adapter_settings(adapters, digests=digests if digests is not None else _NO_FILES),
        legacy_lora=adapter_settings(adapters),
    )


LORA_FLAGS = frozenset({"--lora", "--lora-scaled"})


class LoraMemo:
    """The last ``GET /lora-adapters`` answer of one server process (see ``gather_identity``).
    A read that times out falls back to it (adapters change only by a ``POST /lora-adapters``,
    which a busy server answers after the batch too); any other error propagates."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._last: tuple[int, Sequence[Mapping[str, Any]]] | None = None  # (epoch, adapters)
        self.fallbacks = 0

    def read(self, client: SlotClient, *, epoch: int, deadline: Deadline | None) -> Sequence[Mapping[str, Any]]:
        """The server's answer (every loaded adapter, its path and scale), or its last one."""
        with self._guard:
            last = self._last if self._last is not None and self._last[0] == epoch else None
        try:
            adapters = client.lora_adapters(deadline=deadline)
        except ServerTimeout:
            if last is None:
                raise
            with self._guard:
                self.fallbacks += 1
            log.info("/lora-adapters did not answer in time (the server is busy); using its last answer")
            return last[1]
        with self._guard:
            self._last = (epoch, adapters)
        return adapters


def kv_types(argv: list[str] | None) -> str:
    """KV cache types from the server's flags (/props does not report them); "" unknown."""
    if argv is None:
        return ""
    k = flag_value(argv, ("-ctk", "--cache-type-k")) or "f16"
    v = flag_value(argv, ("-ctv", "--cache-type-v")) or "f16"
    return f"{k}/{v}"


def identity_from_props(
    props: dict[str, Any], *, binary: Path | None, argv: list[str] | None = None, digests: Digests | None = None
) -> ServerIdentity:
    """The server's identity from its /props and command line. ``digests``: the content digests
    of its model, binary and flag files (the engine's cache); without it (``ocpc doctor`` reads
    only the cache facts) no file is read and ``model_digest`` stays "", which keeps no files."""
    model_path = str(props.get("model_path") or "")
    settings = props.get("default_generation_settings") or {}
    template = str(props.get("chat_template") or "")
    build_info = str(props.get("build_info") or "unknown")
    return ServerIdentity(
        model_digest=model_digest(model_path, digests) if model_path and digests is not None else "",
        build_id=build_id(build_info, binary, digests),
        chat_template_digest=xxhash.xxh64_hexdigest(template.encode()),
        n_ctx=int(settings.get("n_ctx") or 0),
        total_slots=int(props.get("total_slots") or 1),
        kv_types=kv_types(argv),
        cache=cache_facts(model_family(model_path), argv),
        kv_flags=kv_settings(argv, digests=digests if digests is not None else _NO_FILES) if argv is not None else None,
        model_path=model_path,
        model_files=model_file_identities(model_path) if model_path else (),
        build=build_identity(build_info, binary),
        legacy_kv_flags=kv_settings(argv) if argv is not None else None,
    )


class _NoFiles:
    """No file is read (no ``Digests`` given): a flag's file reads as unreadable (``file_token``),
    so such an identity never equals one whose files were read."""

    def digest(self, path: str | Path) -> str | None:
        return None


_NO_FILES = _NoFiles()


def cache_facts(family: Family, argv: list[str] | None) -> CacheFacts:
    """The facts for a server running a model of ``family`` with command line ``argv``
    (``LLAMA_ARG_*`` settings already folded in front, as ``server_command`` gives it);
    the flags stay unknown (None) when the command line cannot be seen."""
    if argv is None:
        return CacheFacts(family)
    checkpoints = flag_value(argv, CTX_CHECKPOINTS)
    return CacheFacts(
        family,
        swa_full=flag_value(argv, (SWA_FULL,)) is not None,
        checkpoints=int(checkpoints) if checkpoints and checkpoints.isdigit() else None,
    )


def model_family(model_path: str) -> Family:
    """The model file's cache family; UNKNOWN (treated as the strict case) when unreadable."""
    try:
        stat = Path(model_path).stat()
    except OSError:
        return Family.UNKNOWN
    return _family_cached(model_path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _family_cached(model_path: str, size: int, mtime_ns: int) -> Family:
    """Memoised by file identity: reading the header takes ~50 ms, a stat microseconds."""
    try:
        return read_gguf_info(Path(model_path)).family
    except OcpcError:
        return Family.UNKNOWN


# -- the server's command line --------------------------------------------------------------

# Flags status and doctor read that are not on the allow-list, and their LLAMA_ARG_* names.
_STATUS_ENV: dict[str, tuple[str, bool]] = {  # env -> (flag, is a switch)
    "LLAMA_ARG_PORT": ("--port", False),
    "LLAMA_ARG_HOST": ("--host", False),
    "LLAMA_ARG_N_PARALLEL": ("--parallel", False),
    "LLAMA_ARG_CTX_SIZE": ("--ctx-size", False),
    "LLAMA_ARG_CTX_CHECKPOINTS": ("--ctx-checkpoints", False),
    "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": ("--checkpoint-min-step", False),
    "LLAMA_ARG_CACHE_RAM": ("--cache-ram", False),
    "LLAMA_ARG_UBATCH": ("--ubatch-size", False),
    "LLAMA_ARG_ENDPOINT_METRICS": ("--metrics", True),
}
_TRUTHY = ("on", "enabled", "true", "1")


def server_argv(url: str, *, runtime: dict[str, Any] | None = None) -> list[str] | None:
    """The command line in effect for the server at ``url``, or None when it cannot be seen
    (see ``server_command``)."""
    found = server_command(url, runtime=runtime)
    return found[0] if found else None


def server_command(
    url: str, *, runtime: dict[str, Any] | None = None
) -> tuple[list[str], tuple[int, int] | None] | None:
    """The command line in effect for the server at ``url`` and its process (pid, start time
    in clock ticks), or None when it cannot be seen.

    From ``ocpc launch``'s runtime file, else a local llama-server process listening on
    that port (Linux /proc). The API does not expose flags such as --checkpoint-min-step
    or --rope-freq-base; its command line does. llama-server also takes settings from
    ``LLAMA_ARG_*`` variables and from ``llama.cpp/config.ini``; those of the allow-list
    (and the few status shows) are put in front of the real arguments, so the real ones
    still win as they do in the server. Relative file arguments are made absolute against
    the server's working directory.

    The process is the restart witness: a restart always makes a new process, so while this
    pair is alive the server has not restarted, however its slots look (a fresh server's
    slot holding only a restore looks like a restarted server's empty slot in /slots).
    One /proc scan: call it once per server process.
    """
    pid: int | None = None
    argv: list[str] | None = None
    if runtime and isinstance(runtime.get("argv"), list):
        argv = [str(a) for a in runtime["argv"]]
        pid = runtime.get("pid") if isinstance(runtime.get("pid"), int) else None
    else:
        port = port_of(url)
        if port is None:
            return None
        found = _find_process(port)
        if found is None:
            return None
        pid, argv = found
    environ = _environ(pid) if pid is not None else None
    implied = _config_args(environ) + _env_args(environ or {})
    cwd = _cwd(pid) if pid is not None else None
    full = argv[:1] + implied + argv[1:]
    started = process_start(pid) if pid is not None else None
    process = (pid, started) if pid is not None and started is not None else None
    return (_absolute_files(full, cwd) if cwd is not None else full), process


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on, or None when the process is gone. The fields
    are read after the *last* ")": a command name may hold spaces and parentheses."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """The process's start time (/proc/PID/stat field 22), or None when it is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def child_process(entry: dict[str, Any]) -> tuple[int, int] | None:
    """The child server a llama-server router runs for one model (pid, start time), from that
    model's ``GET /models`` entry: while it is loaded, ``status.args`` holds the child's command
    line with the port the router gave it (a fresh one per load). None when the model is not
    loaded or no such process is visible here (another machine, another user's process).

    The child is the restart witness of that model: each load is a new process, and a slot that
    holds only ocpc's restore shows no task, exactly like the empty slot of a newly loaded child."""
    status = entry.get("status")
    if not isinstance(status, dict) or status.get("value") != "loaded" or not isinstance(status.get("args"), list):
        return None
    port = flag_value([str(a) for a in status["args"]], ("--port",))
    found = _find_process(int(port)) if port is not None and port.isdigit() else None
    started = process_start(found[0]) if found is not None else None
    return (found[0], started) if found is not None and started is not None else None


def _find_process(port: int) -> tuple[int, list[str]] | None:
    """A local llama-server whose flags (or LLAMA_ARG_PORT) say it listens on ``port``."""
    for pid, argv in _llama_processes():
        given = flag_value(argv, ("--port",))
        if given is None:
            given = (_environ(pid) or {}).get("LLAMA_ARG_PORT")
        if (given or str(DEFAULT_PORT)) == str(port):
            return pid, argv
    return None


def _llama_processes() -> Iterator[tuple[int, list[str]]]:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if argv and "llama-server" in Path(argv[0]).name:
            yield int(cmdline.parent.name), argv


def _environ(pid: int) -> dict[str, str] | None:
    """The process's environment; None when not ours to read (another user's process)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def _env_args(environ: dict[str, str]) -> list[str]:
    """``LLAMA_ARG_*`` settings as the arguments they stand for (allow-list and status)."""
    out: list[str] = []
    for name, value in sorted(environ.items()):
        flag = kv_flag_for_env(name)
        if flag is not None:
            switch = flag.kind == "switch"
            out += ([flag.canonical] if value.lower() in _TRUTHY else []) if switch else [flag.canonical, value]
        elif name in _STATUS_ENV:
            spelling, switch = _STATUS_ENV[name]
            out += ([spelling] if value.lower() in _TRUTHY else []) if switch else [spelling, value]
    return out


def config_paths(environ: dict[str, str] | None) -> list[Path]:
    """The config files llama-server b11434 reads first (``common_params_apply_system_config``)."""
    env = environ if environ is not None else dict(os.environ)
    config_home = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return [Path("/etc/llama.cpp/config.ini"), Path(config_home) / "llama.cpp" / "config.ini"]


def _config_args(environ: dict[str, str] | None) -> list[str]:
    """Allow-listed settings from the config files, as arguments (they apply before env/argv)."""
    out: list[str] = []
    for path in config_paths(environ):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out += _ini_args(text)
    return out


def _ini_args(text: str) -> list[str]:
    section = "default"
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip() or "default"
            continue
        key, eq, value = line.partition("=")
        if not eq or section not in ("*", "default"):
            continue  # other sections are presets the server applies only by name
        key, value = key.strip(), value.strip().strip('"')
        flag = kv_flag_for_env(key) or kv_flag_for(f"--{key}") or kv_flag_for(f"-{key}")
        if flag is None:
            continue
        if flag.kind == "switch":
            out += [flag.canonical] if value.lower() in _TRUTHY else []
        else:
            out += [flag.canonical, *value.split()[: flag.nargs]] if flag.nargs > 1 else [flag.canonical, value]
    return out


def _absolute_files(argv: list[str], cwd: Path) -> list[str]:
    """Allow-listed file arguments made absolute, so they are stat-ed where the server reads them."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag = kv_flag_for(arg) if arg.startswith("-") else None
        if flag is None or flag.kind not in ("files", "scaled_files"):
            continue
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            out[i] = f"{name}={_absolute_csv(value, cwd, scaled=flag.kind == 'scaled_files')}"
        elif i + 1 < len(out):
            out[i + 1] = _absolute_csv(out[i + 1], cwd, scaled=flag.kind == "scaled_files")
    return out


def _absolute_csv(value: str, cwd: Path, *, scaled: bool) -> str:
    items = []
    for item in value.split(","):
        path, colon, scale = item.rpartition(":") if scaled else (item, "", "")
        if path and not Path(path).is_absolute():
            path = str(cwd / path)
        items.append(f"{path}{colon}{scale}")
    return ",".join(items)


def flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value given to any spelling of a flag (``--x V`` or ``--x=V``); '' for a bare flag.

    The last occurrence wins, as in llama-server's own parser (and as the settings
    ``server_argv`` puts in front of the real arguments require).
    """
    found: str | None = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key.startswith("--"):
            key = key.replace("_", "-")
        if key in names:
            if eq:
                found = value
            else:
                found = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else ""
    return found


def port_of(url: str) -> int | None:
    """The port of ``url``; of a router model's key (``<router>#model=<id>``) the router's."""
    rest = url.split("://", 1)[-1].split("/", 1)[0].split("#", 1)[0].split("?", 1)[0]
    if ":" not in rest:
        return 80
    try:
        return int(rest.rsplit(":", 1)[1])
    except ValueError:
        return None


def runtime_path(settings: Settings, port: int) -> Path:
    """Where `ocpc launch` records how it started the server on ``port``."""
    return settings.home / f"server-{port}.json"


def read_runtime(settings: Settings, port: int) -> dict[str, Any] | None:
    """The record of a live `ocpc launch` on ``port``; None when absent or stale."""
    try:
        data = json.loads(runtime_path(settings, port).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int) or not pid_alive(data["pid"]):
        return None  # left by a launcher that died: its argv may no longer be the server's
    return data


def live_runtimes(settings: Settings) -> list[dict[str, Any]]:
    """Every live `ocpc launch` record in OC_PREFIX_CACHE_HOME, by port."""
    out = []
    for path in sorted(settings.home.glob("server-*.json")):
        match = re.fullmatch(r"server-(\d+)\.json", path.name)
        data = read_runtime(settings, int(match.group(1))) if match else None
        if data is not None and isinstance(data.get("url"), str):
            out.append(data)
    return out


# -- which server status and doctor talk about -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ResolvedServer:
    url: str
    why: str  # one line: which source chose it


def resolve_server(settings: Settings, *, explicit: str | None, explicit_source: str = "--server") -> ResolvedServer:
    """The llama-server ``status``, ``doctor``, ``install``, the daemon and the proxy use, and why.

    First match: an explicit URL (``--server`` or OC_PREFIX_CACHE_BASE_URL), the server
    the running daemon keeps warm, the one live ``ocpc launch``, the one llama-server process
    running here, a llama-server answering on a usual port (8080, 9931), else the default,
    saying so. Without this, ``ocpc launch --port 9000`` is followed by a status of the default
    port's server, and an install for a server on 9931 pointed OpenCode at 8080.
    """
    if explicit:
        return ResolvedServer(url=explicit.rstrip("/"), why=f"given by {explicit_source}")
    served = daemon_server_url(settings)
    if served:
        return ResolvedServer(url=served, why=f"the ocpc daemon at {settings.daemon_url} serves it")
    live = live_runtimes(settings)
    if len(live) == 1:
        return ResolvedServer(
            url=str(live[0]["url"]).rstrip("/"), why=f"ocpc launch runs it (pid {live[0].get('launcher_pid', '?')})"
        )
    if live:
        ports = ", ".join(str(port_of(str(r["url"]))) for r in live)
        return ResolvedServer(
            url=settings.base_url,
            why=f"the default: {len(live)} ocpc launch servers run (ports {ports}); pick one with --server",
        )
    running = local_servers()
    if len(running) == 1:
        ((pid, url),) = running.items()
        return ResolvedServer(url=url, why=f"a llama-server process (pid {pid}) listens there")
    if running:
        urls = ", ".join(sorted(set(running.values())))
        return ResolvedServer(
            url=settings.base_url,
            why=f"the default: {len(running)} llama-server processes run ({urls}); pick one with --server",
        )
    for port in PROBE_PORTS:
        url = f"http://127.0.0.1:{port}"
        if _answers_health(url):
            return ResolvedServer(url=url, why=f"a llama-server answers /health on port {port}")
    return ResolvedServer(
        url=settings.base_url,
        why=f"the default (llama-server's own without --port): no ocpc daemon, ocpc launch or "
        f"llama-server found running; pass --server to choose (ports tried: "
        f"{', '.join(map(str, PROBE_PORTS))})",
    )


# Where a llama-server listens when nothing says: b11434's default, and the default upstream
# announced it moves to.
PROBE_PORTS = (DEFAULT_PORT, 9931)


def local_servers() -> dict[int, str]:
    """pid -> URL of each local llama-server process, from its --host/--port flags (or
    LLAMA_ARG_HOST/LLAMA_ARG_PORT); a router's children (llama-servers it started) left out."""
    found = {}
    processes = dict(_llama_processes())
    for pid, argv in processes.items():
        if _parent(pid) in processes:
            continue  # a router's child: the router's own URL is the one to use
        env = _environ(pid) or {}
        port = flag_value(argv, ("--port",)) or env.get("LLAMA_ARG_PORT") or str(DEFAULT_PORT)
        host = flag_value(argv, ("--host",)) or env.get("LLAMA_ARG_HOST") or "127.0.0.1"
        if host in ("0.0.0.0", "::", "[::]", "localhost"):
            host = "127.0.0.1"  # listening everywhere: loopback reaches it
        if port.isdigit():
            found[pid] = f"http://{host}:{int(port)}"
    return found


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def _answers_health(url: str) -> bool:
    """Whether ``url`` answers like llama-server's /health (ok, or 503 while loading)."""
    try:
        response = loopback.get(f"{url}/health", timeout=httpx.Timeout(0.5, connect=0.3), what="llama-server")
        data = response.json()
    except (ServerError, ValueError):
        return False
    return response.status_code in (200, 503) and isinstance(data, dict) and ("status" in data or "error" in data)


def daemon_server_url(settings: Settings, *, timeout: float = 2.0) -> str | None:
    """The llama-server URL the daemon on OC_PREFIX_CACHE_DAEMON_PORT says it serves."""
    try:
        data = loopback.get(
            f"{settings.daemon_url}/v1/status", timeout=httpx.Timeout(timeout, connect=0.5), what="ocpc's daemon"
        ).json()
    except (ServerError, ValueError):
        return None
    url = (data.get("server") or {}).get("url") if isinstance(data, dict) else None
    return url.rstrip("/") if isinstance(url, str) and url.startswith(("http://", "https://")) else None


_LOOPBACK = {"localhost": "127.0.0.1", "::1": "127.0.0.1"}


def same_server(a: str, b: str) -> bool:
    """Two URLs of one server: ``http://localhost:9000/`` and ``http://127.0.0.1:9000`` are."""
    return _server_key(a) == _server_key(b)


def _server_key(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").lower()
    return parts.scheme.lower(), _LOOPBACK.get(host, host), port_of(url)


def kv_flag_names() -> list[str]:
    """The allow-list's canonical names, for messages."""
    return [flag.canonical for flag in KV_FLAGS]
