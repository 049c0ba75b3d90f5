"""The server's own RAM prompt cache as ocpc's first parking tier, for one server process.

Why: with more conversations than slots, llama-server already keeps conversations in RAM
(``--cache-ram``, 8 GiB by default, with ``--cache-idle-slots``): every request that starts
copies each idle slot's prompt there, and a request run over a slot the server would keep under
half of stashes the occupant and loads the cached prompt most like its own, a memory copy inside
its own scheduling. A disk park and its restore are slot actions the server runs between its
batches (seconds under load) plus the write; a swap from RAM costs the request nothing. So ocpc
uses the server's RAM first and parks to disk only what it cannot count on staying there.

``RamTier`` is the Preparer's view of it: what the RAM cache holds (``ramcache.RamModel``), what
ocpc last rendered in each slot (to tell where the server would swap), and the few things a
prepare asks: is this conversation in RAM and would the server load it into this slot; may the
slot's occupant be displaced without a disk park; make a slot swap where it would not (one
unrelated token first). The model only decides who goes first, never what is trusted: a RAM hit
is proven by its request's report like any restore (a miss takes the conversation out).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from oc_prefix_cache.chat.conversation import Trail
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.engine.decision import Action
from oc_prefix_cache.engine.ram_contents import RAM_FILL, RAM_FILL_NO_CHECKPOINTS, RamLimit, RamModel, swaps_from_ram
from oc_prefix_cache.engine.tracker import Holding, Seen, SlotTracker
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.families import CacheFacts
from oc_prefix_cache.llama.server_info import flag_value


@dataclass(frozen=True)
class Where:
    """A returning conversation and the RAM cache: tokens held (0: none), and whether the server
    would load them into the slot as it stands."""

    held: int
    here: bool


class RamTier:
    """Thread-safe. ``argv``: the server's command line (None: not known); ``bytes_per_token``:
    learned from this server's slot saves (None before the first); ``busy``: the slots a request
    of ours runs in now (they are not idle when another request starts)."""

    def __init__(
        self,
        *,
        server: str,
        client: SlotClient,
        tracker: SlotTracker,
        argv: Callable[[], list[str] | None],
        bytes_per_token: Callable[[], float | None],
        busy: Callable[[], set[int]],
        count: Callable[[str], None],
    ) -> None:
        self.server, self.client, self.tracker = server, client, tracker
        self.model = RamModel()
        self._argv, self._bytes_per_token, self._busy, self._count = argv, bytes_per_token, busy, count
        self._guard = threading.Lock()
        # slot -> (server process epoch, the tokens of the last request planned there, or of what a warm
        # start restored): what ocpc knows the slot's contents start with
        self._rendered: dict[int, tuple[int, tuple[int, ...]]] = {}
        # conversation -> what it was and its last request, when it went to RAM: enough to park it
        # before a graceful stop empties the cache (``parkable``)
        self._kept: dict[str, tuple[int, Holding, Trail]] = {}
        self._tokens_for_clear: tuple[int, tuple[int, int]] | None = None  # (epoch, tokens): ``clear``
        self._fill = RAM_FILL  # the share of the limit counted on, until a prepare reads the family (``learn``)

    @property
    def fill(self) -> float:
        """The share of the server's limit the model counts on (``ramcache.RAM_FILL*``)."""
        return self._fill

    def learn(self, cache: CacheFacts) -> None:
        """The model's cache family and flags, as a prepare read them: how much of the limit the
        model counts on. Measured at K = 16 agents on 2 slots (Gemma 3, ``--swa-full``): counting on
        60% there took conversations the server still held for gone, and each came back from its
        head, re-processing its turns."""
        self._fill = RAM_FILL if cache.checkpointed_entries else RAM_FILL_NO_CHECKPOINTS

    def capacity(self) -> int | None:
        """Tokens the server's RAM prompt cache holds (None: unlimited; 0: off or not known: a
        server whose command line ocpc cannot read, or before its first save)."""
        argv = self._argv()
        if argv is None:
            return 0
        return RamLimit.from_flag(flag_value(argv, ("--cache-ram", "-cram"))).tokens(self._bytes_per_token())

    def runs(self, slot: int, tokens: tuple[int, ...], *, epoch: int) -> None:
        """The request rendered as ``tokens`` runs in ``slot`` next (or a warm start put them there)."""
        with self._guard:
            self._rendered[slot] = (epoch, tokens)

    def _occupant(self, slot: int, epoch: int) -> tuple[int, ...] | None:
        with self._guard:
            known = self._rendered.get(slot)
        return known[1] if known is not None and known[0] == epoch else None

    def where(self, conversation: str, seen: Seen, slot: int, request: tuple[int, ...]) -> Where:
        """Whether the RAM model holds this returning conversation, and whether the server would
        load it into ``slot`` as the slot stands: only where the occupant is one it stashes rather
        than truncates (``ramcache.swaps_from_ram``)."""
        held = self.model.holds(conversation, epoch=seen.epoch)
        if not held:
            return Where(0, False)
        occupant = self._occupant(slot, seen.epoch)
        holding = seen.holding
        occupant_tokens = holding.n_tokens if holding is not None else (seen.now.n_tokens or 0)
        here = swaps_from_ram(occupant=occupant, occupant_tokens=occupant_tokens, request=request)
        return Where(held, here)

    def keeps_occupant(self, seen: Seen) -> tuple[bool, bool]:
        """Whether the slot's conversation is whole in RAM with room to stay there, and whether it
        would fit if the server stashed it now (a request run over it): either way displacing it
        needs no park to disk (its next turn comes back from RAM)."""
        holding = seen.holding
        if holding is None or holding.kind != "conv" or not holding.conversation or seen.restarted:
            return False, False
        capacity = self.capacity()
        whole = self.model.holds(holding.conversation, epoch=seen.epoch) >= holding.n_tokens and self.model.room(
            capacity, tokens=0, epoch=seen.epoch, fill=self._fill
        )
        return whole, self.model.room(capacity, tokens=holding.n_tokens, epoch=seen.epoch, fill=self._fill)

    def clear(self, slot: int, request: tuple[int, ...], *, deadline: Deadline) -> None:
        """One token the request does not start with, evaluated in ``slot``: the server stashes
        the occupant in RAM for it (it keeps none of it), and the request pinned there next is
        swapped in from RAM (measured: a pinned request takes nothing from RAM into an empty slot
        or over a prefix it shares)."""
        first = request[0] if request else None
        token = next(t for t in self._clear_tokens(deadline) if t != first)
        self.client.evaluate([token], slot=slot, deadline=deadline)
        self._count("ram_clear")

    def _clear_tokens(self, deadline: Deadline) -> tuple[int, int]:
        """The first tokens of "0" and "1" in this server's vocabulary (two, so one differs from
        any request's first), tokenized once per server process rather than on every clear."""
        epoch = self.tracker.epoch(self.server)
        with self._guard:
            known = self._tokens_for_clear
        if known is not None and known[0] == epoch:
            return known[1]
        zero, one = (self.client.tokenize(text, add_special=False, deadline=deadline)[0] for text in ("0", "1"))
        with self._guard:
            self._tokens_for_clear = (epoch, (zero, one))
        return zero, one

    def follow(self, action: Action, slot: int, seen: Seen, request: tuple[int, ...], conversation: str) -> None:
        """What the server's RAM cache does with this request: one run over another conversation
        without a slot action of ocpc's makes the server stash that one (when the slot keeps
        under half of it; always for the one token of ``clear_first``, before a restore too); a
        RAM hit takes this conversation out of RAM and into the slot."""
        epoch, holding = seen.epoch, seen.holding
        if action.target == "ram":
            self.model.loaded(conversation, epoch=epoch)
            with self._guard:
                self._kept.pop(conversation, None)
            self._count("ram_swap")
        if (
            holding is None
            or holding.kind != "conv"
            or not holding.conversation
            or holding.conversation == conversation
        ):
            return
        if not action.clear_first and (action.kind != "hit" or action.target == "slot"):
            return  # a slot action (restore, warm) wipes the slot without the server stashing it
        occupant = self._occupant(slot, epoch)
        if action.clear_first or swaps_from_ram(occupant=occupant, occupant_tokens=holding.n_tokens, request=request):
            self._stashed(holding, seen.trail, epoch)

    def publish_idle(self, slot: int) -> None:
        """The request about to start in ``slot`` makes the server copy every idle slot's prompt
        into its RAM cache (``--cache-idle-slots``, on by default with ``--cache-ram``): from now
        on the model holds those conversations, whatever later replaces them in their slots."""
        capacity = self.capacity()
        if not capacity or "--no-cache-idle-slots" in (self._argv() or []):
            return
        epoch, busy = self.tracker.epoch(self.server), self._busy()
        for other in self.tracker.slots(self.server):
            holding = self.tracker.holding(self.server, other)
            if other == slot or other in busy or holding is None or holding.kind != "conv":
                continue
            self._stashed(holding, self.tracker.trail(self.server, other), epoch)

    def _stashed(self, holding: Holding, trail: Trail | None, epoch: int) -> None:
        self.model.stashed(
            holding.conversation, holding.n_tokens, epoch=epoch, capacity=self.capacity(), fill=self._fill
        )
        held = self.model.entries(epoch=epoch)
        with self._guard:
            if trail is not None and held.get(holding.conversation, 0) >= holding.n_tokens:
                self._kept[holding.conversation] = (epoch, holding, trail)
            self._kept = {c: kept for c, kept in self._kept.items() if c in held and kept[0] == epoch}

    def kept(self, *, epoch: int) -> list[tuple[str, Trail]]:
        """The conversations ocpc saw go to the server's RAM cache on this server process, with
        their last bodies (``engine/instances.py`` tells a returning conversation by them)."""
        with self._guard:
            return [(c, t) for c, (e, _, t) in self._kept.items() if e == epoch]

    def parkable(self, *, epoch: int, min_tokens: int) -> list[tuple[Holding, Trail]]:
        """The conversations that live only in the server's RAM cache (not in a slot), newest
        first, with at least ``min_tokens`` in no file yet: what a graceful stop would lose."""
        held = self.model.entries(epoch=epoch)
        with self._guard:
            kept = [(h, t) for c, (e, h, t) in self._kept.items() if e == epoch and held.get(c, 0) >= h.n_tokens]
        return [(h, t) for h, t in reversed(kept) if h.n_tokens - h.stored >= min_tokens]

    def over(self, live: int) -> bool:
        """Whether the RAM cache cannot keep every displaced conversation plus ``live`` tokens."""
        return self.model.over(self.capacity(), live=live, epoch=self.tracker.epoch(self.server), fill=self._fill)
