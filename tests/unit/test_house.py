"""The house's map cannot rot: the layers are import-linter contracts (pyproject.toml,
``[tool.importlinter]``; docs/design.md draws them), and the engine is built in one place.

The contracts pass on the package as it is, and fail, naming the import, on a copy with one
import running against them: a lower layer importing a higher one, a pure part (chat, harness)
importing the network, the prepare path importing the lifecycle back.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGE = ROOT / "oc_prefix_cache"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the package under ``root`` (its own copy first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_layers_hold_on_the_package() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "named"),
    [
        (
            "chat/head.py",
            "from oc_prefix_cache.doors import daemon",
            "oc_prefix_cache.chat.head -> oc_prefix_cache.doors.daemon",
        ),
        (
            "disk/index.py",
            "from oc_prefix_cache.engine import tracker",
            "oc_prefix_cache.disk.index -> oc_prefix_cache.engine.tracker",
        ),
        ("harness/base.py", "import httpx", "oc_prefix_cache.harness.base -> httpx"),
        (
            "engine/prepare.py",
            "from oc_prefix_cache.engine import lifecycle",
            "oc_prefix_cache.engine.prepare -> oc_prefix_cache.engine.lifecycle",
        ),
    ],
)
def test_an_import_against_the_layers_fails_with_its_name(tmp_path: Path, module: str, line: str, named: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "oc_prefix_cache", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "oc_prefix_cache" / module
    target.write_text(target.read_text() + f"\n{line}  # a wrong import\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert named in result.stdout, result.stdout


def test_the_composition_root_is_the_only_place_that_builds_a_preparer() -> None:
    """engine/wiring.py builds the Preparer and every collaborator; a door, a command or a helper
    that built one would wire the engine a second way (three did, before issue 38)."""
    builders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Preparer":
                builders.append(str(path.relative_to(ROOT)))
    assert builders == ["oc_prefix_cache/engine/wiring.py"]
