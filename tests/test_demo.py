"""`ocpc demo` on the rig: the token facts it shows (timings are the bench's business)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from oc_prefix_cache.cli import app

pytestmark = pytest.mark.rig


def test_demo_shows_the_head_served_from_cache_after_a_restart(models) -> None:
    result = CliRunner().invoke(app, ["demo", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["case"]: row for row in json.loads(result.stdout)["rows"]}
    cold, first = rows["cold, no ocpc"], rows["first run (paid once)"]
    same, restart = rows["new session, same server"], rows["new session after restart"]
    assert cold["cache_n"] == 0 and cold["prompt_n"] > 7000
    assert first["action"] == "warmed"
    head = first["cache_n"]  # the warmed head, reused by the request that follows
    assert same["action"] in ("hit", "restored") and same["cache_n"] >= head
    assert restart["action"] == "restored" and restart["cache_n"] >= head
    assert cold["prompt_n"] >= 15 * restart["prompt_n"]
