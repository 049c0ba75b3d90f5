"""The house in figures, from the code's own imports: files, lines, floors, circles, and the
imports that run against the layers (docs/design.md). Run it on any tree of the package:

    python bench/house_figures.py                      # this checkout
    python bench/house_figures.py --tree /tmp/before   # another (e.g. `git worktree add /tmp/before c925d62`)

Modules are read, never imported. A "floor" is a module's height in the import graph with
each circle drawn as one room (floor 1 imports nothing of the package); a "circle" is a set of
modules that import each other in a loop (TYPE_CHECKING imports count: a reader follows them
too); "against the layers" counts imports from a module to one in a higher layer of the
contract in pyproject.toml ([tool.importlinter]), with a flat tree's modules placed in the
folder they moved to (MOVED below), so a tree before the folders is measured by the same map.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

PKG = "oc_prefix_cache"
# Where the flat package's modules went (issue 38): old name -> new dotted name under the package.
MOVED = {
    "head": "chat.head", "conversation": "chat.conversation", "anthropic": "chat.anthropic",
    "responses": "chat.responses", "slot_client": "llama.client", "server_info": "llama.server_info",
    "fingerprint": "llama.fingerprint", "families": "llama.families", "gguf_meta": "llama.gguf_meta",
    "process": "llama.supervisor", "llama_process": "llama.server_process", "store": "disk.index",
    "parks": "disk.park_files", "slotfile": "disk.slotfile", "events": "disk.events", "gc": "disk.gc",
    "privacy": "disk.privacy", "prepare": "engine.prepare", "prepared": "engine.issued",
    "lifecycle": "engine.lifecycle", "decision": "engine.decision", "executor": "engine.executor",
    "gates": "engine.gates", "loading": "engine.loading", "occupant": "engine.occupant",
    "parking": "engine.parker", "ahead": "engine.park_ahead", "ramtier": "engine.ram_tier",
    "ramcache": "engine.ram_contents", "tracker": "engine.tracker", "broker": "engine.broker",
    "affinity": "engine.affinity", "planner": "engine.planner", "render": "engine.head_render",
    "report": "engine.report", "standdown": "engine.standdown", "warmstart": "engine.warm_start",
    "server_view": "engine.observer", "ondisk": "engine.ondisk", "instances": "engine.instances",
    "capability": "engine.capability", "daemon": "doors.daemon", "proxy": "doors.proxy",
    "proxy_server": "doors.proxy_server", "router": "doors.router", "relay": "doors.relay",
    "upstream": "doors.upstream", "guard": "doors.guard", "launch": "commands.launch",
    "demo": "commands.demo", "doctor": "commands.doctor", "status": "commands.status",
    "top": "commands.top", "stats": "commands.stats", "proxy_env": "commands.proxy_env",
    "jsonc": "install.jsonc", "rig": "rig.build", "tinymodels": "rig.tiny_models",
    "realmodels": "rig.real_models",
}  # fmt: skip


def modules(tree: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``tree``."""
    out = {}
    for path in sorted((tree / PKG).rglob("*.py")):
        parts = list(path.relative_to(tree).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (relative imports resolved; ``from a import b``
    counts ``a.b`` where that is a module, else ``a``)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != PKG:
                found.add(target)
                break
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def floors(graph: dict[str, set[str]], loops: list[list[str]]) -> dict[str, int]:
    room = {m: m for m in graph}
    for loop in loops:
        for m in loop:
            room[m] = loop[0]
    height: dict[str, int] = {}

    def of(r: str, seen: frozenset[str] = frozenset()) -> int:
        if r in height:
            return height[r]
        members = [m for m in graph if room[m] == r]
        below = {room[t] for m in members for t in graph[m]} - {r}
        height[r] = 1 + max((of(b, seen | {r}) for b in below), default=0)
        return height[r]

    return {m: of(room[m]) for m in graph}


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The contract's layer of a module (0 = top), a flat tree's module placed where it moved."""
    rest = module.removeprefix(PKG + ".")
    head = rest.split(".")[0]
    if head in MOVED and "." not in rest:
        rest = MOVED[head]
    dotted = f"{PKG}.{rest}"
    for i, layer in enumerate(layers):
        if any(dotted == m or dotted.startswith(m + ".") for m in layer):
            return i
    return None


def room_of(module: str) -> str:
    """A room, as house.md draws them: a folder of the package, or one of its top-level modules."""
    return ".".join(module.split(".")[:2])


def measure(tree: Path, layers: list[list[str]]) -> dict[str, object]:
    mods = modules(tree)
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    loops = circles(graph)
    height = floors(graph, loops)
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        if a == PKG:
            continue
        rooms[room_of(a)] |= {room_of(b) for b in targets if room_of(b) != room_of(a)}
    room_loops = circles(dict(rooms))
    against = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if (la := layer_of(a, layers)) is not None and (lb := layer_of(b, layers)) is not None and lb < la
    )
    folders = {m.rsplit(".", 1)[0] for m, p in mods.items() if p.name != "__init__.py"}
    return {
        "tree": str(tree),
        "files": len(mods),
        "folders": len(folders),
        "lines": sum(len(p.read_text().splitlines()) for p in mods.values()),
        "imports": sum(len(t) for t in graph.values()),
        "floors": max(height.values()),
        "circles": loops,
        "rooms": len(rooms),
        "room floors": max(floors(dict(rooms), room_loops).values()),
        "room circles": room_loops,
        "against the layers": against,
        "built a Preparer": sorted(
            m for m, p in mods.items() if "Preparer(" in p.read_text() and "class Preparer" not in p.read_text()
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, action="append", help="a checkout of the project (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    config = tomllib.loads((here / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [[m.strip() for m in layer.split("|")] for layer in config["layers"]]
    results = [measure(tree.resolve(), layers) for tree in (args.tree or [here])]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(
            f"{r['tree']}: {r['files']} files in {r['folders']} folders, {r['lines']:,} lines, "
            f"{r['imports']} imports; files on {r['floors']} floors"
        )
        print(
            f"  rooms (a folder or a top-level module): {r['rooms']} on {r['room floors']} floors, "
            f"{len(r['room circles'])} circles"
        )  # type: ignore[arg-type]
        print(f"  circles: {len(r['circles'])}" + "".join(f"\n    {' <-> '.join(c)}" for c in r["circles"]))  # type: ignore[union-attr]
        against = r["against the layers"]
        print(f"  imports against the layers: {len(against)}" + "".join(f"\n    {a}" for a in against))  # type: ignore[arg-type]
        print(f"  modules that build a Preparer: {', '.join(r['built a Preparer']) or 'none'}")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
