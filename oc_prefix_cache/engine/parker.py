"""Parking a conversation and saving a project head: the prefixes longer than a head.

A slot restore or erase replaces what the slot holds without the server stashing it, so
before ocpc displaces a conversation it can vouch for, it parks it: the slot is brought to
exactly the prefix the conversation's next request will strictly extend, and saved as
``oc-conv-<key>.bin``. A project head is the head extended to the end of the system text,
saved once a day per project as ``oc-proj-<key>.bin``. Both through the executor, behind
the same save checks as heads; the decision of *when* is engine/decision.py's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from oc_prefix_cache.chat.conversation import Trail
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Entry
from oc_prefix_cache.disk.park_files import end_of_day, park_entry, park_key
from oc_prefix_cache.engine.executor import Done, Executor, Prefix
from oc_prefix_cache.engine.planner import HeadPlan, HeadPlanner, KnownPrefix
from oc_prefix_cache.engine.tracker import Holding, Seen, SlotTracker
from oc_prefix_cache.errors import OcpcError, ParkTooBig
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import ServerIdentity

log = logging.getLogger("ocpc.parking")

#: The template's generation prompt (``<|im_start|>assistant\n<think>\n``: 5 tokens on Qwen) is
#: what a request has beyond its messages; a park point further back than this from the end
#: of the last request means the template re-renders the conversation itself: not parked.
GENERATION_PROMPT_MAX = 64


class Parker:
    """Thread-safe (stateless beyond its collaborators); callers hold the slot."""

    def __init__(
        self,
        *,
        client: SlotClient,
        planner: HeadPlanner,
        executor: Executor,
        tracker: SlotTracker,
        park_max_bytes: int | None = None,
    ) -> None:
        self.client = client
        self.park_max_bytes = park_max_bytes
        self.planner = planner
        self.executor = executor
        self.tracker = tracker
        self.server = client.server_id

    def save_project(
        self,
        plan: HeadPlan,
        slot: int,
        seen: Seen,
        *,
        key: str,
        server: ServerIdentity,
        identity: str,
        deadline: Deadline,
        tokens: tuple[int, ...] | None = None,
    ) -> Done | None:
        """Extend the head to this project's whole system prompt (``tokens``: the plan's project
        head, or its shorter level) and save it (once a day per project): later sessions of the
        project then process only their user message. A failure here costs nothing: the head is
        in place either way."""
        entry = Entry(
            file="",
            bytes=0,
            prefix_tokens=0,
            created=0,
            last_used=0,
            model=server.model_path,
            server_build=server.build,
            harness=plan.harness,
            identity=identity,
            head=plan.fingerprint,
            expires=end_of_day(time.time()),
        )
        try:
            done = self.executor.save_prefix(
                slot,
                Prefix("proj", key, plan.project if tokens is None else tokens),
                entry,
                epoch=seen.epoch,
                deadline=deadline,
            )
        except OcpcError as exc:
            log.warning("could not save the project head %s (the head is in place): %s", key, exc)
            return None
        return done

    def park_point(
        self, data: dict[str, Any], *, head: str, sent: int, deadline: Deadline
    ) -> tuple[tuple[int, ...], KnownPrefix | None]:
        """Where to park a conversation whose last request was ``data``: the longest token
        prefix of that request that its next request will strictly extend.

        The next request re-renders the end of this one: the generation prompt
        (``<|im_start|>assistant\n<think>\n``) becomes the assistant's reply. So render the
        request as sent and as a next turn would (a reply appended, no generation prompt);
        they part where the reply starts; one token less, since that last shared token may be
        whitespace the real reply merges into. On Qwen3.5 that is 3 tokens before the end,
        after the in-memory checkpoint the server took 4 tokens before the end, so parking
        costs ~1 token of evaluation (the end of the messages, 5 tokens before the end, would
        fall before that checkpoint and cost a whole ubatch: 511 tokens measured).
        """
        prompt, as_sent = self.planner.rendered(self.client, data, head=head, deadline=deadline)
        if len(as_sent) != sent:
            raise OcpcError(f"the slot's last request rendered to {len(as_sent)} tokens, {sent} ran")
        messages = list(data.get("messages") or [])
        next_turn = {
            **data,
            "messages": [*messages, {"role": "assistant", "content": "ok"}],
            "add_generation_prompt": False,
        }
        shown = self.planner.tokens_of(self.client, next_turn, head=head, deadline=deadline)
        n = next(
            (i for i, (a, b) in enumerate(zip(as_sent, shown, strict=False)) if a != b), min(len(as_sent), len(shown))
        )
        n -= 1  # the last shared token may be whitespace the real reply's text merges into (measured:
        # OpenCode's next turn re-tokenized `assistant\n` + its reply with another last token)
        if n < len(as_sent) - GENERATION_PROMPT_MAX:
            raise OcpcError(f"a next turn would re-render the conversation from token {n} of {len(as_sent)}")
        return as_sent[:n], self.planner.text_of(self.client, prompt, as_sent[:n], head=head, deadline=deadline)

    def _check_fits(self, tokens: int) -> None:
        """Refuse, before writing it, a park the park cap cannot keep (gc would delete it at
        once: the whole save for nothing). Its size is this server's bytes per token times its
        tokens; unknown before the server's first save, when the save goes ahead."""
        size = self.executor.costs.bytes_for(tokens)
        if self.park_max_bytes is None or size is None or size <= self.park_max_bytes:
            return
        raise ParkTooBig(
            f"a park of {tokens} tokens would take ~{size / 1e9:.1f} GB, over the "
            f"{self.park_max_bytes / 1e9:.1f} GB park cap: not parked (it could not be kept); "
            "raise OC_PREFIX_CACHE_PARK_MAX_GB to park conversations this long"
        )

    def park(self, seen: Seen, slot: int, *, server: ServerIdentity, identity: str, deadline: Deadline) -> Seen:
        """Park the conversation the slot holds before it is displaced; raise if it cannot be
        parked (the caller then leaves the slot as it is: what ocpc displaces, it parks first).
        Returns the slot as it is now: holding exactly the park."""
        holding, trail = seen.holding, seen.trail
        if holding is None or trail is None:
            raise OcpcError(
                "the slot's conversation cannot be parked (its last request is unknown); the slot is left as it is"
            )
        done, key = self._write(
            holding, trail, slot, epoch=seen.epoch, server=server, identity=identity, deadline=deadline
        )
        parked = Holding(
            kind="conv",
            key=key,
            head=holding.head,
            n_tokens=len(done.tokens),
            exact=True,
            left=self.executor.observe(slot, deadline=deadline),
            conversation=holding.conversation,
            stored=len(done.tokens),
        )
        self.tracker.leave(self.server, slot, parked, trail=trail, epoch=seen.epoch)
        return replace(seen, now=parked.left, holding=parked)

    def park_from_ram(
        self,
        holding: Holding,
        trail: Trail,
        slot: int,
        *,
        epoch: int,
        server: ServerIdentity,
        identity: str,
        deadline: Deadline,
        first: Callable[[tuple[int, ...]], None],
    ) -> Done:
        """Park a conversation the server holds in its RAM cache, not in a slot (a graceful stop
        comes, which empties that cache): ``first(tokens)`` readies ``slot`` so the server loads
        the conversation from RAM for the park's evaluation (``RamTier.clear``); the rest is a park.
        The slot's own contents must be parked already (the caller's order)."""
        done, _ = self._write(
            holding, trail, slot, epoch=epoch, server=server, identity=identity, deadline=deadline, first=first
        )
        self.tracker.forget(self.server, slot, "a conversation from the server's RAM cache was parked through it")
        return done

    def _write(
        self,
        holding: Holding,
        trail: Trail,
        slot: int,
        *,
        epoch: int,
        server: ServerIdentity,
        identity: str,
        deadline: Deadline,
        first: Callable[[tuple[int, ...]], None] | None = None,
    ) -> tuple[Done, str]:
        try:
            tokens, text = self.park_point(
                json.loads(trail.raw), head=holding.head, sent=holding.n_tokens, deadline=deadline
            )
        except (ValueError, OcpcError) as exc:
            raise OcpcError(
                f"could not render the slot's conversation to park it ({exc}); the slot is left as it is"
            ) from exc
        self._check_fits(len(tokens))
        key = park_key(identity=identity, conversation=holding.conversation)
        entry = park_entry(
            model=server.model_path,
            build=server.build,
            identity=identity,
            head=holding.head,
            session=trail.session,
            digests=trail.digests,
            text_chars=text.chars if text else 0,
            text_xxh64=text.text_xxh64 if text else "",
            conversation=holding.conversation,
        )
        try:
            if first is not None:
                first(tokens)
            done = self.executor.save_prefix(slot, Prefix("conv", key, tokens), entry, epoch=epoch, deadline=deadline)
        except OcpcError as exc:
            raise OcpcError(f"could not park the slot's conversation ({exc}); the slot is left as it is") from exc
        log.info("parked %s (slot %d): %s", holding.conversation, slot, done.reason)
        return done, key
