"""Characterisation: the llama-server behaviour the whole product rests on.

If a future server changes one of these facts, this file is what says so. Each test
runs the real server (built from the pinned sdist) on the tiny real-tokenizer models,
with OpenCode's real request body (~7.5k tokens, head ~7.1k).
"""

from __future__ import annotations

import pytest

from oc_prefix_cache.errors import SlotRestoreFailed
from oc_prefix_cache.slot_client import SlotClient

from .helpers import PROJ_A, PROJ_B, capture, chat, head_tokens

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
