"""``ocpc install --harness kilo-code``: a provider in Kilo Code CLI's ``kilo.json`` that goes
through the proxy.

Kilo Code CLI (7.7.9, an OpenCode fork) reads its global config from
``$XDG_CONFIG_HOME/kilo/kilo.json`` (default ``~/.config/kilo/kilo.json``; JSON with comments), with
``--project`` from ``./kilo.json``. Install adds one provider (``--provider-id``, default ``ocpc``):
``@ai-sdk/openai-compatible`` at ``<proxy>/v1`` with a dummy key and the model named with
``--model``, and makes it the default ``model`` when none is set. Kilo sends its session id in
``x-session-id`` by itself, so nothing else is needed. Use it with ``kilo run --model
ocpc/NAME`` (or plainly ``kilo`` when it became the default).

A provider of that id that already points at the proxy gets the model added rather than
duplicated; one that points elsewhere is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.settings import Settings

HARNESS = "kilo-code"
DEFAULT_PROVIDER_ID = "ocpc"
DUMMY_KEY = "ocpc-local"
NPM = "@ai-sdk/openai-compatible"


def default_config_path(*, project: bool, cwd: Path, home: Path, environ: Mapping[str, str]) -> Path:
    if project:
        return cwd / "kilo.json"
    xdg = environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else home / ".config") / "kilo" / "kilo.json"


def plan_edits(
    config: dict[str, Any], *, proxy_url: str, provider_id: str, model: str, output_limit: int | None = None
) -> list[Edit]:
    """What install must add to ``kilo.json``: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    model_entry: dict[str, Any] = {"name": model} | ({"limit": {"output": output_limit}} if output_limit else {})
    providers = config.get("provider")
    if providers is not None and not isinstance(providers, dict):
        raise InstallError("kilo.json's 'provider' is not an object; fix it, then run install again")
    provider = {
        "npm": NPM,
        "name": "ocpc (llama-server through the ocpc proxy)",
        "options": {"baseURL": base, "apiKey": DUMMY_KEY},
        "models": {model: model_entry},
    }
    said = f"added Kilo provider '{provider_id}' -> the ocpc proxy {base}, model '{model}'"
    edits: list[Edit] = []
    if providers is None:
        edits.append(Edit((), "provider", {provider_id: provider}, said))
    elif provider_id not in providers:
        edits.append(Edit(("provider",), provider_id, provider, said))
    else:
        edits += _complete(
            providers[provider_id], provider_id=provider_id, base=base, model=model, model_entry=model_entry
        )
    if "model" not in config:
        edits.append(Edit((), "model", f"{provider_id}/{model}", f"made {provider_id}/{model} Kilo's default model"))
    return edits


def _complete(existing: Any, *, provider_id: str, base: str, model: str, model_entry: dict[str, Any]) -> list[Edit]:
    options = existing.get("options") if isinstance(existing, dict) else None
    url = options.get("baseURL") if isinstance(options, dict) else None
    if not isinstance(url, str) or normalise_base_url(url) != normalise_base_url(base):
        raise InstallError(
            f"Kilo provider '{provider_id}' exists and points at {url or 'no baseURL'}, not the "
            "proxy; pick another --provider-id"
        )
    assert isinstance(existing, dict)
    models = existing.get("models")
    if models is None:
        return [
            Edit(
                ("provider", provider_id),
                "models",
                {model: model_entry},
                f"added model '{model}' to Kilo provider '{provider_id}'",
            )
        ]
    if isinstance(models, dict) and model not in models:
        return [
            Edit(
                ("provider", provider_id, "models"),
                model,
                model_entry,
                f"added model '{model}' to Kilo provider '{provider_id}'",
            )
        ]
    return []


def install(
    settings: Settings,
    *,
    config_path: Path,
    provider_id: str,
    model: str,
    output_limit: int | None = None,
    dry_run: bool = False,
) -> Said:
    """Add (or complete) the proxy provider; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, provider_id=provider_id, model=model, output_limit=output_limit)

    said = edit_config(settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, dry_run=dry_run)
    if said:
        said.append(
            f"use it: kilo run --model {provider_id}/{model} ...; start the proxy with `ocpc launch` "
            f"or `ocpc proxy` (it forwards to {settings.base_url})"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL of the provider Kilo's default ``model`` (``provider/name``) names, if any."""
    model = config.get("model")
    providers = config.get("provider")
    pid = model.split("/", 1)[0] if isinstance(model, str) and "/" in model else None
    provider = providers.get(pid) if isinstance(providers, dict) and pid else None
    options = provider.get("options") if isinstance(provider, dict) else None
    url = options.get("baseURL") if isinstance(options, dict) else None
    return url if isinstance(url, str) else None
