"""The OpenCode plugin this ocpc carries, the copy ``ocpc install`` makes, and how they compare.

The plugin comes from the package (``oc_prefix_cache/shipped/`` in a wheel, put there by
the build from ``plugin-js/``), or ``plugin-js/`` itself in a source checkout. OpenCode
loads the copy in ``$OC_PREFIX_CACHE_HOME/plugin/``, which stays old after an upgrade
until ``ocpc install`` runs again: doctor compares the two.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import unquote, urlparse

from oc_prefix_cache.files import write_private
from oc_prefix_cache.install.records import InstallError, normalise_base_url
from oc_prefix_cache.settings import Settings

PLUGIN_NAME = "ocpc-plugin.js"
SOURCE_TREE_PLUGIN = Path(__file__).resolve().parent.parent.parent / "plugin-js" / PLUGIN_NAME
PLUGIN_VERSION_RE = re.compile(r'OCPC_PLUGIN_VERSION = "([^"]+)"')


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
    raise InstallError(
        f"this ocpc carries no plugin (looked for {shipped} and {SOURCE_TREE_PLUGIN}); "
        "reinstall ocpc from its wheel or a full checkout"
    )


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
        problem = (
            f"the installed plugin {path} is {state.installed_version}, older than this ocpc's {state.package_version}"
        )
    elif mine is not None and theirs is not None and mine > theirs:
        problem = (
            f"the installed plugin {path} is {state.installed_version}, newer than this ocpc's "
            f"{state.package_version} (a newer ocpc installed it?)"
        )
    else:
        problem = (
            f"the installed plugin {path} ({state.installed_version or 'no version'}) differs from "
            f"this ocpc's copy ({state.package_version or 'no version'})"
        )
    return PluginState(path, state.installed_version, state.package_version, problem)


def _version_key(version: str | None) -> tuple[int, ...] | None:
    """``1.2.3`` -> (1, 2, 3), for ordering; None when it is not dotted numbers."""
    if version is None or not re.fullmatch(r"\d+(\.\d+)*", version):
        return None
    return tuple(int(part) for part in version.split("."))


def install_plugin_files(settings: Settings, base_url: str, said: list[str], *, dry_run: bool = False) -> Path:
    """The plugin and the settings it reads, in ocpc's own folder (not the user's config);
    with ``dry_run``, only what would be written is said."""
    plugin = packaged_plugin()
    target = installed_plugin_path(settings)
    would = "would have " if dry_run else ""
    if not target.exists() or target.read_bytes() != plugin.data:
        if not dry_run:
            write_private(target, plugin.data)
        said.append(f"{would}copied the plugin{f' {plugin.version}' if plugin.version else ''} to {target}")
    plugin_settings = {
        "daemonUrl": settings.daemon_url,
        "baseURL": normalise_base_url(base_url),
        "logFile": str(settings.log_dir / "plugin.jsonl"),
    }
    settings_path = target.parent / "ocpc-plugin.json"
    data = (json.dumps(plugin_settings, indent=2) + "\n").encode()
    if not settings_path.exists() or settings_path.read_bytes() != data:
        if not dry_run:
            write_private(settings_path, data)
        said.append(
            f"{would}written {settings_path} (daemon {settings.daemon_url}, server {base_url})"
            if dry_run
            else f"wrote {settings_path} (daemon {settings.daemon_url}, server {base_url})"
        )
    return target
