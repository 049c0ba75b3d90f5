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
- ``CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system,-per_turn_effort``: tells Claude Code that the
  model takes no ``role: "system"`` entries inside ``messages`` (true of llama-server's templates:
  the Qwen3.5 one refuses them with HTTP 500). Without system turns, Claude Code lays the prompt
  out as it does for such a model of its own: the environment, model name, deferred tools, agent
  types, skills, git status and date come as ``<system-reminder>`` blocks *before* the typed text,
  and its harness line and tool descriptions say so, instead of a system turn *after* the typed
  text, which every new session had to process again (measured on 2.1.332: docs/harnesses.md).
  Without per-turn effort, the effort goes only in the body's ``output_config`` (which
  llama-server ignores), not also in an empty system entry after the typed text (sent for models
  Claude Code knows, such as its default model name). A capability list the user already has is
  kept, with ``;-mid_conv_system,-per_turn_effort`` appended (later entries win);
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

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.settings import Settings

HARNESS = "claude-code"
DUMMY_TOKEN = "ocpc-local"
BASE_URL = "ANTHROPIC_BASE_URL"
TOKEN_KEYS = ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY")
# Values Claude Code 2.1.332 was seen to honour for these switches (a user's own spelling stays).
TRUE_VALUES = frozenset({"1", "true", "yes"})
FALSE_VALUES = frozenset({"0", "false", "no"})
CAPABILITIES = "CLAUDE_CODE_MODEL_CAPABILITIES"
# Claude Code's capabilities that put role:"system" entries inside messages: system turns (the
# environment, agent lists, tool changes) and per-turn effort statements (an empty system entry
# carrying ``output_config``, sent for models Claude Code knows to take them)
SYSTEM_ENTRIES = ("mid_conv_system", "per_turn_effort")
NO_SYSTEM_ENTRIES = ",".join(f"-{name}" for name in SYSTEM_ENTRIES)


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
        (
            CAPABILITIES,
            capabilities_without_system_turns(env.get(CAPABILITIES)),
            "no system turns inside messages: the environment, skills and git status come before the typed "
            "text as <system-reminder> blocks, so a new session in a project processes only its own text",
        ),
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
        edits.append(
            Edit(
                (),
                "env",
                block,
                "added Claude Code's env block:" + "".join(f"\n  {k}={v}: {why}" for k, v, why in missing),
                container=True,
            )
        )
    else:
        edits += [Edit(("env",), k, v, f"set env {k}={v} ({why})") for k, v, why in reversed(missing)]
    for key, value, why in wanted:
        if key in env and not _same(key, env[key], value):
            edits.append(
                Edit(
                    ("env",),
                    key,
                    value,
                    f"replaced your env {key}={env[key]!r} with {value!r} ({why}); "
                    f"`ocpc uninstall --harness {HARNESS}` puts yours back",
                    kind="replace",
                )
            )
    return edits


def _same(key: str, current: Any, wanted: str) -> bool:
    """Whether the user's value already does what ours would."""
    if not isinstance(current, str):
        return False
    if key == BASE_URL:
        return normalise_base_url(current) == normalise_base_url(wanted)
    if key == CAPABILITIES:
        return system_turns_off(current)
    if wanted in TRUE_VALUES:
        return current.strip().lower() in TRUE_VALUES
    if wanted in FALSE_VALUES:
        return current.strip().lower() in FALSE_VALUES
    return current == wanted


def capabilities_without_system_turns(current: Any) -> str:
    """The value for ``CLAUDE_CODE_MODEL_CAPABILITIES``: the user's list, kept, with system entries
    off for every model (an entry without ``model=`` applies to all; a later entry wins)."""
    if not isinstance(current, str) or not current.strip():
        return NO_SYSTEM_ENTRIES
    if system_turns_off(current):
        return current
    return f"{current.strip().rstrip(';')};{NO_SYSTEM_ENTRIES}"


def system_turns_off(value: str) -> bool:
    """Whether a capability list turns both kinds of system entries off for every model, read as
    Claude Code 2.1.332 reads it: ``;``-separated entries ``[model[*]=]cap,-cap,...``, later ones
    winning. Off when the last entry for all models that names a capability negates it and no
    later entry for one model turns it back on."""
    off = dict.fromkeys(SYSTEM_ENTRIES, False)
    for entry in value.split(";"):
        model, has_model, caps = entry.partition("=")
        names = [c.strip() for c in (caps if has_model else model).split(",")]
        for name in SYSTEM_ENTRIES:
            if f"-{name}" in names and not has_model:
                off[name] = True
            elif name in names:
                off[name] = False
    return all(off.values())


def install(settings: Settings, *, config_path: Path, model: str | None = None, dry_run: bool = False) -> Said:
    """Point Claude Code at ``settings.proxy_url``; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, model=model)

    said = edit_config(settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, dry_run=dry_run)
    if said:
        said.append(
            f"start the proxy with `ocpc launch` or `ocpc proxy` (it forwards to {settings.base_url}); "
            "a project's .claude/settings(.local).json env still wins over this file"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL a Claude Code settings object sets, if any."""
    env = config.get("env")
    value = env.get(BASE_URL) if isinstance(env, dict) else None
    return value if isinstance(value, str) else None
