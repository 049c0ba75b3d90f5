"""What `--swa-full` costs a sliding-window model in speed: the same work, with and without it.

`ocpc launch` starts an SWA model (Gemma 3, gpt-oss) with `--swa-full`, because without it no
restore of a prefix longer than the window can serve (docs/design.md, "Model families"). The
flag keeps every layer's KV for the whole context. This bench gives `-np N` slots work at once on
the real Gemma 3 270M, fresh servers, arms alternated (A B B A, or with ``--arms`` A B C C B A):

- ``plain``: llama-server at its defaults (`--no-repack` only, which this CPU build needs);
- ``swa-full``: the same with `--swa-full`;
- ``swa-full-split``, ``plain-split``: the same with `--no-kv-unified` (each slot its own KV).

The measure is the **wall time** of the same requests. The server's per-slot timings (printed
too) are no measure of it: a batch serves several slots at once, and the server books the batch's
time to each slot as prompt or decode time, by where that slot stands. With `--swa-full` those
per-slot figures came out 1.9-4.3x plain's per decoded token on 2-4 slots while the wall time of
the same work was 0.96-1.09x (configuration.md, "What `--swa-full` costs").

Two shapes of work:
- default: each slot gets a fresh ~4k-token prompt (a different one per slot), all at once, and
  decodes ``--predict`` tokens (`ignore_eos`);
- ``--turns R``: the agents ramp's shape. Each slot's prompt is prefilled alone first; then R
  rounds in which every slot at once sends its conversation so far plus ``--new`` words (a tool
  result) and decodes ``--predict`` tokens, its reply kept in the next round's prompt, so each
  turn processes only its new tokens.

    .venv/bin/python bench/swa_full_bench.py                          # -np 4, ~4k tokens, 64 decoded
    .venv/bin/python bench/swa_full_bench.py --slots 2 --turns 6 --predict 24   # the ramp's turns
    .venv/bin/python bench/swa_full_bench.py --smoke                  # CI: 2 slots, ~250 tokens, 8 decoded
    .venv/bin/python bench/swa_full_bench.py --arms plain,swa-full,swa-full-split
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache import loopback
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.settings import Settings

ARMS = {
    "plain": (),
    "swa-full": ("--swa-full",),
    # Each slot its own KV stream (`--no-kv-unified`), so a slot's attention spans only its own
    # cells: whether the pool's shared range matters (measured: it does not).
    "swa-full-split": ("--swa-full", "--no-kv-unified"),
    "plain-split": ("--no-kv-unified",),
}


def measure(
    binary: Path,
    model: Path,
    work: Path,
    *,
    flags: tuple[str, ...],
    slots: int,
    words: int,
    predict: int,
    turns: int,
    new_words: int,
) -> dict[str, Any]:
    """One fresh server: the wall time of each round of work on all slots at once, and the
    server's per-slot timings of those requests."""
    config = ServerConfig(
        binary=binary,
        model=model,
        port=free_port(),
        slot_dir=None,
        ctx_size=32768,
        parallel=slots,
        extra_args=(*REAL_MODELS["gemma3"].server_args, *flags),
    )
    server = LlamaServer(config=config, log_path=work / f"server-{config.port}.log")
    server.start()
    client = loopback.client(base_url=server.url, timeout=1800)

    def tokens(text: str) -> list[int]:
        found: list[int] = client.post("/tokenize", json={"content": text}).json()["tokens"]
        return found

    def complete(slot: int) -> dict[str, Any]:
        body = {
            "prompt": prompts[slot],
            "n_predict": predict,
            "ignore_eos": True,
            "id_slot": slot,
            "cache_prompt": bool(turns),
            "return_tokens": True,
        }
        answer: dict[str, Any] = client.post("/completion", json=body).json()
        if turns:  # the conversation grows by its reply and the next tool result
            prompts[slot] = prompts[slot] + answer["tokens"] + tool_results[slot]
        return dict(answer["timings"])

    try:
        prompts = [tokens(" ".join(f"word{i}_{j}" for j in range(words))) for i in range(slots)]
        tool_results = [tokens(" ".join(f"tool{i}_{j}" for j in range(new_words))) for i in range(slots)]
        for slot in range(slots if turns else 0):
            complete(slot)  # each conversation's context, prefilled alone
        walls: list[float] = []
        timings: list[dict[str, Any]] = []
        with ThreadPoolExecutor(slots) as pool:
            for _ in range(max(turns, 1)):
                start = time.monotonic()
                timings += pool.map(complete, range(slots))
                walls.append(time.monotonic() - start)
    finally:
        client.close()
        server.stop()
    return {
        "wall_s": statistics.mean(walls),
        "decode_ms_per_token": statistics.mean(t["predicted_per_token_ms"] for t in timings),
        "prefill_tokens_per_s": statistics.mean(t["prompt_per_second"] for t in timings),
        "prompt_tokens": timings[-1]["prompt_n"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--words", type=int, default=700, help="words per prompt (700: ~4.1k tokens)")
    parser.add_argument("--predict", type=int, default=64)
    parser.add_argument(
        "--turns",
        type=int,
        default=0,
        help="rounds of the ramp's turns on each slot's cached prompt (0: one fresh prompt each)",
    )
    parser.add_argument(
        "--new", type=int, default=40, help="with --turns: words of tool result per turn (40: ~170 tokens)"
    )
    parser.add_argument(
        "--arms", default="plain,swa-full", help=f"comma-separated, the first is the baseline; of {', '.join(ARMS)}"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI: 2 slots, 40 words (~250 tokens), 8 tokens each, so the script cannot rot",
    )
    args = parser.parse_args()
    if args.smoke:
        args.slots, args.words, args.predict = 2, 40, 8
    stop_on_sigterm()
    settings = Settings.from_env(dict(os.environ))
    rig = ensure_rig(settings)
    model = ensure_real_model(rig, settings, "gemma3")
    arms = args.arms.split(",")
    if unknown := [arm for arm in arms if arm not in ARMS]:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    shape = (
        f"{args.turns} rounds of turns" if args.turns else "one fresh prompt each"
    ) + f", {args.slots} slots at once"
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="ocpc-swa-") as tmp:
        for arm in [*arms, *reversed(arms)]:  # A B C C B A
            row = measure(
                rig.server,
                model,
                Path(tmp),
                flags=ARMS[arm],
                slots=args.slots,
                words=args.words,
                predict=args.predict,
                turns=args.turns,
                new_words=args.new,
            )
            results[arm].append(row)
            print(
                f"{arm:14s} wall {row['wall_s']:6.2f} s a round  (per slot, as the server books it: decode "
                f"{row['decode_ms_per_token']:6.1f} ms/token, prefill {row['prefill_tokens_per_s']:6.1f} tokens/s; "
                f"{row['prompt_tokens']} prompt tokens processed; {shape})",
                flush=True,
            )
    keys = ("wall_s", "decode_ms_per_token", "prefill_tokens_per_s")
    mean = {arm: {k: statistics.mean(r[k] for r in rows) for k in keys} for arm, rows in results.items()}
    base = arms[0]
    for arm in arms[1:]:
        ratio = {k: mean[arm][k] / mean[base][k] for k in keys}
        print(
            f"{arm}/{base}: wall time of the same work {ratio['wall_s']:.2f}x  (per-slot booking: decode time "
            f"per token {ratio['decode_ms_per_token']:.2f}x, prefill speed {ratio['prefill_tokens_per_s']:.2f}x)"
        )


if __name__ == "__main__":
    main()
