"""``ocpc install --harness pi``: a provider in pi's ``models.json`` that goes through the proxy.

pi (0.73.1) reads custom providers from ``$PI_CODING_AGENT_DIR/models.json``, by default
``~/.pi/agent/models.json`` (JSON; comments are stripped before parsing). Install adds one
provider (``--provider-id``, default ``ocpc``): ``openai-completions`` at ``<proxy>/v1``, a
dummy key, ``compat.sendSessionAffinityHeaders: true`` (then every request carries pi's
session id in ``session_id`` and ``x-session-affinity``, which keeps a conversation on its
slot) and the model named with ``--model``. Use it with ``pi --provider ocpc --model NAME``
(pi picks it by itself when it is the only provider with a key).

A provider of that id that already points at the proxy is completed (the model, the
affinity switch) rather than duplicated; one that points elsewhere is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.settings import Settings

HARNESS = "pi"
DEFAULT_PROVIDER_ID = "ocpc"
DUMMY_KEY = "ocpc-local"  # not an environment variable's name, so pi sends it as it is
API = "openai-completions"
AFFINITY = "sendSessionAffinityHeaders"


def default_config_path(*, home: Path, environ: Mapping[str, str]) -> Path:
    folder = environ.get("PI_CODING_AGENT_DIR")
    return (Path(folder).expanduser() if folder else home / ".pi" / "agent") / "models.json"


def plan_edits(
    config: dict[str, Any], *, proxy_url: str, provider_id: str, model: str, output_limit: int | None = None
) -> list[Edit]:
    """What install must add to ``models.json``: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    model_entry: dict[str, Any] = {"id": model} | ({"maxTokens": output_limit} if output_limit else {})
    providers = config.get("providers")
    if providers is not None and not isinstance(providers, dict):
        raise InstallError("models.json's 'providers' is not an object; fix it, then run install again")
    provider = {"baseUrl": base, "api": API, "apiKey": DUMMY_KEY, "compat": {AFFINITY: True}, "models": [model_entry]}
    said = f"added pi provider '{provider_id}' -> the ocpc proxy {base}, model '{model}', session-affinity headers on"
    if providers is None:
        return [Edit((), "providers", {provider_id: provider}, said)]
    existing = providers.get(provider_id)
    if existing is None:
        return [Edit(("providers",), provider_id, provider, said)]
    return _complete(existing, path=("providers", provider_id), base=base, model=model, model_entry=model_entry)


def _complete(
    existing: Any, *, path: tuple[str, ...], base: str, model: str, model_entry: dict[str, Any]
) -> list[Edit]:
    """A provider of this id exists: add what it lacks when it is ours in kind, else refuse."""
    pid = path[-1]
    url = existing.get("baseUrl") if isinstance(existing, dict) else None
    if not isinstance(url, str) or normalise_base_url(url) != normalise_base_url(base):
        raise InstallError(
            f"pi provider '{pid}' exists and points at {url or 'no baseUrl'}, not the proxy; pick another --provider-id"
        )
    assert isinstance(existing, dict)
    if existing.get("api", API) != API:
        raise InstallError(
            f"pi provider '{pid}' uses api {existing.get('api')!r}; the proxy serves {API} at "
            f"{base}; pick another --provider-id"
        )
    edits: list[Edit] = []
    compat = existing.get("compat")
    if compat is None:
        edits.append(Edit(path, "compat", {AFFINITY: True}, f"turned on pi's session-affinity headers for '{pid}'"))
    elif isinstance(compat, dict) and AFFINITY not in compat:
        edits.append(Edit((*path, "compat"), AFFINITY, True, f"turned on pi's session-affinity headers for '{pid}'"))
    elif isinstance(compat, dict) and compat.get(AFFINITY) is not True:
        edits.append(
            Edit(
                (*path, "compat"),
                AFFINITY,
                True,
                f"replaced your compat.{AFFINITY}={compat.get(AFFINITY)!r} of '{pid}' with true (without the "
                "session id a conversation cannot keep its slot); uninstall puts yours back",
                kind="replace",
            )
        )
    models = existing.get("models")
    if models is None:
        edits.append(Edit(path, "models", [model_entry], f"added model '{model}' to pi provider '{pid}'"))
    elif isinstance(models, list) and not any(isinstance(m, dict) and m.get("id") == model for m in models):
        edits.append(Edit(path, "models", model_entry, f"added model '{model}' to pi provider '{pid}'", kind="append"))
    return edits


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
            f"use it: pi --provider {provider_id} --model {model}; start the proxy with `ocpc launch` "
            f"or `ocpc proxy` (it forwards to {settings.base_url})"
        )
    return said


def proxy_providers(config: dict[str, Any], proxy_url: str) -> dict[str, dict[str, Any]]:
    """The providers of a ``models.json`` that point at ``proxy_url``, by id."""
    providers = config.get("providers")
    if not isinstance(providers, dict):
        return {}
    want = normalise_base_url(proxy_url)
    return {
        str(pid): p
        for pid, p in providers.items()
        if isinstance(p, dict) and isinstance(p.get("baseUrl"), str) and normalise_base_url(p["baseUrl"]) == want
    }
