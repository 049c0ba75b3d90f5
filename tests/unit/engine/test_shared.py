"""The engine's use of the shared store (engine/shared.py), as classes of promises.

* A conversation is never given another's state, and never set back: only a park whose messages
  are the first messages of the request is brought, and only when it covers more than this box's
  own (a stale park of a conversation that went on, or was compacted, on another box never is).
* A store that hangs (a hard-mounted NFS) costs a request its deadline's share and no more: the
  request goes on as without a store.
* A file being digested for the first time holds no request up: it goes on unprepared.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.disk.content_digest import ContentDigests
from oc_prefix_cache.disk.index import Index, Store, chain_digest
from oc_prefix_cache.disk.park_files import Park, park_entry, park_key
from oc_prefix_cache.disk.shared_store import SharedStore
from oc_prefix_cache.disk.slotfile import file_digest, slot_filename
from oc_prefix_cache.engine.shared import SharedFiles
from oc_prefix_cache.errors import DigestPending

IDENTITY = "i" * 16


def published_park(tmp_path: Path, box: str, session: str, digests: tuple[str, ...], data: bytes) -> None:
    """A park of ``session`` covering ``digests``, published by ``box``."""
    slot_dir = tmp_path / box / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    key = park_key(identity=IDENTITY, conversation=session)
    path = slot_dir / slot_filename(key, "conv")
    path.write_bytes(data)
    entry = park_entry(model="m", build="b", identity=IDENTITY, head="h" * 16, session=session, digests=digests)
    entry.file, entry.bytes, entry.prefix_tokens, entry.xxh64 = path.name, len(data), len(data), file_digest(path)
    entry.kind = "conv"
    entry.last_used = int(time.time())
    SharedStore(tmp_path / "store", box=box, slot_dir=slot_dir).publish(Index(entries={key: entry}))


def this_box(tmp_path: Path) -> SharedFiles:
    home = tmp_path / "here"
    slot_dir = home / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    store = Store(index_path=home / "index.json", lock_path=home / "index.lock")
    return SharedFiles(shared=SharedStore(tmp_path / "store", box="here", slot_dir=slot_dir), store=store)


def msgs(*names: str) -> tuple[str, ...]:
    return tuple(f"{n:0>16}"[:16] for n in names)


@given(
    park_chain=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=5),
    request_chain=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_only_a_park_whose_messages_begin_the_request_is_ever_brought(
    tmp_path_factory: pytest.TempPathFactory, park_chain: list[str], request_chain: list[str]
) -> None:
    tmp_path = tmp_path_factory.mktemp("shared")
    parked, request = msgs(*park_chain), msgs(*request_chain)
    published_park(tmp_path, "box-a", "routed-x", parked, b"kv" * 100)
    here = this_box(tmp_path)
    found = here.park(identity=IDENTITY, session="routed-x", digests=request, local=None, deadline=Deadline.after(10))
    begins = len(parked) <= len(request) and chain_digest(list(request[: len(parked)])) == chain_digest(list(parked))
    assert (found is not None) == begins
    assert (here.counts["brought"] == 1) == begins


def test_a_longer_own_park_is_never_replaced_by_a_shorter_one_from_another_box(tmp_path: Path) -> None:
    request = msgs("a", "b", "c", "d", "e")
    published_park(tmp_path, "box-a", "routed-x", request[:2], b"old" * 100)
    here = this_box(tmp_path)
    mine = Park(key="k" * 16, n_tokens=900, session="routed-x", messages=4, head="h" * 16)
    found = here.park(identity=IDENTITY, session="routed-x", digests=request, local=mine, deadline=Deadline.after(10))
    assert found is mine and here.counts["brought"] == 0


def test_a_store_that_hangs_costs_a_request_its_bound_and_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = this_box(tmp_path)
    release = threading.Event()
    monkeypatch.setattr(SharedStore, "others", lambda self, until=None: release.wait(30) and [])  # a hung NFS read
    mine = Park(key="k" * 16, n_tokens=9, session="s", messages=1, head="h" * 16)
    started = time.monotonic()
    try:
        found = here.park(
            identity=IDENTITY, session="s", digests=msgs("a", "b"), local=mine, deadline=Deadline.after(1.0)
        )
        assert not here.head("f" * 16, deadline=Deadline.after(0.5))
    finally:
        release.set()
    assert found is mine
    assert time.monotonic() - started < 5.0
    assert here.counts["timed_out"] >= 1


def test_a_file_digested_for_the_first_time_holds_no_request_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import oc_prefix_cache.disk.content_digest as content_digest

    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights" * 1000)
    slow = threading.Event()
    real = content_digest.file_content_digest
    monkeypatch.setattr(content_digest, "file_content_digest", lambda p: slow.wait(10) and real(p))
    digests = ContentDigests(tmp_path / "digests.json")
    started = time.monotonic()
    with pytest.raises(DigestPending):
        digests.within(0.2).digest(model)
    assert time.monotonic() - started < 2.0
    slow.set()
    assert digests.within(5.0).digest(model) == real(model)  # found once it is read
