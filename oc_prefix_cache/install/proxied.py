"""The harnesses ``ocpc install`` sends to the proxy: where each reads its config, which of
install's options it takes, and the call that installs it. The command line asks here, so
that a new agent is one entry (and its module), not a branch in every command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from oc_prefix_cache.errors import InstallError
from oc_prefix_cache.install import aider, claude_code, cline, codex, kilo_code, pi, qwen_code
from oc_prefix_cache.install.records import Said
from oc_prefix_cache.settings import Settings


@dataclass(frozen=True)
class Spec:
    """What install takes for one harness (``project``: the config ``--project`` edits, or
    None when the agent reads no per-project file of this kind)."""

    config: str  # where it is, in words, for help and errors
    project: str | None = None
    provider_id: bool = False
    output_limit: bool = False


SPECS: dict[str, Spec] = {
    "claude-code": Spec("~/.claude/settings.json (or $CLAUDE_CONFIG_DIR)", project="./.claude/settings.local.json"),
    "pi": Spec("~/.pi/agent/models.json (or $PI_CODING_AGENT_DIR)", provider_id=True, output_limit=True),
    "kilo-code": Spec("~/.config/kilo/kilo.json", project="./kilo.json", provider_id=True, output_limit=True),
    "codex": Spec("~/.codex/config.toml (or $CODEX_HOME)", provider_id=True),
    "aider": Spec("~/.aider.conf.yml", project="./.aider.conf.yml"),
    "qwen-code": Spec("~/.qwen/settings.json", project="./.qwen/settings.json"),
    "cline": Spec("~/.cline/data/settings/providers.json (or $CLINE_DATA_DIR, $CLINE_DIR)"),
}


def default_path(harness: str, *, project: bool, cwd: Path, home: Path, environ: Mapping[str, str]) -> Path:
    """The config the harness reads (its own variables included), or with ``project`` this
    folder's; a harness without a project file refuses ``--project``."""
    spec = SPECS[harness]
    if project and spec.project is None:
        raise InstallError(f"{harness} reads its config only from {spec.config}; drop --project")
    if harness == "claude-code":
        return claude_code.default_config_path(project=project, cwd=cwd, home=home, environ=environ)
    if harness == "pi":
        return pi.default_config_path(home=home, environ=environ)
    if harness == "kilo-code":
        return kilo_code.default_config_path(project=project, cwd=cwd, home=home, environ=environ)
    if harness == "codex":
        return codex.default_config_path(home=home, environ=environ)
    if harness == "aider":
        return aider.default_config_path(project=project, cwd=cwd, home=home)
    if harness == "qwen-code":
        return qwen_code.default_config_path(project=project, cwd=cwd, home=home)
    return cline.default_config_path(home=home, environ=environ)


def check_options(harness: str, *, provider_id: str | None, output_limit: int | None) -> None:
    spec = SPECS[harness]
    if provider_id and not spec.provider_id:
        raise InstallError(f"{harness} has no provider id to choose; drop --provider-id")
    if output_limit and not spec.output_limit:
        raise InstallError(f"{harness} takes no output limit from ocpc; drop --output-limit")


def install(
    settings: Settings,
    harness: str,
    *,
    config_path: Path,
    model: str | None,
    provider_id: str | None,
    output_limit: int | None,
    environ: Mapping[str, str],
    dry_run: bool,
) -> Said:
    """Wire ``harness`` to ``settings.proxy_url``; one line per change."""
    check_options(harness, provider_id=provider_id, output_limit=output_limit)
    if harness == "claude-code":
        return claude_code.install(settings, config_path=config_path, model=model, dry_run=dry_run)
    if harness == "pi":
        return pi.install(
            settings,
            config_path=config_path,
            provider_id=provider_id or pi.DEFAULT_PROVIDER_ID,
            model=model or "local",
            output_limit=output_limit,
            dry_run=dry_run,
        )
    if harness == "kilo-code":
        return kilo_code.install(
            settings,
            config_path=config_path,
            output_limit=output_limit,
            model=model or "local",
            provider_id=provider_id or kilo_code.DEFAULT_PROVIDER_ID,
            dry_run=dry_run,
        )
    if harness == "codex":
        return codex.install(
            settings,
            config_path=config_path,
            model=model,
            dry_run=dry_run,
            provider_id=provider_id or codex.DEFAULT_PROVIDER_ID,
        )
    if harness == "aider":
        return aider.install(settings, config_path=config_path, model=model, environ=environ, dry_run=dry_run)
    if harness == "qwen-code":
        return qwen_code.install(settings, config_path=config_path, model=model, dry_run=dry_run)
    if harness == "cline":
        return cline.install(settings, config_path=config_path, model=model, dry_run=dry_run)
    raise InstallError(f"{harness} is not a proxy harness")
