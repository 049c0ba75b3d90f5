"""Harness adapters: what the proxy knows about each coding agent (see docs/harnesses.md).

``select`` picks the adapter for a request; each adapter says how its harness's body is
normalised, where its stable head ends and which conversation a request belongs to.
"""

from __future__ import annotations

from oc_prefix_cache.harness.aider import AiderAdapter
from oc_prefix_cache.harness.base import Adapter, Incoming, select
from oc_prefix_cache.harness.claude_code import ClaudeCodeAdapter
from oc_prefix_cache.harness.cline import ClineAdapter
from oc_prefix_cache.harness.codex import CodexAdapter
from oc_prefix_cache.harness.generic import GenericAdapter
from oc_prefix_cache.harness.kilo_code import KiloCodeAdapter
from oc_prefix_cache.harness.opencode import OpenCodeAdapter
from oc_prefix_cache.harness.openhands import OpenHandsAdapter
from oc_prefix_cache.harness.pi import PiAdapter
from oc_prefix_cache.harness.qwen_code import QwenCodeAdapter

DEFAULT_ADAPTERS: tuple[Adapter, ...] = (
    OpenCodeAdapter(),
    ClaudeCodeAdapter(),
    PiAdapter(),
    CodexAdapter(),
    QwenCodeAdapter(),
    KiloCodeAdapter(),
    AiderAdapter(),
    ClineAdapter(),
    OpenHandsAdapter(),
)
NAMES = frozenset(adapter.name for adapter in DEFAULT_ADAPTERS) | {"generic"}

__all__ = [
    "DEFAULT_ADAPTERS",
    "NAMES",
    "Adapter",
    "AiderAdapter",
    "ClaudeCodeAdapter",
    "ClineAdapter",
    "CodexAdapter",
    "GenericAdapter",
    "Incoming",
    "KiloCodeAdapter",
    "OpenCodeAdapter",
    "OpenHandsAdapter",
    "PiAdapter",
    "QwenCodeAdapter",
    "select",
]
