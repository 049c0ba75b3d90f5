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

from oc_prefix_cache.llama.families import CacheFacts, Family

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


def prefix_gate(file_tokens: Sequence[int], request_tokens: Sequence[int]) -> Gate:
    """A parked conversation's tokens must be a strict prefix of the request's: the request
    goes on from there, and a hybrid model reuses nothing that it does not strictly extend."""
    n = len(file_tokens)
    if n == 0 or n >= len(request_tokens):
        return Gate(False, f"the park holds {n} tokens, the request {len(request_tokens)}: not a strict prefix")
    if tuple(file_tokens) != tuple(request_tokens[:n]):
        first = next(i for i, (a, b) in enumerate(zip(file_tokens, request_tokens, strict=False)) if a != b)
        return Gate(False, f"the park's tokens differ from the request's at token {first}")
    return Gate(True, f"the park's {n} tokens are a strict prefix of the request's {len(request_tokens)}")


def probe_gate(*, cache_n: int, head_tokens: int) -> Gate:
    need = PROBE_MIN_REUSE * head_tokens
    if cache_n >= need:
        return Gate(True, f"probe reused {cache_n}/{head_tokens} head tokens")
    return Gate(False, f"probe reused only {cache_n}/{head_tokens} head tokens (need >= {need:.0f})")


def untouched(
    *,
    prompt_tokens_before: float | None,
    prompt_tokens_after: float | None,
    probe_processed: int,
    probe_tokens: int,
    after_tokens: int | None,
    was_busy: bool,
) -> Gate:
    """Did the probe run on a slot nothing else touched between the restore and the probe?

    Only then may a failed probe condemn the file: a request of another client that took
    the slot in between makes a good file look bad. With ``--metrics`` the server's own
    processed-token counter proves it (it grew by exactly the probe's tokens); without it,
    the slot must have been idle before and hold exactly the probe's tokens after it.
    """
    if was_busy:
        return Gate(False, "the slot was busy before the restore")
    if after_tokens != probe_tokens:
        return Gate(
            False, f"the slot holds {after_tokens} tokens after the probe of {probe_tokens}: another request ran in it"
        )
    if prompt_tokens_before is not None and prompt_tokens_after is not None:
        grew = prompt_tokens_after - prompt_tokens_before
        if grew != probe_processed:
            return Gate(False, f"the server processed {grew:.0f} prompt tokens meanwhile, the probe {probe_processed}")
        return Gate(True, "the server processed only the probe's tokens meanwhile (/metrics)")
    return Gate(True, "the slot was idle and its last task is the probe (no /metrics to be sure)")


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


def likely_cause(*, cache: CacheFacts, build_info: str, head_tokens: int, checkpoint_min_step: int | None) -> str:
    """A human guess at why a gate failed, for the loud log line."""
    causes = []  # (a server whose flags say no restore serves never gets here: ocpc stood down)
    if cache.family is Family.SWA and cache.swa_full is None:
        causes.append(
            "a sliding-window model on a server whose flags ocpc cannot see: without --swa-full no restore is reused"
        )
    if cache.partial_cache and not has_checkpoint_files(build_info):
        causes.append(
            f"hybrid/SWA model on build {build_info or 'unknown'} (< b{CHECKPOINT_FILES_BUILD}): "
            "only an exact token prefix is reusable"
        )
    if checkpoint_min_step is not None and checkpoint_min_step > head_tokens:
        causes.append(f"--checkpoint-min-step {checkpoint_min_step} is larger than the head ({head_tokens} tokens)")
    causes.append("the file may be from another model or build, or damaged")
    return "; ".join(causes)
