"""Warm before the first request: which file each slot gets back (``engine.warm_start.choose``),
without a server. On the real server: tests/rig/commands/test_warmstart.py."""

from __future__ import annotations

from oc_prefix_cache.disk.index import Entry, Index
from oc_prefix_cache.engine.warm_start import choose

S = "http://127.0.0.1:9000"


def entry(kind: str, key: str, *, head: str = "", build: str = "b1") -> Entry:
    prefix = {"head": "oc-prefix", "proj": "oc-proj", "conv": "oc-conv"}[kind]
    return Entry(
        file=f"{prefix}-{key}.bin",
        bytes=1,
        prefix_tokens=1,
        created=0,
        last_used=0,
        model="m.gguf",
        server_build=build,
        harness="pi",
        kind=kind,
        head=head or key,
    )


def test_each_slot_gets_its_last_head_or_project_head_or_its_parks_head() -> None:
    h, p, c, old = "a" * 16, "b" * 16, "c" * 16, "d" * 16
    index = Index(
        entries={
            h: entry("head", h),
            p: entry("proj", p, head=h),
            c: entry("conv", c, head=h),
            old: entry("head", old, build="b0"),
        },
        current={
            f"{S}#slot0": h,
            f"{S}#slot1": p,
            f"{S}#slot2": c,
            f"{S}#slot3": old,
            "http://127.0.0.1:9001#slot4": h,
        },
    )
    picks, passed = choose(index, server=S, n_slots=6, model="m.gguf", build="b1", now=10)
    assert [(x.slot, x.key) for x in picks] == [(0, p), (1, p), (2, p)]  # the project head cut on h
    index.entries[p].expires = 5  # a project head of yesterday: the head alone
    picks, _ = choose(index, server=S, n_slots=3, model="m.gguf", build="b1", now=10)
    assert [(x.slot, x.key) for x in picks] == [(0, h), (2, h)]
    assert passed == [
        "slot 3: its file was written for another model or build",
        "slot 4: nothing recorded",
        "slot 5: nothing recorded",
    ]
