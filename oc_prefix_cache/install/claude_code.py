"""``ocpc install --harness claude-code``: send Claude Code to the ocpc proxy.

Claude Code has no request hook, but it takes its API base URL from the ``env`` block of its
settings file, and that block wins over the shell's environment (checked on 2.1.332: with
``ANTHROPIC_BASE_URL`` exported to one server and set in ``~/.claude/settings.json`` to
another, the request went to the settings' one). Install adds to that block:

- ``ANTHROPIC_BASE_URL``: the proxy (Claude Code then posts ``/v1/messages`` there);
- ``ANTHROPIC_AUTH_TOKEN``: a dummy, only when neither it nor ``ANTHROPIC_API_KEY`` is set
  (without one, ``-p`` asks for a login; with it, no login of the user's goes to the proxy);
- ``CLAUDE_CODE_ATTRIBUTION_HEADER=0``: drops the ``x-anthropic-billing-header`` system block,
  whose fingerprint follows the first prompt's characters, so that sessions share a head;
- ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1``: no ``HEAD /api/hello``, telemetry or registry
  fetches from a local setup;
- ``ANTHROPIC_MODEL``, when ``--model`` names one (otherwise Claude Code sends its default
  model name, which a single-model llama-server ignores).

Every other key stays; a value the user set that differs is replaced only with a line that
says so, and uninstall puts it back. The file is ``$CLAUDE_CONFIG_DIR/settings.json`` when
that variable is set (Claude Code then ignores ``~/.claude``), else ``~/.claude/settings.json``;
a project's ``.claude/settings.json`` and ``.claude/settings.local.json`` win over it
(``--project`` edits the latter, which is not checked in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..settings import Settings
from .records import Edit, InstallError, Said, edit_config, normalise_base_url

HARNESS = "claude-code"
DUMMY_TOKEN = "ocpc-local"
BASE_URL = "ANTHROPIC_BASE_URL"
TOKEN_KEYS = ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY")
# Values Claude Code 2.1.332 was seen to honour for these switches (a user's own spelling stays).
TRUE_VALUES = frozenset({"1", "true", "yes"})
FALSE_VALUES = frozenset({"0", "false", "no"})


def default_config_path(*, project: bool, cwd: Path, home: Path, environ: Mapping[str, str]) -> Path:
    """Where Claude Code reads its user settings (or, with ``project``, this project's own)."""
    if project:
        return cwd / ".claude" / "settings.local.json"
    folder = environ.get("CLAUDE_CONFIG_DIR")
    return (Path(folder) if folder else home / ".claude") / "settings.json"


def plan_edits(config: dict[str, Any], *, proxy_url: str, model: str | None) -> list[Edit]:
    """The ``env`` entries to add or replace: the pure decision, tested on its own."""
    env = config.get("env")
    if env is not None and not isinstance(env, dict):
        raise InstallError("the settings' 'env' is not an object; fix it, then run install again")
    env = env or {}
    base = normalise_base_url(proxy_url)
    wanted: list[tuple[str, str, str]] = [  # key, value, why
        (BASE_URL, base, "Claude Code's requests go to the ocpc proxy"),
        ("CLAUDE_CODE_ATTRIBUTION_HEADER", "0", "no per-prompt billing block, so sessions share the head"),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1", "no telemetry or update checks"),
    ]
    if not any(key in env for key in TOKEN_KEYS):
        wanted.insert(1, ("ANTHROPIC_AUTH_TOKEN", DUMMY_TOKEN, "a dummy token: no login needed"))
    if model:
        wanted.append(("ANTHROPIC_MODEL", model, "the model name sent"))
    missing = [(k, v, why) for k, v, why in wanted if k not in env]
    edits: list[Edit] = []
    if "env" not in config:
        block = {k: v for k, v, _ in missing}
        edits.append(Edit((), "env", block, "added to Claude Code's env: "
                          + ", ".join(f"{k}={v}" for k, v in block.items()), container=True))
    else:
        edits += [Edit(("env",), k, v, f"set env {k}={v} ({why})") for k, v, why in reversed(missing)]
    for key, value, why in wanted:
        if key in env and not _same(key, env[key], value):
            edits.append(Edit(("env",), key, value, f"replaced your env {key}={env[key]!r} with {value!r} ({why}); "
                              f"`ocpc uninstall --harness {HARNESS}` puts yours back", kind="replace"))
    return edits


def _same(key: str, current: Any, wanted: str) -> bool:
    """Whether the user's value already does what ours would."""
    if not isinstance(current, str):
        return False
    if key == BASE_URL:
        return normalise_base_url(current) == normalise_base_url(wanted)
    if wanted in TRUE_VALUES:
        return current.strip().lower() in TRUE_VALUES
    if wanted in FALSE_VALUES:
        return current.strip().lower() in FALSE_VALUES
    return current == wanted


def install(settings: Settings, *, config_path: Path, model: str | None = None, dry_run: bool = False) -> Said:
    """Point Claude Code at ``settings.proxy_url``; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, model=model)

    said = edit_config(settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, dry_run=dry_run)
    if said:
        said.append(f"start the proxy with `ocpc launch` or `ocpc proxy` (it forwards to {settings.base_url}); "
                    "a project's .claude/settings(.local).json env still wins over this file")
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL a Claude Code settings object sets, if any."""
    env = config.get("env")
    value = env.get(BASE_URL) if isinstance(env, dict) else None
    return value if isinstance(value, str) else None
