"""``ocpc install`` for OpenCode: wire the plugin into its config.

Three things at most go into the config: the plugin's ``file://`` URL in ``plugin``, a
provider for the llama-server when none points at it, and ``agent.title.disable``: OpenCode's
TUI asks the model for a title at each new session's first message, and that request costs the
session more than a few percent of its first turn (``TITLE_COST``, measured in the real TUI by
``bench/title_bench.py``), so install turns it off and says why; ``--keep-title`` keeps it, also
after an install that turned it off. The npm files that the SDK pre-install created are
recorded with the config (see ``npm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oc_prefix_cache.install.npm import preinstall_plugin_sdk, record_npm
from oc_prefix_cache.install.plugin import install_plugin_files
from oc_prefix_cache.install.records import (
    Edit,
    InstallError,
    Said,
    absolute,
    edit_config,
    normalise_base_url,
    withdraw,
)
from oc_prefix_cache.settings import Settings

CONTEXT_LIMIT = 32768  # OpenCode wants both limits when one is set; the tiny models' context
#: What the title request costs a new session, measured with ocpc in OpenCode 1.18.33's TUI on
#: Gemma 3 270M (bench/title_bench.py; docs/performance.md has the tables): what install says
#: when it turns titles off, and when it keeps them.
TITLE_COST = (
    "each new session's title request (~600 prompt tokens and a short reply) held the server 2.1-3.0 s: "
    "with one slot the first request waited up to 1.9 s for it (~12% of the first answer); with two it "
    "ran beside it and the first answer took 18% longer (measured: docs/performance.md)"
)
TITLE_OFF = (
    f"disabled OpenCode's title request (agent.title.disable): {TITLE_COST}; `ocpc install --keep-title` keeps titles"
)
TITLE_KEPT = f"kept OpenCode's title request (--keep-title): {TITLE_COST}"
TITLE_BACK = "took out agent.title.disable, which an earlier `ocpc install` had set (--keep-title)"


def default_config_path(*, project: bool, cwd: Path, xdg_config_home: Path) -> Path:
    folder = cwd / ".opencode" if project else xdg_config_home / "opencode"
    jsonc_path = folder / "opencode.jsonc"
    return jsonc_path if jsonc_path.exists() else folder / "opencode.json"


def plan_edits(
    config: dict[str, Any],
    *,
    plugin_url: str,
    base_url: str,
    provider_id: str,
    model: str,
    keep_title: bool,
    output_limit: int | None = None,
) -> list[Edit]:
    """What install must insert into ``config``: the pure decision, tested on its own."""
    edits: list[Edit] = []
    plugins = config.get("plugin")
    if not isinstance(plugins, list) or plugin_url not in plugins:
        if isinstance(plugins, list):
            edits.append(Edit((), "plugin", plugin_url, f"added the plugin {plugin_url}", kind="append"))
        else:
            edits.append(Edit((), "plugin", [plugin_url], f"added the plugin {plugin_url}"))
    providers = config.get("provider") if isinstance(config.get("provider"), dict) else None
    if matching_provider(config, base_url) is None:
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "llama.cpp (ocpc)",
            "options": {"baseURL": normalise_base_url(base_url) + "/v1"},
            "models": {
                model: {"name": model}
                | ({"limit": {"context": CONTEXT_LIMIT, "output": output_limit}} if output_limit else {})
            },
        }
        if providers is None:
            edits.append(
                Edit((), "provider", {provider_id: provider}, f"added provider '{provider_id}' for {base_url}")
            )
        elif provider_id in providers:
            raise InstallError(f"provider '{provider_id}' exists and points elsewhere; pick --provider-id")
        else:
            edits.append(Edit(("provider",), provider_id, provider, f"added provider '{provider_id}' for {base_url}"))
    if not keep_title and not config.get("small_model"):
        agent = config.get("agent")
        if agent is None:
            edits.append(Edit((), "agent", {"title": {"disable": True}}, TITLE_OFF))
        elif isinstance(agent, dict) and "title" not in agent:
            edits.append(Edit(("agent",), "title", {"disable": True}, TITLE_OFF))
    return edits


def is_title_switch(change: dict[str, Any]) -> bool:
    """A recorded change that is install's title switch, in either shape ``plan_edits`` makes."""
    path, key, value = list(change.get("path") or []), change.get("key"), change.get("value")
    return (path == [] and key == "agent" and value == {"title": {"disable": True}}) or (
        path == ["agent"] and key == "title" and value == {"disable": True}
    )


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


def install(
    settings: Settings,
    *,
    config_path: Path,
    base_url: str,
    provider_id: str,
    model: str,
    keep_title: bool = False,
    opencode_version: str | None = None,
    output_limit: int | None = None,
    dry_run: bool = False,
) -> Said:
    """Install; returns one line per change (empty when there was nothing to do)."""
    config_path = absolute(config_path)  # the npm folder is recorded as its parent
    said: list[str] = []
    plugin_path = install_plugin_files(settings, base_url, said, dry_run=dry_run)

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(
            config,
            plugin_url=plugin_path.as_uri(),
            base_url=base_url,
            provider_id=provider_id,
            model=model,
            keep_title=keep_title,
            output_limit=output_limit,
        )

    if keep_title and not dry_run:  # the user's choice now, over an earlier install's
        taken, lines = withdraw(settings, config_path=config_path, harness="opencode", picks=is_title_switch)
        said += ([TITLE_BACK] if taken else []) + lines
    edited = edit_config(settings, config_path=config_path, harness="opencode", plan=plan, dry_run=dry_run)
    result = Said(said + edited, config=edited.config, diff=edited.diff, dry_run=dry_run)
    if dry_run:
        if opencode_version:
            result.append(f"would pre-install @opencode-ai/plugin@{opencode_version} in {config_path.parent}")
        return result
    if opencode_version:
        npm_said, npm = preinstall_plugin_sdk(config_path.parent, opencode_version)
        result += npm_said
        if npm is not None and npm.created:
            record_npm(settings, config_path, npm)
    return result
