"""ocpc gc: the pure policy (one test per rule and kind, then random folders), then run_gc on disk."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from oc_prefix_cache.disk.gc import (
    DAY,
    HOUR,
    STALE_CURRENT_S,
    DiskFile,
    GcPlan,
    _still_deletable,
    list_slot_dir,
    pid_alive,
    plan_gc,
    run_gc,
)
from oc_prefix_cache.disk.index import INDEX_VERSION, Entry, Index, Store
from oc_prefix_cache.disk.slotfile import fingerprint_of
from oc_prefix_cache.settings import Settings

NOW = 1_700_000_000.0
SLOT0 = "http://127.0.0.1:8080#slot0"
A, B, C, D, E = (f"{c}" * 16 for c in "abcde")
PREFIX = {"head": "oc-prefix", "proj": "oc-proj", "conv": "oc-conv"}
TAG = "0123abcd"
NEAR_MISSES = (
    "oc-prefix-ABCDEF0123456789.bin",
    f"oc-prefix-{A}.bin.part",
    f"oc-prefix-{A[:15]}.bin",
    f"xoc-prefix-{A}.bin",
    "other.bin",
    "index.json",
    "index.lock",
    ".index-x.tmp",
    f"oc-prefix-{A}.bin\n",
    f"oc-prefix-{A}.bin ",
    f"oc-prefix-{'٣' * 16}.bin",
    # the other kinds' near misses: wrong case, lengths, tags, digits
    f"oc-conv-{A[:15]}.bin",
    f"oc-proj-{A.upper()}.bin",
    f"oc-conv-{A}.bin.1234567.part",
    f"oc-conv-{A}.bin.ABCDEF01.part",
    f"oc-conv-{A}.bin.{TAG}.part.1",
    f"other-{A}.bin.{TAG}.part",
    f"oc-proj-{A}.bin.{TAG}",
    f"x.bin.{TAG}.part",
    "ocpc-doctor-.bin",
    "ocpc-doctor-12.bin.part",
    "ocpc-doctor-٣.bin",
    "ocpc-doctor-12a.bin",
    "ocpc-doctor-12.bin\n",
    "oc-conv.bin",
    "ocpc-selftest-12.bin",
    f"ocpc-selftest-12-{TAG}x.bin",
    "ocpc-selftest--00000000.bin",
    f"ocpc-doctor-12-{TAG}.bin",
)


def is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def kind_by_hand(filename: str) -> str | None:
    """An oracle independent of the code's regexes: which kind of ocpc file, or None."""
    for kind, prefix in PREFIX.items():
        if (
            filename.startswith(prefix + "-")
            and filename.endswith(".bin")
            and is_hex(filename[len(prefix) + 1 : -len(".bin")], 16)
        ):
            return kind
    if filename.endswith(".part"):
        final, dot, tag = filename[: -len(".part")].rpartition(".")
        if dot and is_hex(tag, 8) and kind_by_hand(final) in PREFIX:
            return "part"
    digits = filename[len("ocpc-doctor-") : -len(".bin")]
    if (
        filename.startswith("ocpc-doctor-")
        and filename.endswith(".bin")
        and digits
        and all(c in "0123456789" for c in digits)
    ):
        return "doctor"
    if filename.startswith("ocpc-selftest-") and filename.endswith(".bin"):  # the self-test's: pid, maybe a tag
        pid, dash, tag = filename[len("ocpc-selftest-") : -len(".bin")].partition("-")
        if pid and all(c in "0123456789" for c in pid) and dash and is_hex(tag, 8):
            return "doctor"
    return None


def ours_by_hand(filename: str) -> bool:
    return kind_by_hand(filename) is not None


def name(fp: str, kind: str = "head") -> str:
    return f"{PREFIX[kind]}-{fp}.bin"


def disk(fp_or_name: str, *, days_old: float = 0, size: int = 100, regular: bool = True) -> DiskFile:
    n = fp_or_name if fingerprint_of(fp_or_name) or "." in fp_or_name else name(fp_or_name)
    return DiskFile(n, size, NOW - days_old * DAY, regular)


def entry(fp: str, *, days_ago: float, kind: str = "head", expires: int = 0) -> Entry:
    return Entry(
        file=name(fp, kind),
        bytes=100,
        prefix_tokens=10,
        created=0,
        last_used=int(NOW - days_ago * DAY),
        model="m.gguf",
        server_build="b1",
        harness="opencode",
        kind=kind,
        expires=expires,
    )


def index_of(used: dict[str, float], current: dict[str, str] | None = None) -> Index:
    return Index(entries={fp: entry(fp, days_ago=d) for fp, d in used.items()}, current=current or {})


def plan(
    files: list[DiskFile],
    index: Index | None,
    *,
    ttl: float = 30,
    keep: int = 0,
    cap: int | None = None,
    error: str | None = None,
    park_ttl: float = 48,
    park_cap: int | None = None,
    live: frozenset[int] = frozenset(),
    listing_error: str | None = None,
) -> GcPlan:
    return plan_gc(
        files=files,
        index=index,
        index_error=error,
        listing_error=listing_error,
        now=NOW,
        ttl_days=ttl,
        keep_recent=keep,
        max_bytes=cap,
        park_ttl_hours=park_ttl,
        park_max_bytes=park_cap,
        live_pids=live,
    )


def actions(p: GcPlan) -> dict[str, str]:
    return {d.fingerprint: d.action for d in p.decisions}


def by_name(p: GcPlan) -> dict[str, tuple[str, str]]:
    return {d.name: (d.action, d.rule) for d in p.decisions}


# --- one test per rule ---------------------------------------------------------------


def test_only_pattern_files_are_considered_and_others_are_ignored() -> None:
    files = [disk(n, days_old=400) for n in NEAR_MISSES] + [disk(A, days_old=400)]
    p = plan(files, Index())
    assert [d.name for d in p.decisions] == [name(A)]
    assert set(p.ignored) == set(NEAR_MISSES)
    assert [d.name for d in p.to_delete] == [name(A)]  # an old orphan: the only candidate


def test_a_current_fingerprint_is_kept_by_every_rule_cap_included() -> None:
    p = plan([disk(A, size=500)], index_of({A: 400}, {SLOT0: A}), ttl=1, keep=0, cap=10)
    (d,) = p.decisions
    assert (d.action, d.rule, d.reason) == ("keep", "current", f"current fingerprint of {SLOT0}")
    assert p.warnings and "never deleted" in p.warnings[0] and p.bytes_after == 500


def test_a_current_key_no_running_ocpc_has_seen_for_days_stops_protecting_its_file() -> None:
    """A port or slot no longer in use pinned its GB-sized head for ever, over the cap; now only
    while some ocpc has seen the slot in the last three days (an undated key counts as fresh)."""
    files = [disk(A, size=500), disk(B, size=500), disk(C, size=500)]
    index = index_of({A: 1, B: 1, C: 1}, {SLOT0: A, "http://127.0.0.1:9931#slot1": B, "http://old:1#slot0": C})
    index.current_seen = {SLOT0: int(NOW - 3600), "http://old:1#slot0": int(NOW - STALE_CURRENT_S - 60)}
    p = plan(files, index, cap=1000)
    assert p.stale_current == ("http://old:1#slot0",)
    assert by_name(p)[name(A)] == ("keep", "current") and by_name(p)[name(B)] == ("keep", "current")
    assert by_name(p)[name(C)] == ("delete", "cap")


def test_run_gc_drops_stale_current_keys_and_dates_undated_ones(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    put(s, name(A), days_old=1)
    put(s, name(B), days_old=1)
    index = index_of({A: 1, B: 1}, {SLOT0: A, "http://old:1#slot0": B})
    index.current_seen = {"http://old:1#slot0": int(NOW - 4 * DAY)}
    store_of(s).save(index)
    p = run_gc(s, dry_run=False, now=NOW)
    after = store_of(s).load()
    assert p.stale_current == ("http://old:1#slot0",) and p.to_delete == ()  # B is used within the TTL
    assert after.current == {SLOT0: A} and after.current_seen == {SLOT0: int(NOW)}


def test_a_current_fingerprint_without_an_entry_is_still_kept() -> None:
    p = plan([disk(A, days_old=400)], index_of({}, {SLOT0: A}))
    assert actions(p) == {A: "keep"} and p.orphans == (name(A),)


def test_entries_used_within_the_ttl_are_kept_and_older_ones_deleted() -> None:
    p = plan([disk(A), disk(B)], index_of({A: 2, B: 41}), ttl=30)
    by = {d.fingerprint: d for d in p.decisions}
    assert (by[A].action, by[A].reason) == ("keep", "used 2 days ago (TTL 30 days)")
    assert (by[B].action, by[B].rule, by[B].reason) == ("delete", "expired", "unused for 41 days (TTL 30 days)")
    assert p.bytes_on_disk == 200 and p.bytes_after == 100 and p.bytes_freed == 100


def test_the_keep_recent_most_recent_are_kept_regardless_of_age() -> None:
    p = plan([disk(fp) for fp in (A, B, C, D)], index_of({A: 100, B: 200, C: 300, D: 400}), ttl=30, keep=2)
    assert actions(p) == {A: "keep", B: "keep", C: "delete", D: "delete"}
    assert {d.rule for d in p.decisions if d.action == "keep"} == {"recent"}
    assert p.decisions[0].reason.startswith("one of the 2 most recent")


def test_the_cap_trims_oldest_first_but_never_the_current_one() -> None:
    files = [disk(fp, size=10 * 10**9) for fp in (A, B, C, D)]
    idx = index_of({A: 40, B: 1, C: 2, D: 3}, {SLOT0: A})  # A is the oldest, but current
    p = plan(files, idx, ttl=30, keep=3, cap=20 * 10**9)
    assert actions(p) == {A: "keep", B: "keep", C: "delete", D: "delete"}
    assert {d.reason for d in p.to_delete} == {"over the 20.0 GB cap: oldest first"}
    assert p.bytes_after == 20 * 10**9 and p.warnings == ()


def test_the_cap_counts_orphans_by_mtime() -> None:
    p = plan([disk(A, days_old=1), disk(B, days_old=5)], index_of({A: 3}), cap=150)
    assert actions(p) == {A: "keep", B: "delete"} and p.to_delete[0].rule == "cap"


def test_a_corrupt_index_turns_cleanup_off() -> None:
    p = plan([disk(A, days_old=400), disk("other.bin")], None, error="index.json is not valid JSON")
    assert p.to_delete == () and p.decisions[0].rule == "disabled"
    assert p.disabled == (
        "index.json is unreadable (index.json is not valid JSON): cleanup is off until it is fixed or moved away"
    )


def test_an_index_error_wins_even_if_an_index_is_passed() -> None:
    p = plan([disk(A, days_old=400)], Index(), error="cannot read index.json")
    assert p.to_delete == () and p.disabled and p.orphans == ()


def test_a_missing_index_counts_as_empty() -> None:
    p = plan([disk(A, days_old=40), disk(B, days_old=3)], Index())
    assert p.disabled is None and p.orphans == (name(A), name(B))
    assert actions(p) == {A: "delete", B: "keep"}
    assert p.decisions[1].reason == "orphan (not in the index), 3 days old: kept until 30 days"


def test_entries_whose_file_is_missing_are_reported() -> None:
    p = plan([disk(A)], index_of({A: 1, B: 1}))
    assert p.missing == (B,) and actions(p) == {A: "keep"}


def test_a_symlink_named_like_ours_is_ignored_and_its_entry_is_not_missing() -> None:
    p = plan([disk(A, regular=False)], index_of({A: 400}))
    assert p.decisions == () and p.ignored == (name(A),) and p.missing == ()


# --- project heads, parked conversations, temp files, doctor probes ------------------


def proj(fp: str, *, days_ago: float = 0, expires_in_h: float | None = 12) -> Entry:
    expires = 0 if expires_in_h is None else int(NOW + expires_in_h * HOUR)
    return entry(fp, days_ago=days_ago, kind="proj", expires=expires)


def conv(fp: str, *, hours_ago: float) -> Entry:
    return entry(fp, days_ago=hours_ago / 24, kind="conv")


def test_a_project_head_lives_until_its_entry_expires() -> None:
    files = [disk(name(fp, "proj")) for fp in (A, B, C)]
    idx = Index(
        entries={A: proj(A, expires_in_h=3), B: proj(B, expires_in_h=-2), C: proj(C, expires_in_h=-40)},
        current={SLOT0: C},
    )
    p = plan(files, idx, ttl=365, keep=5)
    assert {d.kind for d in p.decisions} == {"proj"}
    assert by_name(p) == {
        name(A, "proj"): ("keep", "ttl"),
        name(B, "proj"): ("delete", "expired"),
        name(C, "proj"): ("keep", "current"),
    }
    assert [d.reason for d in p.to_delete] == ["expired 2 h ago"]


def test_a_project_head_without_an_expiry_falls_back_to_the_ttl() -> None:
    idx = Index(entries={A: proj(A, days_ago=2, expires_in_h=None), B: proj(B, days_ago=40, expires_in_h=None)})
    p = plan([disk(name(A, "proj")), disk(name(B, "proj"))], idx, ttl=30)
    assert by_name(p) == {name(A, "proj"): ("keep", "ttl"), name(B, "proj"): ("delete", "expired")}


def test_an_orphan_project_head_goes_after_a_day() -> None:
    p = plan([disk(name(A, "proj"), days_old=1.1), disk(name(B, "proj"), days_old=0.9)], Index(), ttl=365)
    assert by_name(p) == {name(A, "proj"): ("delete", "orphan"), name(B, "proj"): ("keep", "orphan")}
    assert p.orphans == (name(A, "proj"), name(B, "proj"))


def test_project_heads_share_the_cap_with_heads_least_recently_used_first() -> None:
    files = [disk(A, size=100), disk(name(B, "proj"), size=100), disk(C, size=100), disk(name(D, "conv"), size=500)]
    idx = Index(
        entries={A: entry(A, days_ago=1), B: proj(B, days_ago=3), C: entry(C, days_ago=2), D: conv(D, hours_ago=1)}
    )
    p = plan(files, idx, cap=200)  # heads + proj = 300 > 200; the parked conversation does not count
    assert by_name(p) == {
        name(A): ("keep", "ttl"),
        name(B, "proj"): ("delete", "cap"),
        name(C): ("keep", "ttl"),
        name(D, "conv"): ("keep", "ttl"),
    }
    assert p.to_delete[0].reason == "over the 200 bytes cap: oldest first"


def test_a_parked_conversation_is_kept_within_the_park_ttl_and_deleted_after() -> None:
    files = [disk(name(fp, "conv")) for fp in (A, B, C)]
    idx = Index(
        entries={A: conv(A, hours_ago=47), B: conv(B, hours_ago=49), C: conv(C, hours_ago=500)}, current={SLOT0: C}
    )
    p = plan(files, idx, ttl=365, keep=5, park_ttl=48)
    assert by_name(p) == {
        name(A, "conv"): ("keep", "ttl"),
        name(B, "conv"): ("delete", "expired"),
        name(C, "conv"): ("keep", "current"),
    }
    assert p.to_delete[0].reason == "parked conversation unused for 2 days (park TTL 48 hours)"
    assert p.to_delete[0].kind == "conv"


def test_an_orphan_parked_conversation_goes_after_the_park_ttl() -> None:
    p = plan([disk(name(A, "conv"), days_old=3), disk(name(B, "conv"), days_old=1)], Index(), park_ttl=48)
    assert by_name(p) == {name(A, "conv"): ("delete", "orphan"), name(B, "conv"): ("keep", "orphan")}


def test_the_park_cap_trims_parked_conversations_only_oldest_first() -> None:
    files = [
        disk(name(A, "conv"), size=300),
        disk(name(B, "conv"), size=300),
        disk(name(C, "conv"), size=300),
        disk(name(E, "conv"), size=300),
        disk(D, size=5000),
    ]
    idx = Index(
        entries={
            A: conv(A, hours_ago=3),
            B: conv(B, hours_ago=1),
            C: conv(C, hours_ago=2),
            E: conv(E, hours_ago=4),
            D: entry(D, days_ago=400),
        },
        current={SLOT0: A},
    )
    p = plan(files, idx, keep=1, park_cap=700)  # A is not the oldest, but current; B is the newest
    assert by_name(p) == {
        name(A, "conv"): ("keep", "current"),
        name(B, "conv"): ("keep", "ttl"),
        name(C, "conv"): ("delete", "cap"),
        name(E, "conv"): ("delete", "cap"),
        name(D): ("keep", "recent"),
    }
    assert {d.reason for d in p.to_delete} == {"over the 700 bytes park cap: oldest first"}
    assert p.warnings == ()
    alone = plan(files, idx, keep=1, park_cap=100)
    assert alone.warnings == (
        f"the current parked conversations and the newest ({name(B, 'conv')}) alone take "
        "600 bytes, over the 100 bytes park cap; they are never deleted",
    )


def test_a_park_bigger_than_the_park_cap_is_not_deleted_right_after_it_is_written() -> None:
    """The newest park survives the cap (the park path decides before saving whether it fits)."""
    files = [disk(name(A, "conv"), size=900), disk(name(B, "conv"), size=300)]
    idx = Index(entries={A: conv(A, hours_ago=0), B: conv(B, hours_ago=1)})
    p = plan(files, idx, park_cap=800)
    assert by_name(p) == {name(A, "conv"): ("keep", "ttl"), name(B, "conv"): ("delete", "cap")}


def test_temp_files_of_saves_go_after_an_hour() -> None:
    old, young = f"{name(A, 'conv')}.{TAG}.part", f"{name(B)}.{TAG}.part"
    p = plan([disk(old, days_old=61 / 1440), disk(young, days_old=59 / 1440)], Index(), ttl=365)
    assert by_name(p) == {old: ("delete", "stale"), young: ("keep", "in_progress")}
    assert [(d.kind, d.fingerprint) for d in p.decisions] == [("part", A), ("part", B)]
    assert p.orphans == () and p.missing == ()


def test_a_temp_file_of_a_current_key_still_goes_when_stale() -> None:
    """The current file is the renamed one; a temp file that old is a save that died."""
    stale = f"{name(A)}.{TAG}.part"
    p = plan([disk(A, days_old=400), disk(stale, days_old=1)], index_of({A: 400}, {SLOT0: A}))
    assert by_name(p) == {name(A): ("keep", "current"), stale: ("delete", "stale")}


def test_a_self_test_file_left_behind_goes_like_a_doctor_probe() -> None:
    """The self-test at first contact with a server (engine/capability.py) deletes its file; one left by a
    process that died goes like doctor's probe, and one of a live process stays."""
    files = [disk(f"ocpc-selftest-11-{TAG}.bin", days_old=11 / 1440), disk(f"ocpc-selftest-12-{TAG}.bin", days_old=1)]
    p = plan(files, Index(), live=frozenset({12}))
    assert by_name(p) == {
        f"ocpc-selftest-11-{TAG}.bin": ("delete", "stale"),
        f"ocpc-selftest-12-{TAG}.bin": ("keep", "in_progress"),
    }


def test_doctor_probes_go_once_their_process_is_gone_and_ten_minutes_old() -> None:
    files = [
        disk("ocpc-doctor-11.bin", days_old=11 / 1440),
        disk("ocpc-doctor-12.bin", days_old=9 / 1440),
        disk("ocpc-doctor-13.bin", days_old=400),
    ]
    p = plan(files, Index(), live=frozenset({13}))
    assert by_name(p) == {
        "ocpc-doctor-11.bin": ("delete", "stale"),
        "ocpc-doctor-12.bin": ("keep", "in_progress"),
        "ocpc-doctor-13.bin": ("keep", "in_progress"),
    }
    assert {d.kind for d in p.decisions} == {"doctor"} and {d.fingerprint for d in p.decisions} == {""}
    assert p.to_delete[0].reason == "ocpc doctor's probe left behind: process 11 is gone, 11 min old"


def test_a_missing_or_unlistable_folder_turns_cleanup_off() -> None:
    p = plan([], index_of({A: 400, B: 1}), listing_error="the slot folder /x does not exist")
    assert p.disabled == (
        "the slot folder /x does not exist: cleanup is off this run (nothing deleted, index.json left as it is)"
    )
    assert p.decisions == () and p.missing == () and p.to_delete == ()


def test_every_kind_is_disabled_by_a_corrupt_index() -> None:
    files = [
        disk(name(A, "conv"), days_old=400),
        disk(f"{name(A)}.{TAG}.part", days_old=400),
        disk("ocpc-doctor-1.bin", days_old=400),
    ]
    p = plan(files, None, error="bad")
    assert p.to_delete == () and {d.rule for d in p.decisions} == {"disabled"} and len(p.decisions) == 3


# --- random folders ------------------------------------------------------------------

hex16 = st.text("0123456789abcdef", min_size=16, max_size=16)


@dataclass(frozen=True)
class World:
    files: list[DiskFile]
    index: Index
    ttl: float
    keep: int
    cap: int | None
    park_ttl: float = 48
    park_cap: int | None = None
    live: frozenset[int] = frozenset()


@st.composite
def worlds(draw: st.DrawFn) -> World:
    fps = draw(st.lists(hex16, max_size=8, unique=True))
    age = st.floats(min_value=-1, max_value=120)  # days; a little in the future too
    size = st.integers(0, 1000)
    files = []
    for fp in fps:  # mostly regular files; some entries lose theirs; some are not regular
        kind = draw(st.sampled_from(["regular", "regular", "regular", "gone", "not regular"]))
        if kind != "gone":
            files.append(DiskFile(name(fp), draw(size), NOW - draw(age) * DAY, kind == "regular"))
    files += [
        disk(n, days_old=draw(age), size=draw(size)) for n in draw(st.lists(st.sampled_from(NEAR_MISSES), unique=True))
    ]
    entries = {fp: entry(fp, days_ago=draw(age)) for fp in fps if draw(st.booleans())}
    pool = st.sampled_from(fps) | hex16 if fps else hex16
    current = {f"http://h#slot{i}": fp for i, fp in enumerate(draw(st.lists(pool, max_size=2)))}
    cap = draw(st.none() | st.integers(0, 5000))
    return World(files, Index(entries, current), draw(st.sampled_from([0, 0.5, 7, 30])), draw(st.integers(0, 4)), cap)


@st.composite
def mixed_worlds(draw: st.DrawFn) -> World:
    """Every kind at once: heads, project heads, parked conversations (with and without
    entries, some gone, some not regular), temp files, doctor probes and strangers."""
    keys = draw(st.lists(hex16, max_size=10, unique=True))
    age = st.floats(min_value=-1, max_value=120)  # days
    size = st.integers(0, 1000)
    files: dict[str, DiskFile] = {}
    entries: dict[str, Entry] = {}
    for key in keys:
        kind = draw(st.sampled_from(list(PREFIX)))
        presence = draw(st.sampled_from(["regular", "regular", "regular", "gone", "not regular"]))
        if presence != "gone":
            files[name(key, kind)] = DiskFile(name(key, kind), draw(size), NOW - draw(age) * DAY, presence == "regular")
        if draw(st.booleans()):
            expires = 0 if kind == "head" else draw(st.just(0) | st.integers(int(NOW - 3 * DAY), int(NOW + 3 * DAY)))
            entries[key] = entry(key, days_ago=draw(age), kind=kind, expires=expires)
    for _ in range(draw(st.integers(0, 3))):  # temp files of saves, some for the keys above
        target = name(draw(st.sampled_from(keys) | hex16 if keys else hex16), draw(st.sampled_from(list(PREFIX))))
        tag = draw(st.text("0123456789abcdef", min_size=8, max_size=8))
        part = f"{target}.{tag}.part"
        files[part] = DiskFile(part, draw(size), NOW - draw(st.floats(min_value=0, max_value=3)) * HOUR)
    pids = draw(st.lists(st.integers(1, 99999), max_size=3, unique=True))
    for pid in pids:
        probe = f"ocpc-doctor-{pid}.bin"
        files[probe] = DiskFile(probe, draw(size), NOW - draw(st.floats(min_value=0, max_value=30)) * 60)
    for n in draw(st.lists(st.sampled_from(NEAR_MISSES), unique=True)):
        files[n] = disk(n, days_old=draw(age), size=draw(size))
    pool = st.sampled_from(keys) | hex16 if keys else hex16
    current = {f"http://h#slot{i}": key for i, key in enumerate(draw(st.lists(pool, max_size=3)))}
    return World(
        list(files.values()),
        Index(entries, current),
        ttl=draw(st.sampled_from([0, 0.5, 7, 30])),
        keep=draw(st.integers(0, 4)),
        cap=draw(st.none() | st.integers(0, 5000)),
        park_ttl=draw(st.sampled_from([0, 1, 48, 500])),
        park_cap=draw(st.none() | st.integers(0, 3000)),
        live=frozenset(draw(st.lists(st.sampled_from(pids), unique=True))) if pids else frozenset(),
    )


def plan_of(w: World) -> GcPlan:
    return plan_gc(
        files=w.files,
        index=w.index,
        index_error=None,
        listing_error=None,
        now=NOW,
        ttl_days=w.ttl,
        keep_recent=w.keep,
        max_bytes=w.cap,
        park_ttl_hours=w.park_ttl,
        park_max_bytes=w.park_cap,
        live_pids=w.live,
    )


@given(worlds())
@hyp_settings(max_examples=400)
def test_random_folders_keep_every_promise(w: World) -> None:
    p = plan_of(w)
    regular_ours = {f.name for f in w.files if f.regular and ours_by_hand(f.name)}
    by = {d.name: d for d in p.decisions}
    assert set(by) == regular_ours  # never anything else, so never deleted
    current = set(w.index.current.values())
    for d in p.to_delete:
        assert d.fingerprint not in current and d.rule in ("expired", "orphan", "cap")
        assert d.rule == "cap" or NOW - d.used_at > w.ttl * DAY
    with_file = [(e.last_used, e.file) for e in w.index.entries.values() if e.file in by]
    for used, file in with_file:
        if NOW - used <= w.ttl * DAY:
            assert by[file].action == "keep" or (by[file].rule == "cap" and "cap" in by[file].reason)
    newest = sorted((u for u, _ in with_file), reverse=True)
    if w.keep and newest:
        threshold = newest[min(w.keep, len(newest)) - 1]
        for used, file in with_file:
            if used > threshold:
                assert by[file].action == "keep" or by[file].rule == "cap"
        assert sum(1 for _, f in with_file if by[f].action == "keep" or by[f].rule == "cap") >= min(w.keep, len(newest))
    kept = [d for d in p.decisions if d.action == "keep"]
    assert p.bytes_after == sum(d.bytes for d in kept)
    if w.cap is not None:
        assert p.bytes_after <= w.cap or all(d.rule == "current" for d in kept)
        trimmed = [d.used_at for d in p.to_delete if d.rule == "cap"]
        if trimmed:  # oldest first: nothing kept (but current) is older than what was trimmed
            assert all(d.used_at >= max(trimmed) for d in kept if d.rule != "current")
    else:
        assert all(d.rule != "cap" for d in p.decisions)
    assert set(p.missing) == {k for k, e in w.index.entries.items() if e.file not in {f.name for f in w.files}}


def expiry_of(w: World, file: str) -> int:
    dates = [e.expires for e in w.index.entries.values() if e.file == file]
    return 0 if not dates or 0 in dates else max(dates)


@given(mixed_worlds())
@hyp_settings(max_examples=400)
def test_mixed_folders_keep_every_promise_of_every_kind(w: World) -> None:
    p = plan_of(w)
    by = {d.name: d for d in p.decisions}
    assert {n: d.kind for n, d in by.items()} == {
        f.name: kind_by_hand(f.name) for f in w.files if f.regular and ours_by_hand(f.name)
    }
    current = set(w.index.current.values())
    indexed = {e.file for e in w.index.entries.values()}
    for d in p.to_delete:
        age = NOW - d.used_at
        if d.kind in PREFIX:
            assert d.fingerprint not in current
        if d.kind == "part":
            assert d.rule == "stale" and age > HOUR
        elif d.kind == "doctor":
            assert d.rule == "stale" and age > 600 and int(d.name[12:-4]) not in w.live
        elif d.reason.startswith("expired "):  # its entry's expiry date passed (any kind)
            assert d.rule == "expired" and 0 < expiry_of(w, d.name) <= NOW
        elif d.kind == "head":
            assert d.rule == "cap" or age > w.ttl * DAY
        elif d.kind == "proj":
            assert d.rule in ("cap", "expired", "orphan")
            assert d.rule != "orphan" or (d.name not in indexed and age > DAY)
            assert d.rule != "expired" or age > w.ttl * DAY  # no expiry date: the heads' TTL
        else:
            assert d.rule in ("cap", "expired", "orphan") and (d.rule == "cap" or age > w.park_ttl * HOUR)
        if d.rule == "cap":
            assert d.kind in PREFIX and d.reason.endswith("park cap: oldest first") == (d.kind == "conv")
    for group, cap in ((("head", "proj"), w.cap), (("conv",), w.park_cap)):
        kept = [d for d in p.decisions if d.kind in group and d.action == "keep"]
        if cap is None:
            assert all(d.rule != "cap" for d in p.decisions if d.kind in group)
            continue
        newest = max((d for d in kept if d.rule != "current"), key=lambda d: (d.used_at, d.name), default=None)
        spared = [d for d in kept if d.rule == "current" or (group == ("conv",) and d is newest)]
        assert sum(d.bytes for d in kept) <= cap or len(spared) == len(kept)
        trimmed = [d.used_at for d in p.to_delete if d.rule == "cap" and d.kind in group]
        if trimmed:
            assert all(d.used_at >= max(trimmed) for d in kept if d.rule != "current")
    assert p.bytes_after == sum(d.bytes for d in p.decisions if d.action == "keep")
    assert set(p.missing) == {k for k, e in w.index.entries.items() if e.file not in {f.name for f in w.files}}


@given(mixed_worlds(), st.sampled_from([0, 1, 48, 500]), st.none() | st.integers(0, 3000))
@hyp_settings(max_examples=300)
def test_park_cleanup_never_touches_heads_project_heads_or_strangers(
    w: World, park_ttl: float, park_cap: int | None
) -> None:
    """Whatever the park settings, every other file gets the very same decision; and the
    park settings are the only ones that move a parked conversation's."""
    p, q = plan_of(w), plan_of(replace(w, park_ttl=park_ttl, park_cap=park_cap))
    assert p.ignored == q.ignored
    assert [d for d in p.decisions if d.kind != "conv"] == [d for d in q.decisions if d.kind != "conv"]
    r = plan_of(replace(w, ttl=365, keep=0, cap=0))  # very different head settings
    assert [d for d in p.decisions if d.kind == "conv"] == [d for d in r.decisions if d.kind == "conv"]
    for d in q.to_delete:
        assert ours_by_hand(d.name) and (d.kind != "conv" or d.fingerprint not in w.index.current.values())


@given(mixed_worlds())
def test_random_folders_with_a_corrupt_index_delete_nothing(w: World) -> None:
    p = plan_gc(
        files=w.files,
        index=None,
        index_error="bad",
        listing_error=None,
        now=NOW,
        ttl_days=w.ttl,
        keep_recent=w.keep,
        max_bytes=w.cap,
        park_ttl_hours=w.park_ttl,
        park_max_bytes=w.park_cap,
        live_pids=w.live,
    )
    assert p.to_delete == () and p.disabled and p.bytes_after == p.bytes_on_disk


# --- run_gc on a real folder ---------------------------------------------------------


def make_settings(home: Path, **env: str) -> Settings:
    return Settings.from_env({"OC_PREFIX_CACHE_HOME": str(home), **env})


def put(s: Settings, fname: str, *, days_old: float, size: int = 100) -> Path:
    s.slot_dir.mkdir(parents=True, exist_ok=True)
    path = s.slot_dir / fname
    path.write_bytes(b"x" * size)
    os.utime(path, (NOW - days_old * DAY, NOW - days_old * DAY))
    return path


def store_of(s: Settings) -> Store:
    return Store(index_path=s.index_path, lock_path=s.lock_path)


def seed(s: Settings) -> None:
    """A current file, a fresh one, an expired one, an old orphan, a young orphan, a stranger."""
    for fp, days in ((A, 90), (B, 2), (C, 60), (D, 90), (E, 1)):
        put(s, name(fp), days_old=days)
    put(s, "notes.txt", days_old=400)
    store_of(s).save(index_of({A: 90, B: 2, C: 60, "f" * 16: 1}, {SLOT0: A}))


def test_run_gc_deletes_files_and_updates_the_index(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    seed(s)
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.applied and sorted(d.fingerprint for d in p.to_delete) == [C, D]
    assert sorted(f.name for f in s.slot_dir.iterdir()) == sorted([name(A), name(B), name(E), "notes.txt"])
    index = store_of(s).load()  # still a valid index
    assert sorted(index.entries) == [A, B] and index.current == {SLOT0: A}
    assert run_gc(s, dry_run=False, now=NOW).to_delete == ()  # idempotent


def test_run_gc_dry_run_deletes_nothing(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    seed(s)
    before = {p.name: p.read_bytes() for p in s.slot_dir.iterdir()}
    index_text = s.index_path.read_text()
    p = run_gc(s, dry_run=True, now=NOW)
    assert not p.applied and len(p.to_delete) == 2 and p.missing == ("f" * 16,)
    assert {q.name: q.read_bytes() for q in s.slot_dir.iterdir()} == before
    assert s.index_path.read_text() == index_text


def test_run_gc_with_a_corrupt_index_deletes_nothing_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    put(s, name(A), days_old=400)
    s.index_path.write_bytes(b'{"version": 1, "entries": ')
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.disabled and "cleanup is off" in p.disabled and p.to_delete == ()
    assert (s.slot_dir / name(A)).exists() and s.index_path.read_bytes() == b'{"version": 1, "entries": '


def test_run_gc_never_follows_a_symlink_out_of_the_folder(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_MAX_GB="0.000000001")
    outside = tmp_path / "precious"
    outside.mkdir()
    target = outside / "data.bin"
    target.write_bytes(b"p" * 1000)
    os.utime(target, (NOW - 400 * DAY, NOW - 400 * DAY))
    s.slot_dir.mkdir(parents=True)
    (s.slot_dir / name(A)).symlink_to(target)
    (s.slot_dir / name(B)).symlink_to(outside)
    store_of(s).save(index_of({A: 400}))
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.decisions == () and set(p.ignored) == {name(A), name(B)}
    assert target.read_bytes() == b"p" * 1000 and (s.slot_dir / name(A)).is_symlink()
    assert list(store_of(s).load().entries) == [A]  # the entry is not "missing" either


def test_run_gc_rechecks_each_file_just_before_deleting_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that became a symlink, or was rewritten, after the listing is left alone."""
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    target = tmp_path / "precious.bin"
    target.write_bytes(b"p" * 100)
    s.slot_dir.mkdir(parents=True)
    (s.slot_dir / name(A)).symlink_to(target)
    put(s, name(B), days_old=1)
    store_of(s).save(index_of({A: 90, B: 90}))
    stale = [DiskFile(name(A), 100, NOW - 90 * DAY), DiskFile(name(B), 100, NOW - 90 * DAY)]
    monkeypatch.setattr("oc_prefix_cache.disk.gc.list_slot_dir", lambda _: stale)
    p = run_gc(s, dry_run=False, now=NOW)
    assert {d.fingerprint: d.reason for d in p.decisions} == {A: "no longer a regular file", B: "changed while gc ran"}
    assert p.to_delete == () and len(p.warnings) == 2
    assert target.exists() and (s.slot_dir / name(A)).is_symlink() and (s.slot_dir / name(B)).exists()
    assert sorted(store_of(s).load().entries) == [A, B]


def test_run_gc_on_a_missing_folder_does_nothing(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.decisions == () and p.disabled is None and not s.index_path.exists()


def test_run_gc_applies_the_cap_from_settings(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_MAX_GB="0.00000025")  # 250 bytes
    for fp, days in ((A, 1), (B, 2), (C, 3)):
        put(s, name(fp), days_old=days)
    store_of(s).save(index_of({A: 1, B: 2, C: 3}))
    p = run_gc(s, dry_run=False, now=NOW)
    assert [d.fingerprint for d in p.to_delete] == [C] and p.to_delete[0].reason.startswith("over the 250 bytes cap")
    assert sorted(store_of(s).load().entries) == [A, B]


@given(mixed_worlds())
@hyp_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_run_gc_on_random_real_folders_keeps_strangers_and_current_files(w: World) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = replace(
            make_settings(Path(tmp)),
            ttl_days=w.ttl,
            keep_recent=w.keep,
            max_gb=None if w.cap is None else w.cap / 1e9,
            park_ttl_hours=w.park_ttl,
            park_max_gb=None if w.park_cap is None else w.park_cap / 1e9,
        )
        s.slot_dir.mkdir(parents=True)
        for f in w.files:
            if f.regular:
                put(s, f.name, days_old=(NOW - f.mtime) / DAY, size=f.bytes)
            else:
                (s.slot_dir / f.name).mkdir()
        store_of(s).save(w.index)
        p = run_gc(s, dry_run=False, now=NOW)
        left = {f.name for f in list_slot_dir(s.slot_dir)}
        assert {f.name for f in w.files} - left == {d.name for d in p.to_delete}
        assert all(ours_by_hand(n) for n in {f.name for f in w.files} - left)
        currents = {name(key, kind) for key in w.index.current.values() for kind in PREFIX}
        assert currents & {f.name for f in w.files} <= left
        assert all(not pid_alive(int(d.name[12:-4])) for d in p.to_delete if d.kind == "doctor")
        index = store_of(s).load()
        assert all(e.file in left for e in index.entries.values())
        assert json.loads(s.index_path.read_text())["version"] == INDEX_VERSION


def dead_pid() -> int:
    """The pid of a process that has exited (reused within this test only by bad luck)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_run_gc_cleans_every_kind_and_nothing_else(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    gone_pid, my_pid = dead_pid(), os.getpid()
    files = {
        name(A): 2,
        name(B, "proj"): 0.1,
        name(C, "proj"): 0.1,
        name(D, "conv"): 1,
        name(E, "conv"): 3,
        f"{name(A)}.{TAG}.part": 2 / 24,
        f"{name(B, 'proj')}.{TAG}.part": 0.5 / 24,
        f"ocpc-doctor-{gone_pid}.bin": 1,
        f"ocpc-doctor-{my_pid}.bin": 1,
        "notes.txt": 400,
        f"oc-conv-{A}.bin.{TAG}.part.keep": 400,
    }
    for fname, days in files.items():
        put(s, fname, days_old=days)
    store_of(s).save(
        Index(
            entries={
                A: entry(A, days_ago=2),
                B: proj(B, expires_in_h=5),
                C: proj(C, expires_in_h=-1),
                D: conv(D, hours_ago=24),
                E: conv(E, hours_ago=72),
            },
            current={SLOT0: A},
        )
    )
    p = run_gc(s, dry_run=False, now=NOW)
    assert sorted((d.kind, d.rule) for d in p.to_delete) == [
        ("conv", "expired"),
        ("doctor", "stale"),
        ("part", "stale"),
        ("proj", "expired"),
    ]
    assert sorted(f.name for f in s.slot_dir.iterdir()) == sorted(
        [
            name(A),
            name(B, "proj"),
            name(D, "conv"),
            f"{name(B, 'proj')}.{TAG}.part",
            f"ocpc-doctor-{my_pid}.bin",
            "notes.txt",
            f"oc-conv-{A}.bin.{TAG}.part.keep",
        ]
    )
    assert sorted(store_of(s).load().entries) == [A, B, D]
    assert set(p.ignored) == {"notes.txt", f"oc-conv-{A}.bin.{TAG}.part.keep"}


def test_run_gc_rechecks_temp_files_and_doctor_probes_before_deleting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe whose doctor runs, a temp file rewritten or turned into a symlink: all left alone."""
    s = make_settings(tmp_path)
    target = tmp_path / "precious.bin"
    target.write_bytes(b"p" * 100)
    probe, written, linked = f"ocpc-doctor-{os.getpid()}.bin", f"{name(A)}.{TAG}.part", f"{name(B)}.{TAG}.part"
    put(s, probe, days_old=1)
    put(s, written, days_old=0)
    (s.slot_dir / linked).symlink_to(target)
    stale = [DiskFile(n, 100, NOW - DAY) for n in (probe, written, linked)]
    monkeypatch.setattr("oc_prefix_cache.disk.gc.list_slot_dir", lambda _: stale)
    monkeypatch.setattr("oc_prefix_cache.disk.gc._live_doctor_pids", lambda _: frozenset())  # planned as gone
    p = run_gc(s, dry_run=False, now=NOW)
    assert {d.name: (d.rule, d.reason) for d in p.decisions} == {
        probe: ("skipped", f"ocpc doctor (process {os.getpid()}) is running"),
        written: ("skipped", "changed while gc ran"),
        linked: ("skipped", "no longer a regular file"),
    }
    assert p.to_delete == () and len(p.warnings) == 3
    assert all((s.slot_dir / n).exists() for n in (probe, written)) and (s.slot_dir / linked).is_symlink()


def test_the_recheck_refuses_names_ocpc_does_not_write(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    planned = DiskFile(path.name, path.stat().st_size, path.stat().st_mtime)
    assert _still_deletable(path, planned, current=set(), alive=lambda _: False) == "not a file ocpc writes"
    conv_path = tmp_path / name(A, "conv")
    conv_path.write_text("x")
    planned = DiskFile(conv_path.name, 1, conv_path.stat().st_mtime)
    assert _still_deletable(conv_path, planned, current={A}, alive=lambda _: False) == "is a current fingerprint"
    assert _still_deletable(conv_path, planned, current=set(), alive=lambda _: False) is None


def test_run_gc_on_a_missing_folder_keeps_the_index(tmp_path: Path) -> None:
    """A slot folder on an unmounted disk is missing, not empty: no entry may be dropped."""
    s = make_settings(tmp_path)
    store_of(s).save(index_of({A: 1, B: 400}, {SLOT0: A}))
    before = s.index_path.read_bytes()
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.disabled and str(s.slot_dir) in p.disabled and "cleanup is off" in p.disabled
    assert p.to_delete == () and p.missing == () and not p.applied
    assert s.index_path.read_bytes() == before


def test_run_gc_on_an_unlistable_folder_keeps_the_index(tmp_path: Path) -> None:
    s = make_settings(tmp_path)
    s.slot_dir.parent.mkdir(parents=True, exist_ok=True)
    s.slot_dir.write_text("not a folder")
    store_of(s).save(index_of({A: 400}))
    before = s.index_path.read_bytes()
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.disabled and "cannot list the slot folder" in p.disabled and s.index_path.read_bytes() == before


def test_run_gc_reads_a_version_1_index_as_heads_and_writes_version_2(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    put(s, name(A), days_old=90)
    put(s, name(B), days_old=1)
    old = {
        fp: {
            k: v
            for k, v in vars(entry(fp, days_ago=d)).items()
            if k
            in ("file", "bytes", "prefix_tokens", "created", "last_used", "model", "server_build", "harness", "xxh64")
        }
        for fp, d in ((A, 90), (B, 1))
    }
    s.index_path.write_text(json.dumps({"version": 1, "entries": old, "current": {}}))
    p = run_gc(s, dry_run=False, now=NOW)
    assert [(d.kind, d.rule, d.fingerprint) for d in p.to_delete] == [("head", "expired", A)]
    data = json.loads(s.index_path.read_text())
    assert data["version"] == INDEX_VERSION and list(data["entries"]) == [B] and data["entries"][B]["kind"] == "head"


def test_ocpc_gc_shows_each_file_kind(tmp_path: Path) -> None:
    from oc_prefix_cache.cli import app

    s = Settings.from_env()  # the isolated home conftest set up
    put(s, name(A, "conv"), days_old=3)
    put(s, f"{name(A)}.{TAG}.part", days_old=1)
    put(s, "notes.txt", days_old=1)
    runner = CliRunner()
    result = runner.invoke(app, ["gc", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(d["kind"], d["action"], d["rule"]) for d in data["decisions"]] == [
        ("conv", "delete", "orphan"),
        ("part", "delete", "stale"),
    ]
    assert data["ignored"] == ["notes.txt"] and data["dry_run"] is True
    text = runner.invoke(app, ["gc", "--dry-run"])
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert any(line.split()[:4] == ["would", "delete", "conv", name(A, "conv")] for line in lines), lines
    assert any(line.split()[:4] == ["would", "delete", "part", f"{name(A)}.{TAG}.part"] for line in lines), lines
    assert (s.slot_dir / name(A, "conv")).exists()


# --- entries of kinds this ocpc does not know (a newer ocpc's, after a downgrade) ---------

unknown_kinds = st.text(max_size=10).filter(lambda k: k not in ("head", "proj", "conv"))


@st.composite
def worlds_with_foreign_entries(draw: st.DrawFn) -> tuple[World, dict[str, dict[str, object]]]:
    """A mixed world whose index also holds entries of unknown kinds, naming: a file in one of
    our patterns nothing else names (old enough to go as an orphan), a file the world already
    has (a head past its TTL, a stranger...), or a name in no pattern; some with a stale temp
    file beside them."""
    w = draw(mixed_worlds())
    files = {f.name: f for f in w.files}
    foreign: dict[str, dict[str, object]] = {}
    for key in draw(st.lists(hex16.filter(lambda k: k not in w.index.entries), max_size=4, unique=True)):
        choice = draw(st.sampled_from(["ours", "existing", "stranger"]))
        if choice == "existing" and files:
            fname = draw(st.sampled_from(sorted(files)))
        elif choice == "stranger":
            fname = draw(st.sampled_from(["oc-tier-7.bin", "x.bin", f"oc-prefix-{key}.gguf"]))
        else:
            fname = name(key, draw(st.sampled_from(list(PREFIX))))
        if fname not in files:
            files[fname] = disk(fname, days_old=400, size=draw(st.integers(0, 1000)))
        if draw(st.booleans()) and kind_by_hand(fname) in PREFIX:
            part = f"{fname}.{TAG}.part"
            files[part] = DiskFile(part, 10, NOW - 5 * HOUR)
        foreign[key] = {"kind": draw(unknown_kinds), "file": fname, "bytes": 1, "tier": draw(st.integers())}
    return replace(w, files=list(files.values())), foreign


def with_foreign(index: Index, foreign: dict[str, dict[str, object]]) -> Index:
    """The index as a newer ocpc would leave it, read back through the real reader."""
    data = index.to_json()
    data["entries"] = {**data["entries"], **foreign}
    return Index.from_json(json.loads(json.dumps(data)), source="test")


@given(worlds_with_foreign_entries())
@hyp_settings(max_examples=300)
def test_gc_never_deletes_or_judges_the_files_of_entries_of_unknown_kinds(
    world: tuple[World, dict[str, dict[str, object]]],
) -> None:
    """Before, one such entry made the index corrupt and cleanup stopped altogether; reading them
    must not make their files fair game either (an orphan in our pattern, a temp file, a head
    past its TTL that the newer entry names too): they are ignored, like a stranger's."""
    w, foreign = world
    p = plan_of(replace(w, index=with_foreign(w.index, foreign)))
    assert p.disabled is None
    theirs = {str(raw["file"]) for raw in foreign.values()}
    theirs |= {f.name for f in w.files if f.name.endswith(".part") and f.name.rsplit(".", 2)[0] in theirs}
    assert not theirs & {d.name for d in p.decisions}, theirs
    assert not theirs & set(p.orphans)
    assert {f.name for f in w.files} & theirs <= set(p.ignored)


def test_run_gc_keeps_entries_of_unknown_kinds_and_their_files_and_cleans_the_rest(tmp_path: Path) -> None:
    s = make_settings(tmp_path, OC_PREFIX_CACHE_KEEP_RECENT="0")
    seed(s)
    newer = {"kind": "tier2", "file": name("7" * 16, "conv"), "bytes": 100, "shards": [1, 2]}
    put(s, str(newer["file"]), days_old=400)  # an orphan by our rules: a conv file no entry of ours names
    put(s, f"{newer['file']}.{TAG}.part", days_old=1)  # and a stale temp file of it
    data = json.loads(s.index_path.read_text())
    data["entries"]["7" * 16] = newer
    data["entries"]["8" * 16] = {"file": "whatever", "kind": "", "x": None}  # an empty kind is unknown too
    s.index_path.write_text(json.dumps(data, indent=1) + "\n")
    p = run_gc(s, dry_run=False, now=NOW)
    assert p.applied and sorted(d.fingerprint for d in p.to_delete) == [C, D]  # gc still works
    assert (s.slot_dir / str(newer["file"])).exists() and (s.slot_dir / f"{newer['file']}.{TAG}.part").exists()
    after = json.loads(s.index_path.read_text())["entries"]
    assert after["7" * 16] == newer and after["8" * 16] == data["entries"]["8" * 16] and C not in after
    planned = DiskFile(str(newer["file"]), 100, NOW - 400 * DAY)
    assert "does not know" in str(
        _still_deletable(s.slot_dir / planned.name, planned, current=set(), alive=pid_alive, foreign={planned.name})
    )
