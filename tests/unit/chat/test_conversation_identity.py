"""Conversation identity (issue 36, defect 1): two different conversations never share a name, and one
conversation keeps its name across its turns, for every agent, with and without a session header.

Two layers, each tested as a class:
* the **key** each harness adapter names (harness/): over the real captures of every agent (two
  projects, two sessions in one project, the turns of one session, a subagent and its parent);
* the **name** ocpc gives each conversation under a shared key (engine/instances.py): a property over
  made-up conversations that share one key, begin alike, and leave their state in a slot, in the
  server's RAM cache, in a park, or nowhere.

What the captures say (tests/data/*/README.md): Aider, Cline, Qwen Code and pi without its
affinity headers send **byte-identical** bodies for the same first question in the same project
(A1 and A2). Nothing in such a request tells the two sessions apart, so their key is the same,
and it is marked shared: ocpc never takes it for the conversation itself, and tells the sessions
apart by their messages from the first reply on (the second property).
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oc_prefix_cache.chat import responses
from oc_prefix_cache.chat.anthropic import to_chat
from oc_prefix_cache.chat.conversation import INSTANCE_SEP, ConversationKey, Trail, parse
from oc_prefix_cache.disk.index import Index
from oc_prefix_cache.disk.park_files import park_entry
from oc_prefix_cache.engine.instances import Instances
from oc_prefix_cache.engine.tracker import Holding, Observation, SlotTracker
from oc_prefix_cache.harness import NAMES, Incoming, select
from tests.helpers import DATA

API = {"/v1/messages": "anthropic", "/v1/responses": "responses", "/v1/chat/completions": "openai"}


def key_of(relative: str) -> tuple[str, ConversationKey, dict[str, Any]]:
    """(adapter, key, the chat body) of a capture, as the proxy finds them (doors/proxy.py ``_parse``)."""
    path = DATA / relative
    data = json.loads(path.read_text())
    if "body_json" in data:
        body, headers_raw, url = data["body_json"], data["headers"], data["path"].split("?")[0]
    else:  # opencode-1.18.33: the body alone, its headers beside it
        body, url = data, "/v1/chat/completions"
        headers_raw = json.loads((path.parent / "headers_and_hashes.json").read_text())[path.name]["headers"]
    pairs = headers_raw.items() if isinstance(headers_raw, dict) else headers_raw
    headers = {str(k).lower(): str(v) for k, v in pairs}
    api = API[url]
    incoming = Incoming(api=api, headers=headers, body=body)
    adapter = select(incoming, enabled=NAMES)
    normalised, _ = adapter.normalise(incoming)
    chat = (
        to_chat(normalised)
        if api == "anthropic"
        else responses.prepared(normalised)
        if api == "responses"
        else normalised
    )
    return adapter.name, adapter.key(Incoming(api=api, headers=headers, body=normalised), chat), chat


#: Two projects (A and B), per agent.
PROJECTS = [
    ("aider-0.86.2/A1.json", "aider-0.86.2/B1.json"),
    ("aider-0.86.2/diff-A1.json", "aider-0.86.2/diff-B1.json"),
    ("claude-code-2.1.332-installed/A1.json", "claude-code-2.1.332-installed/B1.json"),
    ("cline-3.0.65/A1.json", "cline-3.0.65/B1.json"),
    ("codex-0.171.0/A1.json", "codex-0.171.0/B1.json"),
    ("kilo-code-7.7.9/A1.json", "kilo-code-7.7.9/B1.json"),
    ("opencode-1.18.33/02_projA_turn1_main_request.json", "opencode-1.18.33/03_projB_turn1_main_request.json"),
    ("openhands-1.16.0/A1.json", "openhands-1.16.0/B1.json"),
    ("qwen-code-0.24.4/A1.json", "qwen-code-0.24.4/B1.json"),
    ("qwen-code-0.24.4/A1-memory.json", "qwen-code-0.24.4/B1-memory.json"),
]
#: Two sessions in one project that began with the same words.
SESSIONS = [
    ("aider-0.86.2/A1.json", "aider-0.86.2/A2.json"),
    ("aider-0.86.2/A1.json", "aider-0.86.2/T-turn1.json"),
    ("claude-code-2.1.332/A1.json", "claude-code-2.1.332/A2.json"),
    ("claude-code-2.1.332-installed/A1.json", "claude-code-2.1.332-installed/A2.json"),
    ("cline-3.0.65/A1.json", "cline-3.0.65/A2.json"),
    ("codex-0.171.0/A1.json", "codex-0.171.0/A2.json"),
    ("kilo-code-7.7.9/A1.json", "kilo-code-7.7.9/A2.json"),
    ("openhands-1.16.0/A1.json", "openhands-1.16.0/A2.json"),
    ("pi-0.73.1/A1.json", "pi-0.73.1/A2.json"),
    ("pi-0.73.1/A1-affinity.json", "pi-0.73.1/A2-continue-affinity.json"),
    ("qwen-code-0.24.4/A1.json", "qwen-code-0.24.4/A2.json"),
    ("qwen-code-0.24.4/A1-memory.json", "qwen-code-0.24.4/A2-memory.json"),
]
#: The turns of one conversation, in order.
TURNS = [
    ("aider-0.86.2/T-turn1.json", "aider-0.86.2/T-turn2.json"),
    ("claude-code-2.1.332/A2.json", "claude-code-2.1.332/A2-continue.json"),
    ("claude-code-2.1.332-installed/A2.json", "claude-code-2.1.332-installed/A2-continue.json"),
    ("claude-code-2.1.332-installed/A4-subagent-1.json", "claude-code-2.1.332-installed/A4-subagent-4.json"),
    ("claude-code-2.1.332-installed/A4-subagent-2.json", "claude-code-2.1.332-installed/A4-subagent-3.json"),
    (
        "claude-code-2.1.332-subagent/0002-POST-v1_messages.json",
        "claude-code-2.1.332-subagent/0003-POST-v1_messages.json",
    ),
    ("opencode-1.18.33/02_projA_turn1_main_request.json", "opencode-1.18.33/04_projA_turn2_main_request.json"),
    (
        "opencode-1.18.33/04_projA_turn2_main_request.json",
        "opencode-1.18.33/05_projA_turn2_after_toolcall_request.json",
    ),
    (
        "opencode-1.18.33-subagent/0002-POST-v1_chat_completions.json",
        "opencode-1.18.33-subagent/0005-POST-v1_chat_completions.json",
    ),
    (
        "opencode-1.18.33-subagent/0003-POST-v1_chat_completions.json",
        "opencode-1.18.33-subagent/0004-POST-v1_chat_completions.json",
    ),
    ("openhands-1.16.0/T-turn1.json", "openhands-1.16.0/T-turn2.json"),
    ("openhands-1.16.0/S1.json", "openhands-1.16.0/S1-after.json"),
    ("pi-0.73.1/A2.json", "pi-0.73.1/A2-continue.json"),
]
#: A subagent (or an agent's side conversation) and its parent.
SUBAGENTS = [
    ("claude-code-2.1.332-installed/A4-subagent-1.json", "claude-code-2.1.332-installed/A4-subagent-2.json"),
    (
        "claude-code-2.1.332-subagent/0002-POST-v1_messages.json",
        "claude-code-2.1.332-subagent/0001-POST-v1_messages.json",
    ),
    ("kilo-code-7.7.9/S1.json", "kilo-code-7.7.9/S1-subagent.json"),
    (
        "opencode-1.18.33-subagent/0002-POST-v1_chat_completions.json",
        "opencode-1.18.33-subagent/0003-POST-v1_chat_completions.json",
    ),
    ("openhands-1.16.0/S1.json", "openhands-1.16.0/S1-subagent.json"),
    ("qwen-code-0.24.4/A1.json", "qwen-code-0.24.4/A1-memory.json"),
]


def same_request(a: str, b: str) -> bool:
    """Whether two captures send the same body and the same session headers: nothing tells them apart."""
    _, key_a, chat_a = key_of(a)
    _, key_b, chat_b = key_of(b)
    return chat_a == chat_b and key_a.shared and key_b.shared


@pytest.mark.parametrize("a,b", PROJECTS + SUBAGENTS)
def test_two_projects_and_a_subagent_and_its_parent_never_share_a_key(a: str, b: str) -> None:
    assert key_of(a)[1].name != key_of(b)[1].name


@pytest.mark.parametrize("a,b", SESSIONS)
def test_two_sessions_in_one_project_share_a_key_only_when_nothing_tells_them_apart(a: str, b: str) -> None:
    _, key_a, _ = key_of(a)
    _, key_b, _ = key_of(b)
    if same_request(a, b):  # byte-identical: the key is the same, and said to be shared
        assert key_a == key_b and key_a.shared
    else:
        assert key_a.name != key_b.name, (a, b)


@pytest.mark.parametrize("a,b", TURNS)
def test_one_conversation_keeps_its_key_across_its_turns(a: str, b: str) -> None:
    assert key_of(a)[1].name == key_of(b)[1].name


def test_a_key_made_from_content_is_shared_and_a_session_id_is_not() -> None:
    for relative in (
        "aider-0.86.2/A1.json",
        "cline-3.0.65/A1.json",
        "qwen-code-0.24.4/A1.json",
        "pi-0.73.1/A1.json",
        "openhands-1.16.0/S1-subagent.json",
    ):
        assert key_of(relative)[1].shared, relative
    for relative in (
        "opencode-1.18.33/02_projA_turn1_main_request.json",
        "claude-code-2.1.332/A1.json",
        "codex-0.171.0/A1.json",
        "kilo-code-7.7.9/A1.json",
        "openhands-1.16.0/A1.json",
        "pi-0.73.1/A1-affinity.json",
    ):
        assert not key_of(relative)[1].shared, relative


def test_aiders_key_is_never_its_canned_example_alone() -> None:
    """Every Aider session on a machine shared one key before: the system prompt and the example
    exchange are the same in every project (A1, B1 and T-turn1 gave one key)."""
    names = {key_of(f"aider-0.86.2/{name}.json")[1].name for name in ("A1", "B1")}
    assert len(names) == 2
    _, key, chat = key_of("aider-0.86.2/A1.json")
    other_question = json.loads(json.dumps(chat))
    other_question["messages"][-1]["content"] = other_question["messages"][-1]["content"].replace("say ok", "fix it", 1)
    adapter = select(Incoming(api="openai", headers={}, body=other_question), enabled=NAMES)
    assert adapter.name == "aider"
    assert adapter.key(Incoming(api="openai", headers={}, body=other_question), other_question).name != key.name


# -- the names under a shared key: a property ------------------------------------------------------

SERVER = "http://127.0.0.1:1"
KEY = ConversationKey.content("agent", "the project", "the first question", source="test")


def body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}, separators=(",", ":")).encode()


@dataclass
class FakeRam:
    """The RAM tier's one answer this test needs: what ocpc saw go to the server's RAM cache."""

    kept_trails: dict[str, Trail] = field(default_factory=dict)

    def kept(self, *, epoch: int) -> list[tuple[str, Trail]]:
        return list(self.kept_trails.items())


@dataclass
class World:
    """Where each conversation's last state is, as ocpc records it."""

    tracker: SlotTracker = field(default_factory=SlotTracker)
    ram: FakeRam = field(default_factory=FakeRam)
    index: Index = field(default_factory=Index)
    busy: set[int] = field(default_factory=set)

    def instances(self) -> Instances:
        return Instances(
            server=SERVER,
            tracker=self.tracker,
            ram=self.ram,  # type: ignore[arg-type]
            busy=lambda: set(self.busy),
            index=lambda: self.index,
        )

    def leave(self, where: str, slot: int, name: str, raw: bytes) -> None:
        trail = Trail.of(parse(raw.decode()), session="")
        if where == "slot":
            holding = Holding(
                kind="conv",
                key=name,
                head="h",
                n_tokens=10,
                exact=False,
                left=Observation(id_task=1, n_tokens=10, n_processed=10, n_cached=0),
                conversation=name,
            )
            self.tracker.leave(SERVER, slot, holding, trail=trail)
        elif where == "ram":
            self.ram.kept_trails[name] = trail
        elif where == "park":
            entry = park_entry(
                model="m", build="b", identity="i", head="h", session="", digests=trail.digests, conversation=name
            )
            key = f"{len(self.index.entries):016x}"
            self.index.entries[key] = replace(entry, file=f"oc-conv-{key}.bin", kind="conv")


#: a block the system text holds, which the newest message repeats after its text (Aider's reminder)
RULES = "Reply with whole files, each in a fenced block after its path."
words = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=3)


@settings(
    max_examples=int(os.environ.get("OCPC_PROPERTY_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    conversations=st.lists(st.lists(st.tuples(words, words), min_size=1, max_size=4), min_size=2, max_size=4),
    places=st.lists(st.sampled_from(["slot", "ram", "park", "nowhere"]), min_size=4, max_size=4),
    busy=st.booleans(),
    reminder=st.booleans(),
)
def test_under_a_shared_key_each_conversation_gets_its_own_name_and_finds_it_again(
    conversations: list[list[tuple[str, str]]], places: list[str], busy: bool, reminder: bool
) -> None:
    """Conversations under one shared key, all with the same first question (so their first requests
    are byte-identical), each then going its own way: turns of (reply, next message). A first
    request is never given a running conversation's name; a conversation's later turn finds its
    own name wherever ocpc last saw it, and never another's. ``reminder``: as Aider does, the newest
    message carries a block of rules that the next turn leaves out of it."""
    world = World()
    first = [{"role": "system", "content": "the project\n" + RULES}, {"role": "user", "content": "the first question"}]
    names: list[str] = []
    for i, _ in enumerate(conversations):  # every first request, one after the other, on its own slot
        found = world.instances().find(KEY, body(first), continuing=False)
        assert found.where == "new" and found.name.startswith(KEY.name + INSTANCE_SEP)
        assert found.name not in names  # byte-identical first requests: two conversations, two names
        names.append(found.name)
        world.leave("slot", i, found.name, body(first))
        if busy:
            world.busy.add(i)
    world = World(busy=world.busy)  # each conversation's first turn ended; each left its state at its place
    histories: list[list[dict[str, str]]] = []
    for i, turns in enumerate(conversations):
        messages = list(first)
        for reply, typed in turns[:-1]:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": typed}]
        histories.append(messages)
        sent = (
            messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + "\n\n" + RULES}]
            if reminder
            else messages
        )
        world.leave(places[i % len(places)], i, names[i], body(sent))
    for i, turns in enumerate(conversations):
        reply, typed = turns[-1]
        nxt = histories[i] + [{"role": "assistant", "content": reply}, {"role": "user", "content": typed}]
        found = world.instances().find(KEY, body(nxt), continuing=True)
        # whose recorded history the request goes on from (conversations that began alike share theirs)
        # a park is found by its exact message chain: one whose last message had the rules is not
        known = ["nowhere" if p == "park" and reminder else p for p in places]
        # never another's name unless that one said exactly what this one says, up to at least as far as
        # this one's own record (the same words so far: the two cannot be told apart); its own whenever
        # its own record is known and no other's says as much
        alike = {
            names[j]
            for j in range(len(conversations))
            if j != i
            and known[j % len(known)] != "nowhere"
            and _starts_with(nxt, histories[j])
            and len(histories[j]) >= len(histories[i])
        }
        assert found.where == "new" or found.name == names[i] or found.name in alike, (found, names[i])
        if known[i % len(known)] != "nowhere" and not alike:
            assert found.name == names[i], (found, names[i])


def _starts_with(messages: list[dict[str, str]], prefix: list[dict[str, str]]) -> bool:
    return messages[: len(prefix)] == prefix


def test_a_retry_of_a_turn_finds_its_conversation_only_where_no_twin_may_be_running() -> None:
    world = World()
    turn = body(
        [
            {"role": "system", "content": "p"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "again"},
        ]
    )
    world.leave("slot", 0, "agent-x~1", turn)
    assert world.instances().find(KEY, turn, continuing=True).where == "new"  # another key's conversation
    key = ConversationKey(name="agent-x", shared=True, source="test")
    assert world.instances().name(key, turn, continuing=True) == "agent-x~1"  # a retry, the slot idle
    world.busy.add(0)
    assert world.instances().name(key, turn, continuing=True) != "agent-x~1"  # its twin may be running there
    world.busy.clear()
    first = body([{"role": "system", "content": "p"}, {"role": "user", "content": "q"}])
    world.leave("slot", 1, "agent-x~2", first)
    assert world.instances().name(key, first, continuing=False) != "agent-x~2"  # the same first request: a new session
    session = ConversationKey.session("ses_1")
    assert world.instances().name(session, turn, continuing=True) == "ses_1"  # a session id is its own name


def aider_after_an_edit() -> tuple[dict[str, Any], dict[str, Any]]:
    """T-turn2, and its next turn as Aider sends it after the reply edited a file: the turns move
    before the chat files (whose contents changed), after a "committed" pair Aider adds."""
    _, _, before = key_of("aider-0.86.2/T-turn2.json")
    messages = before["messages"]
    fixed, chat_files, history = messages[:7], messages[7:9], messages[9:]
    reminder = history[-1]["content"][len("say it again") :]
    history = history[:-1] + [
        {"role": "user", "content": "say it again"},
        {"role": "assistant", "content": "calc.py\n```\ndef add(a, b):\n    return b + a\n```"},
        {"role": "user", "content": "I committed the changes with git hash 1a2b3c4 & commit msg: x"},
        {"role": "assistant", "content": "Ok."},
    ]
    files = [{"role": "user", "content": chat_files[0]["content"] + "\ncalc.py changed"}, chat_files[1]]
    after = {**before, "messages": fixed + history + files + [{"role": "user", "content": "now the tests" + reminder}]}
    return before, after


def test_an_aider_turn_after_an_edit_keeps_its_key_and_its_name() -> None:
    """Aider rewrites its history when a reply edits files: the turn moves before the chat files,
    whose contents changed, so the next body does not repeat the last one. Its key stays (the
    files its repo map lists, not their symbols), and the one conversation live under it is found."""
    before, after = aider_after_an_edit()
    adapter = select(Incoming(api="openai", headers={}, body=after), enabled=NAMES)
    key = adapter.key(Incoming(api="openai", headers={}, body=after), after)
    assert key == adapter.key(Incoming(api="openai", headers={}, body=before), before) and key.rewrites_history
    world = World()
    world.leave("slot", 0, key.name + INSTANCE_SEP + "mine", body(before["messages"]))
    assert (
        world.instances().find(key, body(after["messages"]), continuing=True, rewrites_history=True).name
        == key.name + INSTANCE_SEP + "mine"
    )
    world.leave("slot", 1, key.name + INSTANCE_SEP + "twin", body(before["messages"]))  # two live: not guessed
    assert world.instances().find(key, body(after["messages"]), continuing=True, rewrites_history=True).where == "new"


def test_two_twins_next_turns_named_at_once_get_their_own_names() -> None:
    """Two sessions that began alike (byte-identical first requests, one slot each): their next
    turns are named while neither has begun in its slot. The broker names under its lock and
    never gives a name with a request in flight, so the second is not sent to the first's slot."""
    from oc_prefix_cache.engine.broker import Ask, SlotBroker

    world = World()
    first = [{"role": "system", "content": "p"}, {"role": "user", "content": "q"}]
    for slot, name in enumerate(("agent-x~a", "agent-x~b")):
        world.leave("slot", slot, name, body(first))
    key = ConversationKey(name="agent-x", shared=True, source="test")
    broker = SlotBroker(
        server=SERVER,
        tracker=world.tracker,
        props=lambda deadline: {"total_slots": 2},
        namer=lambda k, raw, going, rewrites, busy: world.instances().name(
            k, raw, continuing=going, rewrites_history=rewrites, in_flight=busy
        ),
    )
    nxt = body(first + [{"role": "assistant", "content": "same reply"}, {"role": "user", "content": "go on"}])
    from oc_prefix_cache.deadline import Deadline

    taken = [
        broker.take(
            Ask(conversation="", key=key, raw=nxt, continuing=True, n_slots=2, returning=True),
            deadline=Deadline.after(5),
        )
        for _ in range(2)
    ]  # the first still in flight
    try:
        assert taken[0].conversation != taken[1].conversation, taken
        assert taken[0].slot != taken[1].slot  # the second did not wait for the first's slot
    finally:
        for one in taken:
            broker.give_back(one)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=()), max_size=40))
def test_every_key_and_digest_of_request_text_takes_any_text_lone_surrogates_too(text: str) -> None:
    """A lone surrogate (a JS agent cut a tool's output mid-emoji) made a head's key fail, and with it
    the daemon's answer (cut mid-body) and the proxy's planning: no key or digest made from what a
    request says may raise on any text."""
    from oc_prefix_cache.chat.conversation import frame_of, text_digest
    from oc_prefix_cache.chat.head import Head
    from oc_prefix_cache.disk.park_files import park_key, project_key
    from oc_prefix_cache.engine.broker import head_key

    head = Head(tools_json=text, system_head=text, marker="<env>", model=text, n_tools=1)
    for value in (
        head_key(head),
        frame_of({"tools": [text], "chat_template_kwargs": {text: text}}),
        text_digest(text),
        park_key(identity=text, conversation=text),
        project_key(identity=text, head=text, project_text=text),
        ConversationKey.content("agent", text, text, source="t").name,
    ):
        assert isinstance(value, str) and value
