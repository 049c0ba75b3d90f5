"""The @opencode-ai/plugin pre-install, and taking exactly its files away again.

OpenCode installs the plugin SDK with npm in its config folder at its first start after a
plugin appears (22 s with the registry, a 73 s stall without); ``ocpc install`` does it
up front. What the folder held before is listed first, so the record names only what this
run created, with digests: uninstall removes those, and only while they are unchanged, and
never shared node_modules content.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from oc_prefix_cache.files import write_atomic
from oc_prefix_cache.install.records import InstallRecord, config_target, load_records, write_records
from oc_prefix_cache.settings import Settings

NPM_MANIFESTS = ("package.json", "package-lock.json")


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


def preinstall_plugin_sdk(folder: Path, version: str) -> tuple[list[str], NpmRecord | None]:
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
        proc = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        failure = proc.stderr[-300:] if proc.returncode != 0 else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = str(exc)
    created = [
        NpmEntry(path, kind, _digest(folder / path, kind))
        for path, kind in sorted(_npm_entries(folder).items())
        if path not in before
    ]
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


def record_npm(settings: Settings, config_path: Path, npm: NpmRecord) -> None:
    """Add the npm files to this config's install record (a bare one when the config needed
    no edit, so `ocpc uninstall` still knows to take them away)."""
    records = load_records(settings)
    raw = records.get(str(config_path))
    if raw is None:
        target = config_target(config_path)
        current = target.read_bytes() if target.exists() else b""
        raw = asdict(InstallRecord(str(config_path), True, None, hashlib.sha256(current).hexdigest(), restorable=False))
    created = [asdict(e) for e in npm.created]
    if raw.get("npm_folder") == str(npm.folder):
        created = list(raw.get("npm_created") or []) + created
    raw.update(npm_folder=str(npm.folder), npm_created=created, npm_lock_sha256=npm.lock_sha256)
    records[str(config_path)] = raw
    write_records(settings, records)


def remove_npm_files(folder: Path, created: list[NpmEntry], lock_sha256: str | None) -> list[str]:
    """Remove what the pre-install created and nobody changed since; say what stays and why.

    A package-lock.json that changed since means npm ran here again and may now rely on
    any of these packages: then everything npm-related stays.
    """
    if lock_sha256 is not None and _file_sha256(folder / "package-lock.json") != lock_sha256:
        return [
            f"kept the npm files install created in {folder}: package-lock.json changed since install, "
            "so npm may rely on them now (remove them by hand if not)"
        ]
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
