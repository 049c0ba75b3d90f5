"""``ocpc doctor``: check every condition the cache depends on, and say how to fix each.

Checks run in order and later ones are skipped when the server is down. Each check is a
``Check`` with ``ok``, ``warn`` or ``fail``; any ``fail`` makes the exit code non-zero.
Each harness ``ocpc install`` wired to the proxy (Claude Code, pi, Kilo, Codex, Aider, Qwen
Code, Cline) gets a check of its own: its config still points at the proxy, and the proxy
answers there. ``privacy`` flags any of ocpc's folders or files (the home, the slot folder,
a slot file, the index, a log) that group or others can reach (disk/privacy.py). ``proxy-env`` says
when ``HTTP_PROXY`` & co. would send the agents' requests past ocpc, to that proxy (commands/proxy_env.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.head import Head, extract_head, parse_body
from oc_prefix_cache.commands.demo import opencode_body
from oc_prefix_cache.commands.proxy_env import AGENT_NAMES, PROXY_VARS, proxy_gap
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.privacy import describe_left, fix_command, scan
from oc_prefix_cache.engine.capability import Capabilities, Capability
from oc_prefix_cache.engine.gates import CHECKPOINT_FILES_BUILD, build_number
from oc_prefix_cache.engine.head_render import render_head
from oc_prefix_cache.errors import FormatError, JsoncError, OcpcError, ServerError, SlotSaveDisabled, StoreError
from oc_prefix_cache.install import (
    HARNESSES,
    InstallError,
    aider,
    cline,
    codex,
    config_target,
    default_config_path,
    installed,
    installed_plugin_state,
    jsonc,
    kilo_code,
    normalise_base_url,
    plugin_path_in_config,
    qwen_code,
)
from oc_prefix_cache.install import claude_code as claude_install
from oc_prefix_cache.install import pi as pi_install
from oc_prefix_cache.install.records import InstallRecord, format_of
from oc_prefix_cache.llama.client import SlotClient, Timeouts
from oc_prefix_cache.llama.families import SWA_FULL, CacheFacts, Family
from oc_prefix_cache.llama.fingerprint import adapter_settings, kv_settings
from oc_prefix_cache.llama.server_info import (
    ResolvedServer,
    daemon_server_url,
    flag_value,
    identity_from_props,
    kv_flag_names,
    port_of,
    read_runtime,
    same_server,
    server_argv,
)
from oc_prefix_cache.settings import Settings

# harness -> the base URL its config selects (None: none); their doctor check is the same
OTHERS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    kilo_code.HARNESS: kilo_code.base_url_in,
    codex.HARNESS: codex.base_url_in,
    aider.HARNESS: aider.base_url_in,
    qwen_code.HARNESS: qwen_code.base_url_in,
    cline.HARNESS: cline.base_url_in,
}

SERVER_DEFAULT_MIN_STEP = 8192  # llama-server's --checkpoint-min-step when not given


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def run_checks(
    settings: Settings, *, opencode_config: Path | None = None, server: ResolvedServer | None = None
) -> list[Check]:
    """Every check, against ``server`` (see ``server_info.resolve_server``; default: the settings')."""
    server = server or ResolvedServer(url=settings.base_url, why="OC_PREFIX_CACHE_BASE_URL or its default")
    settings = replace(settings, base_url=server.url)
    harnesses = harness_checks(settings, cwd=Path.cwd())
    checks: list[Check] = [
        _index(settings),
        _privacy(settings),
        _daemon(settings),
        proxy_env_check(settings, os.environ),
        _opencode(settings, opencode_config, optional=bool(harnesses)),
        *harnesses,
    ]
    with SlotClient(settings.base_url, timeouts=Timeouts(connect=1.0, quick=10.0, slot_io=60.0)) as client:
        try:
            props = client.props()
        except ServerError as exc:
            checks.insert(
                0,
                Check(
                    "server",
                    "fail",
                    f"{exc} ({server.why})",
                    f"start it with `ocpc launch -m MODEL.gguf --port {port_of(settings.base_url)}`, "
                    "or point ocpc at yours with --server URL",
                ),
            )
            return checks
        checks.insert(
            0, Check("server", "ok", f"{settings.base_url} answers ({server.why}); model {props.get('model_path')}")
        )
        port = port_of(settings.base_url)
        argv = server_argv(settings.base_url, runtime=read_runtime(settings, port) if port else None)
        identity = identity_from_props(props, binary=None, argv=argv)
        checks.append(_slot_save_path(settings, client))
        layout, head_tokens = _layout(settings, client)
        checks.append(layout)
        checks.append(_family(identity.cache))
        checks.append(_self_test(settings, str(props.get("model_path") or "")))
        checks.append(_build(str(props.get("build_info") or "unknown"), identity.cache.partial_cache, props))
        checks.append(_kv_flags(argv, client, port))
        checks.append(_min_step(argv, head_tokens, identity.cache.family is Family.HYBRID))
        checks.append(_slots(int(props.get("total_slots") or 1), opencode_config or _default_config()))
        checks.append(_disk(settings))
    return checks


def _self_test(settings: Settings, model_path: str) -> Check:
    """What this server's build does with slot files (engine/capability.py), as the running daemon learned
    it (and whether it stands down on the server now), else as ``capabilities.json`` keeps it for
    this model: the build, its slot-file version, whether a restore serves, what to do."""
    try:
        status = loopback.get(
            f"{settings.daemon_url}/v1/status", timeout=httpx.Timeout(3.0, connect=0.5), what="ocpc's daemon"
        ).json()
    except (ServerError, ValueError):
        status = None
    mine = isinstance(status, dict) and same_server(
        str((status.get("server") or {}).get("url") or ""), settings.base_url
    )
    daemon = status.get("daemon") if mine and isinstance(status, dict) else None
    daemon = daemon if isinstance(daemon, dict) else {}
    down, found = daemon.get("stood_down"), daemon.get("capability")
    capability = Capability.from_json(found) if isinstance(found, dict) else None
    if capability is None:  # no daemon serving it: the newest self-test of this model on this machine
        kept = [c for c in Capabilities(settings.capabilities_path).all() if c.model == model_path]
        capability = max(kept, key=lambda c: c.at, default=None)
    if isinstance(down, str) and down:
        return Check(
            "self-test",
            "fail",
            f"ocpc stands down on this server until it restarts: {down}",
            capability.advice()
            if capability is not None and not capability.usable
            else "see the reason; `ocpc status` shows it too",
        )
    if capability is None:
        return Check(
            "self-test",
            "ok",
            "not run yet: the first prepare on this server binary and model runs it "
            "(a few tokens saved, restored and reused)",
        )
    what = (
        f"build {capability.build.split('|')[0]}, slot-file version {capability.version}"
        f"{'' if capability.known_format else ' (a version this ocpc has not read)'}: {capability.reason}"
    )
    if capability.usable:
        return Check("self-test", "ok", what)
    return Check("self-test", "fail", what, capability.advice())


def _kv_flags(argv: list[str] | None, client: SlotClient, port: int | None) -> Check:
    """The flags and adapters that change KV contents, as the fingerprint sees them."""
    try:
        adapters = adapter_settings(client.lora_adapters())
    except ServerError as exc:
        return Check("kv-flags", "warn", f"cannot read the server's LoRA adapters: {exc}")
    if argv is None:
        return Check(
            "kv-flags",
            "warn",
            f"cannot see llama-server's command line (no live `ocpc launch` runtime file for port {port}, "
            "no local llama-server process on it): the fingerprint cannot tell apart servers that differ "
            f"only in {', '.join(kv_flag_names())} (or their LLAMA_ARG_* variables), so a head saved "
            "under one of them would restore silently under another",
            "start the server with `ocpc launch`, or run ocpc on its machine as the user running it",
        )
    seen = kv_settings(argv) + tuple(f"adapter {a}" for a in adapters)
    shown = ", ".join(_short(s) for s in seen) or "none (the model's own settings)"
    if any("|unreadable" in s for s in seen):
        return Check(
            "kv-flags",
            "warn",
            f"KV-changing settings: {shown}; a file among them is not readable here, "
            "so a change to it would not be seen",
            "run ocpc as the user running llama-server",
        )
    return Check("kv-flags", "ok", f"KV-changing settings in the fingerprint: {shown}")


def _short(setting: str) -> str:
    """A fingerprint setting for people: file names without folder, size and mtime."""
    return re.sub(r"[^,=|]*/([^,/=|]+)\|(?:\d+\|\d+|unreadable)", r"\1", setting)


def _slot_save_path(settings: Settings, client: SlotClient) -> Check:
    """Prove where saves land: save to a probe file, look for it in ocpc's folder, delete it."""
    name = f"ocpc-doctor-{os.getpid()}.bin"
    try:
        client.save(settings.slot, name)
    except SlotSaveDisabled:
        return Check(
            "slot-save-path",
            "fail",
            "llama-server runs without --slot-save-path",
            f"start it with `ocpc launch`, or add --slot-save-path {settings.slot_dir}/",
        )
    except ServerError as exc:
        return Check("slot-save-path", "warn", f"could not test a save: {exc}")
    landed = settings.slot_dir / name
    if landed.exists():
        landed.unlink()
        return Check("slot-save-path", "ok", f"saves land in {settings.slot_dir}")
    return Check(
        "slot-save-path",
        "fail",
        f"the server saves somewhere other than {settings.slot_dir}",
        "set OC_PREFIX_CACHE_SLOT_DIR to the server's --slot-save-path (with a trailing /), "
        f"and delete the stray {name} there",
    )


def _layout(settings: Settings, client: SlotClient) -> tuple[Check, int | None]:
    """How many tokens the head covers on this template, and how many of them are tools."""
    body = parse_body(opencode_body("A"))
    head = extract_head(body, settings.markers)
    if not isinstance(head, Head):
        return Check("template", "warn", f"sample request has no head: {head.reason}"), None
    try:
        rendered = render_head(client, body, head)
        tools = None
        if rendered.tools_in_head:  # the same head rendered without tools: the difference is theirs
            bare = render_head(client, parse_body(_without_tools(opencode_body("A"))), head)
            tools = len(rendered.tokens) - len(bare.tokens)
    except OcpcError as exc:
        return Check("template", "warn", f"could not render a sample OpenCode request: {exc}"), None
    n = len(rendered.tokens)
    if not rendered.tools_in_head:
        return Check(
            "template",
            "warn",
            f"head {n:,} tokens: the template renders tools after the marker, so the cached head holds no tools",
            "a template that renders tools first caches more",
        ), n
    return Check(
        "template",
        "ok",
        f"head {n:,} tokens (OpenCode 1.18 sample), of which tools {tools:,}"
        if tools is not None
        else f"head {n:,} tokens",
    ), n


def _without_tools(raw: bytes) -> bytes:
    data = json.loads(raw)
    data.pop("tools", None)
    data.pop("tool_choice", None)
    return json.dumps(data).encode()


def _family(cache: CacheFacts) -> Check:
    """The model's cache family, and whether the server's flags let a restore serve there."""
    label = f"{cache.family.label} model"
    why_not = cache.restores_serve
    if why_not:
        return Check(
            "cache-family",
            "fail",
            f"{label}: {why_not}; until then ocpc stands down",
            f"restart llama-server with {cache.fix} (or run it with `ocpc launch`)",
        )
    if cache.family is Family.SWA and cache.swa_full is None:
        return Check(
            "cache-family",
            "warn",
            f"{label}: cannot see whether the server runs with {SWA_FULL}; "
            "without it no restore is reused (ocpc then finds out and stands down)",
            f"start llama-server with {SWA_FULL}, or with `ocpc launch` so its flags are recorded",
        )
    how = {
        Family.TRANSFORMER: "restores are reused by common prefix",
        Family.SWA: f"{SWA_FULL} is on: restores are reused by common prefix",
        Family.HYBRID: "restores are reused as exact token prefixes (what ocpc saves)",
        Family.UNKNOWN: "the model file is not readable here: assuming exact prefixes only",
    }[cache.family]
    return Check("cache-family", "warn" if cache.family is Family.UNKNOWN else "ok", f"{label}: {how}")


def _build(build_info: str, hybrid: bool, props: dict[str, Any]) -> Check:
    number = build_number(build_info)
    kind = "hybrid/SWA" if hybrid else "plain transformer"
    if number is not None and number >= CHECKPOINT_FILES_BUILD:
        return Check("build", "ok", f"{build_info}: slot files keep checkpoints; {kind} model")
    what = (
        "restores are reused only as exact token prefixes, which is what ocpc saves"
        if hybrid
        else "restores are reused by common prefix"
    )
    return Check(
        "build",
        "warn" if hybrid else "ok",
        f"{build_info or 'unknown build'} (< b{CHECKPOINT_FILES_BUILD} or unknown); {kind} model: {what}",
        f"a build >= b{CHECKPOINT_FILES_BUILD} also persists checkpoints" if hybrid else "",
    )


def _min_step(argv: list[str] | None, head_tokens: int | None, hybrid: bool) -> Check:
    if argv is None:
        return Check(
            "checkpoint-min-step",
            "warn",
            "cannot see the server's command line",
            "start it with `ocpc launch` so its flags are recorded",
        )
    raw = flag_value(argv, ("--checkpoint-min-step", "-cms"))
    step = int(raw) if raw and raw.isdigit() else SERVER_DEFAULT_MIN_STEP
    given = "" if raw else " (the server's default)"
    if head_tokens is None or not hybrid:
        return Check("checkpoint-min-step", "ok", f"{step}{given}" + ("" if hybrid else "; not needed for this model"))
    if step > head_tokens:
        return Check(
            "checkpoint-min-step",
            "fail",
            f"{step}{given} is larger than the head ({head_tokens:,} tokens): a hybrid model gets no "
            "checkpoint inside a conversation, so a turn that diverges re-processes everything",
            "pass --checkpoint-min-step 1024 (ocpc launch does)",
        )
    return Check("checkpoint-min-step", "ok", f"{step}{given} <= head ({head_tokens:,} tokens)")


def _slots(total: int, config: Path) -> Check:
    try:
        text = config.read_text()
    except OSError:
        text = ""
    title_off = '"disable": true' in text.replace(" ", "").replace('"disable":true', '"disable": true')
    if total == 1 and not title_off and "small_model" not in text:
        return Check(
            "slots",
            "warn",
            "-np 1 and OpenCode's title request share the slot: at each new session's "
            "first message the first request waits for it (measured: up to 1.9 s, ~12% of the first answer)",
            "`ocpc install` without --keep-title turns titles off; or run -np 2 (it takes the other slot)",
        )
    return Check("slots", "ok", f"{total} slot(s)" + ("; title request disabled" if title_off else ""))


def _disk(settings: Settings) -> Check:
    folder = settings.slot_dir if settings.slot_dir.exists() else settings.home
    try:
        free = shutil.disk_usage(folder if folder.exists() else Path.home()).free
        entries = Store(index_path=settings.index_path, lock_path=settings.lock_path).load().entries.values()
    except (OSError, StoreError):
        return Check("disk", "warn", "cannot read the free space or the index")
    largest = max((e.bytes for e in entries), default=0)
    detail = f"{free / 1e9:.1f} GB free in {folder}; largest slot file {largest / 1e6:.1f} MB"
    if largest and free < largest:
        return Check("disk", "fail", detail, "free space, or lower OC_PREFIX_CACHE_MAX_GB and run `ocpc gc`")
    if largest and free < 2 * largest:
        return Check("disk", "warn", detail, "less than two files' worth free: `ocpc gc`")
    return Check("disk", "ok", detail)


def _index(settings: Settings) -> Check:
    try:
        index = Store(index_path=settings.index_path, lock_path=settings.lock_path).load()
    except StoreError as exc:
        return Check("index", "fail", str(exc), f"fix or move away {settings.index_path}")
    foreign = len(index.foreign)
    kept = (
        (
            f"; {foreign} entr{'y' if foreign == 1 else 'ies'} of a kind this ocpc does not know (a newer "
            "version's): kept as they are, never used or deleted"
        )
        if foreign
        else ""
    )
    return Check("index", "ok", f"{len(index.entries)} fingerprint(s) recorded{kept}")


def _privacy(settings: Settings) -> Check:
    """ocpc's folders 0700 and files 0600: a park's token ids decode to the whole prompt with the
    model's tokenizer, and the logs hold session ids."""
    try:
        found = scan(settings)
    except OSError as exc:
        return Check("privacy", "warn", f"cannot check the modes of ocpc's files: {exc}")
    if not found:
        return Check(
            "privacy", "ok", f"ocpc's folders and files are yours alone ({settings.home}, {settings.slot_dir})"
        )
    ours = [f for f in found if not f.left]
    theirs = [f for f in found if f.left]
    detail = (
        "other users can reach what may hold your prompts (a slot file decodes to its whole prompt) and "
        "session ids: " + "; ".join(describe_left(found))
    )
    fixes = []
    if ours:
        fixes.append(f"`ocpc doctor --fix` (changes only ocpc's own names), or: {_shortened(fix_command(ours))}")
    if theirs:
        fixes.append(
            f"if no other account needs them: {_shortened(fix_command(theirs))}; and start llama-server "
            "under umask 077 (`ocpc launch` does; systemd: UMask=0077) so its slot files are 0600"
        )
    return Check("privacy", "warn", detail, "; ".join(fixes))


def _shortened(command: str, limit: int = 600) -> str:
    """A fix command of many files, cut to a readable length (the detail names the rest)."""
    return command if len(command) <= limit else command[:limit].rsplit(" ", 1)[0] + " ..."


def _daemon(settings: Settings) -> Check:
    try:
        loopback.raise_for_status(
            loopback.get(f"{settings.daemon_url}/health", timeout=httpx.Timeout(2.0, connect=0.5), what="ocpc's daemon")
        )
    except ServerError:
        return Check(
            "daemon",
            "warn",
            f"no ocpc daemon at {settings.daemon_url}: sessions go on uncached",
            "run `ocpc launch` (server and daemon) or `ocpc daemon`",
        )
    served = daemon_server_url(settings)
    if served is not None and not same_server(served, settings.base_url):
        return Check(
            "daemon",
            "warn",
            f"the ocpc daemon at {settings.daemon_url} keeps {served} warm, not {settings.base_url}",
            f"run `ocpc daemon --server {settings.base_url}` (another "
            "OC_PREFIX_CACHE_DAEMON_PORT for a second one), or check the right server with --server",
        )
    return Check("daemon", "ok", f"up at {settings.daemon_url}" + (f", serving {served}" if served else ""))


def installed_agents(settings: Settings) -> list[str]:
    """The agents ``ocpc install`` wired to ocpc here (its records), by name."""
    try:
        return [AGENT_NAMES.get(h, h) for h in HARNESSES if installed(settings, h)]
    except InstallError:
        return []


def proxy_env_check(settings: Settings, environ: Mapping[str, str]) -> Check:
    """Proxy variables the agents would follow past ocpc (commands/proxy_env.py): ocpc ignores them for
    its own calls, the agents do not. A fail when an agent is installed here; this reads only
    this process's environment, which is the agents' when they start from the same shell."""
    gap = proxy_gap(environ, [settings.proxy_url, settings.daemon_url, settings.base_url])
    if gap is None:
        set_now = [name for name in PROXY_VARS if environ.get(name, "").strip()]
        return Check(
            "proxy-env",
            "ok",
            f"{', '.join(set_now)} set, and NO_PROXY keeps 127.0.0.1 out of it"
            if set_now
            else "no proxy variable set: the agents reach ocpc directly",
        )
    agents = installed_agents(settings)
    return Check(
        "proxy-env",
        "fail" if agents and not gap.https_only else "warn",
        gap.detail(
            f"{', '.join(agents)} (installed here)" if agents else "an agent", "ocpc's proxy, daemon and llama-server"
        ),
        gap.fix,
    )


def _opencode(settings: Settings, config: Path | None, *, optional: bool = False) -> Check:
    """The OpenCode config loads this ocpc's plugin. ``optional``: another harness is wired to
    the proxy, so no OpenCode config at all is a choice, not a problem."""
    path = config or _default_config()
    try:
        text = path.read_text()
    except OSError:
        if optional:
            return Check("opencode", "ok", f"not installed (no OpenCode config at {path})")
        return Check("opencode", "warn", f"no OpenCode config at {path}", "run `ocpc install`")
    if "ocpc-plugin.js" not in text:
        return Check("opencode", "warn", f"{path} does not load the ocpc plugin", "run `ocpc install`")
    try:
        state = installed_plugin_state(settings, plugin_path_in_config(text))
    except OcpcError as exc:
        return Check("opencode", "warn", f"{path} loads the ocpc plugin; {exc}")
    if state.problem is None:
        version = f" {state.installed_version}" if state.installed_version else ""
        return Check("opencode", "ok", f"{path} loads the ocpc plugin{version}, the same as this ocpc's")
    missing = not state.installed.exists()
    return Check(
        "opencode",
        "fail" if missing else "warn",
        f"{path} loads the ocpc plugin, but {state.problem}",
        "run `ocpc install` (OpenCode picks the new copy up at its next start)",
    )


def _default_config() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return default_config_path(project=False, cwd=Path.cwd(), xdg_config_home=Path(xdg))


# --- the harnesses that reach llama-server through the proxy (`ocpc install --harness`) -----

PROXY_FIX = "start the proxy: `ocpc launch` (server, daemon and proxy) or `ocpc proxy`"


@dataclass(frozen=True)
class ProxyProbe:
    """What the proxy URL said: ``GET /health`` (the proxy passes it through to llama-server)
    and ``GET /ocpc/status`` (only ocpc's proxy has it: a llama-server on that port does not)."""

    url: str
    status: int | None  # /health; None: nothing answered
    error: str = ""
    forwards_to: str | None = None  # the server /ocpc/status names; None: not ocpc's proxy


Probe = Callable[[str], ProxyProbe]


def probe_proxy(url: str) -> ProxyProbe:
    timeout = httpx.Timeout(5.0, connect=1.0)
    try:
        health = loopback.get(f"{url}/health", timeout=timeout, what="ocpc's proxy")
    except ServerError as exc:
        return ProxyProbe(url, None, str(exc) or type(exc).__name__)
    try:
        status = loopback.get(f"{url}/ocpc/status", timeout=timeout, what="ocpc's proxy")
        server = status.json().get("server") if status.status_code == 200 else None
    except (ServerError, ValueError, AttributeError):
        server = None
    return ProxyProbe(url, health.status_code, forwards_to=server if isinstance(server, str) else None)


def harness_checks(settings: Settings, *, cwd: Path, probe: Probe = probe_proxy) -> list[Check]:
    """One check per config ocpc wired to the proxy (its install records); none for a harness
    that was never installed, so doctor stays quiet about agents you do not use."""
    try:
        claude = installed(settings, claude_install.HARNESS)
        pis = installed(settings, pi_install.HARNESS)
        others = [record for harness in OTHERS for record in installed(settings, harness)]
    except InstallError as exc:
        return [Check("harnesses", "warn", f"cannot read ocpc's install records: {exc}")]
    seen: dict[str, ProxyProbe] = {}

    def once(url: str) -> ProxyProbe:
        if url not in seen:
            seen[url] = probe(url)
        return seen[url]

    return (
        [claude_code_check(settings, Path(r.config), cwd=cwd, probe=once) for r in claude]
        + [pi_check(settings, Path(r.config), probe=once) for r in pis]
        + [proxied_check(settings, r, probe=once) for r in others]
    )


def proxied_check(settings: Settings, record: InstallRecord, *, probe: Probe = probe_proxy) -> Check:
    """A harness whose install only points it at the proxy: the URL its config selects is
    still the proxy's (read in the config's own format), and the proxy answers."""
    name, config = record.harness, Path(record.config)
    reinstall = f"run `ocpc install --harness {name}`"
    try:
        text = config_target(config).read_text()
    except FileNotFoundError:
        return Check(
            name, "warn", f"ocpc was installed into {config}, which is gone: {name} does not use the proxy", reinstall
        )
    except (OSError, InstallError) as exc:
        return Check(name, "warn", f"cannot read {config}: {exc}", reinstall)
    try:
        data = format_of(record).parse(text)
    except (FormatError, InstallError) as exc:
        return Check(name, "warn", f"{config} {exc}", reinstall)
    url = OTHERS[name](data)
    if url is None:
        return Check(
            name, "warn", f"{config} no longer selects a provider at a base URL: {name} bypasses the proxy", reinstall
        )
    if normalise_base_url(url) != normalise_base_url(settings.proxy_url):
        return Check(
            name,
            "warn",
            f"{config} sends {name} to {url}, not to the proxy at {settings.proxy_url}",
            f"{reinstall}, or set OC_PREFIX_CACHE_PROXY_PORT to the port it names",
        )
    return _proxy_verdict(name, f"{config} sends {name} to the proxy", probe(normalise_base_url(url)))


def claude_code_check(settings: Settings, config: Path, *, cwd: Path, probe: Probe = probe_proxy) -> Check:
    """Claude Code's settings send it to the proxy (and no project file here overrides that),
    and the proxy answers."""
    name, reinstall = "claude-code", "run `ocpc install --harness claude-code`"
    data = _read_json(config)
    if isinstance(data, Check):
        return replace(data, name=name, fix=reinstall)
    url = claude_install.base_url_in(data)
    if url is None:
        return Check(
            name, "warn", f"{config} no longer sets ANTHROPIC_BASE_URL: Claude Code bypasses the proxy", reinstall
        )
    if normalise_base_url(url) != normalise_base_url(settings.proxy_url):
        return Check(
            name,
            "warn",
            f"{config} sends Claude Code to {url}, not to the proxy at {settings.proxy_url}",
            f"{reinstall}, or set OC_PREFIX_CACHE_PROXY_PORT to the port it names",
        )
    for local in (cwd / ".claude" / "settings.json", cwd / ".claude" / "settings.local.json"):
        other = _read_json(local) if local.exists() and local.resolve() != config.resolve() else None
        theirs = claude_install.base_url_in(other) if isinstance(other, dict) else None
        if theirs is not None and normalise_base_url(theirs) != normalise_base_url(url):
            return Check(
                name,
                "warn",
                f"{config} sends Claude Code to the proxy, but in this project {local} "
                f"sends it to {theirs} (a project's settings win)",
                f"remove ANTHROPIC_BASE_URL from {local}, or run install with --project here",
            )
    verdict = _proxy_verdict(name, f"{config} sends Claude Code to the proxy", probe(normalise_base_url(url)))
    env = data.get("env")
    capabilities = env.get(claude_install.CAPABILITIES) if isinstance(env, dict) else None
    if verdict.status == "ok" and not (isinstance(capabilities, str) and claude_install.system_turns_off(capabilities)):
        return Check(
            name,
            "warn",
            f"{config} sends Claude Code to the proxy, but does not set "
            f"{claude_install.CAPABILITIES}={claude_install.NO_SYSTEM_ENTRIES} (an install of an older ocpc, or "
            "edited since): "
            "its environment comes after the typed text, so every new session processes it again "
            "(~2,100 tokens on 2.1.332)",
            reinstall,
        )
    return verdict


def pi_check(settings: Settings, config: Path, *, probe: Probe = probe_proxy) -> Check:
    """pi's models.json has a provider at the proxy, with the session-affinity headers on,
    and the proxy answers."""
    name, reinstall = "pi", "run `ocpc install --harness pi`"
    data = _read_json(config)
    if isinstance(data, Check):
        return replace(data, name=name, fix=reinstall)
    providers = pi_install.proxy_providers(data, settings.proxy_url)
    if not providers:
        return Check(
            name, "warn", f"{config} has no provider at the proxy {settings.proxy_url}/v1: pi bypasses it", reinstall
        )
    pid, provider = next(iter(providers.items()))
    compat = provider.get("compat")
    if not (isinstance(compat, dict) and compat.get(pi_install.AFFINITY) is True):
        return Check(
            name,
            "warn",
            f"pi provider '{pid}' in {config} sends no session-affinity headers: conversations cannot keep their slot",
            f'set "compat": {{"{pi_install.AFFINITY}": true}} on it, or {reinstall}',
        )
    return _proxy_verdict(
        name,
        f"pi provider '{pid}' in {config} goes through the proxy",
        probe(normalise_base_url(str(provider["baseUrl"]))),
    )


def _read_json(config: Path) -> dict[str, Any] | Check:
    try:
        target = config_target(config)
        text = target.read_text()
    except FileNotFoundError:
        return Check("", "warn", f"ocpc was installed into {config}, which is gone: that agent does not use the proxy")
    except (OSError, InstallError) as exc:
        return Check("", "warn", f"cannot read {config}: {exc}")
    try:
        data = jsonc.loads(text)
    except JsoncError as exc:
        return Check("", "warn", f"{config} is not valid JSON: {exc}")
    return data if isinstance(data, dict) else Check("", "warn", f"{config} is not a JSON object")


def _proxy_verdict(name: str, what: str, probe: ProxyProbe) -> Check:
    if probe.status is None:
        return Check(
            name, "fail", f"{what}, but nothing answers at {probe.url} ({probe.error}): its requests fail", PROXY_FIX
        )
    if probe.forwards_to is None:
        return Check(
            name,
            "warn",
            f"{what}, but what answers at {probe.url} is not the ocpc proxy (no /ocpc/status): "
            "requests reach the server unprepared",
            "stop what listens there (a llama-server on the proxy's "
            "port?) and start the proxy (`ocpc launch` or `ocpc proxy`), or install again with another "
            "OC_PREFIX_CACHE_PROXY_PORT",
        )
    if probe.status == 200:
        return Check(
            name, "ok", f"{what}; the proxy answers at {probe.url}, forwarding to {probe.forwards_to} (healthy)"
        )
    return Check(
        name,
        "warn",
        f"{what}; the proxy at {probe.url} answers /health with HTTP {probe.status}: "
        f"the llama-server behind it ({probe.forwards_to}) is down or still loading",
        "start llama-server (`ocpc launch`), or point the proxy at yours (`ocpc proxy --server URL`)",
    )
