"""The stand-down rules and the family facts, without a server (the rig tests in
test_families.py show them on the real one)."""

from __future__ import annotations

from oc_prefix_cache.engine.standdown import MISSES, StandDown
from oc_prefix_cache.llama.families import CacheFacts, Family, family_of
from oc_prefix_cache.llama.server_info import cache_facts


def test_one_failed_probe_is_the_files_fault_two_on_one_process_are_the_servers() -> None:
    down = StandDown()
    assert down.probe_failed(1) is None and down.why(1) is None
    why = down.probe_failed(1)
    assert why is not None and down.declare(1, why)
    assert not down.declare(1, why)  # said once
    assert down.why(1) == why
    assert down.why(2) is None  # a restart: a new process is judged afresh
    assert down.probe_failed(2) is None  # and its count starts again


def test_misses_count_only_in_a_row_without_a_proof_of_reuse_between() -> None:
    down = StandDown()
    for _ in range(MISSES - 1):
        assert down.missed(1) is None
    down.proof(1)  # a passed probe or a served report
    for _ in range(MISSES - 1):
        assert down.missed(1) is None
    assert down.missed(1) is not None


def test_families_from_gguf_keys() -> None:
    assert family_of("qwen3", {"qwen3.attention.sliding_window": 0}) is Family.TRANSFORMER
    assert family_of("gemma3", {"gemma3.attention.sliding_window": 512}) is Family.SWA
    assert family_of("qwen35", {"qwen35.ssm.state_size": 128}) is Family.HYBRID
    # a hybrid with sliding-window attention layers is still a hybrid: its state rolls back only to checkpoints
    assert family_of("x", {"x.ssm.state_size": 16, "x.attention.sliding_window": 4096}) is Family.HYBRID


def test_what_each_family_and_flag_set_means_for_restores() -> None:
    swa = Family.SWA
    assert cache_facts(swa, ["llama-server", "--swa-full"]).restores_serve is None
    # even with --swa-full the server cuts an SWA slot back only within its window or to a
    # checkpoint: a longer slot's common prefix is no hit (tests/rig/llama/test_families.py, measured)
    assert cache_facts(swa, ["llama-server", "--swa-full"]).partial_cache
    without = cache_facts(swa, ["llama-server", "-c", "8192"])
    assert without.restores_serve is not None and "--swa-full" in without.restores_serve
    unknown = cache_facts(swa, None)  # flags not visible: not known, learned (gates, reports)
    assert unknown.restores_serve is None and unknown.partial_cache
    hybrid = cache_facts(Family.HYBRID, ["llama-server", "--ctx-checkpoints", "0"])
    assert hybrid.restores_serve is not None and hybrid.fix == "--ctx-checkpoints 32"
    assert cache_facts(Family.HYBRID, ["llama-server"]).restores_serve is None
    assert CacheFacts(Family.TRANSFORMER).restores_serve is None and not CacheFacts(Family.TRANSFORMER).partial_cache
