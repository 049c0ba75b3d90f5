"""``ocpc install --harness cline``: Cline CLI's OpenAI-compatible provider at the proxy, and
Cline set to use it.

Cline CLI (3.0.65) keeps its providers in ``providers.json``: ``$CLINE_PROVIDER_SETTINGS_PATH``,
else ``$CLINE_DATA_DIR/settings/providers.json``, else ``<$CLINE_DIR or ~/.cline>/data/settings/
providers.json`` (its ``ProviderSettingsManager``). ``cline auth -p openai -k KEY -m MODEL -b URL``
writes it, but not reversibly: it overwrites the provider and ``lastUsedProvider`` and keeps no
record. So install writes the very entry that command writes (``providers["openai-compatible"]``:
``settings`` {provider, apiKey, model, baseUrl}, ``updatedAt``, ``tokenSource: "manual"``) and sets
``lastUsedProvider``, recorded like every install. The shape matters: Cline validates the whole
file (version 1, ``updatedAt`` a date-time) and treats a file that fails as empty, then
overwrites it on its next save.

Cline rewrites the file itself on every run (``updatedAt`` refreshed, ``modes: {}`` added), so
the entry counts as ocpc's while its ``settings`` are ocpc's. A provider of the user's there, or
another ``lastUsedProvider``, is replaced and said; uninstall puts it back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, InstallError, Said, edit_config, normalise_base_url
from oc_prefix_cache.settings import Settings

HARNESS = "cline"
PROVIDER = "openai-compatible"
DEFAULT_MODEL = "local"
DUMMY_KEY = "ocpc-local"
VERSION = 1
UNINSTALL = f"`ocpc uninstall --harness {HARNESS}` puts yours back"


def default_config_path(*, home: Path, environ: Mapping[str, str]) -> Path:
    explicit = (environ.get("CLINE_PROVIDER_SETTINGS_PATH") or "").strip()
    if explicit:
        return Path(explicit).expanduser()
    data = (environ.get("CLINE_DATA_DIR") or "").strip()
    if data:
        return Path(data).expanduser() / "settings" / "providers.json"
    folder = (environ.get("CLINE_DIR") or "").strip()
    return (Path(folder).expanduser() if folder else home / ".cline") / "data" / "settings" / "providers.json"


def now_iso() -> str:
    """A date-time as Cline writes ``updatedAt`` (UTC, milliseconds, ``Z``)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def plan_edits(config: dict[str, Any], *, proxy_url: str, model: str, updated_at: str) -> list[Edit]:
    """What install must set in ``providers.json``: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    settings = {"provider": PROVIDER, "apiKey": DUMMY_KEY, "model": model, "baseUrl": base}
    entry = {"settings": settings, "updatedAt": updated_at, "tokenSource": "manual"}
    said = f"set Cline's {PROVIDER} provider -> the ocpc proxy {base}, model '{model}'"
    version = config.get("version")
    if version is not None and version != VERSION:
        raise InstallError(f"providers.json has version {version!r}; this ocpc knows Cline's version {VERSION} only")
    edits: list[Edit] = []
    if not config:  # a new file: the whole skeleton Cline writes, so that all of it is ocpc's
        edits += [Edit((), "version", VERSION, ""), Edit((), "modes", {}, "")]
    elif version is None:
        edits.append(Edit((), "version", VERSION, "set providers.json's version (Cline ignores a file without it)"))
    providers = config.get("providers")
    if providers is None:
        edits.append(Edit((), "providers", {PROVIDER: entry}, said, container=True, same_when=("settings",)))
    elif not isinstance(providers, dict):
        raise InstallError("providers.json's 'providers' is not an object; fix it, then run install again")
    current = providers.get(PROVIDER) if isinstance(providers, dict) else None
    if providers is None:
        pass
    elif current is None:
        edits.append(Edit(("providers",), PROVIDER, entry, said, same_when=("settings",)))
    elif not _is_ours(current, settings):
        edits.append(
            Edit(
                ("providers",),
                PROVIDER,
                entry,
                f"replaced your Cline {PROVIDER} provider "
                f"({_describe(current)}) with the ocpc proxy {base}, model '{model}'; {UNINSTALL}",
                kind="replace",
                same_when=("settings",),
            )
        )
    last = config.get("lastUsedProvider")
    if last is None:
        edits.append(Edit((), "lastUsedProvider", PROVIDER, f"made {PROVIDER} the provider Cline uses"))
    elif last != PROVIDER:
        edits.append(
            Edit(
                (),
                "lastUsedProvider",
                PROVIDER,
                f"replaced your lastUsedProvider {last!r} with {PROVIDER!r} (the provider Cline runs); {UNINSTALL}",
                kind="replace",
            )
        )
    return edits


def _is_ours(current: Any, settings: dict[str, str]) -> bool:
    mine = current.get("settings") if isinstance(current, dict) else None
    if not isinstance(mine, dict) or not isinstance(mine.get("baseUrl"), str):
        return False
    return (
        normalise_base_url(mine["baseUrl"]) == normalise_base_url(settings["baseUrl"])
        and mine.get("model") == settings["model"]
    )


def _describe(current: Any) -> str:
    """Which provider it was, without its key."""
    mine = current.get("settings") if isinstance(current, dict) else None
    if not isinstance(mine, dict):
        return "not a valid entry"
    return f"model {mine.get('model')!r} at {mine.get('baseUrl') or 'its default URL'}"


def install(settings: Settings, *, config_path: Path, model: str | None = None, dry_run: bool = False) -> Said:
    """Point Cline at ``settings.proxy_url``; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url
    stamp = now_iso()

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, model=model or DEFAULT_MODEL, updated_at=stamp)

    said = edit_config(settings, config_path=config_path, harness=HARNESS, plan=plan, proxy_url=proxy, dry_run=dry_run)
    if said:
        said.append(
            f'use it: cline "..." (or cline -i); start the proxy with `ocpc launch` or `ocpc proxy` '
            f"(it forwards to {settings.base_url})"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    """The base URL of the provider Cline runs (``lastUsedProvider``), if it has one."""
    providers = config.get("providers")
    entry = providers.get(config.get("lastUsedProvider")) if isinstance(providers, dict) else None
    mine = entry.get("settings") if isinstance(entry, dict) else None
    url = mine.get("baseUrl") if isinstance(mine, dict) else None
    return url if isinstance(url, str) else None
