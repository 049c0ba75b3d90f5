"""``ocpc status``: the server, the daemon, the plugin, the disk, and a one-line verdict.

Every part is gathered on its own and time-bounded, so a dead server or daemon is
reported, not fatal: the disk state is always shown. The verdict is a pure function of
the gathered facts. JSON shape: docs/operations.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from oc_prefix_cache import loopback
from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.disk.slotfile import fingerprint_of, kind_of
from oc_prefix_cache.errors import OcpcError, ServerError, StoreError
from oc_prefix_cache.llama.client import SlotClient, Timeouts
from oc_prefix_cache.llama.fingerprint import kv_settings
from oc_prefix_cache.llama.server_info import (
    ResolvedServer,
    flag_value,
    port_of,
    read_runtime,
    same_server,
    server_argv,
)
from oc_prefix_cache.settings import Settings

QUICK = Timeouts(connect=0.5, quick=2.0)


def gather(settings: Settings, *, server: ResolvedServer | None = None) -> dict[str, Any]:
    """Every part, about ``server`` (see ``server_info.resolve_server``; default: the settings')."""
    server = server or ResolvedServer(url=settings.base_url, why="OC_PREFIX_CACHE_BASE_URL or its default")
    settings = replace(settings, base_url=server.url)
    return {
        "server": server_part(settings) | {"why": server.why},
        "daemon": daemon_part(settings),
        "plugin": plugin_part(settings),
        "disk": disk_part(settings),
    }


def plugin_part(settings: Settings, *, tail_bytes: int = 1 << 20) -> dict[str, Any]:
    """Counts from the plugin's own log: its fail-opens never reach the daemon."""
    path = settings.log_dir / "plugin.jsonl"
    counts = {"forwards": 0, "prepares": 0, "fail_opens": 0, "reports": 0}
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - tail_bytes))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return {"log": str(path), **counts, "last_error": None}
    last_error = None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("ev") if isinstance(event, dict) else None
        if kind == "forward":
            counts["forwards"] += 1
        elif kind == "prepare":
            counts["prepares"] += 1
        elif kind == "report":
            counts["reports"] += 1
        elif kind == "error" and event.get("stage") == "prepare":
            counts["fail_opens"] += 1
            last_error = event.get("error")
    return {"log": str(path), **counts, "last_error": last_error}


def server_part(settings: Settings) -> dict[str, Any]:
    """The server; a llama-server router (``--models-dir``) with ``router: true`` and ``models``:
    each model's status and, while loaded, its model file, slots, context and busy slots (asked
    with ``autoload=false``: nothing is loaded to be looked at). A router's own ``slots`` count is
    its loaded models' slots together, and its ``model``, ``n_ctx`` are null."""
    url = settings.base_url
    part: dict[str, Any] = {"url": url, "reachable": False}
    models: list[dict[str, Any]] | None = None
    with SlotClient(url, timeouts=QUICK) as client:
        try:
            props = client.props()
            if props.get("role") == "router":
                models = _router_models(url)
                slots: list[dict[str, Any]] = []
            else:
                slots = client.slots()
        except OcpcError as exc:
            part["error"] = str(exc)
            return part
    port = port_of(url)
    argv = server_argv(url, runtime=read_runtime(settings, port) if port else None)
    part.update(
        reachable=True,
        build=props.get("build_info"),
        model=props.get("model_path"),
        slots=len(slots),
        n_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
        busy=[s.get("id") for s in slots if s.get("is_processing")],
        flags=_flags(argv),
        kv_flags=list(kv_settings(argv)) if argv is not None else None,
    )
    if models is not None:
        part.update(router=True, models=models, model=None, n_ctx=None, slots=sum(m.get("slots", 0) for m in models))
    return part


def _router_models(url: str) -> list[dict[str, Any]]:
    from oc_prefix_cache.doors.router import models_view

    views = models_view(url, timeouts=QUICK)
    if views is None:
        raise OcpcError(f"the router at {url} did not list its models (GET /models)")
    out = []
    for view in views:
        model: dict[str, Any] = {"id": view["id"], "status": view["status"]}
        if "error" in view:
            model["error"] = view["error"]
        if "slots" in view:
            slots = view["slots"]
            model.update(
                model=view.get("model_path"),
                slots=len(slots),
                n_ctx=view.get("n_ctx"),
                busy=[s.get("id") for s in slots if s.get("is_processing")],
            )
        out.append(model)
    return out


def _flags(argv: list[str] | None) -> dict[str, str | None] | None:
    if argv is None:
        return None
    names = {
        "slot_save_path": ("--slot-save-path",),
        "parallel": ("-np", "--parallel"),
        "checkpoint_min_step": ("--checkpoint-min-step", "-cms"),
        "ctx_checkpoints": ("--ctx-checkpoints", "-ctxcp"),
        "cache_ram": ("--cache-ram", "-cram"),
        "ctx_size": ("-c", "--ctx-size"),
        "metrics": ("--metrics",),
    }
    return {key: flag_value(argv, spellings) for key, spellings in names.items()}


def daemon_part(settings: Settings) -> dict[str, Any]:
    url = settings.daemon_url
    try:
        data = loopback.get(f"{url}/v1/status", timeout=httpx.Timeout(2.0, connect=0.5), what="ocpc's daemon").json()
    except (ServerError, ValueError) as exc:
        return {"url": url, "up": False, "error": f"no ocpc daemon at {url} ({type(exc).__name__})"}
    daemon = data.get("daemon") or {}
    counters = daemon.get("counters") or {}
    recent = [
        {"action": e.get("action"), "ms": e.get("elapsed_ms"), "fingerprint": e.get("fingerprint")}
        for e in (daemon.get("events") or [])[-5:]
    ]
    part = {
        "url": url,
        "up": True,
        "server_url": (data.get("server") or {}).get("url"),
        "counters": counters,
        "fail_opens": counters.get("failed", 0),
        "recent": recent,
        "last_report": daemon.get("last_report"),
        "stood_down": daemon.get("stood_down"),
    }
    models = data.get("models")
    if isinstance(models, dict):  # behind a router: each model's Engine
        part["models"] = {model: _model_part(status) for model, status in models.items() if isinstance(status, dict)}
    return part


def _model_part(status: dict[str, Any]) -> dict[str, Any]:
    """One router model's Engine in the daemon: its counters, last report, what its slots hold."""
    counters = status.get("counters") or {}
    slots = (status.get("tracker") or {}).get("slots") or {}
    return {
        "counters": counters,
        "fail_opens": counters.get("failed", 0),
        "last_report": status.get("last_report"),
        "stood_down": status.get("stood_down"),
        "holding": {slot: held for slot, held in slots.items() if held},
        "warm_starts": counters.get("warm_start", 0),
    }


def disk_part(settings: Settings) -> dict[str, Any]:
    store = Store(index_path=settings.index_path, lock_path=settings.lock_path)
    part: dict[str, Any] = {
        "slot_dir": str(settings.slot_dir),
        "cap_bytes": int(settings.max_gb * 1e9) if settings.max_gb else None,
        "park_cap_bytes": int(settings.park_max_gb * 1e9) if settings.park_max_gb else None,
        "park_ttl_hours": settings.park_ttl_hours,
    }
    try:
        index = store.load()
        part["index_error"] = None
    except StoreError as exc:
        index, part["index_error"] = None, str(exc)
    current = {fp for key, fp in index.current.items() if _on_server(key, settings.base_url)} if index else set()
    files = []
    for path in _pattern_files(settings.slot_dir):
        fp = fingerprint_of(path.name) or ""
        entry = index.entries.get(fp) if index else None
        files.append(
            {
                "fingerprint": fp,
                "file": path.name,
                "kind": kind_of(path.name),
                "bytes": path.stat().st_size,
                "last_used": entry.last_used if entry else None,
                "prefix_tokens": entry.prefix_tokens if entry else None,
                "current": fp in current,
                "indexed": entry is not None,
                "session": entry.session if entry else "",
            }
        )
    part["files"] = sorted(files, key=lambda f: -(f["last_used"] or 0))
    part["total_bytes"] = sum(f["bytes"] for f in files)
    part["by_kind"] = {
        kind: {
            "files": sum(1 for f in files if f["kind"] == kind),
            "bytes": sum(f["bytes"] for f in files if f["kind"] == kind),
        }
        for kind in ("head", "proj", "conv")
    }
    part["current"] = sorted(current)
    return part


def _on_server(key: str, url: str) -> bool:
    """``current`` keys are ``store.slot_key(url, N)``: only this server's slots make a file current here."""
    prefix, mark, slot = key.rpartition("#slot")
    return bool(mark) and slot.isdigit() and same_server(prefix, url)


def _pattern_files(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if fingerprint_of(p.name) and p.is_file() and not p.is_symlink()]
    except OSError:
        return []


def verdict(status: dict[str, Any]) -> str:
    """One line: warm, cold or broken, with the reason."""
    server, daemon, disk = status["server"], status["daemon"], status["disk"]
    if not server.get("reachable"):
        return f"broken: llama-server at {server['url']} is not reachable; run ocpc doctor"
    flags = server.get("flags") or {}
    if server.get("flags") is not None and not flags.get("slot_save_path"):
        return "broken: llama-server runs without --slot-save-path; run ocpc doctor"
    if not daemon.get("up"):
        return "broken: the ocpc daemon is not running (sessions go on uncached); run ocpc doctor"
    if daemon.get("server_url") and not same_server(daemon["server_url"], server["url"]):
        return f"broken: the ocpc daemon keeps {daemon['server_url']} warm, not this server; run ocpc doctor"
    if disk.get("index_error"):
        return "broken: index.json is unreadable (cleanup is off); run ocpc doctor"
    saved = {f["fingerprint"] for f in disk["files"]}
    if any(fp in saved for fp in disk["current"]):
        return "warm: next session starts from cache"
    return "cold: no head saved yet; the next session warms it once"


def age(seconds_ago: float) -> str:
    if seconds_ago < 90:
        return f"{seconds_ago:.0f} s ago"
    if seconds_ago < 5400:
        return f"{seconds_ago / 60:.0f} min ago"
    if seconds_ago < 129600:
        return f"{seconds_ago / 3600:.0f} h ago"
    return f"{seconds_ago / 86400:.0f} days ago"


def render(data: dict[str, Any], out: Console) -> None:
    """The status screen: one line per part, indented details, the verdict last (80 columns)."""
    server, daemon, disk = data["server"], data["daemon"], data["disk"]
    if server["reachable"] and server.get("router"):
        flags = server.get("flags") or {}
        loaded = [m for m in server["models"] if m["status"] == "loaded"]
        out.print(
            f"server  {server['url']}  {server['build']}  router: {len(server['models'])} models, {len(loaded)} loaded"
        )
        for model in server["models"]:
            detail = (
                f"{Path(model.get('model') or '?').name}  slots {model['slots']} x {model['n_ctx']} ctx"
                f"{'  busy ' + ','.join(map(str, model['busy'])) if model['busy'] else ''}"
                if "slots" in model
                else model.get("error", "")
            )
            out.print(f"        model {escape(model['id'])}  {model['status']}  {escape(detail)}".rstrip())
        if flags:
            out.print(
                f"        slot-save-path {flags.get('slot_save_path') or 'MISSING'}  "
                f"checkpoint-min-step {flags.get('checkpoint_min_step') or 'default'}"
            )
    elif server["reachable"]:
        flags = server.get("flags") or {}
        out.print(
            f"server  {server['url']}  {server['build']}  {Path(server['model'] or '?').name}  "
            f"slots {server['slots']} x {server['n_ctx']} ctx"
        )
        if flags:
            out.print(
                f"        slot-save-path {flags.get('slot_save_path') or 'MISSING'}  "
                f"checkpoint-min-step {flags.get('checkpoint_min_step') or 'default'}"
            )
    else:
        out.print(f"server  {server['url']}  [red]down[/red]: {server.get('error')}")
    if server.get("why"):
        out.print(f"        (this server: {server['why']})")
    if daemon["up"]:
        c = daemon["counters"]
        out.print(
            f"daemon  {daemon['url']}  hit {c.get('hit', 0)}  restored {c.get('restored', 0)}  "
            f"warmed {c.get('warmed', 0)}  skipped {c.get('skipped', 0)}  fail-open {daemon['fail_opens']}"
        )
        if daemon.get("stood_down"):
            out.print(f"        [yellow]standing down on this server[/yellow]: {daemon['stood_down']}", soft_wrap=True)
        for event in daemon["recent"]:
            if event.get("ms") is None:  # a stand-down event, said above
                continue
            out.print(f"        {event['action']:9} {event['ms']:8.1f} ms  {event['fingerprint'] or ''}")
        report = daemon.get("last_report")
        if report:
            out.print(
                f"        last request: {report['cache_n']:,} tokens from cache, {report['prompt_n']:,} "
                f"processed ({report['verdict']})"
            )
        for model, part in (daemon.get("models") or {}).items():
            c = part["counters"]
            held = ", ".join(
                f"slot {slot} {h.get('kind')} {h.get('tokens', 0):,} tok" for slot, h in sorted(part["holding"].items())
            )
            out.print(
                f"        model {escape(model)}: hit {c.get('hit', 0)}  restored {c.get('restored', 0)}  "
                f"warmed {c.get('warmed', 0)}  skipped {c.get('skipped', 0)}  "
                f"warm starts {part['warm_starts']}" + (f"; holds {held}" if held else ""),
                soft_wrap=True,
            )
    else:
        out.print(f"daemon  [red]down[/red]: {daemon['error']}")
    plugin = data["plugin"]
    if plugin["forwards"]:
        out.print(
            f"plugin  {plugin['forwards']} requests forwarded, {plugin['fail_opens']} without the daemon"
            + (f" (last: {plugin['last_error']})" if plugin["last_error"] else "")
        )
    cap = f" of {disk['cap_bytes'] / 1e9:.1f} GB cap" if disk["cap_bytes"] else ""
    out.print(f"disk    {disk['slot_dir']}  {len(disk['files'])} file(s), {disk['total_bytes'] / 1e6:,.1f} MB{cap}")
    kinds = disk.get("by_kind") or {}
    if kinds:
        park_cap = f" of {disk['park_cap_bytes'] / 1e9:.1f} GB" if disk.get("park_cap_bytes") else ""
        out.print(
            f"        heads {kinds['head']['files']}, project heads {kinds['proj']['files']}, "
            f"parked conversations {kinds['conv']['files']} ({kinds['conv']['bytes'] / 1e6:,.1f} MB{park_cap})"
        )
    names = {"head": "head", "proj": "project", "conv": "parked"}
    for f in disk["files"][:8]:
        used = age(time.time() - f["last_used"]) if f["last_used"] else "not in index"
        out.print(
            f"        {names.get(f.get('kind') or '', '?'):7} {f['fingerprint']}  {f['bytes'] / 1e6:8.1f} MB  "
            f"{used}{'  current' if f['current'] else ''}"
        )
    if disk.get("index_error"):
        out.print(f"        [red]{disk['index_error']}[/red]")
    out.print(data["verdict"], style="bold")
