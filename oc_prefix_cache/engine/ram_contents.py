"""What llama-server's own RAM prompt cache (``--cache-ram``) holds, as far as ocpc can tell.

Why: with more conversations than slots, the server already parks in RAM. When a request
lands in a slot that holds another prompt, the server stashes that prompt's state in its
RAM cache and loads the cached prompt most like the new one (server-task.cpp,
``server_prompt_cache::alloc``/``load``): a memory copy inside its own scheduling. A disk
park restored by ocpc instead is a slot action the server runs between its batches
(measured under load: 2.3-9.4 s for a 13-40 MB park, while another slot decoded), and it
wipes the slot without the server stashing it, so the occupant must be parked to disk
first. Below memory pressure ocpc must therefore stay out of the way (the first rule:
never worse than plain llama-server), and act only for what the RAM cache no longer holds:
after a restart, or once the server dropped it.

The model: the server evicts its oldest entries first (``update``: ``pop_front`` while
over the limit), so ocpc keeps the conversations the server stashed in the order it
stashed them, with their tokens, and drops the oldest while their sum exceeds what the
limit holds (the limit in bytes over this server's bytes per token, learned from its slot
saves). A conversation the model says is in RAM is left to the server (``hit``, source
"ram"); the report proves it (it reused its history) or not, and a miss takes the
conversation out of the model: the model only ever decides who goes first, never what
is trusted. Pure and thread-safe; one per server process (cleared on a restart).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: b11434's ``--cache-ram`` default, in MiB (``-1``: no limit, ``0``: off).
DEFAULT_CACHE_RAM_MIB = 8192
#: The share of the RAM cache's limit ocpc counts on where the server's entries carry context
#: checkpoints (hybrids; SWA models without ``--swa-full``): an entry is its slot's state plus a
#: copy of each checkpoint (``server_prompt_cache_state::size``), so it is not a fixed size per
#: token (measured on Gemma 3 without ``--swa-full``: 637 tokens 9.4 MiB, 2,306 tokens 14.3 MiB),
#: and the bytes per token learned from slot saves only estimate what the cache keeps.
RAM_FILL = 0.6
#: ... and where they carry none (plain transformers; SWA models with ``--swa-full``, which the
#: server then treats as a transformer and never checkpoints): an entry is the slot's state, the
#: bytes a slot save writes (``llama_state_seq_get_data``), so the estimate is near exact; the
#: margin is for entries ocpc does not model (another client's, a head copied from an idle slot).
RAM_FILL_NO_CHECKPOINTS = 0.9


def _believed(capacity: int | None, fill: float) -> int | None:
    """The tokens ocpc believes the RAM cache keeps: ``fill`` of its limit (None: no limit).
    The model errs towards "evicted": it then restores a park or a head where RAM may still have
    served, never expects from RAM what the server already dropped."""
    return None if capacity is None else int(fill * capacity)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def swaps_from_ram(*, occupant: Sequence[int] | None, occupant_tokens: int, request: Sequence[int]) -> bool:
    """Whether the server, given ``request`` pinned to a slot that holds ``occupant_tokens`` tokens
    (``occupant``: a known prefix of them, as ocpc last rendered that slot's request; None: not
    known), stashes the occupant in RAM and loads the request's own cached prompt.

    b11434's ``get_available_slot`` does that only when the slot would keep under half of what it
    holds (``f_keep < 0.5``), and not for an empty slot (``f_keep`` is 0/0 there: measured,
    tests/rig/llama/test_server_facts.py). Otherwise it keeps the shared prefix, truncates the rest and
    processes the request from there: a returning conversation that shares a head with a short
    occupant would re-process everything after the head, and the occupant's tail is lost. Where it
    would not swap, one token the request does not start with, evaluated in the slot first, makes
    it swap (``Preparer``'s ``clear_first``): the server stashes the occupant for that token too."""
    if occupant_tokens <= 0:
        return False  # pinned to an empty slot, the server loads nothing (f_keep is 0/0 there)
    if occupant is None:
        return False
    shared = common_prefix(occupant, request)
    if shared >= len(occupant) and len(occupant) < occupant_tokens:
        return False  # all that is known of it is shared: it may share more
    return shared < 0.5 * occupant_tokens


@dataclass(frozen=True)
class RamLimit:
    """The server's RAM cache limit, from its command line."""

    mib: int | None  # None: no limit (-1); 0: off

    @classmethod
    def from_flag(cls, value: str | None) -> RamLimit:
        """``--cache-ram``'s value as given (None: the flag absent, the server's default)."""
        if value is None or value == "":
            return cls(DEFAULT_CACHE_RAM_MIB)
        try:
            mib = int(value)
        except ValueError:
            return cls(0)  # unreadable: believe nothing is in RAM (ocpc acts as without a RAM cache)
        return cls(None if mib < 0 else mib)

    def tokens(self, bytes_per_token: float | None) -> int | None:
        """How many tokens it holds (None: unlimited); 0 when off or the cost per token is unknown."""
        if self.mib == 0 or bytes_per_token is None or bytes_per_token <= 0:
            return 0
        if self.mib is None:
            return None
        return int(self.mib * 2**20 / bytes_per_token)


class RamModel:
    """The conversations the server stashed in RAM, oldest first, for one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = -1
        self._entries: OrderedDict[str, int] = OrderedDict()

    def stashed(
        self, conversation: str, tokens: int, *, epoch: int, capacity: int | None, fill: float = RAM_FILL
    ) -> None:
        """The server copied ``conversation`` (``tokens`` long) from a slot to its RAM cache: when a
        request ran over it (``get_available_slot``), or, with ``--cache-idle-slots`` (the default),
        when any completion task started while its slot sat idle. As ``server_prompt_cache::alloc``
        does it: a copy the cache already holds whole is skipped (it keeps its place in line); a
        longer one replaces the shorter (which it contains) at the end; the oldest go while the
        total is over the limit."""
        if not conversation or tokens <= 0 or capacity == 0:
            return
        with self._lock:
            self._same_process(epoch)
            if self._entries.get(conversation, 0) >= tokens:
                return
            self._entries.pop(conversation, None)
            if capacity is not None and tokens > capacity:
                return  # the server skips an entry over its whole limit
            self._entries[conversation] = tokens
            limit = _believed(capacity, fill)
            while limit is not None and sum(self._entries.values()) > limit:
                self._entries.popitem(last=False)

    def holds(self, conversation: str, *, epoch: int) -> int:
        """The tokens of ``conversation`` the RAM cache should hold (0: none)."""
        with self._lock:
            self._same_process(epoch)
            return self._entries.get(conversation, 0)

    def loaded(self, conversation: str, *, epoch: int) -> None:
        """It went back into a slot (the server loads it from RAM) or the server did not have it."""
        with self._lock:
            self._same_process(epoch)
            self._entries.pop(conversation, None)

    def over(self, capacity: int | None, *, live: int, epoch: int, fill: float = RAM_FILL) -> bool:
        """Whether the RAM cache cannot keep every displaced conversation plus ``live`` more
        tokens (the slots' conversations, each displaced sooner or later): pressure, when
        the conversations parked ahead on disk are the ones that come back served."""
        limit = _believed(capacity, fill)
        if not limit:  # unlimited; or off or unknown: the old rule (engine/park_ahead.py)
            return False
        with self._lock:
            self._same_process(epoch)
            return sum(self._entries.values()) + live > limit

    def room(self, capacity: int | None, *, tokens: int, epoch: int, fill: float = RAM_FILL) -> bool:
        """Whether ``tokens`` more fit in what the model believes the cache keeps: a conversation
        left to the RAM cache (not parked to disk) must not be the next one the server evicts."""
        limit = _believed(capacity, fill)
        if limit is None:
            return True
        with self._lock:
            self._same_process(epoch)
            return limit > 0 and sum(self._entries.values()) + tokens <= limit

    def entries(self, *, epoch: int) -> dict[str, int]:
        """What the model holds for this server process (conversation -> tokens), oldest first."""
        with self._lock:
            self._same_process(epoch)
            return dict(self._entries)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._entries)

    def _same_process(self, epoch: int) -> None:
        if epoch != self._epoch:  # a restart empties the server's RAM cache
            self._entries.clear()
            self._epoch = epoch
