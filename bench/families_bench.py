"""Every model family on the multi-conversation workload: plain llama-server at its defaults,
ocpc on the server `ocpc launch` starts, and the ideal oracle, arms alternated step by step.

The workload is sessions_bench's (tests/workload.py: a parent growing by tool results, an
`explore` subagent, another project's session, a `general` subagent, the parent returning
between them), on one slot. Per family:

- ``plain``: llama-server with its own defaults (`-c 32768 -np 1 --metrics`, plus what this
  machine needs: `--no-repack` for the real Gemma's Q4_K weights); its own RAM prompt cache
  (8 GiB by default) is all it has;
- ``ocpc``: the prepare/report cycle on a server with the flags `ocpc launch` gives it
  (checkpoints, `--cache-ram 8192`, and the family's own: `--swa-full` for an SWA model);
- the ideal oracle: an unbounded prefix cache (each request processes only what follows its
  longest common token prefix with any earlier request).

Families: the tiny hybrid (qwen35), the tiny transformer (qwen3), the real Gemma 3 270M
(SWA), the fat-KV model (a 27B's 102,400 bytes per token), and "gemma3 own server": Gemma
on a server started without ocpc's launcher (no `--swa-full`: both arms on plain's flags),
where ocpc must stand down and cost nothing.

    .venv/bin/python bench/families_bench.py                 # all five (fat-kv takes ~15 min)
    .venv/bin/python bench/families_bench.py --smoke         # CI: qwen3, and gemma3 on its own server
    .venv/bin/python bench/families_bench.py --families gemma3,gemma3-own --json bench/results/families-NAME.json
    .venv/bin/python bench/families_bench.py --families gemma3 --build 10502 --aa \
        --json bench/results/families-gemma3-b10502.json   # an older build, A/A noise
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sessions_bench import FLAGS, bench_model  # noqa: E402
from oc_prefix_cache.commands.launch import family_flags
from oc_prefix_cache.llama.server_info import model_family
from oc_prefix_cache.rig.build import MATRIX_BUILDS, PINNED_BUILD, ensure_matrix_server, ensure_rig
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.rig.tiny_models import ensure_model
from oc_prefix_cache.settings import Settings

PLAIN = ("--metrics",)  # llama-server's defaults; --metrics only lets the bench read its token counter
#: The smoke run's steps per family (None: the whole scenario). Gemma on its own server is there
#: to show ocpc standing down, which its first request does; its whole scenario is ~28k tokens at
#: ~100-145 tokens/s per arm on a CI machine (6.5 minutes and more); the smoke runs its first two
#: steps (the stand-down and one request after it), about a tenth, with the real model's
#: conversations CI-sized (workload.shortened: 1,724 tokens for the two steps instead of ~3.9k).
SMOKE_STEPS: dict[str, int | None] = {"qwen3": None, "gemma3-own": 2}


@dataclass(frozen=True)
class Family:
    label: str
    model: str
    launcher: bool = True  # the ocpc arm's server has `ocpc launch`'s flags (else plain's)


FAMILIES = {
    f.label: f
    for f in (
        Family("qwen35", "qwen35"),
        Family("qwen3", "qwen3"),
        Family("gemma3", "gemma3"),
        Family("fat-kv", "fat-kv"),
        Family("gemma3-own", "gemma3", launcher=False),
    )
}


def args_for(family: Family, model_path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(plain's flags, ocpc's flags) for a family, with what this machine needs for the model."""
    needs = REAL_MODELS[family.model].server_args if family.model in REAL_MODELS else ()
    own = tuple(arg for flag in family_flags(model_family(str(model_path))) for arg in flag.args())
    plain = (*needs, *PLAIN)
    return plain, ((*needs, *FLAGS, *own) if family.launcher else plain)


def summary(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, res in results.items():
        oracle, plain, ocpc = res["oracle"], res["totals"]["plain"], res["totals"]["ocpc"]
        wall = res["wall_ms"]
        row = {
            "family": label,
            "build": res.get("build", ""),
            "oracle": oracle,
            "plain": plain,
            "ocpc": ocpc,
            "plain_x": plain / oracle,
            "ocpc_x": ocpc / oracle,
            "plain_s": wall["plain"] / 1000,
            "ocpc_s": wall["ocpc"] / 1000,
            "wall_ratio": wall["ocpc"] / wall["plain"],
        }
        if "plain-again" in wall:  # the A/A arm: plain against itself, in the same alternated run
            row["aa_ratio"] = wall["plain-again"] / wall["plain"]
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'family':<12} {'oracle':>8} {'plain':>8} {'ocpc':>8} {'plain/oracle':>12} {'ocpc/oracle':>11} "
        f"{'plain s':>8} {'ocpc s':>8} {'ocpc/plain wall':>15} {'A/A wall':>8}  build"
    )
    for r in rows:
        aa = f"{r['aa_ratio']:.2f}x" if "aa_ratio" in r else "-"
        print(
            f"{r['family']:<12} {r['oracle']:>8,} {r['plain']:>8,.0f} {r['ocpc']:>8,.0f} {r['plain_x']:>11.2f}x "
            f"{r['ocpc_x']:>10.2f}x {r['plain_s']:>8.1f} {r['ocpc_s']:>8.1f} {r['wall_ratio']:>14.2f}x {aa:>8}  "
            f"{r.get('build', '')}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CI: qwen3 and gemma3 on its own server")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--build",
        default=PINNED_BUILD,
        help=f"the llama-server build: the pinned b{PINNED_BUILD} or one of the matrix's "
        f"({', '.join(MATRIX_BUILDS)}; `ocpc rig build --matrix` builds them)",
    )
    parser.add_argument("--aa", action="store_true", help="a third arm, plain again: the run's own A/A noise")
    args = parser.parse_args()
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    binary = rig.server if args.build == PINNED_BUILD else ensure_matrix_server(settings, args.build)
    labels = list(SMOKE_STEPS) if args.smoke else args.families.split(",")
    unknown = [label for label in labels if label not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ocpc-families-") as work:
        for label in labels:
            family = FAMILIES[label]
            path = (
                ensure_real_model(rig, settings, family.model)
                if family.model in REAL_MODELS
                else ensure_model(rig, family.model)
            )
            plain, ocpc = args_for(family, path)
            results[label] = bench_model(
                label,
                binary,
                path,
                Path(work),
                smoke=True,
                plain_args=plain,
                ocpc_args=ocpc,
                limit=SMOKE_STEPS[label] if args.smoke else None,
                short=args.smoke and family.model in REAL_MODELS,
                aa=args.aa,
            )
            render(summary({label: results[label]}))  # as it goes: the full run is long
    print()
    render(summary(results))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary(results), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
