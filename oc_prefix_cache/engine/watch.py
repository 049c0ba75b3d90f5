"""Between requests: what the engine does for one server while no request asks.

The daemon and the proxy call ``Watch.run`` every second: notice a restart early (one look at
the slots), take back slots lent to requests whose report never came, park ahead the
conversations of slots left idle (engine/park_ahead.py), and write noted file uses to the index
when due. Behind a router, nothing here loads an unloaded model (every call is a background
one: ``autoload=false``).
"""

from __future__ import annotations

from collections.abc import Callable

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import UsageLog
from oc_prefix_cache.engine.broker import SlotBroker
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.park_ahead import AheadWriter
from oc_prefix_cache.engine.shared import SharedFiles
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.settings import Settings


class Watch:
    """One server's work between requests, with the collaborators it uses."""

    def __init__(
        self,
        *,
        settings: Settings,
        server: str,
        client: SlotClient,
        view: ServerView,
        broker: SlotBroker,
        usage: UsageLog,
        ahead: AheadWriter,
        stood_down: Callable[[], str | None],
        count: Callable[[str], None],
        shared: SharedFiles | None = None,
    ) -> None:
        self.settings, self.server, self.client, self.view = settings, server, client, view
        self.broker, self.usage, self.ahead = broker, usage, ahead
        self.stood_down, self.count, self.shared = stood_down, count, shared

    def run(self) -> None:
        with self.client.background():
            try:
                self.view.observe(self.settings.slot)
                n_slots = self.broker.slots_known()
                if n_slots is not None:  # its slots exist: gc keeps their current files (UsageLog.alive)
                    self.usage.alive(self.server, n_slots)
            except OcpcError:
                pass  # down or restarting: the next look tells
            self._reclaim_leases()
            if not self.stood_down():
                # with a shared store every turn is parked (what another box continues from)
                park_min = 0 if self.shared is not None else self.settings.park_min_tokens
                self.ahead.run(threshold_s=self._ahead_threshold(), park_min=park_min)
            if self.usage.due():
                self.usage.flush_or_keep()
            if self.shared is not None:
                self.shared.publish_if_due()

    def _ahead_threshold(self) -> float | None:
        """How long a park must take to be written ahead. Behind a router, every park is: the
        router unloads a model without a word, so a park left for the displacement is never made.
        With a shared store too: a box can die without a word, and its conversations continue on
        another box from their last park."""
        threshold = self.settings.park_ahead_s
        always = self.client.model is not None or self.shared is not None
        return 0.0 if threshold is not None and always else threshold

    def _reclaim_leases(self) -> None:
        """Slots lent to the plugin's requests whose report never came (an answer without timings,
        a plugin that gave up) are taken back once the server shows them idle (engine/broker.py)."""
        if not self.broker.overdue():  # no /slots call for leases whose request is still young
            return
        try:
            slots = self.client.slots(deadline=Deadline.after(2.0))
        except OcpcError:
            return
        idle = {s.get("id"): not s.get("is_processing") for s in slots if isinstance(s, dict)}
        tasks = {s.get("id"): s["id_task"] for s in slots if isinstance(s, dict) and isinstance(s.get("id_task"), int)}
        if self.broker.reclaim(lambda slot: idle.get(slot) is True, task=tasks.get):
            self.count("lease_reclaimed")
