"""One deadline per prepare, shared by every wait and every server call in it.

The caller (the plugin, the proxy) waits a bounded time for a prepare and then sends the
real request whatever happened. So a prepare has one budget, counted from its arrival:
lock waits, server calls and file I/O all draw from it, and no call that changes the
slot may start once too little of it is left. A slot change that lands after the caller
gave up would change the slot under the real request it was meant to serve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from oc_prefix_cache.errors import DeadlineExceeded

#: No slot-changing call starts with less than this left: it must finish, and the answer
#: reach the caller, before the caller stops waiting and forwards its request.
SLOT_CHANGE_MARGIN_S = 2.0
#: Without a caller-supplied budget (an older plugin): what that plugin waits at most.
DEFAULT_BUDGET_S = 240.0
#: The answer itself needs a moment to travel back.
REPLY_MARGIN_S = 0.25


@dataclass(frozen=True)
class Deadline:
    """An absolute point on the monotonic clock."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def from_budget_ms(cls, raw: str | None, *, received: float | None = None) -> Deadline:
        """The deadline a caller's ``x-ocpc-budget-ms`` header gives (default when absent or bad)."""
        budget = DEFAULT_BUDGET_S
        if raw is not None:
            try:
                value = float(raw) / 1000.0
            except ValueError:
                value = budget
            if value == value and 0.0 < value < 86400.0:  # not NaN, positive, sane
                budget = value
        start = time.monotonic() if received is None else received
        return cls(start + budget - REPLY_MARGIN_S)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def bound(self, seconds: float, *, what: str) -> float:
        """``seconds`` cut to what is left; ``DeadlineExceeded`` when nothing is left."""
        left = self.remaining()
        if left <= 0.0:
            raise DeadlineExceeded(f"no time left to {what}: the caller has already sent its request")
        return min(seconds, left)

    def before_slot_change(self, seconds: float, *, what: str) -> float:
        """The timeout for a call that changes the slot, or ``DeadlineExceeded`` if it may
        not start: it must end ``SLOT_CHANGE_MARGIN_S`` before the caller stops waiting."""
        left = self.remaining() - SLOT_CHANGE_MARGIN_S
        if left <= 0.0:
            raise DeadlineExceeded(
                f"not starting to {what}: under {SLOT_CHANGE_MARGIN_S:g} s of the caller's budget left, "
                "so the slot is left as it is for the request"
            )
        return min(seconds, left)
