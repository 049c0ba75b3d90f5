"""Harness adapters: what the proxy knows about each coding agent (see docs/harnesses.md).

``select`` picks the adapter for a request; each adapter says how its harness's body is
normalised, where its stable head ends and which conversation a request belongs to.
"""

from __future__ import annotations

from .aider import AiderAdapter
from .base import Adapter, Incoming, select
from .claude_code import ClaudeCodeAdapter
from .cline import ClineAdapter
from .codex import CodexAdapter
from .generic import GenericAdapter
from .kilo_code import KiloCodeAdapter
from .opencode import OpenCodeAdapter
from .openhands import OpenHandsAdapter
from .pi import PiAdapter
from .qwen_code import QwenCodeAdapter

DEFAULT_ADAPTERS: tuple[Adapter, ...] = (OpenCodeAdapter(), ClaudeCodeAdapter(), PiAdapter(), CodexAdapter(),
                                         QwenCodeAdapter(), KiloCodeAdapter(), AiderAdapter(), ClineAdapter(),
                                         OpenHandsAdapter())
NAMES = frozenset(adapter.name for adapter in DEFAULT_ADAPTERS) | {"generic"}

__all__ = [
    "DEFAULT_ADAPTERS", "NAMES", "Adapter", "AiderAdapter", "ClaudeCodeAdapter", "ClineAdapter", "CodexAdapter",
    "GenericAdapter", "Incoming", "KiloCodeAdapter", "OpenCodeAdapter", "OpenHandsAdapter", "PiAdapter",
    "QwenCodeAdapter", "select",
]
