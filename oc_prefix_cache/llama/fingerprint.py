"""The fingerprint: one xxh64 over everything that can move the head's tokens or KV contents.

If any input changes (the head as the template renders it, the model's bytes, the server
build, context size, the server flags that change what the KV cache holds, the active LoRA
adapters, the harness), the fingerprint changes and the next session pays one deliberate cold
prefill. A stale file is never restored under a new configuration: the server cannot tell us a
file is from another model of the same shapes, or was computed under another RoPE base or
adapter (it restores it "successfully"), so identity is ours to record.

Identity holds exactly what changes a slot file's meaning, and nothing of where it was made
(FORMAT 4): the model, the server binary and every file a KV flag names are identified by their
*content* (xxh3_128 of their bytes, ``Digests``: disk/content_digest.py keeps them), never by
path, name or mtime. A copy of the model or of the server at another path, on another machine,
keeps every park and head; one changed byte is another identity. ocpc's own version no longer
counts either: what a file holds is the server's doing, and an upgrade that changed how ocpc
cuts heads changes the rendered head, which counts. The inputs of FORMAT 3 (paths, sizes,
mtimes, ocpc's version) are kept aside on ``ServerIdentity`` only to find files made before
(``legacy_server_key``, ``legacy_fingerprint``): engine/prepare.py adopts them.

The server flags that count are an allow-list (``KV_FLAGS``), read from llama.cpp's
``common/arg.cpp`` (b11434): a flag outside it (``--port``, ``-t``, ``--host``, logging,
``-np``...) never moves the fingerprint, so moving a server to another port or thread
count keeps its cache. Pure apart from ``stat`` calls and the digests asked of the ``Digests``
passed in: the inputs are gathered in ``server_info``.

The head counts as rendered, not as its parts (tools JSON, system text): the KV holds the
rendered tokens, and a template that leaves tools out (Gemma 3's GGUF template renders none)
gives one head for a parent and a subagent that differ only in tools; fingerprinted by
its tools, each re-prefilled the same tokens (1,885 on Gemma, per subagent).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from oc_prefix_cache.chat.conversation import text_digest
from oc_prefix_cache.chat.head import Head
from oc_prefix_cache.llama.families import CacheFacts

FORMAT = 4  # bump when the fingerprint's inputs change meaning (2: KV flags and LoRA adapters;
#            3: the head as rendered, not its tools and system text; 4: the model, the binary and
#            flag files by content, not path/size/mtime, and no ocpc version: a copy elsewhere, or an
#            upgrade of ocpc, keeps every file)
LEGACY_FORMAT = 3  # the format of the files ocpc made before (``legacy_server_key``)
LEGACY_OCPC = "0.1.0"  # the ocpc version every FORMAT 3 key holds (the one release that wrote them)


class Digests(Protocol):
    """Content digests of files by path (disk/content_digest.py's ``ContentDigests``)."""

    def digest(self, path: str | Path) -> str | None: ...


@dataclass(frozen=True)
class FileIdentity:
    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class ServerIdentity:
    """What the server says about itself, plus the content of the files it runs.

    The fields up to ``lora`` are its identity (``server_key``); the rest describe it (the index
    labels files with the model path and build) or are FORMAT 3's inputs, kept to find files made
    before (``legacy_server_key``): none of them is in the key."""

    model_digest: str  # xxh3_128 of every shard's bytes (comma-separated, in order); "" when not readable here
    build_id: str  # build_info, plus the binary's content digest when the binary is known
    chat_template_digest: str
    n_ctx: int  # per slot
    total_slots: int
    kv_types: str  # cache types when the server reports them, else ""
    cache: CacheFacts  # the model's cache family and the flags that decide what a restore is worth
    # The allow-listed flags in effect (``kv_settings``, file arguments by content); None when the
    # command line is not visible, so such a server can never share a fingerprint with one whose
    # flags are known.
    kv_flags: tuple[str, ...] | None = None
    lora: tuple[str, ...] = ()  # active adapters from GET /lora-adapters (``adapter_settings``)
    # -- not identity: labels, and FORMAT 3's inputs ---------------------------------------
    model_path: str = ""  # as the server reports it (the index's ``model``, status)
    model_files: tuple[FileIdentity, ...] = ()  # FORMAT 3: every shard's name, size and mtime
    build: str = ""  # FORMAT 3: build_info, plus the binary's name/size/mtime (the index's ``server_build``)
    legacy_kv_flags: tuple[str, ...] | None = None  # FORMAT 3: ``kv_flags`` with files by path|size|mtime
    legacy_lora: tuple[str, ...] = ()  # FORMAT 3: ``lora`` likewise


_IDENTITY = (
    "model_digest",
    "build_id",
    "chat_template_digest",
    "n_ctx",
    "kv_types",
    "kv_flags",
    "lora",
)  # total_slots and cache stay out: a file fits any slot of the same n_ctx, and the cache
#    facts are derived from the model and the KV flags, both already covered


@dataclass(frozen=True)
class FingerprintInputs:
    server: ServerIdentity
    harness: str
    head: Head
    rendered_head: str  # the template's rendering of the head: covers template and tool layout
    ocpc_version: str = ""  # not an input since FORMAT 4 (kept for callers that pass it)


def _server_part(server: ServerIdentity) -> dict[str, Any]:
    part = asdict(server)
    return {name: part[name] for name in _IDENTITY}


def server_key(server: ServerIdentity) -> str:
    """The identity a parked conversation or a project head is filed under: everything of
    the server (model content, build, template, n_ctx, KV flags, adapters) that decides what
    a slot file means. A same-shape file from other weights restores silently, so parks are
    only ever looked up under this key (or, for files made before, ``legacy_server_key``)."""
    return text_digest(
        json.dumps({"format": FORMAT, "server": _server_part(server)}, sort_keys=True, ensure_ascii=False)
    )


def fingerprint(inputs: FingerprintInputs) -> str:
    """16 hex digits; stable across processes and machines for the same inputs."""
    payload: dict[str, Any] = {
        "format": FORMAT,
        "server": _server_part(inputs.server),
        "harness": inputs.harness,
        "model_name": inputs.head.model,
        "rendered_head": inputs.rendered_head,  # tools, system text and template, as the KV holds them
    }
    return text_digest(json.dumps(payload, sort_keys=True, ensure_ascii=False))


def _legacy_server_part(server: ServerIdentity) -> dict[str, Any]:
    """FORMAT 3's server part, exactly as that version's ``asdict`` wrote it."""
    return {
        "model_path": server.model_path,
        "model_files": [asdict(f) for f in server.model_files],
        "build": server.build,
        "chat_template_digest": server.chat_template_digest,
        "n_ctx": server.n_ctx,
        "kv_types": server.kv_types,
        "kv_flags": list(server.legacy_kv_flags) if server.legacy_kv_flags is not None else None,
        "lora": list(server.legacy_lora),
    }


def legacy_server_key(server: ServerIdentity) -> str:
    """The key ocpc before FORMAT 4 filed this server's parks and project heads under (model
    path and shard mtimes, the binary's name/size/mtime, flag files by path|size|mtime, ocpc
    0.1.0): where a user's parks from before the upgrade are found, to be adopted."""
    payload = {"format": LEGACY_FORMAT, "server": _legacy_server_part(server), "ocpc": LEGACY_OCPC}
    return text_digest(json.dumps(payload, sort_keys=True, ensure_ascii=False))


def legacy_fingerprint(inputs: FingerprintInputs) -> str:
    """The head fingerprint ocpc before FORMAT 4 named this head's file by (``head-<fp>``)."""
    payload: dict[str, Any] = {
        "format": LEGACY_FORMAT,
        "server": _legacy_server_part(inputs.server),
        "harness": inputs.harness,
        "ocpc": LEGACY_OCPC,
        "model_name": inputs.head.model,
        "rendered_head": inputs.rendered_head,
    }
    return text_digest(json.dumps(payload, sort_keys=True, ensure_ascii=False))


# -- the server flags that change what the KV cache holds ----------------------------------


@dataclass(frozen=True, kw_only=True)
class KvFlag:
    """One llama-server option that changes the KV cache's contents or layout.

    ``kind`` says how its value is read and normalised:
    ``switch`` (no value), ``number``, ``choice``, ``text``, ``pair`` (two values),
    ``files`` (comma-separated files), ``scaled_files`` (``FILE:SCALE,...``).
    ``accumulates``: every occurrence adds to the server's list (adapters, overrides);
    otherwise the last occurrence wins, as llama.cpp's parser does.
    """

    names: tuple[str, ...]  # every spelling; the first is the canonical one
    kind: str
    why: str
    env: str | None = None  # LLAMA_ARG_* variable that sets it too
    accumulates: bool = False
    default: str | None = None  # the b11434 default: giving it explicitly changes nothing

    @property
    def canonical(self) -> str:
        return self.names[0]

    @property
    def nargs(self) -> int:
        return {"switch": 0, "pair": 2}.get(self.kind, 1)


KV_FLAGS: tuple[KvFlag, ...] = (
    KvFlag(
        names=("--cache-type-k", "-ctk"),
        kind="text",
        env="LLAMA_ARG_CACHE_TYPE_K",
        default="f16",
        why="element type of every cached K row: the bytes a slot file holds",
    ),
    KvFlag(
        names=("--cache-type-v", "-ctv"),
        kind="text",
        env="LLAMA_ARG_CACHE_TYPE_V",
        default="f16",
        why="element type of every cached V row",
    ),
    KvFlag(
        names=("--flash-attn", "-fa"),
        kind="choice",
        env="LLAMA_ARG_FLASH_ATTN",
        default="auto",
        why="V is stored transposed without flash attention: another layout, other numerics",
    ),
    KvFlag(
        names=("--swa-full",),
        kind="switch",
        env="LLAMA_ARG_SWA_FULL",
        why="SWA layers keep every token instead of the window: what the cache holds",
    ),
    KvFlag(
        names=("--rope-scaling",),
        kind="text",
        env="LLAMA_ARG_ROPE_SCALING_TYPE",
        why="RoPE scaling method: positions are baked into every cached K",
    ),
    KvFlag(
        names=("--rope-scale",),
        kind="number",
        env="LLAMA_ARG_ROPE_SCALE",
        why="RoPE context scale (sets the frequency scale): cached K values",
    ),
    KvFlag(
        names=("--rope-freq-base",),
        kind="number",
        env="LLAMA_ARG_ROPE_FREQ_BASE",
        why="RoPE base frequency: cached K values",
    ),
    KvFlag(
        names=("--rope-freq-scale",),
        kind="number",
        env="LLAMA_ARG_ROPE_FREQ_SCALE",
        why="RoPE frequency scale: cached K values",
    ),
    KvFlag(
        names=("--yarn-orig-ctx",),
        kind="number",
        env="LLAMA_ARG_YARN_ORIG_CTX",
        why="YaRN original context: RoPE correction, cached K values",
    ),
    KvFlag(
        names=("--yarn-ext-factor",),
        kind="number",
        env="LLAMA_ARG_YARN_EXT_FACTOR",
        why="YaRN extrapolation mix: cached K values",
    ),
    KvFlag(
        names=("--yarn-attn-factor",),
        kind="number",
        env="LLAMA_ARG_YARN_ATTN_FACTOR",
        why="YaRN attention magnitude: every later layer's K/V",
    ),
    KvFlag(
        names=("--yarn-beta-slow",),
        kind="number",
        env="LLAMA_ARG_YARN_BETA_SLOW",
        why="YaRN high correction dim: cached K values",
    ),
    KvFlag(
        names=("--yarn-beta-fast",),
        kind="number",
        env="LLAMA_ARG_YARN_BETA_FAST",
        why="YaRN low correction dim: cached K values",
    ),
    KvFlag(
        names=("--override-kv",),
        kind="text",
        accumulates=True,
        why="overrides model metadata (RoPE, norms, add_bos...): anything, tokens included",
    ),
    KvFlag(
        names=("--lora",),
        kind="files",
        accumulates=True,
        why="a LoRA adapter changes the attention weights, so every cached K/V",
    ),
    KvFlag(
        names=("--lora-scaled",),
        kind="scaled_files",
        accumulates=True,
        why="a LoRA adapter and its scale: every cached K/V",
    ),
    KvFlag(
        names=("--lora-init-without-apply",),
        kind="switch",
        why="adapters load at scale 0 (until POST /lora-adapters): which adapters act",
    ),
    KvFlag(
        names=("--control-vector",),
        kind="files",
        accumulates=True,
        why="added to the hidden state of every layer it covers: later layers' K/V",
    ),
    KvFlag(
        names=("--control-vector-scaled",),
        kind="scaled_files",
        accumulates=True,
        why="a control vector and its scale: later layers' K/V",
    ),
    KvFlag(names=("--control-vector-layer-range",), kind="pair", why="which layers the control vectors touch"),
)

_BY_SPELLING: dict[str, KvFlag] = {name: flag for flag in KV_FLAGS for name in flag.names}
_BY_ENV: dict[str, KvFlag] = {flag.env: flag for flag in KV_FLAGS if flag.env}


def kv_flag_for(spelling: str) -> KvFlag | None:
    """The allow-listed flag an argument names (``--x=V``, ``--x_y`` and short forms too)."""
    key = spelling.partition("=")[0] if spelling.startswith("--") else spelling
    if key.startswith("--"):
        key = key.replace("_", "-")  # llama.cpp accepts --rope_freq_base for --rope-freq-base
    return _BY_SPELLING.get(key)


def kv_flag_for_env(name: str) -> KvFlag | None:
    return _BY_ENV.get(name)


def kv_settings(argv: Sequence[str], *, digests: Digests | None = None) -> tuple[str, ...]:
    """The allow-listed flags in ``argv`` (argv[0] is the binary), normalised and sorted.

    ``-ctk q8_0`` and ``--cache-type-k=q8_0`` give the same ``--cache-type-k=q8_0``; a
    value equal to the build's default is dropped; a file argument is named by its content
    (``file_token``: a retrained adapter under the same name is another adapter, a copy of it
    elsewhere the same). Every other flag is ignored, so it cannot move the fingerprint.
    """
    values: dict[str, list[str]] = {}
    args = list(argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        flag = kv_flag_for(arg) if arg.startswith("-") else None
        if flag is None:
            continue
        given: list[str]
        if arg.startswith("--") and "=" in arg:
            given = [arg.split("=", 1)[1]]
        else:
            given, i = args[i : i + flag.nargs], i + flag.nargs  # llama.cpp takes the next ones as they are
        if len(given) < flag.nargs:
            continue  # the server itself refuses to start on this
        value = _normalise(flag, given, digests)
        if flag.accumulates:
            values.setdefault(flag.canonical, []).append(value)
        else:
            values[flag.canonical] = [value]
    out = []
    for name in sorted(values):
        flag = _BY_SPELLING[name]
        out += [f"{name}={v}" for v in values[name] if v != flag.default]
    return tuple(out)


def _normalise(flag: KvFlag, given: list[str], digests: Digests | None) -> str:
    if flag.kind == "switch":
        return "on"
    if flag.kind == "pair":
        return " ".join(given)
    value = given[0]
    if flag.kind == "number":
        return _number(value)
    if flag.kind == "choice":
        return _choice(value)
    if flag.kind == "files":
        return ",".join(file_token(item, digests) for item in _csv(value))
    if flag.kind == "scaled_files":
        return ",".join(_scaled_file(item, digests) for item in _csv(value))
    return value


def _scaled_file(item: str, digests: Digests | None) -> str:
    path, colon, scale = item.rpartition(":")
    return f"{file_token(path, digests)}:{_number(scale)}" if colon else item


def _number(value: str) -> str:
    try:
        return repr(float(value))  # 10000, 10000.0 and 1e4 are one value
    except ValueError:
        return value


def _choice(value: str) -> str:
    """llama.cpp's truthy/falsey/auto spellings, as one word each."""
    lowered = value.lower()
    if lowered in ("on", "enabled", "true", "1"):
        return "on"
    if lowered in ("off", "disabled", "false", "0"):
        return "off"
    if lowered in ("auto", "-1"):
        return "auto"
    return value


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def file_token(path: str, digests: Digests | None = None) -> str:
    """A file argument as the fingerprint sees it: ``xxh3:<its content digest>``, wherever it
    lies. Without ``digests`` (``ocpc status`` and ``doctor`` show flags without reading files;
    FORMAT 3's key): its path, size and mtime, as before."""
    if digests is not None:
        found = digests.digest(path)
        return f"xxh3:{found}" if found else f"{path}|unreadable"
    try:
        stat = Path(path).stat()
    except OSError:
        return f"{path}|unreadable"
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def adapter_settings(adapters: Sequence[Mapping[str, Any]], *, digests: Digests | None = None) -> tuple[str, ...]:
    """The active LoRA adapters of ``GET /lora-adapters``: id, the file (``file_token``) and scale.

    An adapter at scale 0 does nothing (``--lora-init-without-apply`` loads them so), so
    only active ones count; ``POST /lora-adapters`` changing a scale moves the fingerprint.
    """
    out = []
    for item in adapters:
        try:
            scale = float(item.get("scale") or 0.0)
        except (TypeError, ValueError):
            scale = float("nan")  # unreadable: count it, never silently equal
        if scale == 0.0:
            continue
        path = str(item.get("path") or "")
        out.append(f"{item.get('id')}={file_token(path, digests)}:{scale!r}")
    return tuple(out)


_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def model_shards(model_path: str) -> list[Path]:
    """The model file, or every shard of a split GGUF (``-00001-of-00003.gguf``), in order."""
    path = Path(model_path)
    match = _SHARD_RE.match(path.name)
    if match:
        n = int(match.group("n"))
        return [path.with_name(f"{match.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    return [path]


def model_digest(model_path: str, digests: Digests) -> str:
    """The content of the model: every shard's digest, in order; "" when any shard cannot be read
    here (no identity: ocpc then keeps no files for it)."""
    found = [digests.digest(shard) for shard in model_shards(model_path)]
    return ",".join(d for d in found if d) if all(found) else ""


def model_file_identities(model_path: str) -> tuple[FileIdentity, ...]:
    """Name, size and mtime of the model file, or of every shard of a split GGUF (FORMAT 3's)."""
    out = []
    for shard in model_shards(model_path):
        try:
            stat = shard.stat()
        except OSError:
            return ()
        out.append(FileIdentity(name=shard.name, size=stat.st_size, mtime_ns=stat.st_mtime_ns))
    return tuple(out)


def build_id(build_info: str, binary: Path | None, digests: Digests | None) -> str:
    """The server build as identity: its build string, plus the binary's content digest when the
    binary is known (``ocpc launch`` knows it, /proc shows it): a copy of the binary elsewhere is the
    same build, a rebuild another. Builds from an sdist report ``b0-unknown``, so the string alone
    cannot tell two builds apart."""
    if binary is None or digests is None:
        return build_info
    found = digests.digest(binary)
    return f"{build_info}|xxh3:{found}" if found else build_info


def build_identity(build_info: str, binary: Path | None) -> str:
    """The server build as a label (the index's ``server_build``) and FORMAT 3's identity: its
    build string, plus the binary's name, size and mtime when we know it.

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
