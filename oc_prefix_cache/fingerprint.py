"""The fingerprint: one xxh64 over everything that can move the head's tokens or KV layout.

If any input changes (tools, model file, server build, template, context size, harness
or ocpc version, the head text), the fingerprint changes and the next session pays one
deliberate cold prefill. A stale file is never restored under a new configuration: the
server cannot tell us a file is from another model of the same shapes (it restores it
"successfully"), so identity is ours to record.

Pure: the inputs are gathered elsewhere (``server_identity`` does the I/O).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from .head import Head

FORMAT = 1  # bump when the fingerprint's inputs change meaning


@dataclass(frozen=True)
class FileIdentity:
    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class ServerIdentity:
    """What the server says about itself, plus the identity of the files it runs."""

    model_path: str
    model_files: tuple[FileIdentity, ...]  # every shard; empty when not readable here
    build: str  # build_info, extended with the binary's identity when the number is useless
    chat_template_digest: str
    n_ctx: int  # per slot
    total_slots: int
    kv_types: str  # cache types when the server reports them, else ""
    hybrid: bool  # recurrent/hybrid/SWA: only exact-prefix restores are reusable


@dataclass(frozen=True)
class FingerprintInputs:
    server: ServerIdentity
    harness: str
    ocpc_version: str
    head: Head
    rendered_head: str  # the template's rendering of the head: covers template and tool layout


def fingerprint(inputs: FingerprintInputs) -> str:
    """16 hex digits; stable across processes and machines for the same inputs."""
    server = asdict(inputs.server)
    server.pop("total_slots")  # a file fits any slot of the same n_ctx
    server.pop("hybrid")  # derived from the model file, already covered
    payload: dict[str, Any] = {
        "format": FORMAT,
        "server": server,
        "harness": inputs.harness,
        "ocpc": inputs.ocpc_version,
        "model_name": inputs.head.model,
        "tools": inputs.head.tools_json,
        "system_head": inputs.head.system_head,
        "marker": inputs.head.marker,
        "rendered_head": inputs.rendered_head,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()
    return xxhash.xxh64_hexdigest(blob)


_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def model_file_identities(model_path: str) -> tuple[FileIdentity, ...]:
    """Size and mtime of the model file, or of every shard of a split GGUF."""
    path = Path(model_path)
    match = _SHARD_RE.match(path.name)
    if match:
        n = int(match.group("n"))
        paths = [path.with_name(f"{match.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    else:
        paths = [path]
    out = []
    for shard in paths:
        try:
            stat = shard.stat()
        except OSError:
            return ()
        out.append(FileIdentity(name=shard.name, size=stat.st_size, mtime_ns=stat.st_mtime_ns))
    return tuple(out)


def build_identity(build_info: str, binary: Path | None) -> str:
    """The server build: its build string, plus the binary's size/mtime when we know it.

    Builds from an sdist report ``b0-unknown``, so the string alone cannot tell two
    builds apart; the launcher knows the binary and records it.
    """
    if binary is None:
        return build_info
    try:
        stat = binary.stat()
    except OSError:
        return build_info
    return f"{build_info}|{binary.name}|{stat.st_size}|{stat.st_mtime_ns}"
