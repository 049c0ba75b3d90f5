"""The composition root: the one place an engine for one llama-server is built.

The daemon (for its server, and for each model behind a router), the proxy and every test
build an engine here and nowhere else, so the parts and who gets which collaborator are
written down once. Each part gets what it uses (a counter, a look at the slots, the tracker),
never the object that owns it: the prepare path does not know the lifecycle, the lifecycle
does not know the prepare path; they share a small record of slot activity.

    Engine                     what a door holds: prepare, report, watch, start and stop, status
      ├─ Preparer              the prepare path (engine/prepare.py)
      ├─ Reporter              what the real request reused (engine/report.py)
      ├─ Lifecycle             parks before a stop, warm starts, a process gone (engine/lifecycle.py)
      ├─ Watch                 between requests (engine/watch.py)
      ├─ SlotBroker            which slot a request takes on -np N (engine/broker.py)
      └─ the parts they share  tracker, server view, executor, disk, RAM tier, occupant, parker,
                               park ahead, loader, instances, stand-down, telemetry, slot activity

A few parts need each other both ways (the server view learns the RAM cache's size for the RAM
tier, which reads the view's argv; the broker names conversations by the instances, which ask
the broker's table what is busy): here, and only here, such a link is a late-bound call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.content_digest import shared as shared_digests
from oc_prefix_cache.disk.events import EventLog
from oc_prefix_cache.disk.gc import AfterSaves
from oc_prefix_cache.disk.index import Store, UsageLog
from oc_prefix_cache.disk.shared_store import SharedStore, box_id
from oc_prefix_cache.engine.broker import SlotBroker
from oc_prefix_cache.engine.capability import Capabilities, SelfTest
from oc_prefix_cache.engine.executor import Executor
from oc_prefix_cache.engine.instances import Instances
from oc_prefix_cache.engine.issued import Records
from oc_prefix_cache.engine.lifecycle import Lifecycle
from oc_prefix_cache.engine.loading import Loader
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.occupant import Occupant
from oc_prefix_cache.engine.ondisk import OnDisk
from oc_prefix_cache.engine.park_ahead import AheadWriter, IdleSlots
from oc_prefix_cache.engine.parker import Parker
from oc_prefix_cache.engine.planner import HeadPlanner
from oc_prefix_cache.engine.prepare import ACTIONS, HeadRule, Preparer, PrepareResult
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.report import Reporter
from oc_prefix_cache.engine.shared import SharedFiles
from oc_prefix_cache.engine.slot_activity import SlotActivity
from oc_prefix_cache.engine.standdown import Declarer, StandDown
from oc_prefix_cache.engine.telemetry import Stats, Telemetry
from oc_prefix_cache.engine.tracker import SlotTracker
from oc_prefix_cache.engine.watch import Watch
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import server_key
from oc_prefix_cache.llama.server_info import port_of, read_runtime
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.prepare")


class Background:
    """One worker thread for work nobody waits on (gc after a save, index writes of uses)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=64)
        self._thread = threading.Thread(target=self._run, name="ocpc-background", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            log.warning("background queue full; dropping a job (the next save schedules gc again)")

    def stop(self, *, timeout: float = 10.0) -> None:
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a background job must not kill the worker
                log.exception("background job failed")


@dataclass(frozen=True)
class Engine:
    """One llama-server's engine, as the doors see it: the parts built by ``build_engine``.

    Its methods only hand a door's call to the part whose job it is, so a door holds one
    object and a reader sees in one place where each call goes."""

    settings: Settings
    server: str  # the server's URL (and model behind a router): the tracker's and broker's key
    client: SlotClient
    store: Store
    tracker: SlotTracker
    planner: HeadPlanner
    executor: Executor
    view: ServerView
    disk: OnDisk
    ram: RamTier
    occupant: Occupant
    parker: Parker
    standdown: StandDown
    broker: SlotBroker
    preparer: Preparer
    reporter: Reporter
    lifecycle: Lifecycle
    watcher: Watch
    usage: UsageLog
    telemetry: Telemetry
    activity: SlotActivity
    shared: SharedFiles | None = None  # many boxes: the store the boxes share (engine/shared.py)

    # -- a request -----------------------------------------------------------------
    def prepare(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        *,
        slot: int | None = None,
        deadline: Deadline | None = None,
        session: str | None = None,
        head_of: HeadRule | None = None,
        harness: str | None = None,
        conversation: str | None = None,
    ) -> PrepareResult:
        """Make a slot ready for a chat-completions body; never raises (engine/prepare.py)."""
        return self.preparer.prepare(
            raw,
            headers,
            slot=slot,
            deadline=deadline,
            session=session,
            head_of=head_of,
            harness=harness,
            conversation=conversation,
        )

    def report(
        self,
        *,
        fingerprint: str,
        cache_n: int,
        prompt_n: int,
        prepare_id: str = "",
        predicted_n: int | None = None,
        prompt_ms: float | None = None,
        door: str = "plugin",
    ) -> dict[str, Any]:
        """Learn from the real request: did it reuse what was prepared for it? (engine/report.py)"""
        report = self.reporter.report(
            fingerprint=fingerprint,
            cache_n=cache_n,
            prompt_n=prompt_n,
            prepare_id=prepare_id,
            predicted_n=predicted_n,
            prompt_ms=prompt_ms,
            door=door,
        )
        self.telemetry.reported(report)
        return dict(report)

    def count(self, key: str) -> None:
        """Count an event a front door saw (``status()["counters"]``)."""
        self.telemetry.count(key)

    # -- between requests, and around the server's life ------------------------------
    def watch(self) -> None:
        """Between requests, every second (engine/watch.py)."""
        self.watcher.run()

    def park_live(self, *, deadline: Deadline) -> list[dict[str, Any]]:
        """Park every conversation the slots hold: a graceful stop comes next (engine/lifecycle.py)."""
        return self.lifecycle.park_live(deadline=deadline)

    def warm_start(self, *, deadline: Deadline, yielding: bool = False) -> list[str]:
        """Bring the heads other boxes warmed (a shared store: engine/shared.py), then restore into
        each idle slot the head or project head it held last (engine/lifecycle.py)."""
        brought = self._bring_heads(deadline) if self.shared is not None else []
        said = [f"{len(brought)} heads brought from the shared store"] if brought else []
        return said + self.lifecycle.warm_start(deadline=deadline, yielding=yielding)

    def _bring_heads(self, deadline: Deadline) -> list[str]:
        assert self.shared is not None
        try:
            identity = server_key(self.view.identity(deadline))
        except OcpcError as exc:  # the server not up yet, its model not digested yet: the first miss brings them
            log.info("no heads brought from the shared store at start: %s", exc)
            return []
        return self.shared.bring_heads(identity, deadline=deadline)

    def warm_loaded(self, *, woke: bool, deadline: Deadline) -> list[str]:
        """Behind a router: warm the slots of a model just loaded or woken (engine/lifecycle.py)."""
        return self.lifecycle.warm_loaded(woke=woke, deadline=deadline)

    def process_ended(self, why: str, *, if_known: bool = False) -> None:
        """The server's process ended, known from elsewhere (a router unloaded this model)."""
        self.lifecycle.process_ended(why, if_known=if_known)

    def flush_usage(self) -> None:
        self.usage.flush_or_keep()

    # -- what it says of itself ------------------------------------------------------
    def stood_down(self) -> str | None:
        """Why ocpc stands down on this server process (restores cannot serve), or None.

        Memory only, no server call: the proxy asks before every request. A restart (a new
        server process, noticed by any look at the slots) ends it; the facts are read again."""
        return self.standdown.why(self.tracker.epoch(self.server))

    @property
    def stats(self) -> Stats:
        return self.telemetry.stats

    def status(self) -> dict[str, Any]:
        counters, events, last_report = self.telemetry.snapshot()
        capability = self.preparer.capability
        return {
            "counters": {a: counters.get(a, 0) for a in ACTIONS}
            | {k: v for k, v in counters.items() if k not in ACTIONS},
            "events": events,
            "last_report": last_report,
            "tracker": self.tracker.snapshot().get(self.server, {}),
            "stood_down": self.stood_down(),
            "capability": capability.to_json() if capability else None,
            "doing": self.activity.snapshot(),
            "shared": dict(self.shared.counts) if self.shared is not None else None,
        }


def build_engine(
    *,
    settings: Settings,
    client: SlotClient,
    store: Store,
    tracker: SlotTracker | None = None,
    planner: HeadPlanner | None = None,
    server_binary: Path | None = None,
    runtime: dict[str, Any] | None = None,
    schedule: Callable[[Callable[[], None]], None] | None = None,
) -> Engine:
    """Build one server's engine. ``tracker``: shared by every engine of one process (several
    servers, a router's models); ``schedule``: the daemon's background worker (else a thread
    per job); ``server_binary``/``runtime``: how ``ocpc launch`` started the server, when it did."""
    server = client.server_id
    tracker = tracker or SlotTracker(lock_dir=settings.home)
    planner = planner or HeadPlanner()
    usage = UsageLog(store)
    telemetry = Telemetry(server=server, events=EventLog(settings.log_dir))
    client.on_evaluate = telemetry.own_prefill
    gc = AfterSaves(settings, schedule=schedule or _in_a_thread, flush=usage.flush_or_keep)
    executor = Executor(
        client=client,
        tracker=tracker,
        store=store,
        slot_dir=settings.slot_dir,
        on_saved=gc.saved,
        known=settings.slot_versions,
    )
    standdown = StandDown()
    declare = Declarer(server=server, standdown=standdown, telemetry=telemetry)
    records = Records()  # what each prepare did, until its report (engine/issued.py)
    idle = IdleSlots()  # slots left idle by a served request: parks written ahead (engine/park_ahead.py)
    activity = SlotActivity(epoch=lambda: tracker.epoch(server), seconds_for=executor.costs.seconds_for)
    ram: RamTier | None = None  # the view and the RAM tier need each other: bound below
    view = ServerView(
        client=client,
        tracker=tracker,
        read_slot=lambda slot, deadline: executor.observe(slot, deadline=deadline),
        binary=server_binary,
        runtime=runtime,
        learn=lambda cache: ram.learn(cache) if ram is not None else None,
        digests=shared_digests(settings.home / "digests.json"),  # the model's and binary's content: read once
    )
    shared = shared_files(settings, store)
    disk = OnDisk(slot_dir=settings.slot_dir, store=store, tracker=tracker, server=server)
    park_cap = None if settings.park_max_gb is None else round(settings.park_max_gb * 1e9)
    parker = Parker(client=client, planner=planner, executor=executor, tracker=tracker, park_max_bytes=park_cap)
    instances: Instances | None = None  # the broker names conversations by them; they ask its table: bound below
    broker = SlotBroker(
        server=server,
        tracker=tracker,
        props=lambda deadline: client.props(deadline=deadline),
        process_gone=view.process_gone,
        namer=lambda key, raw, going_on, rewrites, in_flight: _named(
            instances, key, raw, going_on, rewrites, in_flight
        ),
    )
    ram = RamTier(
        server=server,
        client=client,
        tracker=tracker,
        argv=view.argv,
        bytes_per_token=lambda: executor.costs.bytes_per_token,
        busy=broker.table.busy,
        count=telemetry.count,
    )
    instances = Instances(server=server, tracker=tracker, ram=ram, busy=broker.table.busy, index=disk.index)
    occupant = Occupant(
        server=server,
        tracker=tracker,
        view=view,
        parker=parker,
        ram=ram,
        park_min_tokens=settings.park_min_tokens,
        count=telemetry.count,
    )
    ahead = AheadWriter(
        server=server,
        tracker=tracker,
        idle=idle,
        seconds_for=executor.costs.seconds_for,
        observe=lambda slot, deadline: view.observe(slot, deadline=deadline),
        park=occupant.park_with_identity,
        count=telemetry.count,
        ram_over=ram.over,
    )
    reporter = Reporter(
        server=server,
        records=records,
        tracker=tracker,
        planner=planner,
        standdown=standdown,
        idle=idle,
        observe=view.observe,
        count=telemetry.count,
        declare=declare,
        event=telemetry.write,
    )
    loader = Loader(
        executor=executor,
        ram=ram,
        disk=disk,
        parker=parker,
        view=view,
        standdown=standdown,
        count=telemetry.count,
        declare=declare,
    )
    preparer = Preparer(
        settings=settings,
        server=server,
        client=client,
        tracker=tracker,
        planner=planner,
        executor=executor,
        view=view,
        disk=disk,
        usage=usage,
        records=records,
        occupant=occupant,
        ram=ram,
        ahead=ahead,
        idle=idle,
        loader=loader,
        instances=instances,
        standdown=standdown,
        declare=declare,
        capabilities=Capabilities(settings.capabilities_path),  # by a self-test at first contact
        selftest=SelfTest(client=client, slot_dir=settings.slot_dir, known=settings.slot_versions),
        activity=activity,
        telemetry=telemetry,
        shared=shared,
    )

    def stood_down() -> str | None:
        return standdown.why(tracker.epoch(server))

    lifecycle = Lifecycle(
        settings=settings,
        server=server,
        client=client,
        store=store,
        usage=usage,
        tracker=tracker,
        view=view,
        broker=broker,
        executor=executor,
        occupant=occupant,
        parker=parker,
        ram=ram,
        activity=activity,
        stood_down=stood_down,
        count=telemetry.count,
    )
    watcher = Watch(
        settings=settings,
        server=server,
        client=client,
        view=view,
        broker=broker,
        usage=usage,
        ahead=ahead,
        stood_down=stood_down,
        count=telemetry.count,
        shared=shared,
    )
    return Engine(
        settings=settings,
        server=server,
        client=client,
        store=store,
        tracker=tracker,
        planner=planner,
        executor=executor,
        view=view,
        disk=disk,
        ram=ram,
        occupant=occupant,
        parker=parker,
        standdown=standdown,
        broker=broker,
        preparer=preparer,
        reporter=reporter,
        lifecycle=lifecycle,
        watcher=watcher,
        usage=usage,
        telemetry=telemetry,
        activity=activity,
        shared=shared,
    )


def shared_files(settings: Settings, store: Store) -> SharedFiles | None:
    """The shared store's use by this box, when the user gave one (OC_PREFIX_CACHE_SHARED_STORE)."""
    if settings.shared_store is None:
        return None
    shared = SharedStore(settings.shared_store, box=box_id(settings.home), slot_dir=settings.slot_dir)
    return SharedFiles(shared=shared, store=store)


def engine_for_url(
    settings: Settings, *, server_url: str, tracker: SlotTracker | None = None, model: str | None = None
) -> Engine:
    """An engine of its own for a standalone proxy (``ocpc launch``'s proxy shares the daemon's
    instead); ``model``: one model of a llama-server router (doors/router.py)."""
    port = port_of(server_url)
    return build_engine(
        settings=settings,
        client=SlotClient(server_url, model=model),
        store=Store(index_path=settings.index_path, lock_path=settings.lock_path),
        tracker=tracker,
        schedule=Background().submit,
        runtime=read_runtime(settings, port) if port else None,
    )


def _named(
    instances: Instances | None,
    key: ConversationKey,
    raw: bytes,
    going_on: bool,
    rewrites: bool,
    in_flight: frozenset[str],
) -> str:
    """The broker's namer (under its lock): the conversation under a shared key (engine/instances.py)."""
    assert instances is not None, "the broker named a conversation before the engine was built"
    return instances.name(key, raw, continuing=going_on, rewrites_history=rewrites, in_flight=in_flight)


def _in_a_thread(job: Callable[[], None]) -> None:
    """Work nobody waits on, when no background worker was given (the daemon gives one)."""
    threading.Thread(target=job, name="ocpc-job", daemon=True).start()
