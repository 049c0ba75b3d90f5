"""The prepare path: make a slot ready for one request, as cheaply as possible.

The flow, each step its own module:
1. **facts about the request** (chat/conversation.py, chat/head.py): a later turn of the
   conversation the slot holds is recognised from its text alone (no parse); anything
   else is parsed once and its head cut (tools + system text up to the first marker);
2. **what the slot holds** (engine/observer.py, engine/tracker.py): one ``GET /slots``, compared with
   what ocpc recorded when it last left the slot; a restart is noticed here, on every request;
3. **the head plan** (engine/planner.py): the request rendered and tokenized as the server will,
   its head's exact tokens and fingerprint; its files' states (engine/ondisk.py);
4. **the decision** (engine/decision.py): pure, one table;
5. **the action** (engine/occupant.py, engine/loading.py, engine/executor.py, engine/parker.py,
   engine/ram_tier.py): park the occupant, restore or warm behind the gates, within the deadline.
Answers: ``hit``, ``restored``, ``warmed``, ``skipped`` or ``failed`` (with a reason). The
caller always forwards the real request, whatever the answer; the plugin or proxy then
reports what the server reused (engine/report.py), which binds the slot's new state to this
conversation or, on a miss, makes ocpc prove the file again (never rebuild it). Which slot a
request takes on ``-np N`` is engine/broker.py's; a server's start and stop, engine/lifecycle.py's;
who builds all of these, engine/wiring.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from oc_prefix_cache.chat.conversation import ConversationKey, Trail, follow, parse
from oc_prefix_cache.chat.head import (
    MAX_BODY_BYTES,
    Head,
    Skip,
    continuing,
    extends,
    from_parsed,
    harness_of,
    locate_head,
    message_text,
)
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.index import Index, UsageLog, slot_key
from oc_prefix_cache.disk.park_files import Park, adopted_park_key, find_park, project_key
from oc_prefix_cache.engine.capability import Capabilities, Capability, SelfTest
from oc_prefix_cache.engine.decision import Action, FileState, RequestFacts, decide
from oc_prefix_cache.engine.executor import Executor
from oc_prefix_cache.engine.instances import Instances
from oc_prefix_cache.engine.issued import Record, Records
from oc_prefix_cache.engine.loading import Loaded, Loader
from oc_prefix_cache.engine.observer import ServerView
from oc_prefix_cache.engine.occupant import Occupant, slot_facts
from oc_prefix_cache.engine.ondisk import OnDisk
from oc_prefix_cache.engine.park_ahead import AheadWriter, IdleSlots
from oc_prefix_cache.engine.planner import HeadPlan, HeadPlanner
from oc_prefix_cache.engine.ram_tier import RamTier, Where
from oc_prefix_cache.engine.shared import SharedFiles
from oc_prefix_cache.engine.slot_activity import SlotActivity
from oc_prefix_cache.engine.standdown import StandDown
from oc_prefix_cache.engine.telemetry import Telemetry
from oc_prefix_cache.engine.tracker import Holding, Seen, SlotTracker
from oc_prefix_cache.errors import BadRequestBody, DeadlineExceeded, LockTimeout, OcpcError, StoodDown
from oc_prefix_cache.harness.base import head_by_markers
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import (
    FingerprintInputs,
    ServerIdentity,
    legacy_fingerprint,
    legacy_server_key,
    server_key,
)
from oc_prefix_cache.settings import Settings

log = logging.getLogger("ocpc.prepare")

ACTIONS = ("hit", "restored", "warmed", "skipped", "failed")
#: A harness's rule for the stable head of a chat body (harness/ adapters' ``head``).
HeadRule = Callable[[dict[str, Any]], Head | Skip]
# A slot a prepare answered for this recently is still its request's: the request may not have
# reached the server yet (the plugin sends it after the answer), so a warm start after a router's
# load leaves it alone.


@dataclass
class PrepareResult:
    action: str
    fingerprint: str | None = None
    prefix_tokens: int = 0
    elapsed_ms: float = 0.0
    reason: str = ""
    tools_in_head: bool | None = None
    prepare_id: str = ""
    source: str = ""  # what the request reuses: "slot" (live), "head", "proj", "park" (from a file)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["elapsed_ms"] = round(self.elapsed_ms, 3)
        return data


@dataclass(frozen=True)
class _Facts:
    """What a prepare knows of its request before it looks at the slot (``Preparer._gather``)."""

    server: ServerIdentity
    identity: str  # the server's key (fingerprint.server_key): what its files are filed under
    conversation: str
    continuing: bool  # it carries earlier assistant turns
    trail: Trail  # its messages, for the next turn's hit path
    plan: HeadPlan  # its head, rendered and tokenized as the server does
    park: Park | None  # its conversation's park, when it is going on
    project: str | None  # its project head's key, when one can be cut
    project_file: FileState
    base: str | None = None  # its project head's shorter level's key, when one can be cut
    base_file: FileState = FileState.MISSING


class Preparer:
    """Prepares one server's slots for requests (any of its slots): the prepare path only.
    Thread-safe. Built by engine/wiring.py, which hands it the collaborators below; what the
    engine does outside a request (reports, the watch between requests, a server's start and
    stop, status) lives beside it there, not here."""

    def __init__(
        self,
        *,
        settings: Settings,
        server: str,
        client: SlotClient,
        tracker: SlotTracker,
        planner: HeadPlanner,
        executor: Executor,
        view: ServerView,
        disk: OnDisk,
        usage: UsageLog,
        records: Records,
        occupant: Occupant,
        ram: RamTier,
        ahead: AheadWriter,
        idle: IdleSlots,
        loader: Loader,
        instances: Instances,
        standdown: StandDown,
        declare: Callable[[int, str], None],
        capabilities: Capabilities,
        selftest: SelfTest,
        activity: SlotActivity,
        telemetry: Telemetry,
        shared: SharedFiles | None = None,
    ) -> None:
        self.settings, self.server, self.client, self.tracker, self.planner = settings, server, client, tracker, planner
        self.executor, self.view, self.disk, self.usage, self.records = executor, view, disk, usage, records
        self.occupant, self.ram, self.ahead, self.idle, self.loader = occupant, ram, ahead, idle, loader
        self.instances, self.standdown, self._declare = instances, standdown, declare
        self.capabilities, self.selftest, self.activity, self.telemetry = capabilities, selftest, activity, telemetry
        self._count = telemetry.count
        self.shared = shared  # many boxes: another box's files, brought on a miss (engine/shared.py)
        self.capability: Capability | None = None  # this server's, once a prepare looked it up

    # -- public ------------------------------------------------------------------------
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
        """Make ``slot`` ready for the chat-completions body ``raw``; never raises.

        ``session``: the conversation's id when the caller knows it (a harness adapter),
        else the ``x-session-id`` header. ``head_of``: the harness's rule for the stable
        head (default: tools + first system text before the earliest configured marker).
        ``harness``: the front door's name for the agent (the event log's), else its User-Agent.
        ``conversation``: the conversation's own name as the front door found it
        (``conversation_of``), so the slot it chose and the prepare agree; else found here.
        """
        started = time.perf_counter()
        lower = {k.lower(): v for k, v in headers.items()}
        deadline = deadline or Deadline.from_budget_ms(lower.get("x-ocpc-budget-ms"))
        slot = self.settings.slot if slot is None else slot
        self.idle.clear(slot)  # a request is about to run there: no park ahead of it now
        session = lower.get("x-session-id", "") if session is None else session
        rule = head_of or (lambda data: head_by_markers(data, self.settings.markers))
        with self.activity.claimed(slot):  # a warm start yields this slot until the answer (engine/lifecycle.py)
            try:
                result = self._prepare(raw, lower, slot, deadline, session, rule, conversation)
            except BadRequestBody as exc:
                result = PrepareResult("skipped", reason=str(exc))
            except StoodDown as exc:  # learned part-way (the slot was erased after a failed gate)
                self.tracker.forget(self.server, slot, "ocpc stood down on this server")
                result = PrepareResult("skipped", reason=str(exc))
            except (DeadlineExceeded, LockTimeout) as exc:
                self._count("failed:deadline")
                result = PrepareResult("failed", reason=str(exc))
            except OcpcError as exc:
                self.tracker.forget(self.server, slot, f"a prepare failed part-way: {exc}")
                log.warning("prepare failed open: %s", exc)
                result = PrepareResult("failed", reason=str(exc))
            except Exception as exc:  # never let a bug break the user's request
                self.tracker.forget(self.server, slot, "a prepare crashed")
                log.exception("prepare crashed; failing open")
                result = PrepareResult("failed", reason=f"internal error: {type(exc).__name__}: {exc}")
        self.ram.publish_idle(slot)
        result.elapsed_ms = (time.perf_counter() - started) * 1000
        if not result.prepare_id:  # skipped or failed: an id of its own, so its report binds nothing
            result.prepare_id = self.records.unrecorded_id()
        self.records.label(result.prepare_id, harness or harness_of(lower.get("user-agent", "")))
        self._log(result)
        return result

    # -- the flow ----------------------------------------------------------------------
    def _prepare(
        self,
        raw: bytes,
        headers: dict[str, str],
        slot: int,
        deadline: Deadline,
        session: str,
        head_of: HeadRule,
        conversation: str | None,
    ) -> PrepareResult:
        """The full path: gather the request's facts (no lock), then, under the slot's lock,
        look at the slot, decide (engine/decision.py, pure) and act (engine/executor.py, engine/parker.py)."""
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequestBody(f"body of {len(raw)} bytes is over the {MAX_BODY_BYTES}-byte limit")
        if self.client.ensure_loaded(deadline=deadline):  # behind a router: the request's model, loaded
            self._count("router_loaded")
        hit = self._same_conversation(raw, session, slot, deadline, conversation)
        if hit is not None:
            return hit
        down = self._standing_down(slot, deadline)
        if down is not None:
            return down
        facts = self._gather(raw, headers, slot, deadline, session, head_of, conversation)
        if isinstance(facts, PrepareResult):
            return facts
        plan = facts.plan
        with self.tracker.slot_lock(self.server, slot, deadline=deadline):
            seen = self.occupant.until_idle(slot, self.view.observe(slot, deadline=deadline), deadline=deadline)
            action, in_ram = self._decide(facts, seen, slot)
            self.ram.follow(action, slot, seen, plan.request_tokens, facts.conversation)
            self.ram.runs(slot, plan.request_tokens, epoch=seen.epoch)
            if action.kind == "skip":  # the slot as observed stays recorded (observe did that)
                return self._skip(action, facts, slot, seen)
            loaded, holding, parked = self._act(action, facts, slot, seen, deadline=deadline, ram_tokens=in_ram)
        # the head is under whatever the slot now holds (a project head, a park): it is used too
        self.usage.note(plan.fingerprint, slot=slot_key(self.server, slot))
        if loaded.prefix.key and loaded.prefix.key != plan.fingerprint:
            self.usage.note(loaded.prefix.key)
        reason = f"{parked}; {loaded.done.reason}" if parked else loaded.done.reason
        return self._answer(
            loaded.done.action,
            plan.fingerprint,
            loaded.expected,
            reason,
            slot=slot,
            epoch=seen.epoch,
            conversation=facts.conversation,
            file=loaded.file,
            split=plan.split,
            tools_in_head=plan.tools_in_head,
            stored=holding.stored,
            source=loaded.source,
        )

    def _skip(self, action: Action, facts: _Facts, slot: int, seen: Seen) -> PrepareResult:
        """The slot is left to the server. Where the decision says the request's report may adopt
        the slot (``Action.adopt``), its trail goes on the slot and its prepare is recorded, so the
        report binds the slot to the conversation as a served request's does."""
        if not action.adopt:
            return PrepareResult(
                "skipped", facts.plan.fingerprint, reason=action.reason, tools_in_head=facts.plan.tools_in_head
            )
        self.tracker.leave(self.server, slot, None, trail=facts.trail, epoch=seen.epoch)
        prepare_id = self.records.keep(
            Record(
                slot=slot,
                epoch=seen.epoch,
                action="skipped",
                fingerprint=facts.plan.fingerprint,
                expected=0,
                conversation=facts.conversation,
                file="",
                planned_split=False,
                stored=0,
            )
        )
        return PrepareResult(
            "skipped",
            facts.plan.fingerprint,
            reason=action.reason,
            tools_in_head=facts.plan.tools_in_head,
            prepare_id=prepare_id,
        )

    def _gather(
        self,
        raw: bytes,
        headers: dict[str, str],
        slot: int,
        deadline: Deadline,
        session: str,
        head_of: HeadRule,
        conversation: str | None,
    ) -> _Facts | PrepareResult:
        """Everything about the request that needs no look at the slot: its head and plan (the
        server renders and tokenizes), its conversation, park and project head. A request with
        no head, or a server on which restores cannot serve, ends here with its answer."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequestBody(f"body is not UTF-8 JSON ({exc})") from exc
        parsed = parse(text)
        body = from_parsed(parsed)
        head = head_of(body.data)
        if isinstance(head, Skip):  # a title or summary: nothing to load, but what it displaces is parked
            return self._side(head.reason, slot, deadline)
        server = self.view.identity(deadline)
        going_on = continuing(body.messages, head)
        if conversation is None:
            key = ConversationKey.session(session) if session else ConversationKey.chain(parsed.digests)
            conversation = self.instances.name(key, raw, continuing=going_on)
        if not server.model_digest:
            raise OcpcError(
                f"cannot read the model file llama-server names ({server.model_path or 'none'}); ocpc keys "
                "the cache on its content, so run the daemon on the server's machine"
            )
        if server.cache.restores_serve:  # known from the model and the flags: stand down at once
            return self._stand_down(server.cache.restores_serve)
        identity, legacy = server_key(server), legacy_server_key(server)
        capability = self.capability = self.capabilities.adopt(identity, legacy)
        if capability is not None and not capability.usable:  # this binary and model failed the self-test
            return self._stand_down(f"{capability.reason}; {capability.advice()}")
        harness = harness_of(headers.get("user-agent", ""))
        system = message_text(body.messages[0]) if body.messages and head.project else None
        if going_on:  # its park may be being written right now, by whoever took its slot
            self.occupant.await_park(conversation, slot, deadline=deadline)
        index = self.disk.index()
        park = (
            find_park(index, identity=identity, session=session, digests=parsed.digests)
            if going_on and index is not None
            else None
        )
        old_park = (  # none under its own identity: one made before it (FORMAT 3's key), to adopt
            find_park(index, identity=legacy, session=session, digests=parsed.digests)
            if going_on and index is not None and park is None
            else None
        )
        if going_on and self.shared is not None and old_park is None:  # moved here from another box?
            park = self.shared.park(
                identity=identity, session=session, digests=parsed.digests, local=park, deadline=deadline
            )
        plan = self.planner.plan(
            self.client,
            body.data,
            head,
            server=server,
            harness=harness,
            deadline=deadline,
            system_text=system,
            longer=self.disk.known_park(park or old_park),
        )
        project = (
            project_key(identity=identity, head=plan.fingerprint, project_text=plan.project_text)
            if plan.project
            else None
        )
        base = project_key(identity=identity, head=plan.fingerprint, project_text=plan.base_text) if plan.base else None
        if index is not None:
            adopted, any_adopted = self._adopt_legacy(index, server, head, plan, identity, legacy, old_park, deadline)
            park = adopted or park
            if any_adopted:  # the project heads' states read their entries
                index = self.disk.index()
        if self.shared is not None and self._bring_shared(index, plan.fingerprint, (project, base), deadline):
            index = self.disk.index()
        return _Facts(
            server=server,
            identity=identity,
            conversation=conversation,
            continuing=going_on,
            trail=Trail.of(parsed, session=session),
            plan=plan,
            park=park,
            project=project,
            project_file=self.disk.project_state(index, project),
            base=base,
            base_file=self.disk.project_state(index, base),
        )

    def _bring_shared(
        self, index: Index | None, fingerprint: str, projects: tuple[str | None, ...], deadline: Deadline
    ) -> bool:
        """The head and project heads this box has no file of, brought from another box's (the
        shared store), to be restored behind the gates as its own; whether any was brought."""
        assert self.shared is not None
        brought = False
        if self.disk.state("head", fingerprint) is FileState.MISSING and self.shared.head(
            fingerprint, deadline=deadline
        ):
            self._count("shared:head")
            brought = True
        for key in projects:
            if (
                key
                and self.disk.project_state(index, key) is FileState.MISSING
                and self.shared.project(key, deadline=deadline)
            ):
                self._count("shared:proj")
                brought = True
        return brought

    def _adopt_legacy(
        self,
        index: Index,
        server: ServerIdentity,
        head: Head,
        plan: HeadPlan,
        identity: str,
        legacy: str,
        old_park: Park | None,
        deadline: Deadline,
    ) -> tuple[Park | None, bool]:
        """Files made by ocpc before identities were by content (FORMAT 3: model path and mtime,
        binary path and mtime, ocpc's version) are found under their old names and adopted
        (engine/ondisk.py): the request's head, its project heads, and its park (``old_park``, found
        under the old key), each only where the new name has no file yet. Returns the adopted park,
        and whether anything was adopted. What is adopted is restored behind the same gates as any
        file; nothing is adopted twice."""
        missing_head = self.disk.state("head", plan.fingerprint) is FileState.MISSING
        levels = [text for text, cut in ((plan.project_text, plan.project), (plan.base_text, plan.base)) if cut]
        wanted = [
            text
            for text in levels
            if self.disk.project_state(index, project_key(identity=identity, head=plan.fingerprint, project_text=text))
            is FileState.MISSING
        ]
        if not (missing_head or wanted or old_park):
            return None, False
        offset = locate_head(plan.prompt, head)
        if offset is None:
            return None, False
        old_head = legacy_fingerprint(
            FingerprintInputs(server=server, harness=plan.harness, head=head, rendered_head=plan.prompt[:offset])
        )
        timeout = max(0.05, min(1.0, deadline.remaining() / 4))
        adopt = self.disk.adopt
        any_adopted = False
        if missing_head and adopt(
            "head", old_head, plan.fingerprint, identity="", head=plan.fingerprint, timeout=timeout
        ):
            self._count("adopted:head")
            any_adopted = True
        for text in wanted:
            old = project_key(identity=legacy, head=old_head, project_text=text)
            new = project_key(identity=identity, head=plan.fingerprint, project_text=text)
            if self.disk.project_state(index, old) is not FileState.MISSING and adopt(
                "proj", old, new, identity=identity, head=plan.fingerprint, timeout=timeout
            ):
                self._count("adopted:proj")
                any_adopted = True
        if old_park is None:
            return None, any_adopted
        entry = index.entries.get(old_park.key)
        new = adopted_park_key(identity=identity, conversation=entry.conversation if entry else "", old=old_park.key)
        over = plan.fingerprint if old_park.head in (old_head, "") else old_park.head
        if not adopt("conv", old_park.key, new, identity=identity, head=over, timeout=timeout):
            return None, any_adopted
        self._count("adopted:park")
        return replace(old_park, key=new, head=over), True

    def _decide(self, facts: _Facts, seen: Seen, slot: int) -> tuple[Action, int]:
        """The decision on what the slot holds now; and what the RAM model says the server's RAM
        cache holds of this conversation (tokens, 0: none, or none the server would load here)."""
        request = RequestFacts(
            skip=None,
            conversation=facts.conversation,
            continues_slot=seen.trail is not None and _continues(seen.trail, facts.trail),
            continuing=facts.continuing,
            head=facts.plan.fingerprint,
            head_file=self.disk.state("head", facts.plan.fingerprint),
            park=self.disk.state("conv", facts.park.key) if facts.park else FileState.MISSING,
            project=facts.project,
            project_file=facts.project_file,
            base=facts.base,
            base_file=facts.base_file,
        )
        where = (
            self.ram.where(facts.conversation, seen, slot, facts.plan.request_tokens)
            if facts.continuing
            else Where(0, False)
        )
        whole, stashable = self.ram.keeps_occupant(seen)
        stashable = stashable and seen.holding is not None and seen.holding.conversation != facts.conversation
        facts_now = replace(
            slot_facts(seen, facts.conversation, cache=facts.server.cache, park_min=self.settings.park_min_tokens),
            occupant_in_ram=whole,
            occupant_stashable=stashable,
        )
        return decide(facts_now, replace(request, in_ram=where.held > 0, ram_here=where.here)), where.held

    def _act(
        self, action: Action, facts: _Facts, slot: int, seen: Seen, *, deadline: Deadline, ram_tokens: int
    ) -> tuple[Loaded, Holding, str]:
        """Carry the decision out under the slot's lock: park the occupant first if it says so,
        load (or find) the prefix, save a project head; record what the slot holds now."""
        parked = ""
        if action.clear_first and seen.holding is not None and seen.holding.conversation:
            self.ahead.displaced()  # conversations outnumber slots: idle ones are parked to disk ahead too
        if action.park_first:
            self.ahead.displaced()
            parking = time.perf_counter()
            seen = self.occupant.park(seen, slot, server=facts.server, identity=facts.identity, deadline=deadline)
            parked = (
                f"parked the slot's conversation first ({seen.holding.n_tokens if seen.holding else 0} "
                f"tokens in {(time.perf_counter() - parking) * 1000:.0f} ms)"
            )
        if (
            action.kind in ("restore", "warm")
            and not action.clear_first
            and self.capabilities.get(facts.identity) is None
        ):
            seen = self._self_test(facts, slot, seen, deadline=deadline)  # before any warm: can it be kept?
        tokens = {"head": len(facts.plan.tokens), "park": facts.park.n_tokens if facts.park else 0}.get(
            action.target, 0
        )
        with self.activity.doing(slot, f"{action.kind} {action.target}", tokens):
            loaded = self.loader.carry_out(
                action,
                facts.plan,
                slot,
                seen,
                park=facts.park,
                project=facts.project,
                server=facts.server,
                deadline=deadline,
                ram_tokens=ram_tokens,
                base=facts.base,
            )
        save = self.loader.save_project
        if action.save_project and facts.project is not None:
            if facts.base is not None and facts.base_file is FileState.MISSING and loaded.prefix.kind == "head":
                loaded = save(
                    facts.plan,
                    loaded,
                    slot,
                    seen,
                    key=facts.base,
                    tokens=facts.plan.base,
                    server=facts.server,
                    identity=facts.identity,
                    deadline=deadline,
                )
            loaded = save(
                facts.plan,
                loaded,
                slot,
                seen,
                key=facts.project,
                tokens=facts.plan.project,
                server=facts.server,
                identity=facts.identity,
                deadline=deadline,
            )
        holding = self._holding_after(
            loaded, facts.plan, slot, seen, conversation=facts.conversation, deadline=deadline
        )
        self.tracker.leave(self.server, slot, holding, trail=facts.trail, epoch=seen.epoch)
        return loaded, holding, parked

    def _self_test(self, facts: _Facts, slot: int, seen: Seen, *, deadline: Deadline) -> Seen:
        """At first contact with this server binary and model (engine/capability.py): a few of the head's
        tokens saved, read, restored and reused, in the slot about to be replaced anyway (its
        occupant parked first). A build whose restore does not serve makes ocpc stand down before it
        spends a warm; one that serves is used whatever its version number. Returns the slot now."""
        with self.activity.doing(slot, "self-test", 0):
            capability = self.selftest.run(
                facts.plan.tokens,
                slot,
                key=facts.identity,
                build=facts.server.build,
                model=facts.server.model_path,
                deadline=deadline,
            )
        self.tracker.forget(self.server, slot, "ocpc's self-test ran in it")
        self.capabilities.put(capability)
        self.capability = capability
        self._count("selftest:" + ("usable" if capability.usable else "unusable"))
        log.log(
            logging.INFO if capability.usable else logging.WARNING,
            "self-test on %s (%s): %s (%.0f ms)",
            self.server,
            facts.server.build,
            capability.reason,
            capability.measured_ms,
        )
        if not capability.usable:
            why = f"{capability.reason}; {capability.advice()}"
            self._declare(seen.epoch, why)
            raise StoodDown(f"standing down on this server: {why}")
        return self.view.observe(slot, deadline=deadline)

    def _same_conversation(
        self, raw: bytes, session: str, slot: int, deadline: Deadline, conversation: str | None
    ) -> PrepareResult | None:
        """The hit path: the slot's conversation gone on, and the slot still holds it.

        String compares against the conversation's last body, then one ``GET /slots``: a
        restart or any other task since ocpc last saw the slot sends it down the full path.
        """
        seen_trail = self.tracker.trail(self.server, slot)
        if seen_trail is None or (session and seen_trail.session and session != seen_trail.session):
            return None
        trail = follow(seen_trail, raw)
        if trail is None:
            return None
        went_on = len(trail.digests) > len(seen_trail.digests)
        trail = replace(trail, session=session)
        seen = self.view.observe(slot, deadline=deadline)
        holding = seen.holding
        if seen.restarted or holding is None:
            return None
        # without a name from the front door: the session id, else the slot's conversation when the
        # request adds messages to its body (an equal body may be another session that began alike)
        conversation = conversation or session or (holding.conversation if went_on else None)
        if conversation is None or holding.conversation != conversation:
            return None
        self.tracker.leave(self.server, slot, holding, trail=trail, epoch=seen.epoch)
        self.usage.note(holding.head)  # the head under the conversation must not age out
        return self._answer(
            "hit",
            holding.head,
            holding.n_tokens,
            "same conversation: the slot still holds it",
            slot=slot,
            epoch=seen.epoch,
            conversation=conversation,
            file="",
            split=False,
            tools_in_head=None,
            stored=holding.stored,
            source="slot",
        )

    def _holding_after(
        self, loaded: Loaded, plan: HeadPlan, slot: int, seen: Seen, *, conversation: str, deadline: Deadline
    ) -> Holding:
        """What the slot holds now, vouched for by a fresh observation (a plain hit changed nothing)."""
        done = loaded.done
        if loaded.own and seen.holding is not None:
            return replace(seen.holding, left=seen.now)
        if done.action == "hit":  # a new session on a prefix the slot holds, a RAM swap: ocpc changed nothing
            return Holding(
                kind=loaded.prefix.kind,
                key=loaded.prefix.key,
                head=plan.fingerprint,
                n_tokens=loaded.expected,
                exact=done.exact,
                left=seen.now,
                conversation=conversation,
                stored=loaded.expected if loaded.stored is None else loaded.stored,
            )
        now = self.executor.observe(slot, deadline=deadline)
        return Holding(
            kind=loaded.prefix.kind,
            key=loaded.prefix.key,
            head=plan.fingerprint,
            n_tokens=len(done.tokens) or loaded.expected,
            exact=done.exact,
            left=now,
            conversation=conversation,
            stored=loaded.expected,
        )

    def _side(self, why: str, slot: int, deadline: Deadline) -> PrepareResult:
        """A request with no head (a title, a summary): nothing to load. What it displaces is
        parked first, and its report marks the slot as holding a side request (nothing to keep),
        so the conversation's next turn restores its park there instead of leaving the slot alone
        as one whose contents ocpc cannot vouch for."""
        reason = why + self.occupant.park_for_side(slot, deadline)
        prepare_id = self.records.keep(
            Record(
                slot=slot,
                epoch=self.tracker.epoch(self.server),
                action="side",
                fingerprint="",
                expected=0,
                conversation="",
                file="",
                planned_split=False,
                stored=0,
            )
        )
        return PrepareResult("skipped", reason=reason, prepare_id=prepare_id)

    # -- standing down ---------------------------------------------------------------
    def _standing_down(self, slot: int, deadline: Deadline) -> PrepareResult | None:
        """Standing down on this server process: skip at once (one look at the slots, which
        notices a restart: a new process is judged afresh)."""
        if self.standdown.why(self.tracker.epoch(self.server)) is None:
            return None
        seen = self.view.observe(slot, deadline=deadline)
        why = self.standdown.why(seen.epoch)
        if why is None:
            return None
        self._count("stood_down")
        return PrepareResult("skipped", reason=f"standing down on this server: {why}")

    def _stand_down(self, why: str) -> PrepareResult:
        self._declare(self.tracker.epoch(self.server), why)
        self._count("stood_down")
        return PrepareResult("skipped", reason=f"standing down on this server: {why}")

    # -- helpers -----------------------------------------------------------------------
    def _answer(
        self,
        action: str,
        fp: str,
        expected: int,
        reason: str,
        *,
        slot: int,
        epoch: int,
        conversation: str,
        file: str,
        split: bool,
        tools_in_head: bool | None,
        stored: int,
        source: str,
    ) -> PrepareResult:
        prepare_id = self.records.keep(
            Record(
                slot=slot,
                epoch=epoch,
                action=action,
                fingerprint=fp,
                expected=expected,
                conversation=conversation,
                file=file,
                planned_split=split,
                stored=stored,
                source=source,
            )
        )
        self._count(f"source:{source}")
        return PrepareResult(
            action, fp, expected, reason=reason, tools_in_head=tools_in_head, prepare_id=prepare_id, source=source
        )

    def _log(self, result: PrepareResult) -> None:
        self.telemetry.answered(result.action, result.to_json())
        level = logging.WARNING if result.action == "failed" else logging.INFO
        log.log(
            level,
            "%s %s %d tokens %.1f ms: %s",
            result.action,
            result.fingerprint,
            result.prefix_tokens,
            result.elapsed_ms,
            result.reason,
        )


def _continues(previous: Trail, current: Trail) -> bool:
    """``current`` is ``previous``'s conversation gone on: same session, its messages extended,
    and the same tools and template options (else the prompt changed before its messages)."""
    if previous.session and current.session and previous.session != current.session:
        return False
    return previous.frame == current.frame and extends(previous.digests, current.digests)


__all__ = ["ACTIONS", "PrepareResult", "Preparer"]
