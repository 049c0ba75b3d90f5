"""Gates: the pure decisions that keep a restore from being trusted on its word.

llama-server answers 200 to a restore of a file from another model with the same
shapes, and a hybrid model silently re-processes everything when the restored tokens
are not a strict prefix of the next prompt. So a restore counts only when:
1. the file's own token list equals the head's tokens (checked before restoring: a
   failed restore wipes the slot), and
2. a probe that extends the head by a few tokens is served >= 90% from cache
   (``timings.cache_n``, the only honest reuse signal).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

PROBE_MIN_REUSE = 0.90
REPORT_MIN_REUSE = 0.90
# Upstream PR #26004 (said to ship in b11500) persists context checkpoints in slot files.
CHECKPOINT_FILES_BUILD = 11500


@dataclass(frozen=True)
class Gate:
    ok: bool
    reason: str


def header_gate(file_tokens: Sequence[int], head_tokens: Sequence[int]) -> Gate:
    if len(file_tokens) != len(head_tokens):
        return Gate(False, f"file holds {len(file_tokens)} tokens, the head is {len(head_tokens)}")
    if tuple(file_tokens) != tuple(head_tokens):
        first = next(i for i, (a, b) in enumerate(zip(file_tokens, head_tokens, strict=True)) if a != b)
        return Gate(False, f"file tokens differ from the head at token {first}")
    return Gate(True, f"file holds exactly the head's {len(head_tokens)} tokens")


def probe_gate(*, cache_n: int, head_tokens: int) -> Gate:
    need = PROBE_MIN_REUSE * head_tokens
    if cache_n >= need:
        return Gate(True, f"probe reused {cache_n}/{head_tokens} head tokens")
    return Gate(False, f"probe reused only {cache_n}/{head_tokens} head tokens (need >= {need:.0f})")


def divergent_gate(*, cache_n: int) -> Gate:
    """On builds with persisted checkpoints: a different user turn must still reuse some."""
    if cache_n > 0:
        return Gate(True, f"divergent probe reused {cache_n} tokens")
    return Gate(False, "divergent probe reused nothing: the restored checkpoints are not usable")


def served_from_head(*, cache_n: int, prefix_tokens: int) -> bool:
    """Did a real request reuse the head we prepared for it?"""
    return prefix_tokens > 0 and cache_n >= REPORT_MIN_REUSE * prefix_tokens


def build_number(build_info: str) -> int | None:
    """``b11434-abc`` -> 11434; None when unknown (sdist builds say ``b0-unknown``)."""
    match = re.match(r"^b(\d+)", build_info.strip())
    number = int(match.group(1)) if match else 0
    return number or None


def has_checkpoint_files(build_info: str) -> bool:
    number = build_number(build_info)
    return number is not None and number >= CHECKPOINT_FILES_BUILD


def likely_cause(*, hybrid: bool, build_info: str, head_tokens: int,
                 checkpoint_min_step: int | None) -> str:
    """A human guess at why a gate failed, for the loud log line."""
    causes = []
    if hybrid and not has_checkpoint_files(build_info):
        causes.append(
            f"hybrid/SWA model on build {build_info or 'unknown'} (< b{CHECKPOINT_FILES_BUILD}): "
            "only an exact token prefix is reusable"
        )
    if checkpoint_min_step is not None and checkpoint_min_step > head_tokens:
        causes.append(
            f"--checkpoint-min-step {checkpoint_min_step} is larger than the head ({head_tokens} tokens)"
        )
    causes.append("the file may be from another model or build, or damaged")
    return "; ".join(causes)
