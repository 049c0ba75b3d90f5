"""``ocpc install`` / ``ocpc uninstall``: wire the plugin into OpenCode's config, reversibly.

Install edits the user's config as text (jsonc), inserting three things at most: the
plugin's ``file://`` URL in ``plugin``, a provider for the llama-server when none points
at it, and ``agent.title.disable`` (OpenCode's title request would otherwise take the
slot just before every first request). It backs up the original first and records what
it inserted, so uninstall restores the file byte for byte, or, if the user edited it
since, removes exactly our snippets and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import jsonc
from .errors import OcpcError
from .files import write_atomic
from .settings import Settings

PLUGIN_SOURCE = Path(__file__).resolve().parent.parent / "plugin-js" / "ocpc-plugin.js"
PLUGIN_NAME = "ocpc-plugin.js"
CONTEXT_LIMIT = 32768  # OpenCode wants both limits when one is set; the tiny models' context


class InstallError(OcpcError):
    """The OpenCode config cannot be changed safely."""


@dataclass(frozen=True)
class Edit:
    path: tuple[str, ...]  # the object to insert into
    key: str
    value: Any
    array: bool  # append ``value`` to the array ``key`` instead of adding a member
    says: str


@dataclass
class InstallRecord:
    config: str
    existed: bool
    backup: str | None
    written_sha256: str
    insertions: list[dict[str, Any]] = field(default_factory=list)
    # The backup is the whole truth only after a single install: a second install on top
    # may follow edits of the user's, which restoring the first backup would lose.
    restorable: bool = True


def normalise_base_url(url: str) -> str:
    """``http://localhost:8080/v1/`` and ``http://127.0.0.1:8080`` are the same server."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    name, colon, port = host.lower().partition(":")
    host = ("127.0.0.1" if name == "localhost" else name) + colon + port
    return f"{scheme.lower()}://{host}{slash}{path}".rstrip("/")


def default_config_path(*, project: bool, cwd: Path, xdg_config_home: Path) -> Path:
    folder = cwd / ".opencode" if project else xdg_config_home / "opencode"
    jsonc_path = folder / "opencode.jsonc"
    return jsonc_path if jsonc_path.exists() else folder / "opencode.json"


def plan_edits(config: dict[str, Any], *, plugin_url: str, base_url: str, provider_id: str,
               model: str, keep_title: bool, output_limit: int | None = None) -> list[Edit]:
    """What install must insert into ``config``: the pure decision, tested on its own."""
    edits: list[Edit] = []
    plugins = config.get("plugin")
    if not isinstance(plugins, list) or plugin_url not in plugins:
        if isinstance(plugins, list):
            edits.append(Edit((), "plugin", plugin_url, True, f"added the plugin {plugin_url}"))
        else:
            edits.append(Edit((), "plugin", [plugin_url], False, f"added the plugin {plugin_url}"))
    providers = config.get("provider") if isinstance(config.get("provider"), dict) else None
    if matching_provider(config, base_url) is None:
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "llama.cpp (ocpc)",
            "options": {"baseURL": normalise_base_url(base_url) + "/v1"},
            "models": {model: {"name": model} | (
                {"limit": {"context": CONTEXT_LIMIT, "output": output_limit}} if output_limit else {})},
        }
        if providers is None:
            edits.append(Edit((), "provider", {provider_id: provider}, False,
                              f"added provider '{provider_id}' for {base_url}"))
        elif provider_id in providers:
            raise InstallError(f"provider '{provider_id}' exists and points elsewhere; pick --provider-id")
        else:
            edits.append(Edit(("provider",), provider_id, provider, False,
                              f"added provider '{provider_id}' for {base_url}"))
    if not keep_title and not config.get("small_model"):
        agent = config.get("agent")
        if agent is None:
            edits.append(Edit((), "agent", {"title": {"disable": True}}, False,
                              "disabled the title request (it would take the slot before each first request)"))
        elif isinstance(agent, dict) and "title" not in agent:
            edits.append(Edit(("agent",), "title", {"disable": True}, False,
                              "disabled the title request (it would take the slot before each first request)"))
    return edits


def matching_provider(config: dict[str, Any], base_url: str) -> str | None:
    providers = config.get("provider")
    if not isinstance(providers, dict):
        return None
    want = normalise_base_url(base_url)
    for pid, provider in providers.items():
        options = provider.get("options") if isinstance(provider, dict) else None
        url = options.get("baseURL") if isinstance(options, dict) else None
        if isinstance(url, str) and normalise_base_url(url) == want:
            return str(pid)
    return None


def install(settings: Settings, *, config_path: Path, base_url: str, provider_id: str, model: str,
            keep_title: bool = False, opencode_version: str | None = None,
            output_limit: int | None = None) -> list[str]:
    """Install; returns one line per change (empty when there was nothing to do)."""
    said: list[str] = []
    plugin_path = _install_plugin_files(settings, base_url, said)
    existed = config_path.exists()
    original = config_path.read_bytes() if existed else b""
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InstallError(f"{config_path} is not UTF-8 text; not touching it") from exc
    config = jsonc.loads(text)
    if not isinstance(config, dict):
        raise InstallError(f"{config_path} is not a JSON object; not touching it")
    edits = plan_edits(config, plugin_url=plugin_path.as_uri(), base_url=base_url,
                       provider_id=provider_id, model=model, keep_title=keep_title, output_limit=output_limit)
    if edits:
        new_text, insertions = _apply(text if text.strip() else "{\n}\n", edits)
        jsonc.loads(new_text)  # never write what we could not read back
        _load_records(settings)  # a damaged record file stops us before the config is touched
        backup = _backup(settings, config_path, original) if existed else None
        write_atomic(config_path, new_text.encode())
        record = InstallRecord(str(config_path), existed, str(backup) if backup else None,
                               hashlib.sha256(new_text.encode()).hexdigest(),
                               [asdict(i) for i in insertions])
        _save_record(settings, record)
        said += [e.says for e in edits] + [f"wrote {config_path}" + (f" (backup: {backup})" if backup else "")]
    if opencode_version:
        said += _preinstall_plugin_sdk(config_path.parent, opencode_version)
    return said


def uninstall(settings: Settings, *, config_path: Path) -> list[str]:
    records = _load_records(settings)
    raw = records.get(str(config_path))
    if raw is None:
        raise InstallError(f"ocpc has no record of installing into {config_path}")
    try:
        record = InstallRecord(**raw)
    except TypeError as exc:
        raise InstallError(f"{_records_path(settings)} is damaged ({exc}); fix or remove it") from exc
    current = config_path.read_bytes() if config_path.exists() else b""
    if record.restorable and hashlib.sha256(current).hexdigest() == record.written_sha256:
        if record.existed and record.backup:
            write_atomic(config_path, Path(record.backup).read_bytes())
            said = [f"restored {config_path} from {record.backup}"]
        else:
            config_path.unlink()
            said = [f"removed {config_path} (ocpc had created it)"]
    else:
        text = _without_insertions(current, record, config_path)
        write_atomic(config_path, text.encode())
        said = [f"removed ocpc's entries from {config_path}; your later edits are kept"]
    del records[str(config_path)]
    write_atomic(_records_path(settings), json.dumps(records, indent=1).encode())
    return said


def _without_insertions(current: bytes, record: InstallRecord, config_path: Path) -> str:
    """The config minus exactly ocpc's snippets, checked to still be valid JSON(C)."""
    by_hand = f"{config_path} changed where ocpc wrote; restore it by hand" + (
        f" (the original is in {record.backup})" if record.backup else "")
    try:
        text = current.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InstallError(f"{config_path} is no longer UTF-8 text; {by_hand}") from exc
    for raw_insertion in reversed(record.insertions):
        out = jsonc.remove(text, jsonc.Insertion(**raw_insertion))
        if out is None:
            raise InstallError(by_hand)
        text = out
    try:
        jsonc.loads(text)
    except jsonc.JsoncError as exc:
        raise InstallError(f"removing ocpc's entries would leave invalid JSON ({exc}); {by_hand}") from exc
    return text


def _apply(text: str, edits: list[Edit]) -> tuple[str, list[jsonc.Insertion]]:
    insertions = []
    for edit in edits:
        if edit.array:
            text, insertion = jsonc.append_to_array(text, edit.path, edit.key, edit.value)
        else:
            text, insertion = jsonc.insert_member(text, edit.path, edit.key, edit.value)
        insertions.append(insertion)
    return text, insertions


def _install_plugin_files(settings: Settings, base_url: str, said: list[str]) -> Path:
    """The plugin and the settings it reads, in ocpc's own folder (not the user's config)."""
    if not PLUGIN_SOURCE.is_file():
        raise InstallError(f"the plugin is missing at {PLUGIN_SOURCE}; install ocpc from its source tree")
    folder = settings.home / "plugin"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / PLUGIN_NAME
    source = PLUGIN_SOURCE.read_bytes()
    if not target.exists() or target.read_bytes() != source:
        write_atomic(target, source)
        said.append(f"copied the plugin to {target}")
    plugin_settings = {"daemonUrl": settings.daemon_url, "baseURL": normalise_base_url(base_url),
                       "logFile": str(settings.log_dir / "plugin.jsonl")}
    settings_path = folder / "ocpc-plugin.json"
    data = (json.dumps(plugin_settings, indent=2) + "\n").encode()
    if not settings_path.exists() or settings_path.read_bytes() != data:
        write_atomic(settings_path, data)
        said.append(f"wrote {settings_path} (daemon {settings.daemon_url}, server {base_url})")
    return target


def _preinstall_plugin_sdk(folder: Path, version: str) -> list[str]:
    """Install @opencode-ai/plugin now, as OpenCode would at its first start (~20-70 s)."""
    if (folder / "node_modules" / "@opencode-ai" / "plugin").is_dir() and (folder / "package-lock.json").exists():
        return []
    npm = shutil.which("npm")
    if npm is None:
        return ["npm not found: OpenCode will install @opencode-ai/plugin itself at its first start (slow)"]
    package = folder / "package.json"
    if not package.exists():
        write_atomic(package, (json.dumps({"dependencies": {"@opencode-ai/plugin": version}}, indent=2) + "\n").encode())
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=folder,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        return [f"npm install of @opencode-ai/plugin failed (OpenCode will retry at start): {proc.stderr[-300:]}"]
    return [f"pre-installed @opencode-ai/plugin@{version} in {folder} (saves OpenCode's first-start install)"]


def _backup(settings: Settings, config_path: Path, original: bytes) -> Path:
    folder = settings.home / "backups"
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{config_path.name}.{time.strftime('%Y%m%d-%H%M%S')}.", dir=folder)
    with os.fdopen(fd, "wb") as out:
        out.write(original)
    return Path(name)


def _records_path(settings: Settings) -> Path:
    return settings.home / "install.json"


def _load_records(settings: Settings) -> dict[str, dict[str, Any]]:
    path = _records_path(settings)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise InstallError(f"{path} is damaged ({exc}); fix or remove it") from exc
    return data if isinstance(data, dict) else {}


def _save_record(settings: Settings, record: InstallRecord) -> None:
    records = _load_records(settings)
    previous = records.get(record.config)
    if previous is not None:  # a second install on top: keep the first backup and insertions
        record.backup = previous["backup"]
        record.existed = previous["existed"]
        record.insertions = previous["insertions"] + record.insertions
        record.restorable = False
    records[record.config] = asdict(record)
    write_atomic(_records_path(settings), json.dumps(records, indent=1).encode())

