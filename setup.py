"""Build step: ship the OpenCode plugin and the launcher files inside the package.

``plugin-js/ocpc-plugin.js`` and ``launcher/`` stay the only copies in git. Building the
wheel (directly or from the sdist, which carries both through MANIFEST.in) copies them
into ``oc_prefix_cache/shipped/``, where ``ocpc install`` finds the plugin through
importlib.resources when there is no source tree. Everything else is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PLUGIN = Path("plugin-js", "ocpc-plugin.js")
LAUNCHER = Path("launcher")


def shipped_files() -> dict[str, Path]:
    """Package-relative destination -> source file, for everything the build copies in."""
    plugin = ROOT / PLUGIN
    if not plugin.is_file():
        raise SystemExit(f"{plugin} is missing: build ocpc from a full checkout or its sdist")
    files = {"ocpc-plugin.js": plugin}
    for unit in sorted((ROOT / LAUNCHER).iterdir()):
        if unit.is_file():
            files[f"launcher/{unit.name}"] = unit
    return files


class BuildPyWithShipped(build_py):
    """build_py, plus the plugin and launcher copied from their one source into the build."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads plugin-js/ in the checkout itself
        for dest, source in shipped_files().items():
            target = Path(self.build_lib, "oc_prefix_cache", "shipped", dest)
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target), preserve_mode=True)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [str(Path(self.build_lib, "oc_prefix_cache", "shipped", d)) for d in shipped_files()]


setup(cmdclass={"build_py": BuildPyWithShipped})
