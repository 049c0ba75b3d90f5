"""The report: what the real request reused, learned after its answer.

A prepare only believes it made the slot ready; the server's own token counts for the request
(``cache_n``: tokens reused, ``prompt_n``: tokens processed) say whether it did. Served: the
slot's new state (the request and its reply) is bound to the conversation, so its next turn is
a hit without re-checking anything. Missed: ocpc forgets what the slot holds and makes the file
prove itself again on its next restore, never condemns it (another client taking the slot in
between also makes a miss). A report finds its prepare by id (engine/issued.py): a report binds the
slot to that prepare's conversation and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from oc_prefix_cache.disk.events import Event
from oc_prefix_cache.engine.gates import served_from_head
from oc_prefix_cache.engine.issued import Record, Records
from oc_prefix_cache.engine.park_ahead import Idle, IdleSlots
from oc_prefix_cache.engine.planner import HeadPlanner
from oc_prefix_cache.engine.standdown import StandDown
from oc_prefix_cache.engine.tracker import Holding, Seen, SlotTracker
from oc_prefix_cache.errors import OcpcError

log = logging.getLogger("ocpc.prepare")


class Reporter:
    """Reports for one server. ``observe``: a look at one slot (``ServerView.observe``);
    ``count``, ``declare`` (stand down on a server process), ``event``: the Preparer's."""

    def __init__(
        self,
        *,
        server: str,
        records: Records,
        tracker: SlotTracker,
        planner: HeadPlanner,
        standdown: StandDown,
        idle: IdleSlots,
        observe: Callable[[int], Seen],
        count: Callable[[str], None],
        declare: Callable[[int, str], None],
        event: Callable[[Event], None],
    ) -> None:
        self.server, self.records, self.tracker, self.planner = server, records, tracker, planner
        self.standdown, self.idle = standdown, idle
        self._observe, self._count, self._declare, self._event = observe, count, declare, event

    def report(
        self,
        *,
        fingerprint: str,
        cache_n: int,
        prompt_n: int,
        prepare_id: str,
        predicted_n: int | None,
        prompt_ms: float | None,
        door: str,
    ) -> dict[str, Any]:
        """Judge the request against its prepare's record; returns the report as ``status`` shows it."""
        record = self.records.find(prepare_id, fingerprint)
        prompt = cache_n + prompt_n
        verdict = "unknown"
        if record is not None and record.action == "side":  # proves nothing; the slot holds nothing to keep
            verdict = "side"
            self.bind(record, prompt=prompt, generated=predicted_n)
        elif record is not None and record.action == "skipped":  # proves nothing; adopts the slot when the
            if predicted_n is not None:  # token counts say exactly what the request left there
                verdict = "adopted"
                self._count("adopted")
                self.bind(record, prompt=prompt, generated=predicted_n)
        elif record is not None:
            served = served_from_head(cache_n=cache_n, prefix_tokens=record.expected)
            verdict = "served" if served else "missed"
            self._count(f"report_{verdict}")
            self._count(f"report_{verdict}:{record.action}")
            if served:
                self.standdown.proof(record.epoch)
                self.bind(record, prompt=prompt, generated=predicted_n)
            else:
                self._missed(record, cache_n=cache_n)
        at = time.time()
        self._event(
            Event(
                at=at,
                door=door,
                server=self.server,
                slot=record.slot if record else -1,
                harness=record.harness if record else "",
                action=record.action if record else "unknown",
                source=record.source if record else "",
                cache_n=cache_n,
                prompt_n=prompt_n,
                prompt_ms=prompt_ms,
            )
        )
        return {
            "fingerprint": fingerprint,
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "verdict": verdict,
            "at": at,
            "prepare_id": prepare_id,
        }

    def _missed(self, record: Record, *, cache_n: int) -> None:
        """The request re-processed what was prepared: forget the slot, re-prove its file; a
        restore's miss counts towards standing down on this server process (engine/standdown.py)."""
        if record.action == "restored":
            why = self.standdown.missed(record.epoch)
            if why is not None:
                self._declare(record.epoch, why)
        self.tracker.forget(self.server, record.slot, "the real request missed what was prepared")
        if record.file:
            self.tracker.unprove(self.server, record.file)
        if record.planned_split:
            self.planner.distrust(record.fingerprint)
        log.warning(
            "real request after %s reused %d of the %d tokens prepared (%s); %s",
            record.action,
            cache_n,
            record.expected,
            record.fingerprint,
            "its file proves itself again next time" if record.file else "slot state forgotten",
        )

    def bind(self, record: Record, *, prompt: int, generated: int | None) -> None:
        """After a served request: if the slot now holds what that request left (its prompt
        and reply), it holds the conversation, and its next turn may be a hit."""
        try:
            seen = self._observe(record.slot)
        except OcpcError:
            return
        now = seen.now
        if seen.restarted or seen.epoch != record.epoch or not now.after_request(prompt=prompt, generated=generated):
            self.tracker.forget(self.server, record.slot, "could not tie the slot's contents to the request")
            return
        if record.action == "side":  # a title's state: known, and nothing in it worth parking
            self.tracker.leave(
                self.server,
                record.slot,
                Holding(kind="side", key="", head="", n_tokens=prompt, exact=False, left=now, stored=prompt),
                epoch=record.epoch,
            )
            return
        self.tracker.leave(
            self.server,
            record.slot,
            Holding(
                kind="conv",
                key=record.conversation,
                head=record.fingerprint,
                n_tokens=prompt,
                exact=False,
                left=now,
                conversation=record.conversation,
                stored=record.stored,
            ),
            trail=self.tracker.trail(self.server, record.slot),
            epoch=record.epoch,
        )
        self.idle.mark(record.slot, Idle(epoch=record.epoch, conversation=record.conversation, since=time.monotonic()))
