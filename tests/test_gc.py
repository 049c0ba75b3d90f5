"""ocpc gc: the pure policy (one test per rule, then random folders), then run_gc on disk."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from oc_prefix_cache.gc import DAY, DiskFile, GcPlan, list_slot_dir, plan_gc, run_gc
from oc_prefix_cache.settings import Settings
from oc_prefix_cache.slotfile import fingerprint_of
from oc_prefix_cache.store import Entry, Index, Store

NOW = 1_700_000_000.0
SLOT0 = "http://127.0.0.1:8080#slot0"
A, B, C, D, E = (f"{c}" * 16 for c in "abcde")
NEAR_MISSES = ("oc-prefix-ABCDEF0123456789.bin", f"oc-prefix-{A}.bin.part", f"oc-prefix-{A[:15]}.bin",
               f"xoc-prefix-{A}.bin", "other.bin", "index.json", "index.lock", ".index-x.tmp",
               f"oc-prefix-{A}.bin\n", f"oc-prefix-{A}.bin ", f"oc-prefix-{'٣' * 16}.bin")


def ours_by_hand(filename: str) -> bool:
    """An oracle independent of the code's regex: exactly oc-prefix-<16 lower hex>.bin."""
    hex_part = filename[len("oc-prefix-"):-len(".bin")]
    return (filename.startswith("oc-prefix-") and filename.endswith(".bin") and len(hex_part) == 16
            and all(c in "0123456789abcdef" for c in hex_part))


def name(fp: str) -> str:
    return f"oc-prefix-{fp}.bin"


def disk(fp_or_name: str, *, days_old: float = 0, size: int = 100, regular: bool = True) -> DiskFile:
    n = fp_or_name if fingerprint_of(fp_or_name) or "." in fp_or_name else name(fp_or_name)
    return DiskFile(n, size, NOW - days_old * DAY, regular)


def entry(fp: str, *, days_ago: float) -> Entry:
    return Entry(file=name(fp), bytes=100, prefix_tokens=10, created=0, last_used=int(NOW - days_ago * DAY),
                 model="m.gguf", server_build="b1", harness="opencode")


def index_of(used: dict[str, float], current: dict[str, str] | None = None) -> Index:
    return Index(entries={fp: entry(fp, days_ago=d) for fp, d in used.items()}, current=current or {})


def plan(files: list[DiskFile], index: Index | None, *, ttl: float = 30, keep: int = 0,
         cap: int | None = None, error: str | None = None) -> GcPlan:
    return plan_gc(files=files, index=index, index_error=error, now=NOW, ttl_days=ttl,
                   keep_recent=keep, max_bytes=cap)


def actions(p: GcPlan) -> dict[str, str]:
    return {d.fingerprint: d.action for d in p.decisions}


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
    assert p.disabled == ("index.json is unreadable (index.json is not valid JSON): "
                          "cleanup is off until it is fixed or moved away")


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


# --- random folders ------------------------------------------------------------------

hex16 = st.text("0123456789abcdef", min_size=16, max_size=16)


@dataclass(frozen=True)
class World:
    files: list[DiskFile]
    index: Index
    ttl: float
    keep: int
    cap: int | None


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
    files += [disk(n, days_old=draw(age), size=draw(size))
              for n in draw(st.lists(st.sampled_from(NEAR_MISSES), unique=True))]
    entries = {fp: entry(fp, days_ago=draw(age)) for fp in fps if draw(st.booleans())}
    pool = st.sampled_from(fps) | hex16 if fps else hex16
    current = {f"http://h#slot{i}": fp for i, fp in enumerate(draw(st.lists(pool, max_size=2)))}
    cap = draw(st.none() | st.integers(0, 5000))
    return World(files, Index(entries, current), draw(st.sampled_from([0, 0.5, 7, 30])),
                 draw(st.integers(0, 4)), cap)


def plan_of(w: World) -> GcPlan:
    return plan_gc(files=w.files, index=w.index, index_error=None, now=NOW, ttl_days=w.ttl,
                   keep_recent=w.keep, max_bytes=w.cap)


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


@given(worlds())
def test_random_folders_with_a_corrupt_index_delete_nothing(w: World) -> None:
    p = plan_gc(files=w.files, index=None, index_error="bad", now=NOW, ttl_days=w.ttl,
                keep_recent=w.keep, max_bytes=w.cap)
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
    monkeypatch.setattr("oc_prefix_cache.gc.list_slot_dir", lambda _: stale)
    p = run_gc(s, dry_run=False, now=NOW)
    assert {d.fingerprint: d.reason for d in p.decisions} == {
        A: "no longer a regular file", B: "changed while gc ran"}
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


@given(worlds())
@hyp_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_run_gc_on_random_real_folders_keeps_strangers_and_current_files(w: World) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = replace(make_settings(Path(tmp)), ttl_days=w.ttl, keep_recent=w.keep,
                    max_gb=None if w.cap is None else w.cap / 1e9)
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
        assert {name(fp) for fp in w.index.current.values() if any(f.name == name(fp) for f in w.files)} <= left
        index = store_of(s).load()
        assert all(e.file in left for e in index.entries.values())
        assert json.loads(s.index_path.read_text())["version"] == 1
