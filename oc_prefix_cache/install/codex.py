"""``ocpc install --harness codex``: a model provider in Codex CLI's ``config.toml`` that goes
through the proxy, and Codex set to use it.

Codex CLI (0.171.0) reads ``$CODEX_HOME/config.toml`` (default ``~/.codex/config.toml``). It
speaks only the Responses API, so the provider (``--provider-id``, default ``ocpc``) is
``[model_providers.ocpc]`` with ``base_url = "<proxy>/v1"`` and ``wire_api = "responses"``, and
no ``env_key``: the proxy needs no key, and Codex then sends none. Top-level
``model_provider`` selects it; ``model`` (``--model``, default ``local``) is the name Codex
sends and the one it looks its model family up by: an unknown name gets Codex's generic
prompt and plain function tools, which the server's template can render.

A user's own ``model_provider`` is replaced, and said, and uninstall puts it back; a ``model``
of theirs is kept unless ``--model`` names another (say so). A provider of that id pointing
elsewhere is refused. An active ``profile`` that sets its own provider wins over the top level:
install says so, since only the user can choose between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.install.toml_format import TOML
from oc_prefix_cache.settings import Settings

HARNESS = "codex"
DEFAULT_PROVIDER_ID = "ocpc"
DEFAULT_MODEL = "local"
WIRE_API = "responses"
UNINSTALL = f"`ocpc uninstall --harness {HARNESS}` puts yours back"


def default_config_path(*, home: Path, environ: Mapping[str, str]) -> Path:
    folder = environ.get("CODEX_HOME")
    return (Path(folder).expanduser() if folder else home / ".codex") / "config.toml"


def plan_edits(config: dict[str, Any], *, proxy_url: str, provider_id: str, model: str | None) -> list[Edit]:
    """What install must set in ``config.toml``: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    provider = {"name": "ocpc (llama-server through the ocpc proxy)", "base_url": base, "wire_api": WIRE_API}
    providers = config.get("model_providers")
    said = f"added Codex model provider '{provider_id}' -> the ocpc proxy {base} (wire_api = \"{WIRE_API}\")"
    edits: list[Edit] = []
    if providers is None:
        edits.append(Edit((), "model_providers", {provider_id: provider}, said, container=True))
    elif not isinstance(providers, dict):
        raise InstallError("config.toml's 'model_providers' is not a table; fix it, then run install again")
    elif provider_id not in providers:
        edits.append(Edit(("model_providers",), provider_id, provider, said))
    else:
        _check_existing(providers[provider_id], provider_id=provider_id, base=base)
    edits += _top_level(config, "model_provider", provider_id, "Codex uses the proxy's provider", replace=True)
    edits += _top_level(
        config, "model", model or DEFAULT_MODEL, "the model name Codex sends", replace=model is not None
    )
    return edits


def _check_existing(existing: Any, *, provider_id: str, base: str) -> None:
    """A provider of this id exists: fine when it is the proxy's with the Responses API."""
    url = existing.get("base_url") if isinstance(existing, dict) else None
    if not isinstance(url, str) or normalise_base_url(url) != normalise_base_url(base):
        raise InstallError(
            f"Codex model provider '{provider_id}' exists and points at {url or 'no base_url'}, "
            "not the proxy; pick another --provider-id"
        )
    assert isinstance(existing, dict)
    if existing.get("wire_api", WIRE_API) != WIRE_API:
        raise InstallError(
            f"Codex model provider '{provider_id}' uses wire_api = {existing['wire_api']!r}; Codex "
            f'0.171 speaks only "{WIRE_API}": set it there, or pick another --provider-id'
        )


def _top_level(config: dict[str, Any], key: str, value: str, why: str, *, replace: bool) -> list[Edit]:
    current = config.get(key)
    if current is None:
        return [Edit((), key, value, f'set {key} = "{value}" ({why})')]
    if current == value or not replace:
        return []
    return [
        Edit((), key, value, f'replaced your {key} = {current!r} with "{value}" ({why}); {UNINSTALL}', kind="replace")
    ]


def notes(config: dict[str, Any], *, provider_id: str, model: str | None) -> list[str]:
    """What in the user's config still wins over the install, said (not changed)."""
    out: list[str] = []
    current_model = config.get("model")
    if model is None and isinstance(current_model, str) and current_model != DEFAULT_MODEL:
        out.append(f"kept your model = {current_model!r}: Codex sends it to the server (pass --model to set another)")
    profile = config.get("profile")
    profiles = config.get("profiles")
    chosen = profiles.get(profile) if isinstance(profiles, dict) and isinstance(profile, str) else None
    if isinstance(chosen, dict) and chosen.get("model_provider") not in (None, provider_id):
        out.append(
            f"note: your active profile '{profile}' sets model_provider = {chosen['model_provider']!r}, which "
            f"wins over the top level: remove it there, or run `codex --profile <another>`"
        )
    return out


def install(
    settings: Settings, *, config_path: Path, provider_id: str, model: str | None = None, dry_run: bool = False
) -> Said:
    """Add the proxy provider and select it; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url
    seen: list[str] = []

    def plan(config: dict[str, Any]) -> list[Edit]:
        seen.extend(notes(config, provider_id=provider_id, model=model))
        return plan_edits(config, proxy_url=proxy, provider_id=provider_id, model=model)

    said = edit_config(
        settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, fmt=TOML, dry_run=dry_run
    )
    if said:
        said += seen
        said.append(
            f"use it: codex (or codex exec ...); start the proxy with `ocpc launch` or `ocpc proxy` "
            f"(it forwards to {settings.base_url})"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL of the provider a Codex config selects at its top level, if any."""
    pid = config.get("model_provider")
    providers = config.get("model_providers")
    provider = providers.get(pid) if isinstance(providers, dict) and isinstance(pid, str) else None
    url = provider.get("base_url") if isinstance(provider, dict) else None
    return url if isinstance(url, str) else None
