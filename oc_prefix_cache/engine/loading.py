"""Carrying a decision out: put in the slot the prefix the decision names, and say what is there.

A hit finds it (the slot's own state, a prefix the slot holds, the server's RAM cache); a
restore loads it from a file behind the gates (engine/executor.py); a warm prefills the head. A
longer prefix (a project head, a park) that fails its gates falls back to the head; a head
that fails them is rebuilt, and a second failed probe on one server process is the server's
fault: ocpc stands down (engine/standdown.py). Split from engine/prepare.py, which gathers and decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.park_files import Park
from oc_prefix_cache.disk.slotfile import slot_filename
from oc_prefix_cache.engine.decision import Action, FileState
from oc_prefix_cache.engine.executor import Done, Executor, Prefix
from oc_prefix_cache.engine.gates import likely_cause
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.ondisk import OnDisk
from oc_prefix_cache.engine.parker import Parker
from oc_prefix_cache.engine.planner import HeadPlan
from oc_prefix_cache.engine.ram_tier import RamTier
from oc_prefix_cache.engine.standdown import StandDown
from oc_prefix_cache.engine.tracker import Seen
from oc_prefix_cache.errors import Contended, GateFailed, OcpcError, StoodDown
from oc_prefix_cache.llama.fingerprint import ServerIdentity
from oc_prefix_cache.llama.server_info import flag_value

log = logging.getLogger("ocpc.prepare")


@dataclass(frozen=True)
class Loaded:
    """What a prepare put in (or found in) the slot."""

    done: Done
    prefix: Prefix  # the prefix the request should reuse: head, project head, park, or the slot's own
    expected: int  # its tokens
    file: str  # the file restored or saved ("" for a hit)
    source: str  # "slot" (a hit) | "head" | "proj" | "park" | "ram" (the server's RAM cache)
    own: bool = False  # a hit on the conversation's own live state (nothing changed)
    stored: int | None = None  # tokens of it in a file, when not ``expected`` (a RAM hit: its park's, if any)


class Loader:
    """Loads what a decision names into one server's slots (``Preparer._act`` calls it under the
    slot's lock). ``count`` and ``declare`` are the Preparer's counters and stand-down."""

    def __init__(
        self,
        *,
        executor: Executor,
        ram: RamTier,
        disk: OnDisk,
        parker: Parker,
        view: ServerView,
        standdown: StandDown,
        count: Callable[[str], None],
        declare: Callable[[int, str], None],
    ) -> None:
        self.executor, self.ram, self.disk, self.parker, self.view = executor, ram, disk, parker, view
        self.standdown, self.count, self.declare = standdown, count, declare

    def carry_out(
        self,
        action: Action,
        plan: HeadPlan,
        slot: int,
        seen: Seen,
        *,
        park: Park | None,
        project: str | None,
        server: ServerIdentity,
        deadline: Deadline,
        ram_tokens: int = 0,
        base: str | None = None,
    ) -> Loaded:
        """Do what the decision says; a longer prefix that fails its gates falls back to the
        head, a head that fails them is rebuilt. ``ram_tokens``: what the RAM model says the
        server's RAM cache holds of this conversation (a RAM hit expects that much reused)."""
        head = Prefix("head", plan.fingerprint, plan.tokens)
        if action.kind == "hit" and action.target == "ram":  # the server loads it: expect its whole history
            if action.clear_first:
                self.ram.clear(slot, plan.request_tokens, deadline=deadline)
            tokens = ram_tokens
            stored = park.n_tokens if park else 0
            return Loaded(
                Done("hit", action.reason, False),
                Prefix("conv", park.key if park else "", ()),
                tokens,
                "",
                "ram",
                stored=stored,
            )
        if action.kind == "hit":
            holding = seen.holding
            exact = bool(holding and holding.exact)
            if action.target == "slot" and holding is not None:  # the conversation's own live state
                return Loaded(
                    Done("hit", action.reason, exact),
                    Prefix(holding.kind, holding.key, ()),
                    holding.n_tokens,
                    "",
                    "slot",
                    own=True,
                )
            if action.target == "proj" and project is not None:
                return Loaded(
                    Done("hit", action.reason, exact),
                    Prefix("proj", project, plan.project),
                    len(plan.project),
                    "",
                    "slot",
                )
            if action.target == "base" and base is not None:
                return Loaded(
                    Done("hit", action.reason, exact), Prefix("proj", base, plan.base), len(plan.base), "", "slot"
                )
            return Loaded(Done("hit", action.reason, exact), head, len(plan.tokens), "", "slot")
        if action.kind != "restore":
            done = self.executor.warm_head(
                plan, slot, server=server, epoch=seen.epoch, deadline=deadline, why=action.reason
            )
            return Loaded(done, head, len(plan.tokens), slot_filename(plan.fingerprint), "head")
        if action.clear_first:  # the occupant to the server's RAM cache before the restore wipes the slot
            self.ram.clear(slot, plan.request_tokens, deadline=deadline)
        prefix = {
            "proj": Prefix("proj", project or "", plan.project),
            "base": Prefix("proj", base or "", plan.base),
            "park": Prefix("conv", park.key if park else "", ()),
        }.get(action.target, head)
        try:
            done = self.executor.restore(
                prefix,
                plan,
                slot,
                prove=action.prove,
                before=seen.now,
                epoch=seen.epoch,
                deadline=deadline,
                witnessed=self.view.witnessed(),
            )
        except GateFailed as failure:
            self.executor.erase_quietly(slot, deadline=deadline)
            if failure.unknown_version is not None:  # the format's fault, not the file's: stand down at once
                why = (
                    f"a slot file of version {failure.unknown_version}, which this ocpc has not read, did not "
                    f"restore on this server ({failure}); upgrade ocpc, or run a llama-server whose slot files it "
                    "reads (`ocpc doctor`)"
                )
                self.count("gate_failed:unknown_version")
                self.declare(seen.epoch, why)
                raise StoodDown(f"standing down on this server: {why}") from failure
            if prefix.kind != "head":
                self.count(f"gate_failed:{prefix.kind}")
                log.warning(
                    "%s %s failed its gates (%s); loading the head instead",
                    "project head" if prefix.kind == "proj" else "park",
                    prefix.key,
                    failure,
                )
                fallback = "restore" if self.disk.state("head", plan.fingerprint) is not FileState.MISSING else "warm"
                return self.carry_out(
                    replace(action, target="head", prove=True, kind=fallback),
                    plan,
                    slot,
                    seen,
                    park=None,
                    project=project,
                    server=server,
                    deadline=deadline,
                    base=base,
                )
            self.count("gate_failed")
            self._condemned(plan, failure, server=server)
            again = self.standdown.probe_failed(seen.epoch) if failure.probe else None
            if again is not None:
                self.declare(seen.epoch, again)
                raise StoodDown(f"standing down on this server: {again}") from failure
            done = self.executor.warm_head(
                plan, slot, server=server, epoch=seen.epoch, deadline=deadline, why=f"gate failed ({failure}); rebuilt"
            )
            return Loaded(done, head, len(plan.tokens), slot_filename(plan.fingerprint), "head")
        except Contended as exc:
            self.count("contended")
            raise OcpcError(f"contention: {exc}") from exc
        if done.proved:
            self.standdown.proof(seen.epoch)
        n = len(done.tokens) - done.probe
        source = "proj" if action.target == "base" else action.target  # a shorter project head is one too
        return Loaded(
            replace(done, reason=f"{action.reason}: {done.reason}"),
            Prefix(prefix.kind, prefix.key, done.tokens[:n]),
            n,
            slot_filename(prefix.key, prefix.kind),
            source,
        )

    def save_project(
        self,
        plan: HeadPlan,
        loaded: Loaded,
        slot: int,
        seen: Seen,
        *,
        key: str,
        tokens: tuple[int, ...],
        server: ServerIdentity,
        identity: str,
        deadline: Deadline,
    ) -> Loaded:
        """Extend what the slot holds to ``tokens`` (the project head, or its shorter level) and save it."""
        done = self.parker.save_project(
            plan, slot, seen, key=key, tokens=tokens, server=server, identity=identity, deadline=deadline
        )
        if done is None:
            return loaded
        return Loaded(
            Done(loaded.done.action, f"{loaded.done.reason}; {done.reason}", True, tokens),
            Prefix("proj", key, tokens),
            len(tokens),
            slot_filename(key, "proj"),
            loaded.source,
        )

    def _condemned(self, plan: HeadPlan, failure: GateFailed, *, server: Any) -> None:
        step = flag_value(self.view.argv() or [], ("--checkpoint-min-step", "-cms"))
        log.error(
            "restore gate failed for %s: %s; likely cause: %s; rebuilding",
            slot_filename(plan.fingerprint),
            failure,
            likely_cause(
                cache=server.cache,
                build_info=server.build,
                head_tokens=len(plan.tokens),
                checkpoint_min_step=int(step) if step and step.isdigit() else None,
            ),
        )


__all__ = ["Loaded", "Loader"]
