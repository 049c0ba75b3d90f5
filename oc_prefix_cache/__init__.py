"""oc-prefix-cache: keep the stable head of OpenCode prompts warm in llama-server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("oc-prefix-cache")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
