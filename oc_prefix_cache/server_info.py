"""Gather the server's identity: /props, plus the model and binary files behind it.

The daemon runs on the same machine as llama-server (the slot folder is shared), so it
can stat the model file the server names and read its GGUF header.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

from .errors import OcpcError
from .fingerprint import ServerIdentity, build_identity, model_file_identities
from .gguf_meta import read_gguf_info
from .settings import Settings
from .slot_client import SlotClient


def gather_identity(client: SlotClient, *, binary: Path | None, argv: list[str] | None = None) -> ServerIdentity:
    props = client.props()
    return identity_from_props(props, binary=binary, argv=argv)


def kv_types(argv: list[str] | None) -> str:
    """KV cache types from the server's flags (/props does not report them); "" unknown."""
    if argv is None:
        return ""
    k = flag_value(argv, ("-ctk", "--cache-type-k")) or "f16"
    v = flag_value(argv, ("-ctv", "--cache-type-v")) or "f16"
    return f"{k}/{v}"


def identity_from_props(props: dict[str, Any], *, binary: Path | None,
                        argv: list[str] | None = None) -> ServerIdentity:
    model_path = str(props.get("model_path") or "")
    settings = props.get("default_generation_settings") or {}
    template = str(props.get("chat_template") or "")
    return ServerIdentity(
        model_path=model_path,
        model_files=model_file_identities(model_path) if model_path else (),
        build=build_identity(str(props.get("build_info") or "unknown"), binary),
        chat_template_digest=xxhash.xxh64_hexdigest(template.encode()),
        n_ctx=int(settings.get("n_ctx") or 0),
        total_slots=int(props.get("total_slots") or 1),
        kv_types=kv_types(argv),
        hybrid=_is_partial_cache_model(model_path),
    )


def _is_partial_cache_model(model_path: str) -> bool:
    """True for hybrid/recurrent/SWA models; when unreadable, assume the strict case."""
    try:
        stat = Path(model_path).stat()
    except OSError:
        return True
    return _partial_cache_cached(model_path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _partial_cache_cached(model_path: str, size: int, mtime_ns: int) -> bool:
    """Memoised by file identity: reading the header takes ~50 ms, a stat microseconds."""
    try:
        return read_gguf_info(Path(model_path)).partial_cache
    except OcpcError:
        return True


def server_argv(url: str, *, runtime: dict[str, Any] | None = None) -> list[str] | None:
    """How the server at ``url`` was started: from ``ocpc launch``'s runtime file, else by
    finding a local llama-server process listening on that port (Linux /proc), else None.
    The API does not expose flags such as --checkpoint-min-step; its command line does.
    """
    if runtime and isinstance(runtime.get("argv"), list):
        return [str(a) for a in runtime["argv"]]
    port = port_of(url)
    if port is None:
        return None
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if argv and "llama-server" in Path(argv[0]).name and (flag_value(argv, ("--port",)) or "8080") == str(port):
            return argv
    return None


def flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value given to any spelling of a flag (``--x V`` or ``--x=V``); '' for a bare flag."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in names:
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else ""
    return None


def port_of(url: str) -> int | None:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
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
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int) or not _alive(data["pid"]):
        return None  # left by a launcher that died: its argv may no longer be the server's
    return data


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
