"""Model families: what a model's KV cache can do with a restored slot, as facts.

A restore pays off only if the server then reuses it, and whether it does depends on the
model's cache family and on a few server flags (measured on b11434, docs/design.md):

- **transformer**: reuses any common prefix of a restored slot.
- **hybrid / recurrent** (Qwen3.5, Mamba-style layers): the recurrent state rolls back only
  to a context checkpoint, and a slot file carries none in this build, so a restored slot
  is reused only when the next prompt strictly extends every saved token (what ocpc saves).
  Parking a conversation rolls back to its park point through an in-memory checkpoint: with
  ``--ctx-checkpoints 0`` there is none, and a park would cost a whole re-prefill.
- **SWA** (sliding-window layers: Gemma 2/3, gpt-oss, Cohere 2...): without a full-size SWA
  cache the server keeps only the window and re-processes the whole prompt after any
  restore (restored 1,800 tokens of Gemma 3 270M, then ``cache_n`` 0 of 2,303); with
  ``--swa-full`` it reuses a restore of exactly the saved tokens (``cache_n`` 1,800), but
  still cuts a slot back only within its window or to a checkpoint, like a hybrid: a new
  session on a slot holding the head plus a conversation is not a hit. The file is the
  same size either way (13.4 MB); the price of ``--swa-full`` is KV memory.

The decision and the executor read these facts; nothing else branches on the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

SWA_FULL = "--swa-full"
CTX_CHECKPOINTS = ("--ctx-checkpoints", "-ctxcp", "--swa-checkpoints")

# GGUF keys (under "<arch>.") whose non-zero value names the family. Values, not presence:
# some writers emit every key with zeros.
_RECURRENT_KEYS = ("ssm.state_size", "ssm.inner_size", "wkv.head_size", "shortconv.l_cache", "full_attention_interval")
_SWA_KEYS = ("attention.sliding_window",)


class Family(str, Enum):  # noqa: UP042  (str() of a member stays "Family.X", as it always was)
    TRANSFORMER = "transformer"
    HYBRID = "hybrid"  # recurrent or hybrid (recurrent + attention)
    SWA = "swa"  # sliding-window attention layers
    UNKNOWN = "unknown"  # the model file could not be read: assume the strict case

    @property
    def label(self) -> str:
        return {
            "transformer": "plain transformer",
            "hybrid": "hybrid/recurrent",
            "swa": "sliding-window (SWA)",
            "unknown": "unknown family",
        }[self.value]


def family_of(architecture: str, keys: dict[str, Any]) -> Family:
    """The cache family from a GGUF header's keys. Recurrent wins over SWA (a hybrid with
    sliding-window attention layers still has a state that rolls back only to checkpoints)."""

    def set_(names: tuple[str, ...]) -> bool:
        return any(isinstance(keys.get(f"{architecture}.{k}"), int) and keys[f"{architecture}.{k}"] > 0 for k in names)

    if set_(_RECURRENT_KEYS):
        return Family.HYBRID
    if set_(_SWA_KEYS):
        return Family.SWA
    return Family.TRANSFORMER


@dataclass(frozen=True)
class CacheFacts:
    """A model's family and the server flags that decide what a restore is worth there.

    ``swa_full`` and ``checkpoints`` are None when the server's command line is not visible.
    """

    family: Family
    swa_full: bool | None = None
    checkpoints: int | None = None

    @property
    def partial_cache(self) -> bool:
        """Only exact-prefix restores are reusable: the slot cannot be cut back to an earlier
        common prefix except through a context checkpoint. True for hybrids, and for SWA
        models even with ``--swa-full``: the server still rolls an SWA slot back only within
        its window or to a checkpoint (measured on Gemma 3 with ``--swa-full``: a slot holding
        7,541 tokens, a new session sharing its first 1,885: all 2,303 tokens re-processed,
        "lack of cache data"); a restore of exactly the head is reused (1,800 of 2,303)."""
        return self.family is not Family.TRANSFORMER

    @property
    def checkpointed_entries(self) -> bool:
        """Whether the server's RAM prompt cache entries carry context checkpoints besides the
        slot's state (``server_prompt_cache_state::size``): the server checkpoints hybrids and SWA
        models without ``--swa-full``, never a transformer or an SWA model with it (b11434,
        ``do_checkpoint``). Checkpointed entries are larger than their tokens' state by an amount
        ocpc cannot see, so ``ramtier`` counts on less of the limit. Unknown flags or family: True."""
        if self.family is Family.TRANSFORMER:
            return False
        return not (self.family is Family.SWA and self.swa_full)

    @property
    def restores_serve(self) -> str | None:
        """Why no restore can serve on this server, with the fix; None when they can (or
        when it cannot be told from the flags: the gates and reports then find out)."""
        if self.family is Family.SWA and self.swa_full is False:
            return (
                f"a {self.family.label} model without a full-size SWA cache: the server re-processes "
                f"the whole prompt after every restore; start llama-server with {SWA_FULL} "
                "(`ocpc launch` does)"
            )
        if self.family is Family.HYBRID and self.checkpoints == 0:
            # Heads would still restore, but every later turn re-processes the whole prompt
            # anyway (no checkpoint to roll back to), and parking a conversation would cost a
            # whole re-prefill: nothing ocpc does pays off against plain llama-server.
            return (
                "a hybrid model with --ctx-checkpoints 0: no turn can roll back to a checkpoint, so "
                "parks and restores cannot pay off; start llama-server with --ctx-checkpoints 32 "
                "(`ocpc launch` does)"
            )
        return None

    @property
    def fix(self) -> str:
        """The flag that makes restores serve, for the one-line fix doctor and status print."""
        return "--ctx-checkpoints 32" if self.family is Family.HYBRID else SWA_FULL
