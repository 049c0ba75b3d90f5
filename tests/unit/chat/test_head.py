"""The stable head and fingerprint: pure decisions, tested without a server."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from oc_prefix_cache.chat.head import (
    Head,
    Skip,
    extends,
    extract_head,
    harness_of,
    locate_head,
    parse_body,
    tokens_before,
)
from oc_prefix_cache.errors import BadRequestBody
from oc_prefix_cache.llama.families import CacheFacts, Family
from oc_prefix_cache.llama.fingerprint import FileIdentity, FingerprintInputs, ServerIdentity, fingerprint
from tests.helpers import PROJ_A, PROJ_A_TURN2, PROJ_B, TITLE, capture, capture_bytes

MARKERS = ("<env>",)


def head_of(name: str, markers: tuple[str, ...] = MARKERS) -> Head:
    head = extract_head(parse_body(capture_bytes(name)), markers)
    assert isinstance(head, Head)
    return head


def test_two_projects_and_two_turns_share_one_head() -> None:
    a, b, a2 = head_of(PROJ_A), head_of(PROJ_B), head_of(PROJ_A_TURN2)
    assert a == b == a2
    assert a.n_tools == 11 and a.marker == "<env>"
    assert a.system_head.startswith("You are opencode")
    assert "<env>" not in a.system_head and "/home/dev" not in a.system_head


def test_title_request_is_skipped() -> None:
    result = extract_head(parse_body(capture_bytes(TITLE)), MARKERS)
    assert isinstance(result, Skip) and "no tools" in result.reason


def test_no_marker_and_no_system_are_skipped() -> None:
    body = capture(PROJ_A)
    assert isinstance(extract_head(parse_body(json.dumps(body).encode()), ("<nowhere>",)), Skip)
    body["messages"] = body["messages"][1:]
    assert isinstance(extract_head(parse_body(json.dumps(body).encode()), MARKERS), Skip)


def test_a_request_with_its_own_lora_adapters_gets_no_head() -> None:
    """Defect 6: a request's own `lora` changes its KV, so the head's file cannot serve it."""
    body = capture(PROJ_A) | {"lora": [{"id": 0, "scale": 0.5}]}
    result = extract_head(parse_body(json.dumps(body).encode()), MARKERS)
    assert isinstance(result, Skip) and "LoRA" in result.reason
    assert isinstance(extract_head(parse_body(json.dumps(body | {"lora": []}).encode()), MARKERS), Head)


def test_earliest_marker_wins() -> None:
    text = capture(PROJ_A)["messages"][0]["content"]
    later = text.index("<env>")
    earlier = text[: later // 2].split()[-1]
    head = head_of(PROJ_A, ("<env>", earlier))
    assert head.marker == earlier and len(head.system_head) < later


def test_system_content_as_parts_is_read() -> None:
    body = capture(PROJ_A)
    text = body["messages"][0]["content"]
    body["messages"][0]["content"] = [{"type": "text", "text": text[:100]}, {"type": "text", "text": text[100:]}]
    head = extract_head(parse_body(json.dumps(body).encode()), MARKERS)
    assert head == head_of(PROJ_A)


@pytest.mark.parametrize("raw", [b"nope", b"[1]", b'{"messages": {}}', b"\xff"])
def test_bad_bodies_raise_clear_errors(raw: bytes) -> None:
    with pytest.raises(BadRequestBody):
        parse_body(raw)


def test_huge_body_is_refused() -> None:
    with pytest.raises(BadRequestBody, match="limit"):
        parse_body(b" " * (9 * 1024 * 1024))


def test_later_turn_extends_the_first() -> None:
    first = parse_body(capture_bytes(PROJ_A)).message_digests
    second = parse_body(capture_bytes(PROJ_A_TURN2)).message_digests
    other = parse_body(capture_bytes(PROJ_B)).message_digests
    assert extends(first, second)
    assert not extends(second, first)
    assert not extends(first, other)
    assert not extends((), first)


def test_locate_head_ignores_a_marker_inside_tools() -> None:
    head = Head(tools_json="[]", system_head="sys text ", marker="<env>", model="m", n_tools=1)
    prompt = 'tools: "describe <env> here" ... sys text <env> dir'
    assert prompt[: locate_head(prompt, head)].endswith("sys text ")


def test_tokens_before_never_cuts_a_token() -> None:
    pieces = [(1, b"ab"), (2, b"c"), (3, b"de"), (4, b"f")]
    assert tokens_before(pieces, 3) == [1, 2]
    assert tokens_before(pieces, 4) == [1, 2]  # token 3 straddles the cut
    assert tokens_before(pieces, 0) == []


def test_harness_is_the_first_product_token() -> None:
    assert harness_of("opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14") == "opencode/1.18.33"
    assert harness_of("") == "unknown"


SERVER = ServerIdentity(
    model_digest="0123456789abcdef0123456789abcdef",
    build_id="b0-unknown|xxh3:fedcba9876543210fedcba9876543210",
    model_path="/m/model.gguf",
    model_files=(FileIdentity("model.gguf", 100, 1),),
    build="b0-unknown|x|1|2",
    chat_template_digest="t",
    n_ctx=16384,
    total_slots=1,
    kv_types="f16/f16",
    cache=CacheFacts(Family.HYBRID),
)


def inputs(**changes: object) -> FingerprintInputs:
    base = FingerprintInputs(
        server=SERVER,
        harness="opencode/1.18.33",
        ocpc_version="0.1.0",
        head=head_of(PROJ_A),
        rendered_head="<rendered>",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_fingerprint_is_16_hex_and_stable() -> None:
    fp = fingerprint(inputs())
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fingerprint(inputs()) == fp
    assert fingerprint(inputs(head=head_of(PROJ_B))) == fp  # another project, same head


@pytest.mark.parametrize(
    "change",
    [
        {"server": replace(SERVER, model_digest="1123456789abcdef0123456789abcdef")},
        {"server": replace(SERVER, build_id="b11500")},
        {"server": replace(SERVER, chat_template_digest="u")},
        {"server": replace(SERVER, n_ctx=8192)},
        {"server": replace(SERVER, kv_types="q8_0/q8_0")},
        {"server": replace(SERVER, kv_flags=("--rope-freq-base=500000.0",))},
        {"server": replace(SERVER, lora=("0=xxh3:00:1.0",))},
        {"harness": "opencode/1.19.0"},
        {"rendered_head": "<other>"},
    ],
)
def test_every_input_moves_the_fingerprint(change: dict) -> None:
    assert fingerprint(inputs(**change)) != fingerprint(inputs())


@pytest.mark.parametrize(
    "change",
    [
        {"server": replace(SERVER, model_files=(FileIdentity("model.gguf", 100, 2),))},
        {"server": replace(SERVER, model_path="/m/other.gguf")},
        {"server": replace(SERVER, build="b0-unknown|y|1|3")},
        {"server": replace(SERVER, total_slots=4)},
        {"ocpc_version": "0.2.0"},
    ],
)
def test_where_the_files_lie_and_ocpcs_version_do_not_move_the_fingerprint(change: dict) -> None:
    """FORMAT 4: the model's path and mtime, the binary's, and ocpc's version are not identity."""
    assert fingerprint(inputs(**change)) == fingerprint(inputs())


def test_the_head_counts_as_the_template_renders_it() -> None:
    """Tools and system text move the fingerprint through their rendering (a template that
    renders them: a new head); a template that leaves tools out gives one head for bodies
    that differ only in tools (Gemma 3's GGUF template: a subagent reuses its parent's)."""
    head = head_of(PROJ_A)
    rendered = "<|im_start|>system\n" + head.system_head
    assert fingerprint(inputs(rendered_head=rendered + " tools")) != fingerprint(inputs(rendered_head=rendered))
    assert fingerprint(inputs(rendered_head=rendered + "x")) != fingerprint(inputs(rendered_head=rendered))
    fewer_tools = replace(head, tools_json=head.tools_json[: len(head.tools_json) // 2])
    assert fingerprint(inputs(head=fewer_tools, rendered_head=rendered)) == fingerprint(inputs(rendered_head=rendered))


def test_slot_count_does_not_move_the_fingerprint() -> None:
    assert fingerprint(inputs(server=replace(SERVER, total_slots=4))) == fingerprint(inputs())


def test_deeply_nested_body_is_a_clear_error() -> None:
    with pytest.raises(BadRequestBody, match="nested"):
        parse_body(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
