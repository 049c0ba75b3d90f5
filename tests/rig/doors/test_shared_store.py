"""The shared store (issue 39): heads and conversations move between boxes, and a box's death loses none.

Two `ocpc launch --listen` boxes share one store folder; box1 runs its own copy of the model (another
path, another mtime) and its own copy of the server binary, so nothing of a file's identity is a path.
Through `ocpc gateway` (smg, pinning each conversation by ocpc's key):

1. a conversation's first turn lands on one box, which warms the head and parks the conversation
   after the turn (with a store, every turn is parked) and publishes both;
2. the other box's first request (another conversation, the same head) restores that head, behind
   the gates, instead of prefilling it;
3. the first box is killed (SIGKILL: no park, no goodbye); the conversation's next turn goes to the
   survivor (smg retries there), which brings the park from the store and processes only the new
   turn's tokens (and the gate's few): 0 turns lost, 0 requests failed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oc_prefix_cache.rig.build import Rig
from tests import workload
from tests.boxes import MODEL_ALIAS, Box, Gateway, deployment_in, direct, pretty
from tests.e2e.test_e2e_claude_code import END_AT_ONCE
from tests.helpers import SUITE_WAIT_S, wait_until

pytestmark = pytest.mark.rig

TINY_ARGS = ("-c", "32768", *END_AT_ONCE)
GATE_SLACK = 64  # tokens a restore's gate and the template's turn markers may process on top


@pytest.fixture
def shared(rig: Rig, models: dict[str, Path], tmp_path: Path) -> Iterator[tuple[list[Box], Gateway, Path]]:
    store = tmp_path / "store"
    copies = tmp_path / "box1-files"
    copies.mkdir()
    model_copy = copies / "renamed-model.gguf"
    shutil.copyfile(models["qwen35"], model_copy)
    os.utime(model_copy, (time.time() - 86400, time.time() - 86400))  # another mtime too
    binary_copy = copies / "llama-server"
    shutil.copy(rig.server, binary_copy)  # a copy: another path, another mtime, the same bytes
    boxes, gateway = deployment_in(tmp_path, 2)
    env = {"OC_PREFIX_CACHE_SHARED_STORE": str(store)}
    try:
        boxes[0].start(models["qwen35"], server_args=TINY_ARGS, env=env)
        boxes[1].start(model_copy, server_args=TINY_ARGS, env=env, binary=binary_copy)
        gateway.start(boxes)
        yield boxes, gateway, store
    finally:
        gateway.stop()
        for box in boxes:
            box.stop()


def send(
    url: str, conversation: workload.Conversation, *, headers: dict[str, str] | None = None, agent_headers: bool = True
) -> httpx.Response:
    body = conversation.next_body()
    body["model"] = MODEL_ALIAS
    body["max_tokens"] = 4
    with direct() as client:
        client.timeout = httpx.Timeout(SUITE_WAIT_S)
        return client.post(
            f"{url}/v1/chat/completions", json=body, headers={**conversation.headers(), **(headers or {})}
        )


def published(store: Path, box: Box, kind: str) -> list[dict[str, Any]]:
    """The entries of ``kind`` the box has published to the store (its own folder's index)."""
    box_id = (box.home / "box-id").read_text().strip()
    try:
        data = json.loads((store / box_id / "index.json").read_text())
    except (FileNotFoundError, ValueError):
        return []
    return [e for e in data["entries"].values() if e.get("kind") == kind]


def row_of(box: Box, conversation: str, n: int) -> dict[str, Any] | None:
    rows = [r for r in box.network_rows() if r["conversation"] == conversation]
    return rows[n - 1] if len(rows) >= n else None


def test_a_head_warmed_on_one_box_serves_the_other_and_a_conversation_survives_its_box(
    shared: tuple[list[Box], Gateway, Path],
) -> None:
    boxes, gateway, store = shared
    x = workload.shortened(workload.parent("ses_moves"))
    answer = send(gateway.url, x)
    assert answer.status_code == 200, answer.text
    home_url = answer.headers["x-smg-routed-worker-id"]
    first = next(b for b in boxes if b.door == home_url)
    other = next(b for b in boxes if b is not first)
    row = wait_until(lambda: next(iter(first.network_rows()), None), what="the first turn's row")
    conversation = row["conversation"]
    assert row["action"] == "warmed", row
    # the box parks the conversation after its turn and publishes it, with the head
    wait_until(
        lambda: published(store, first, "head") and published(store, first, "conv"), what="head and park published"
    )

    # 2. the other box's first request: another conversation with the same head, through the gateway
    # (smg rewrites a body's JSON, its tools' key order included, so the KV of a head sent through it
    # is its own): new conversations until smg's hash sends one there; those that land on the first
    # box are served from its head
    for n in range(16):
        y = workload.shortened(workload.parent(f"ses_elsewhere_{n}"))
        answer = send(gateway.url, y)
        if answer.headers.get("x-smg-routed-worker-id") == other.door:
            break
    assert answer.status_code == 200, answer.text
    (there,) = other.network_rows()
    print(pretty([row, there]))
    assert there["action"] == "restored", there  # the head, brought from the store, not prefilled
    assert "gate" in there["reason"] or "probe" in there["reason"], there  # proven on this box first
    assert there["cache_n"] >= 0.9 * there["prefix_tokens"], there
    assert other.status()["prepare"]["shared"]["brought"] >= 1

    # 3. the first box dies; the conversation's next turn continues on the survivor from its park
    parked = max(e["prefix_tokens"] for e in published(store, first, "conv"))
    first.kill()
    answer = send(gateway.url, x)
    assert answer.status_code == 200, answer.text  # 0 requests failed
    assert answer.headers["x-smg-routed-worker-id"] == other.door
    moved = wait_until(lambda: row_of(other, conversation, 1), what="the moved turn's row")
    print(pretty([moved]))
    total = moved["cache_n"] + moved["prompt_n"]
    assert moved["cache_n"] >= parked, moved  # all of the park reused
    assert moved["prompt_n"] <= total - parked + GATE_SLACK, (moved, parked)  # only what is new
    counters = other.status()["counters"]
    assert not [k for k in counters if k.startswith(("fail_open", "upstream_failed"))], counters
