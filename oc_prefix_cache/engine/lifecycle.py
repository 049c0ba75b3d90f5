"""A server's lifecycle around the requests: park what its slots hold before it stops, warm its
slots before the first request after it (re)starts or a router loads its model, forget it when
its process ended. Kept apart from the request path (engine/prepare.py): these steps share its
locks, observations and executor, which engine/wiring.py hands to both.

Why each exists: a graceful stop would otherwise lose the live conversations' unparked tails;
a restarted server's first request would wait for its head's restore (seconds on a 27B); a
router unloads and loads models without a word to anyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Store, UsageLog, slot_key
from oc_prefix_cache.disk.slotfile import read_header
from oc_prefix_cache.engine.broker import SlotBroker
from oc_prefix_cache.engine.executor import Executor, Prefix
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.occupant import Occupant
from oc_prefix_cache.engine.parker import Parker
from oc_prefix_cache.engine.planner import HeadPlan
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.slot_activity import SlotActivity
from oc_prefix_cache.engine.tracker import Holding, SlotTracker
from oc_prefix_cache.engine.warm_start import Pick, choose
from oc_prefix_cache.errors import LockTimeout, OcpcError, SlotFileError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import server_key
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.prepare")

LOCK_TRY_S = 0.05  # a warm start after a load takes a slot only if nobody holds it (a request's hold)


class Lifecycle:
    """One server's steps outside any request (see the module docstring), with the collaborators
    they use (built by engine/wiring.py, shared with the prepare path)."""

    def __init__(
        self,
        *,
        settings: Settings,
        server: str,
        client: SlotClient,
        store: Store,
        usage: UsageLog,
        tracker: SlotTracker,
        view: ServerView,
        broker: SlotBroker,
        executor: Executor,
        occupant: Occupant,
        parker: Parker,
        ram: RamTier,
        activity: SlotActivity,
        stood_down: Callable[[], str | None],
        count: Callable[[str], None],
    ) -> None:
        self.settings, self.server, self.client, self.store, self.usage = settings, server, client, store, usage
        self.tracker, self.view, self.broker, self.executor = tracker, view, broker, executor
        self.occupant, self.parker, self.ram, self.activity = occupant, parker, ram, activity
        self.stood_down, self.count = stood_down, count

    def park_live(self, *, deadline: Deadline) -> list[dict[str, Any]]:
        """Park every conversation this server's slots hold (a graceful stop comes next), then
        those that live only in its RAM cache (``_park_ram``).

        Only what ocpc can vouch for (the slot still holds the conversation's last request)
        and is worth it; each slot under its lock, all within ``deadline``. A crash skips
        this and loses at most the tails not parked yet; parks on disk are never touched.
        """
        out: list[dict[str, Any]] = []
        if self.stood_down():
            log.info("park before stop: nothing to park, ocpc stood down on this server (%s)", self.stood_down())
            return out
        slots = self.tracker.slots(self.server)
        for i, slot in enumerate(slots):
            item: dict[str, Any] = {"slot": slot}
            # each slot gets its share of what is left: a busy slot 0 must not spend the
            # whole stop's budget waiting for its lock while slots 1..N go unparked
            share = Deadline.after(deadline.remaining() / (len(slots) - i))
            try:
                with self.tracker.slot_lock(self.server, slot, deadline=share):
                    seen = self.view.observe(slot, deadline=share)
                    holding = seen.holding
                    if seen.restarted or holding is None or holding.kind != "conv" or seen.trail is None:
                        item["parked"] = False
                        item["why"] = "no conversation ocpc can vouch for"
                    elif holding.n_tokens - holding.stored < self.settings.park_min_tokens:
                        item["parked"] = False
                        item["why"] = f"only {holding.n_tokens - holding.stored} tokens not in a file yet"
                    else:
                        server = self.view.identity(share)
                        identity = server_key(server)
                        after = self.occupant.park(seen, slot, server=server, identity=identity, deadline=share)
                        item["parked"] = True
                        item["why"] = f"parked {after.holding.n_tokens if after.holding else 0} tokens"
            except OcpcError as exc:
                item["parked"] = False
                item["why"] = str(exc)
            log.info("park before stop, slot %d: %s", slot, item["why"])
            out.append(item)
        if slots:
            in_slots = {h.conversation for h in (self.tracker.holding(self.server, s) for s in slots) if h}
            out += self._park_ram(slots[0], skip=in_slots, deadline=deadline)
        return out

    def _park_ram(self, slot: int, *, skip: set[str], deadline: Deadline) -> list[dict[str, Any]]:
        """Park, through ``slot`` (its own conversation parked already), the conversations that live
        only in the server's RAM cache (not ``skip``: those the slots hold), newest first, while the
        stop's budget lasts: the stop empties that cache. The server loads each back for its park's
        evaluation."""
        out: list[dict[str, Any]] = []
        epoch = self.tracker.epoch(self.server)
        for holding, trail in self.ram.parkable(epoch=epoch, min_tokens=self.settings.park_min_tokens):
            if holding.conversation in skip:  # a slot holds it: parked with its slot above
                continue
            if deadline.remaining() < 1.0:
                out.append({"conversation": holding.conversation, "parked": False, "why": "no time left"})
                continue
            item: dict[str, Any] = {"conversation": holding.conversation, "from": "the server's RAM cache"}
            try:
                with self.tracker.slot_lock(self.server, slot, deadline=deadline):
                    server = self.view.identity(deadline)
                    done = self.parker.park_from_ram(
                        holding,
                        trail,
                        slot,
                        epoch=epoch,
                        server=server,
                        identity=server_key(server),
                        deadline=deadline,
                        first=lambda tokens: self.ram.clear(slot, tokens, deadline=deadline),
                    )
                item["parked"], item["why"] = True, f"parked {len(done.tokens)} tokens through slot {slot}"
                self.count("parked_from_ram")
            except OcpcError as exc:
                item["parked"], item["why"] = False, str(exc)
            log.info("park before stop, %s from the RAM cache: %s", holding.conversation, item["why"])
            out.append(item)
        return out

    def process_ended(self, why: str, *, if_known: bool = False) -> None:
        """The server's process ended, known from elsewhere (a router unloaded this model): what its
        slots held, its file proofs and its witness go (``ocpc status`` and ``top`` stop showing them).
        ``if_known``: only where ocpc believes something of it (asked every second, it ends once)."""
        if not if_known or self.tracker.knows(self.server):
            self.tracker.restarted(self.server, why)

    def warm_loaded(self, *, woke: bool, deadline: Deadline) -> list[str]:
        """Behind a router: its model was just loaded (a new child process) or woke from sleep (a
        new context in the same process). The warm start of ``warm_start``, yielding to requests
        (``yielding``), and with every call saying ``autoload=false``: if the router unloads the
        model meanwhile, ocpc's restores fail instead of loading it again."""
        with self.client.background():
            if woke:
                self.tracker.restarted(self.server, "the router's model woke from sleep: a new context")
            try:
                self.view.observe(self.settings.slot, deadline=deadline)  # a new child: noticed by its witness
            except OcpcError as exc:
                return [f"not warmed: {exc}"]
            return self.warm_start(deadline=deadline, yielding=True)

    def warm_start(self, *, deadline: Deadline, yielding: bool = False) -> list[str]:
        """Restore into each idle slot the head or project head it held last (engine/warm_start.py), so
        the first request after a (re)start finds it in place (its prepare answers ``hit``).
        Each slot under its lock; one line per slot for the caller to print. Never raises.

        ``yielding`` (after a router's load, when a request may be what loaded the model): a slot
        a request has (a prepare running or just answered for it, its lock held, the server busy
        in it, or a task already run there) is passed over at once; the request's own prepare does
        what it needs. Without it (``ocpc launch``, before any request), a request that comes
        meanwhile waits for its slot's restore, within its own deadline, and finds it warm."""
        try:
            if self.stood_down():
                return [f"not warmed: ocpc stands down on this server ({self.stood_down()})"]
            self.view.argv()  # finds the server's process: the witness a restore without a task needs
            if not self.view.witnessed():
                return [
                    "not warmed: ocpc cannot watch the server's process (a restore then needs a probe, "
                    "and a probe needs a request's tokens)"
                ]
            server = self.view.identity(deadline)
            if server.cache.restores_serve:
                return [f"not warmed: {server.cache.restores_serve}"]
            self.usage.flush_or_keep()  # what this process noted of each slot (a load can come seconds after a use)
            n_slots = self.broker.n_slots(fresh=True)
            if self.broker.slots_known() is None:
                return ["not warmed: the server did not say how many slots it has (/props)"]
            picks, said = choose(
                self.store.load(),
                server=self.server,
                n_slots=n_slots,
                model=server.model_path,
                build=server.build,
                now=time.time(),
            )
        except OcpcError as exc:
            return [f"not warmed: {exc}"]
        for pick in picks:
            said.append(f"slot {pick.slot}: {self._warm_one(pick, deadline, yielding=yielding)}")
        return said

    def _warm_one(self, pick: Pick, deadline: Deadline, *, yielding: bool) -> str:
        started = time.perf_counter()
        path = self.settings.slot_dir / pick.entry.file
        if yielding and self.activity.busy(pick.slot):
            return "not warmed: a request has this slot (its own prepare decides)"
        try:
            with self.tracker.slot_lock(
                self.server, pick.slot, deadline=Deadline.after(LOCK_TRY_S) if yielding else deadline
            ):
                seen = self.view.observe(pick.slot, deadline=deadline)
                if seen.holding is not None or seen.now.busy or seen.now.id_task is not None:
                    return "not warmed: a request came first"
                if yielding and self.activity.busy(pick.slot):  # a prepare began while this one looked
                    return "not warmed: a request has this slot (its own prepare decides)"
                tokens = tuple(read_header(path).tokens)
                head = pick.entry.head or pick.key
                plan = HeadPlan(
                    fingerprint=head,
                    tokens=tokens,
                    request_tokens=tokens,
                    prompt="",
                    tools_in_head=True,
                    harness=pick.entry.harness,
                    split=False,
                )
                with self.activity.doing(pick.slot, f"warm start {pick.entry.kind}", len(tokens)):
                    done = self.executor.restore(
                        Prefix(pick.entry.kind, pick.key, tokens),
                        plan,
                        pick.slot,
                        prove=False,
                        before=seen.now,
                        epoch=seen.epoch,
                        deadline=deadline,
                        witnessed=True,
                        by_request=True,
                    )
                now = self.executor.observe(pick.slot, deadline=deadline)
                if now.id_task is not None:  # a request reached the slot first: the server ran the restore
                    self.count("warm_start_late")  # after it, and the head replaced what it left
                    log.warning(
                        "warm start of slot %d of %s: a request reached the slot before the restore, "
                        "which the server ran after it",
                        pick.slot,
                        self.server,
                    )
                self.tracker.leave(
                    self.server,
                    pick.slot,
                    Holding(
                        kind=pick.entry.kind,
                        key=pick.key,
                        head=head,
                        n_tokens=len(done.tokens),
                        exact=True,
                        left=now,
                        stored=len(done.tokens),
                    ),
                    epoch=seen.epoch,
                )
                self.usage.note(pick.key, slot=slot_key(self.server, pick.slot))
                self.ram.runs(pick.slot, tuple(done.tokens), epoch=seen.epoch)
                self.count("warm_start")
        except LockTimeout:
            return (
                "not warmed: a request has this slot (its own prepare decides)"
                if yielding
                else "not warmed: its slot stayed busy"
            )
        except (OcpcError, SlotFileError) as exc:
            self.count("warm_start_failed")
            return f"not warmed: {exc}"
        return (
            f"{pick.why}: restored {len(done.tokens):,} tokens in {(time.perf_counter() - started) * 1000:.0f} ms "
            "(the first request's report proves it)"
        )
