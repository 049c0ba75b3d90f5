"""``ocpc install --harness aider``: Aider's ``.aider.conf.yml`` sends it to the proxy.

Aider (0.86.2) reads ``.aider.conf.yml`` from the home folder, the git root and the current
folder, later ones winning (``main.py``: the list is reversed before parsing), and its
environment (``OPENAI_API_BASE``, ``AIDER_MODEL``...) and command line win over all of them.
Install sets three top-level entries in ``~/.aider.conf.yml`` (``--project``:
``./.aider.conf.yml``): ``model: openai/<name>`` (litellm's OpenAI-compatible route; ``--model``,
default ``local``), ``openai-api-base: <proxy>/v1``, and a dummy ``openai-api-key`` when the file
names none (litellm refuses to send without one; the proxy ignores it). A value of the user's
that differs is replaced and said; uninstall puts it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oc_prefix_cache.install.records import Edit, Said, edit_config, normalise_base_url
from oc_prefix_cache.install.yaml_format import YamlFormat
from oc_prefix_cache.settings import Settings

HARNESS = "aider"
DEFAULT_MODEL = "local"
DUMMY_KEY = "ocpc-local"
FILE = ".aider.conf.yml"
BASE = "openai-api-base"
KEY = "openai-api-key"
WINS = ("OPENAI_API_BASE", "AIDER_OPENAI_API_BASE", "AIDER_MODEL")  # the environment beats the file


def default_config_path(*, project: bool, cwd: Path, home: Path) -> Path:
    return (cwd if project else home) / FILE


def plan_edits(config: dict[str, Any], *, proxy_url: str, model: str) -> list[Edit]:
    """The entries to add or replace: the pure decision, tested on its own."""
    base = normalise_base_url(proxy_url) + "/v1"
    wanted: list[tuple[str, str, str]] = [
        ("model", f"openai/{model}", "litellm's OpenAI-compatible route, to the proxy"),
        (BASE, base, "Aider's requests go to the ocpc proxy"),
    ]
    if KEY not in config:
        wanted.append((KEY, DUMMY_KEY, "a dummy key: litellm wants one, the proxy needs none"))
    edits: list[Edit] = []
    for key, value, why in wanted:
        current = config.get(key)
        if key not in config:
            edits.append(Edit((), key, value, f"set {key}: {value} ({why})"))
        elif not _same(key, current, value):
            edits.append(
                Edit(
                    (),
                    key,
                    value,
                    f"replaced your {key}: {current!r} with {value!r} ({why}); "
                    f"`ocpc uninstall --harness {HARNESS}` puts yours back",
                    kind="replace",
                )
            )
    return edits


def _same(key: str, current: Any, wanted: str) -> bool:
    if key == BASE and isinstance(current, str):
        return normalise_base_url(current) == normalise_base_url(wanted)
    return bool(current == wanted)


def install(
    settings: Settings,
    *,
    config_path: Path,
    model: str | None = None,
    environ: Mapping[str, str] | None = None,
    dry_run: bool = False,
) -> Said:
    """Point Aider at ``settings.proxy_url``; one line per change (none: nothing to do)."""
    proxy = settings.proxy_url
    name = model or DEFAULT_MODEL

    def plan(config: dict[str, Any]) -> list[Edit]:
        return plan_edits(config, proxy_url=proxy, model=name)

    said = edit_config(
        settings,
        config_path=config_path,
        harness=HARNESS,
        plan=plan,
        proxy_url=proxy,
        fmt=YamlFormat(HARNESS),
        dry_run=dry_run,
    )
    if said:
        winning = [k for k in WINS if (environ or {}).get(k)]
        if winning:
            said.append(
                f"note: your environment sets {', '.join(winning)}, which Aider takes over this file: "
                "unset it to use the proxy"
            )
        said.append(
            f"use it: aider (in any repo); start the proxy with `ocpc launch` or `ocpc proxy` "
            f"(it forwards to {settings.base_url}); a repo's own {FILE} still wins over this one"
        )
    return said


def base_url_in(config: dict[str, Any]) -> str | None:
    value = config.get(BASE)
    return value if isinstance(value, str) else None
