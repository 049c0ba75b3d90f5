"""Finding a request's park in the index, and what a park costs the index (pure, no server)."""

from __future__ import annotations

import json

import xxhash

from oc_prefix_cache.disk.index import Entry, Index, Store
from oc_prefix_cache.disk.park_files import find_park, park_entry

IDENTITY = "8f03b2c6d1e4a957"


def digests(n: int, salt: str = "") -> tuple[str, ...]:
    return tuple(xxhash.xxh64_hexdigest(f"{salt}message {i}".encode()) for i in range(n))


def filed(index: Index, key: str, entry: Entry, *, tokens: int = 100, used: int = 1) -> None:
    entry.file, entry.kind, entry.prefix_tokens, entry.last_used = f"oc-conv-{key}.bin", "conv", tokens, used
    index.entries[key] = entry


def park(chain: tuple[str, ...], *, session: str = "", identity: str = IDENTITY) -> Entry:
    return park_entry(model="m", build="b", identity=identity, head="cf70f4192c7e149e", session=session, digests=chain)


def test_a_request_finds_the_longest_parked_chain_its_messages_extend() -> None:
    mine, other = digests(40), digests(40, salt="other")
    index = Index()
    filed(index, "1" * 16, park(mine[:10]))
    filed(index, "2" * 16, park(mine[:25]))
    filed(index, "3" * 16, park(other[:30]))  # another conversation's, longer
    filed(index, "4" * 16, park(mine[:30], identity="another model"))  # another server identity: never
    found = find_park(index, identity=IDENTITY, session="", digests=mine[:31])
    assert found is not None and found.key == "2" * 16 and found.messages == 25
    assert find_park(index, identity=IDENTITY, session="", digests=mine[:9]) is None
    assert find_park(index, identity=IDENTITY, session="", digests=digests(40, salt="third")) is None


def test_a_session_finds_its_own_latest_park() -> None:
    index = Index()
    filed(index, "1" * 16, park(digests(3), session="ses_a"), used=5)
    filed(index, "2" * 16, park(digests(4), session="ses_a"), used=9)
    filed(index, "3" * 16, park(digests(5), session="ses_b"), used=20)
    found = find_park(index, identity=IDENTITY, session="ses_a", digests=digests(8))
    assert found is not None and found.key == "2" * 16


def test_a_version_2_index_with_whole_chains_still_finds_its_parks(tmp_path) -> None:
    """Version 2 kept a park's whole message chain; an index written by it serves version 3."""
    mine = digests(12)
    old = {
        "version": 2,
        "entries": {
            "5" * 16: {
                "file": "oc-conv-" + "5" * 16 + ".bin",
                "bytes": 10,
                "prefix_tokens": 300,
                "created": 1,
                "last_used": 1,
                "model": "m",
                "server_build": "b",
                "harness": "",
                "kind": "conv",
                "identity": IDENTITY,
                "head": "cf70f4192c7e149e",
                "session": "",
                "chain": list(mine[:7]),
            }
        },
        "current": {},
    }
    (tmp_path / "index.json").write_text(json.dumps(old))
    store = Store(index_path=tmp_path / "index.json", lock_path=tmp_path / "index.lock")
    found = find_park(store.load(), identity=IDENTITY, session="", digests=mine)
    assert found is not None and found.key == "5" * 16 and found.messages == 7 and found.n_tokens == 300


def test_many_long_parked_conversations_keep_the_index_small(tmp_path) -> None:
    """200 parks of 2,000-message conversations made a 9.7 MB index in version 2 (a digest per
    message), rewritten on every park and read on every prepare that is not a hit. A park's
    entry is now the same size whatever its conversation's length."""
    store = Store(index_path=tmp_path / "index.json", lock_path=tmp_path / "index.lock")
    chains = [digests(2000, salt=str(i)) for i in range(200)]

    def fill(index: Index) -> None:
        for i, chain in enumerate(chains):
            filed(index, f"{i:016x}", park(chain), tokens=60_000)

    store.update(fill)
    size = (tmp_path / "index.json").stat().st_size
    assert size < 200_000, f"index of 200 parks: {size:,} bytes"
    found = find_park(store.load(), identity=IDENTITY, session="", digests=chains[123] + digests(3, salt="new"))
    assert found is not None and found.key == f"{123:016x}" and found.messages == 2000
