"""Harness adapters: what the proxy knows about each coding agent (see docs/harnesses.md).

``select`` picks the adapter for a request; each adapter says how its harness's body is
normalised, where its stable head ends and which conversation a request belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence

from oc_prefix_cache.harness.aider import AiderAdapter
from oc_prefix_cache.harness.base import Adapter, Incoming
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


def door_adapters(*, markers: tuple[str, ...], off: frozenset[str]) -> tuple[tuple[Adapter, ...], Adapter]:
    """The adapters a door reads requests with, in order, and its fallback: OpenCode's head rule and
    the generic one take the operator's markers (as the plugin's path does), and the adapters that
    normalise are told which normalisations are off. One list for the proxy and the gateway's
    front, so both read a request alike."""
    adapters: tuple[Adapter, ...] = (
        OpenCodeAdapter(markers=markers),
        ClaudeCodeAdapter(off=off),
        PiAdapter(),
        CodexAdapter(off=off),
        QwenCodeAdapter(),
        KiloCodeAdapter(),
        AiderAdapter(),
        ClineAdapter(),
        OpenHandsAdapter(),
    )
    return adapters, GenericAdapter(markers=markers)


def select(
    incoming: Incoming,
    *,
    enabled: frozenset[str],
    adapters: Sequence[Adapter] | None = None,
    fallback: Adapter | None = None,
) -> Adapter:
    """The first enabled adapter that matches, else the generic one (``fallback``).

    Here, beside the adapters it defaults to (so no adapter module imports the package back).
    ``adapters`` defaults to every harness this package knows, in a fixed order; ``fallback`` to a
    generic adapter with OpenCode's marker. The fallback is used even when "generic" is not in
    ``enabled``: it changes no body, so it is the same as having no adapter at all.
    """
    for adapter in DEFAULT_ADAPTERS if adapters is None else adapters:
        if adapter.name in enabled and adapter.matches(incoming):
            return adapter
    return fallback if fallback is not None else GenericAdapter()


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
    "door_adapters",
    "select",
]
