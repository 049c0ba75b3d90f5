"""``ocpc install`` / ``ocpc uninstall``: wire a harness to ocpc, reversibly.

- OpenCode (``opencode``): the plugin, through OpenCode's config (``opencode.py``);
- Claude Code (``claude_code.py``): the ``env`` block of its settings file -> the proxy;
- pi (``pi.py``): a provider in ``models.json`` -> the proxy, with session-affinity headers;
- Kilo Code (``kilo_code.py``): a provider in ``kilo.json``;
- Codex CLI (``codex.py``): a Responses-API provider in ``config.toml``, selected;
- Aider (``aider.py``): the model and base URL in ``.aider.conf.yml``;
- Qwen Code (``qwen_code.py``): a ``modelProviders`` entry in ``settings.json``, selected;
- Cline CLI (``cline.py``): its OpenAI-compatible provider in ``providers.json``, selected.

Each harness module only plans its entries; ``records.py`` makes every edit the same way
(in the config's format, ``*_format.py``, keeping comments; a backup, a record per config)
and undoes it: the file back byte for byte, or, if the user or the agent edited it since,
exactly ocpc's entries removed. Symlinked
configs are edited behind the link with their mode kept; a config deleted since install is
left deleted. ``npm.py`` is OpenCode's SDK pre-install; ``plugin.py`` the plugin copy.
"""

from __future__ import annotations

from pathlib import Path

from oc_prefix_cache.install.npm import NpmEntry, remove_npm_files
from oc_prefix_cache.install.opencode import default_config_path, install, plan_edits
from oc_prefix_cache.install.plugin import (
    PLUGIN_NAME,
    PluginCopy,
    installed_plugin_state,
    packaged_plugin,
    plugin_path_in_config,
    plugin_version,
)
from oc_prefix_cache.install.records import (
    Edit,
    InstallError,
    InstallRecord,
    Said,
    absolute,
    config_target,
    installed,
    load_records,
    normalise_base_url,
    parse_record,
    restore_config,
    write_records,
)
from oc_prefix_cache.settings import Settings

HARNESSES = ("opencode", "claude-code", "pi", "kilo-code", "codex", "aider", "qwen-code", "cline")

__all__ = [
    "HARNESSES",
    "PLUGIN_NAME",
    "Edit",
    "InstallError",
    "InstallRecord",
    "NpmEntry",
    "PluginCopy",
    "absolute",
    "config_target",
    "default_config_path",
    "install",
    "installed",
    "installed_plugin_state",
    "load_records",
    "normalise_base_url",
    "packaged_plugin",
    "parse_record",
    "plan_edits",
    "plugin_path_in_config",
    "plugin_version",
    "restore_config",
    "Said",
    "uninstall",
    "write_records",
]


def uninstall(settings: Settings, *, config_path: Path, harness: str | None = None) -> list[str]:
    """Undo the install recorded for ``config_path`` (any harness; ``harness`` checks it is
    the one meant): the config, then the npm files it created."""
    config_path = absolute(config_path)
    records = load_records(settings)
    raw = records.get(str(config_path))
    if raw is None:
        what = f" {harness}" if harness else ""
        raise InstallError(
            f"ocpc has no record of installing{what} into {config_path}"
            + ("; give its --config" if harness and harness != "opencode" else "")
        )
    record = parse_record(settings, raw)
    if harness is not None and record.harness != harness:
        raise InstallError(
            f"ocpc installed {record.harness} into {config_path}, not {harness}; "
            f"run `ocpc uninstall --harness {record.harness}`"
        )
    said = restore_config(record, config_path)
    if record.npm_folder and record.npm_created:
        said += remove_npm_files(
            Path(record.npm_folder), [NpmEntry(**e) for e in record.npm_created], record.npm_lock_sha256
        )
    del records[str(config_path)]
    write_records(settings, records)
    return said
