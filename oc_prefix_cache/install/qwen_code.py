"""``ocpc install --harness qwen-code``: a model provider in Qwen Code's ``settings.json`` that
goes through the proxy, and Qwen Code set to use it.

Qwen Code (0.24.4) merges ``~/.qwen/settings.json`` (``--project``: ``./.qwen/settings.json``,
which wins) as JSON with comments. Its base URL comes, first match, from the selected model's
``modelProviders`` entry, then ``--openaiBaseUrl``, then ``OPENAI_BASE_URL``, then
``security.auth.baseUrl`` (``resolveModelConfig``): so install adds an entry to
``modelProviders.openai`` (``id`` = ``--model``, default ``local``; ``baseUrl`` = ``<proxy>/v1``;
``envKey: OCPC_API_KEY``), which a shell's ``OPENAI_BASE_URL`` meant for another provider
cannot override, and selects it the way Qwen Code's own ``/model`` does: ``model.name`` and
``model.baseUrl``, with ``security.auth.selectedType: "openai"``. Keys never go in settings in
Qwen Code's design: the entry names a variable, and the ``env`` block (its lowest-priority
defaults) gives it the dummy value. A new file also gets ``$version: 4`` (0.24.4's), else Qwen
Code migrates and rewrites it on its first run.

A value of the user's that differs (another selected auth type or model) is replaced and said;
uninstall puts it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.settings import Settings

HARNESS = "qwen-code"
DEFAULT_MODEL = "local"
KEY_ENV = "OCPC_API_KEY"
DUMMY_KEY = "ocpc-local"
AUTH = "openai"
SETTINGS_VERSION = 4
UNINSTALL = f"`ocpc uninstall --harness {HARNESS}` puts yours back"


def default_config_path(*, project: bool, cwd: Path, home: Path) -> Path:
    return (cwd if project else home) / ".qwen" / "settings.json"


def plan_edits(config: dict[str, Any], *, proxy_url: str, model: str) -> list[Edit]:
    """What install must add to ``settings.json``: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    entry = {"id": model, "name": f"{model} (llama-server through the ocpc proxy)", "baseUrl": base, "envKey": KEY_ENV}
    edits, selected_url = _provider(config, entry)
    edits += _object(config, "env", {KEY_ENV: DUMMY_KEY}, "the dummy key its entry names")
    edits += _nested(config, ("security", "auth"), "selectedType", AUTH, "Qwen Code's OpenAI-compatible protocol")
    edits += _object(config, "model", {"name": model, "baseUrl": selected_url}, "the model Qwen Code uses")
    if not config:
        edits.append(
            Edit(
                (),
                "$version",
                SETTINGS_VERSION,
                f"marked the new file as settings version {SETTINGS_VERSION} (else Qwen Code migrates and rewrites it)",
            )
        )
    return edits


def _provider(config: dict[str, Any], entry: dict[str, str]) -> tuple[list[Edit], str]:
    """The edit that adds the proxy's entry (none when there is one), and the ``baseUrl`` that
    selects it (an existing entry's own spelling: Qwen Code matches it as text)."""
    said = (
        f"added Qwen Code model provider '{entry['id']}' (modelProviders.openai) -> the ocpc proxy {entry['baseUrl']}"
    )
    providers = config.get("modelProviders")
    if providers is None:
        return [Edit((), "modelProviders", {AUTH: [entry]}, said, container=True)], entry["baseUrl"]
    if not isinstance(providers, dict):
        raise InstallError("settings.json's 'modelProviders' is not an object; fix it, then run install again")
    models = providers.get(AUTH)
    if models is None:
        return [Edit(("modelProviders",), AUTH, [entry], said)], entry["baseUrl"]
    if not isinstance(models, list):
        raise InstallError(
            "settings.json's 'modelProviders.openai' is not a list of models; fix it, then run install again"
        )
    for existing in models:
        url = existing.get("baseUrl") if isinstance(existing, dict) else None
        if (
            isinstance(existing, dict)
            and existing.get("id") == entry["id"]
            and isinstance(url, str)
            and normalise_base_url(url) == normalise_base_url(entry["baseUrl"])
        ):
            return [], url
    # prepended: of two entries with one id, Qwen Code takes the first
    return [Edit(("modelProviders",), AUTH, entry, said, kind="append")], entry["baseUrl"]


def _object(config: dict[str, Any], key: str, wanted: dict[str, str], why: str) -> list[Edit]:
    """Members of the top-level object ``key`` (created, ocpc's own, when missing)."""
    current = config.get(key)
    if current is None:
        return [Edit((), key, wanted, f"set {key}: {wanted} ({why})", container=True)]
    if not isinstance(current, dict):
        raise InstallError(f"settings.json's '{key}' is not an object; fix it, then run install again")
    edits: list[Edit] = []
    for sub, value in wanted.items():
        edits += _member(current, (key,), sub, value, why)
    return edits


def _nested(config: dict[str, Any], path: tuple[str, ...], key: str, value: str, why: str) -> list[Edit]:
    node: Any = config
    for depth, part in enumerate(path):
        child = node.get(part)
        if child is None:
            block: Any = {key: value}
            for outer in reversed(path[depth + 1 :]):
                block = {outer: block}
            return [Edit(path[:depth], part, block, f"set {'.'.join((*path, key))}: {value!r} ({why})", container=True)]
        if not isinstance(child, dict):
            raise InstallError(
                f"settings.json's '{'.'.join(path[: depth + 1])}' is not an object; fix it, then run install again"
            )
        node = child
    return _member(node, path, key, value, why)


def _member(node: dict[str, Any], path: tuple[str, ...], key: str, value: str, why: str) -> list[Edit]:
    name = ".".join((*path, key))
    if key not in node:
        return [Edit(path, key, value, f"set {name}: {value!r} ({why})")]
    if node[key] == value:
        return []
    return [
        Edit(
            path, key, value, f"replaced your {name}: {node[key]!r} with {value!r} ({why}); {UNINSTALL}", kind="replace"
        )
    ]


def install(settings: Settings, *, config_path: Path, model: str | None = None, dry_run: bool = False) -> Said:
    """Add the proxy's model and select it; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url
    name = model or DEFAULT_MODEL

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, model=name)

    said = edit_config(settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, dry_run=dry_run)
    if said:
        said.append(
            f"use it: qwen (or qwen -p ...); start the proxy with `ocpc launch` or `ocpc proxy` (it forwards "
            f"to {settings.base_url}); a project's .qwen/settings.json with its own modelProviders replaces "
            "this file's"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL of the model a Qwen Code settings object selects, if it names one."""
    model = config.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    providers = config.get("modelProviders")
    models = providers.get(AUTH) if isinstance(providers, dict) else None
    for entry in models if isinstance(models, list) else []:
        if isinstance(entry, dict) and entry.get("id") == name and isinstance(entry.get("baseUrl"), str):
            return str(entry["baseUrl"])
    return None
