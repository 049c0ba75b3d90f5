"""``ocpc top``: a live view of what the cache does, for a person at a terminal.

One snapshot (``snapshot``) gathers, each part bounded and allowed to fail on its own: the
server's slots (``/props``, ``/slots``), what each front door (the plugin's daemon, the proxy)
believes each slot holds and is doing now (a restore or warm in flight, with its expected
time), the last requests from the event log (disk/events.py: tokens reused and processed and what
served them), and the disk against its caps. ``render`` turns it into rich tables; ``run``
redraws it every ``interval`` seconds. ``--json`` prints one snapshot for scripts.

Behind a llama-server router (doors/router.py) the server part lists every model: a loaded one with
its child's slots (and what each front door's Engine of that model believes they hold), the
others by their status. Looking never loads a model (``autoload=false``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from oc_prefix_cache import loopback
from oc_prefix_cache.commands.status import disk_part
from oc_prefix_cache.disk.events import read_events
from oc_prefix_cache.errors import OcpcError, ServerError
from oc_prefix_cache.llama.client import SlotClient, Timeouts
from oc_prefix_cache.settings import Settings

QUICK = Timeouts(connect=0.3, quick=1.0)
LAST_REQUESTS = 8


def snapshot(settings: Settings, server: str, *, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    return {
        "at": now,
        "server": _server(server),
        "doors": _doors(settings),
        "requests": _requests(settings.log_dir, now),
        "disk": _disk(settings),
    }


def _server(url: str) -> dict[str, Any]:
    part: dict[str, Any] = {"url": url, "up": False}
    with SlotClient(url, timeouts=QUICK) as client:
        try:
            props = client.props()
            if props.get("role") == "router":
                return _router(url, part)
            slots = client.slots()
        except OcpcError as exc:
            part["error"] = str(exc)
            return part
    part.update(up=True, model=Path(str(props.get("model_path") or "?")).name, slots=_slots(slots))
    return part


def _router(url: str, part: dict[str, Any]) -> dict[str, Any]:
    """A router: each model, a loaded one with its slots (router.models_view)."""
    from oc_prefix_cache.doors.router import models_view

    models = models_view(url, timeouts=QUICK)
    if models is None:
        part["error"] = f"the router at {url} did not list its models (GET /models)"
        return part
    part.update(
        up=True,
        router=True,
        models=[
            {"id": m["id"], "status": m["status"]}
            | ({"error": m["error"]} if "error" in m else {})
            | (
                {"model": Path(str(m.get("model_path") or "?")).name, "slots": _slots(m["slots"])}
                if "slots" in m
                else {}
            )
            for m in models
        ],
    )
    return part


def _slots(slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": s.get("id"),
            "busy": bool(s.get("is_processing")),
            "n_ctx": s.get("n_ctx"),
            "tokens": s.get("n_prompt_tokens"),
            "reused": s.get("n_prompt_tokens_cache"),
            "processed": s.get("n_prompt_tokens_processed"),
        }
        for s in slots
        if isinstance(s, dict)
    ]


def _doors(settings: Settings) -> dict[str, Any]:
    """What the daemon (plugin) and the proxy each believe of the slots, and do now; behind a
    router, also per model (``models``: its Engine's view)."""
    doors = {}
    for name, url in (("daemon", f"{settings.daemon_url}/v1/status"), ("proxy", f"{settings.proxy_url}/ocpc/status")):
        try:
            data = loopback.get(url, timeout=httpx.Timeout(1.0, connect=0.3), what=f"ocpc's {name}").json()
        except (ServerError, ValueError):
            continue
        prepare = (data.get("daemon") if name == "daemon" else data.get("prepare")) or {}
        doors[name] = _door(prepare)
        models = data.get("models") if isinstance(data.get("models"), dict) else {}
        doors[name]["models"] = {
            model: _door((status.get("prepare") if name == "proxy" else status) or {})
            for model, status in models.items()
            if model and isinstance(status, dict)
        }
    return doors


def _door(prepare: dict[str, Any]) -> dict[str, Any]:
    return {
        "holding": (prepare.get("tracker") or {}).get("slots") or {},
        "doing": prepare.get("doing") or {},
        "counters": prepare.get("counters") or {},
        "stood_down": prepare.get("stood_down"),
    }


def _requests(folder: Path, now: float) -> list[dict[str, Any]]:
    recent = list(read_events(folder, since=now - 86400))
    return [e.to_json() for e in recent if e.door != "ocpc"][-LAST_REQUESTS:]


def _disk(settings: Settings) -> dict[str, Any]:
    part = disk_part(settings)
    return {
        "by_kind": part["by_kind"],
        "total_bytes": part["total_bytes"],
        "cap_bytes": part["cap_bytes"],
        "park_cap_bytes": part["park_cap_bytes"],
        "index_error": part["index_error"],
        "parks": [
            {"file": f["file"], "tokens": f["prefix_tokens"], "bytes": f["bytes"], "session": f["session"]}
            for f in part["files"]
            if f["kind"] == "conv"
        ][:5],
    }


# -- drawing -------------------------------------------------------------------------------------


def render(snap: dict[str, Any]) -> RenderableType:
    return Group(_slots_table(snap), _requests_table(snap), _disk_line(snap))


def _slots_table(snap: dict[str, Any]) -> RenderableType:
    server = snap["server"]
    if not server["up"]:
        return Text(f"llama-server {server['url']}: down ({server.get('error', '?')})", style="red")
    if server.get("router"):
        return _router_tables(snap)
    return _table(f"{server['url']}  {server['model']}", server["slots"], snap["doors"], snap["at"])


def _router_tables(snap: dict[str, Any]) -> RenderableType:
    """One slots table per loaded model, then a line with the others and their status."""
    server = snap["server"]
    parts: list[RenderableType] = []
    for model in server["models"]:
        if "slots" in model:
            doors = {
                name: door["models"][model["id"]]
                for name, door in snap["doors"].items()
                if model["id"] in door.get("models", {})
            }
            parts.append(
                _table(
                    f"{server['url']} router: {model['id']}  {model['model']}  (loaded)",
                    model["slots"],
                    doors,
                    snap["at"],
                    no_door="-" if snap["doors"] else None,
                )
            )
    others = [f"{m['id']} ({m['status']})" for m in server["models"] if "slots" not in m]
    loaded = sum(1 for m in server["models"] if "slots" in m)
    line = f"router {server['url']}: {len(server['models'])} models, {loaded} loaded"
    parts.append(Text(escape(line + (f"; not loaded: {', '.join(others)}" if others else ""))))
    return Group(*parts)


def _table(
    title: str, slots: list[dict[str, Any]], doors: dict[str, Any], now: float, *, no_door: str | None = None
) -> Table:
    table = Table(title=escape(title), title_justify="left", expand=False)
    for name in ("slot", "state", "holds (ocpc)", "tokens", "doing"):
        table.add_column(name)
    for slot in slots:
        sid = str(slot["id"])
        holds = _holding(doors, sid) if doors or no_door is None else no_door
        table.add_row(
            sid,
            "busy" if slot["busy"] else "idle",
            holds,
            f"{slot['tokens'] or 0:,}/{slot['n_ctx'] or 0:,}",
            _doing(doors, sid, now),
        )
    return table


def _holding(doors: dict[str, Any], slot: str) -> str:
    for name, door in doors.items():
        held = door["holding"].get(slot)
        if held:
            what = {"head": "head", "proj": "project head", "conv": "conversation"}.get(held.get("kind"), "?")
            who = held.get("conversation") or held.get("key") or ""
            return escape(f"{what} {who[:28]} ({held.get('tokens', 0):,} tok) [{name}]")
    return "-" if doors else "(no ocpc door running)"


def _doing(doors: dict[str, Any], slot: str, now: float) -> str:
    for door in doors.values():
        doing = door["doing"].get(slot)
        if doing:
            spent = now - float(doing.get("since", now))
            expected = doing.get("expected_s")
            progress = f" {min(spent / expected, 1):.0%} of ~{expected:.1f} s" if expected else ""
            return escape(f"{doing['what']} {doing.get('tokens', 0):,} tok, {spent:.1f} s{progress}")
    return ""


def _requests_table(snap: dict[str, Any]) -> RenderableType:
    routed = bool(snap["server"].get("router"))
    table = Table(title="last requests", title_justify="left")
    names = ("time", "harness", "door", *(("model",) if routed else ()), "slot", "served by", "reused", "processed")
    for name in names:
        table.add_column(name, justify="right" if name in ("reused", "processed", "slot") else "left")
    for e in snap["requests"]:
        served = e["source"] or e["action"]
        model = (escape(e["server"].partition("#model=")[2] or "-"),) if routed else ()
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["at"])),
            escape(e["harness"]),
            e["door"],
            *model,
            str(e["slot"]),
            escape(served),
            f"{e['cache_n']:,}",
            f"{e['prompt_n']:,}",
        )
    if not snap["requests"]:
        table.add_row("-", "no request yet", *[""] * (len(names) - 2))
    return table


def _disk_line(snap: dict[str, Any]) -> RenderableType:
    disk = snap["disk"]
    kinds = disk["by_kind"]

    def gb(n: int | None) -> str:
        return "no cap" if n is None else f"{n / 1e9:.2f} GB"

    heads = kinds["head"]["bytes"] + kinds["proj"]["bytes"]
    line = (
        f"disk: heads {kinds['head']['files']} + project heads {kinds['proj']['files']}: {gb(heads)} of "
        f"{gb(disk['cap_bytes'])}; parks {kinds['conv']['files']}: {gb(kinds['conv']['bytes'])} of "
        f"{gb(disk['park_cap_bytes'])}"
    )
    if disk["index_error"]:
        line += f"; index unreadable: {disk['index_error']}"
    parks = "".join(
        f"\n  park {escape(p['file'])} {p['tokens'] or 0:,} tok {escape(p['session'][:30])}" for p in disk["parks"]
    )
    return Text.from_markup(escape(line) + parks)


def run(take: Callable[[], dict[str, Any]], *, interval: float) -> None:
    """Redraw until Ctrl-C."""
    from rich.live import Live

    with Live(render(take()), refresh_per_second=4, screen=True) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(take()))
        except KeyboardInterrupt:
            pass
