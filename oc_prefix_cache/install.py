"""``ocpc install`` / ``ocpc uninstall``: wire the plugin into OpenCode's config, reversibly.

Install edits the user's config as text (jsonc), inserting three things at most: the
plugin's ``file://`` URL in ``plugin``, a provider for the llama-server when none points
at it, and ``agent.title.disable`` (OpenCode's title request would otherwise take the
slot just before every first request). It backs up the original first and records what
it inserted, so uninstall restores the file byte for byte, or, if the user edited it
since, removes exactly our snippets and nothing else. A symlinked config is edited behind
its link, keeping the file's mode. The npm files that the SDK pre-install created are
recorded with digests, so uninstall removes those, and only while they are unchanged.

The plugin it copies is the package's own (``oc_prefix_cache/shipped/`` in a wheel, put
there by the build from ``plugin-js/``), or ``plugin-js/`` itself in a source checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from . import jsonc
from .errors import OcpcError
from .files import write_atomic
from .settings import Settings

PLUGIN_NAME = "ocpc-plugin.js"
SOURCE_TREE_PLUGIN = Path(__file__).resolve().parent.parent / "plugin-js" / PLUGIN_NAME
PLUGIN_VERSION_RE = re.compile(r'OCPC_PLUGIN_VERSION = "([^"]+)"')
CONTEXT_LIMIT = 32768  # OpenCode wants both limits when one is set; the tiny models' context
NPM_MANIFESTS = ("package.json", "package-lock.json")


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
    # What the @opencode-ai/plugin pre-install created in the config's folder (asdict of
    # NpmEntry), and package-lock.json's digest right after: a later npm run changes it.
    npm_folder: str | None = None
    npm_created: list[dict[str, Any]] = field(default_factory=list)
    npm_lock_sha256: str | None = None


@dataclass(frozen=True)
class NpmEntry:
    """One thing npm (or install) created: a manifest, a node_modules package, a .bin link,
    or a folder that held none of the user's files before (``folder``: removed when empty)."""

    path: str  # relative to the config's folder
    kind: str  # file | dir | link | folder
    sha256: str | None  # of the content (a dir: its whole tree); None for a folder


@dataclass(frozen=True)
class NpmRecord:
    folder: Path
    created: list[NpmEntry]
    lock_sha256: str | None


@dataclass(frozen=True)
class PluginCopy:
    """The plugin this ocpc installs, and where it was found."""

    where: str
    data: bytes

    @property
    def version(self) -> str | None:
        return plugin_version(self.data)


@dataclass(frozen=True)
class PluginState:
    """The installed plugin copy against this package's: ``problem`` is None when they match."""

    installed: Path
    installed_version: str | None
    package_version: str | None
    problem: str | None


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
    target = config_target(config_path)
    existed = target.exists()
    original = target.read_bytes() if existed else b""
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
        _write_keeping_mode(target, new_text.encode())
        record = InstallRecord(str(config_path), existed, str(backup) if backup else None,
                               hashlib.sha256(new_text.encode()).hexdigest(),
                               [asdict(i) for i in insertions])
        _save_record(settings, record)
        behind = f" (behind the link {config_path})" if target != config_path else ""
        said += [e.says for e in edits] + [f"wrote {target}{behind}" + (f" (backup: {backup})" if backup else "")]
    if opencode_version:
        npm_said, npm = _preinstall_plugin_sdk(config_path.parent, opencode_version)
        said += npm_said
        if npm is not None and npm.created:
            _record_npm(settings, config_path, npm)
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
    said = _restore_config(record, config_path)
    if record.npm_folder and record.npm_created:
        said += _remove_npm_files(Path(record.npm_folder), [NpmEntry(**e) for e in record.npm_created],
                                  record.npm_lock_sha256)
    del records[str(config_path)]
    write_atomic(_records_path(settings), json.dumps(records, indent=1).encode())
    return said


def _restore_config(record: InstallRecord, config_path: Path) -> list[str]:
    """Put the config back: the backup, or no file, or the current text minus our snippets."""
    target = config_target(config_path)
    if not target.exists():  # deleted since: there is nothing of ours left to take out
        if not record.existed:
            return [f"{config_path} is gone already (ocpc had created it); nothing to restore"]
        return [f"{config_path} is gone (deleted since install); wrote nothing"
                + (f"; the original is still in {record.backup}" if record.backup else "")]
    current = target.read_bytes()
    if record.restorable and hashlib.sha256(current).hexdigest() == record.written_sha256:
        if record.existed and record.backup:
            _write_keeping_mode(target, Path(record.backup).read_bytes())
            return [f"restored {target} from {record.backup}"]
        if record.existed:  # only the npm files were ours: the config is the user's as it is
            return []
        target.unlink()
        return [f"removed {target} (ocpc had created it)"]
    if not record.insertions:
        return []
    text = _without_insertions(current, record, config_path)
    _write_keeping_mode(target, text.encode())
    return [f"removed ocpc's entries from {target}; your later edits are kept"]


def config_target(config_path: Path) -> Path:
    """The file to read and write: behind a symlink (dotfile managers use them), the link's
    target, so the link survives; a link to a missing folder is refused rather than followed."""
    if not config_path.is_symlink():
        return config_path
    target = Path(os.path.realpath(config_path))
    if not target.parent.is_dir():
        raise InstallError(f"{config_path} links to {target}, whose folder is missing; fix or remove the link")
    return target


def _write_keeping_mode(path: Path, data: bytes) -> None:
    """Write atomically, keeping an existing file's mode and (when allowed) its owner:
    a 0644 config stays 0644, and root editing a user's config leaves it the user's."""
    try:
        before = path.stat()
    except FileNotFoundError:
        write_atomic(path, data)
        return
    write_atomic(path, data)
    os.chmod(path, before.st_mode & 0o7777)
    after = path.stat()
    if (after.st_uid, after.st_gid) != (before.st_uid, before.st_gid):
        try:
            os.chown(path, before.st_uid, before.st_gid)
        except PermissionError:
            pass  # only root can give a file away; then it was ours to begin with


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


def plugin_version(data: bytes) -> str | None:
    """The ``OCPC_PLUGIN_VERSION`` a plugin copy declares; None for copies from before it had one."""
    match = PLUGIN_VERSION_RE.search(data.decode("utf-8", errors="replace"))
    return match.group(1) if match else None


def packaged_plugin() -> PluginCopy:
    """The plugin this ocpc installs: the wheel's copy (importlib.resources), else the
    checkout's plugin-js/ (an editable or source-tree install, where the build copied nothing)."""
    shipped = resources.files("oc_prefix_cache").joinpath("shipped").joinpath(PLUGIN_NAME)
    if shipped.is_file():
        return PluginCopy(str(shipped), shipped.read_bytes())
    if SOURCE_TREE_PLUGIN.is_file():
        return PluginCopy(str(SOURCE_TREE_PLUGIN), SOURCE_TREE_PLUGIN.read_bytes())
    raise InstallError(f"this ocpc carries no plugin (looked for {shipped} and {SOURCE_TREE_PLUGIN}); "
                       "reinstall ocpc from its wheel or a full checkout")


def installed_plugin_path(settings: Settings) -> Path:
    return settings.home / "plugin" / PLUGIN_NAME


def plugin_path_in_config(text: str) -> Path | None:
    """The ocpc plugin file a config loads (its ``file://`` URL), when it names one."""
    match = re.search(r'"(file://[^"]*/' + re.escape(PLUGIN_NAME) + r')"', text)
    return Path(unquote(urlparse(match.group(1)).path)) if match else None


def installed_plugin_state(settings: Settings, installed: Path | None = None) -> PluginState:
    """Compare the copy OpenCode loads with this package's: OpenCode keeps running an old
    copy after ocpc is upgraded until `ocpc install` copies the new one."""
    path = installed or installed_plugin_path(settings)
    package = packaged_plugin()
    try:
        data = path.read_bytes()
    except OSError:
        return PluginState(path, None, package.version, f"the plugin file {path} is missing")
    state = PluginState(path, plugin_version(data), package.version, None)
    if data == package.data:
        return state
    mine, theirs = _version_key(state.installed_version), _version_key(state.package_version)
    if mine is not None and theirs is not None and mine < theirs:
        problem = (f"the installed plugin {path} is {state.installed_version}, older than this ocpc's "
                   f"{state.package_version}")
    elif mine is not None and theirs is not None and mine > theirs:
        problem = (f"the installed plugin {path} is {state.installed_version}, newer than this ocpc's "
                   f"{state.package_version} (a newer ocpc installed it?)")
    else:
        problem = (f"the installed plugin {path} ({state.installed_version or 'no version'}) differs from "
                   f"this ocpc's copy ({state.package_version or 'no version'})")
    return PluginState(path, state.installed_version, state.package_version, problem)


def _version_key(version: str | None) -> tuple[int, ...] | None:
    """``1.2.3`` -> (1, 2, 3), for ordering; None when it is not dotted numbers."""
    if version is None or not re.fullmatch(r"\d+(\.\d+)*", version):
        return None
    return tuple(int(part) for part in version.split("."))


def _install_plugin_files(settings: Settings, base_url: str, said: list[str]) -> Path:
    """The plugin and the settings it reads, in ocpc's own folder (not the user's config)."""
    plugin = packaged_plugin()
    target = installed_plugin_path(settings)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() or target.read_bytes() != plugin.data:
        write_atomic(target, plugin.data)
        said.append(f"copied the plugin{f' {plugin.version}' if plugin.version else ''} to {target}")
    plugin_settings = {"daemonUrl": settings.daemon_url, "baseURL": normalise_base_url(base_url),
                       "logFile": str(settings.log_dir / "plugin.jsonl")}
    settings_path = target.parent / "ocpc-plugin.json"
    data = (json.dumps(plugin_settings, indent=2) + "\n").encode()
    if not settings_path.exists() or settings_path.read_bytes() != data:
        write_atomic(settings_path, data)
        said.append(f"wrote {settings_path} (daemon {settings.daemon_url}, server {base_url})")
    return target


def _preinstall_plugin_sdk(folder: Path, version: str) -> tuple[list[str], NpmRecord | None]:
    """Install @opencode-ai/plugin now, as OpenCode would at its first start (~20-70 s).

    What the folder held before is listed first, so the record names only what this run
    created (with digests): uninstall must never take shared node_modules content.
    """
    if (folder / "node_modules" / "@opencode-ai" / "plugin").is_dir() and (folder / "package-lock.json").exists():
        return [], None
    npm = shutil.which("npm")
    if npm is None:
        return ["npm not found: OpenCode will install @opencode-ai/plugin itself at its first start (slow)"], None
    folder.mkdir(parents=True, exist_ok=True)
    before = _npm_entries(folder)
    package = folder / "package.json"
    if not package.exists():
        manifest = {"dependencies": {"@opencode-ai/plugin": version}}
        write_atomic(package, (json.dumps(manifest, indent=2) + "\n").encode())
    try:
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=folder,
                              capture_output=True, text=True, timeout=600, check=False)
        failure = proc.stderr[-300:] if proc.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = str(exc)
    created = [NpmEntry(path, kind, _digest(folder / path, kind))
               for path, kind in sorted(_npm_entries(folder).items()) if path not in before]
    record = NpmRecord(folder, created, _file_sha256(folder / "package-lock.json"))
    if failure is not None:
        return [f"npm install of @opencode-ai/plugin failed (OpenCode will retry at start): {failure}"], record
    return [f"pre-installed @opencode-ai/plugin@{version} in {folder} (saves OpenCode's first-start install)"], record


def _npm_entries(folder: Path) -> dict[str, str]:
    """npm's things in ``folder``, path -> kind: the manifests, each node_modules package
    (scoped ones one level down), each .bin link, npm's hidden lockfile, and the folders
    holding them. Entries, not files: a package is created, kept or removed whole."""
    entries = {name: _kind(folder / name) for name in NPM_MANIFESTS if os.path.lexists(folder / name)}
    modules = folder / "node_modules"
    if not modules.is_dir() or modules.is_symlink():
        return entries
    entries["node_modules"] = "folder"
    for child in sorted(modules.iterdir()):
        rel = f"node_modules/{child.name}"
        if (child.name.startswith("@") or child.name == ".bin") and child.is_dir() and not child.is_symlink():
            entries[rel] = "folder"
            for grandchild in sorted(child.iterdir()):
                entries[f"{rel}/{grandchild.name}"] = _kind(grandchild)
        else:
            entries[rel] = _kind(child)
    return entries


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "link"
    return "dir" if path.is_dir() else "file"


def _digest(path: Path, kind: str) -> str | None:
    """A file's sha256, a link's target, a package folder's whole tree (names, links and
    contents); None for a container folder, which is judged by being empty instead."""
    if kind == "folder":
        return None
    digest = hashlib.sha256()
    if kind == "link":
        digest.update(b"link:" + os.fsencode(os.readlink(path)))
    elif kind == "file":
        digest.update(path.read_bytes())
    else:
        for sub in sorted(_walk(path)):
            rel = os.fsencode(sub.relative_to(path).as_posix())
            if sub.is_symlink():
                digest.update(b"L" + rel + b"\0" + os.fsencode(os.readlink(sub)) + b"\0")
            elif sub.is_dir():
                digest.update(b"D" + rel + b"\0")
            else:
                digest.update(b"F" + rel + b"\0" + hashlib.sha256(sub.read_bytes()).digest())
    return digest.hexdigest()


def _walk(root: Path) -> list[Path]:
    """Everything under ``root``, never following a symlink."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        found += [base / name for name in dirnames + filenames]
    return found


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _record_npm(settings: Settings, config_path: Path, npm: NpmRecord) -> None:
    """Add the npm files to this config's install record (a bare one when the config needed
    no edit, so `ocpc uninstall` still knows to take them away)."""
    records = _load_records(settings)
    raw = records.get(str(config_path))
    if raw is None:
        target = config_target(config_path)
        current = target.read_bytes() if target.exists() else b""
        raw = asdict(InstallRecord(str(config_path), True, None, hashlib.sha256(current).hexdigest(),
                                   restorable=False))
    created = [asdict(e) for e in npm.created]
    if raw.get("npm_folder") == str(npm.folder):
        created = list(raw.get("npm_created") or []) + created
    raw.update(npm_folder=str(npm.folder), npm_created=created, npm_lock_sha256=npm.lock_sha256)
    records[str(config_path)] = raw
    write_atomic(_records_path(settings), json.dumps(records, indent=1).encode())


def _remove_npm_files(folder: Path, created: list[NpmEntry], lock_sha256: str | None) -> list[str]:
    """Remove what the pre-install created and nobody changed since; say what stays and why.

    A package-lock.json that changed since means npm ran here again and may now rely on
    any of these packages: then everything npm-related stays.
    """
    if lock_sha256 is not None and _file_sha256(folder / "package-lock.json") != lock_sha256:
        return [f"kept the npm files install created in {folder}: package-lock.json changed since install, "
                "so npm may rely on them now (remove them by hand if not)"]
    removed: list[str] = []
    said: list[str] = []
    for entry in created:
        path = _inside(folder, entry.path)
        if entry.kind == "folder" or path is None or not os.path.lexists(path):
            continue
        if _kind(path) != entry.kind or _digest(path, entry.kind) != entry.sha256:
            said.append(f"kept {entry.path} in {folder}: changed since install")
            continue
        if entry.kind == "dir":
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(entry.path)
    for entry in sorted((e for e in created if e.kind == "folder"), key=lambda e: -e.path.count("/")):
        path = _inside(folder, entry.path)
        if path is not None and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    if removed:
        first = ("package.json", "package-lock.json", "node_modules/@opencode-ai/plugin")
        removed.sort(key=lambda rel: (first.index(rel) if rel in first else len(first), rel))
        shown = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        said.insert(0, f"removed the npm files install created in {folder}: {shown}")
    return said


def _inside(folder: Path, rel: str) -> Path | None:
    """``folder/rel`` when ``rel`` stays inside ``folder`` (a damaged record must not aim elsewhere)."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        return None
    path = folder / rel
    try:
        path.parent.resolve().relative_to(folder.resolve())
    except (OSError, ValueError):
        return None
    return path


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
    if previous is not None:
        record.npm_folder = previous.get("npm_folder")
        record.npm_created = previous.get("npm_created") or []
        record.npm_lock_sha256 = previous.get("npm_lock_sha256")
    if previous is not None and previous.get("insertions"):
        # a second install on top: keep the first backup and insertions
        record.backup = previous["backup"]
        record.existed = previous["existed"]
        record.insertions = previous["insertions"] + record.insertions
        record.restorable = False
    records[record.config] = asdict(record)
    write_atomic(_records_path(settings), json.dumps(records, indent=1).encode())
