"""The router's load watch between two of its looks (router.LoadWatch), without a router.

The real router is tested in tests/rig/doors/test_router.py and tests/rig/commands/test_top.py; what cannot be made on
demand there is the timing: a request loads a model and the next request's model unloads it,
both between two looks a second apart. Here the router's ``GET /models`` is answered by respx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import respx

from oc_prefix_cache.disk.index import Store
from oc_prefix_cache.doors.router import LoadWatch
from oc_prefix_cache.engine.tracker import Holding, Observation, SlotTracker
from oc_prefix_cache.engine.wiring import Engine, build_engine
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.settings import Settings

ROUTER = "http://127.0.0.1:9"


def models(**status: str) -> dict[str, Any]:
    return {"data": [{"id": model, "status": {"value": value}} for model, value in status.items()]}


def engine(tmp_path: Path, tracker: SlotTracker, model: str) -> Engine:
    """A model's real Engine behind the router (it calls nothing until asked to prepare)."""
    settings = Settings.from_env({"OC_PREFIX_CACHE_HOME": str(tmp_path / "ocpc")})
    return build_engine(
        settings=settings,
        client=SlotClient(ROUTER, model=model),
        tracker=tracker,
        store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
    )


def test_a_model_loaded_and_unloaded_between_two_looks_loses_what_ocpc_knew_of_it(tmp_path: Path) -> None:
    """Before, only a model the watch had seen loaded was ended when it left: one that a request
    loaded and the next unloaded within the second kept its slots' holdings in `ocpc status` and
    `top` for as long as it stayed unloaded."""
    tracker = SlotTracker()
    made: dict[str, Engine] = {}
    watch = LoadWatch(
        ROUTER, engine_for=lambda m: made.setdefault(m, engine(tmp_path, tracker, m)), made=made.get, enabled=False
    )
    with respx.mock:
        route = respx.get(f"{ROUTER}/models")
        route.return_value = httpx.Response(200, json=models(a="unloaded", b="unloaded"))
        watch.tick()
        made["a"] = engine(tmp_path, tracker, "a")  # a request to model a: its Engine, what it left in slot 0
        server = made["a"].server
        left = Observation(id_task=3, n_tokens=1400, n_processed=1400, n_cached=0)
        tracker.leave(server, 0, Holding("conv", "c", "h", 1400, False, left, conversation="c"))
        assert tracker.knows(server)
        route.return_value = httpx.Response(200, json=models(a="unloaded", b="loaded"))
        watch.tick()
        assert tracker.holding(server, 0) is None and not tracker.knows(server)
        epoch = tracker.epoch(server)
        watch.tick()  # still unloaded: nothing more to drop, the epoch stays
        assert tracker.epoch(server) == epoch
        assert "b" not in made  # a model no request used gets no Engine from a look
