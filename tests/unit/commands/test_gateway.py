"""`ocpc gateway`'s smg command line: what smg itself parses from it, for any token `ocpc token` makes.

A token is url-safe base64 and may begin with "-": passed as two arguments, smg's argparse took it
for an option and smg would not start (found by the shared-store rig test). The class: every token
reaches smg whole, and no token is ever on a command line.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oc_prefix_cache.commands import gateway
from oc_prefix_cache.commands.smg_entry import with_key
from oc_prefix_cache.errors import ConfigError
from oc_prefix_cache.settings import Settings

smg_launch = pytest.importorskip("smg.launch_router")
URLSAFE = string.ascii_letters + string.digits + "-_"
BOXES = ("http://127.0.0.2:8766", "http://127.0.0.3:8766")


@given(token=st.text(alphabet=URLSAFE, min_size=16, max_size=64))
@settings(max_examples=200, deadline=None)
def test_smg_parses_its_key_whole_whatever_the_token_begins_with(token: str) -> None:
    plan = gateway.plan(BOXES, policy="consistent_hashing", smg_host="127.0.0.1", smg_port=30001)
    args = smg_launch.parse_router_args(with_key(plan.smg_args()[1:], token))  # [0] is "launch"
    assert args.api_key == token
    assert list(args.worker_urls) == list(BOXES)
    assert args.policy == "consistent_hashing"
    assert (args.host, args.port) == ("127.0.0.1", 30001)
    assert args.prometheus_host == "127.0.0.1"


def test_the_command_line_names_the_token_file_never_the_token(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"OC_PREFIX_CACHE_HOME": str(tmp_path), "OC_PREFIX_CACHE_TOKEN_FILE": str(tmp_path / "t")}
    )
    plan = gateway.plan(BOXES, policy="consistent_hashing", smg_host="127.0.0.1", smg_port=None)
    process = gateway.smg_process(settings, plan)
    assert str(tmp_path / "t") in process.argv and not any("api-key" in a for a in process.argv)
    assert not any(k.lower().endswith("_proxy") for k in (process.env or {}))  # boxes reached directly
    printed = plan.shell_command(settings.token_path)
    assert "oc_prefix_cache.commands.smg_entry" in printed and "api-key" not in printed


@pytest.mark.parametrize(
    "boxes,policy",
    [
        ((), "consistent_hashing"),
        (("127.0.0.2:8766",), "consistent_hashing"),
        (("https://b:1",), "consistent_hashing"),
        (BOXES, "nope"),
    ],
)
def test_a_wrong_gateway_is_refused_before_anything_starts(boxes: tuple[str, ...], policy: str) -> None:
    with pytest.raises(ConfigError):
        gateway.plan(boxes, policy=policy, smg_host="127.0.0.1", smg_port=None)


def test_the_default_policy_pins_each_new_conversation_to_the_box_with_the_fewest() -> None:
    plan = gateway.plan(BOXES, policy="manual", smg_host="127.0.0.1", smg_port=30001)
    args = smg_launch.parse_router_args(with_key(plan.smg_args()[1:], "a" * 32))
    assert (args.policy, args.assignment_mode) == ("manual", "min_group")
    assert list(args.routing_key_headers) == ["x-smg-routing-key"]
