"""What `--swa-full` costs a sliding-window model: decode and prefill speed, with and without it.

`ocpc launch` starts an SWA model (Gemma 3, gpt-oss) with `--swa-full`, because without it no
restore of a prefix longer than the window can serve (docs/design.md, "Model families"). The
flag keeps every layer's KV for the whole context. Measured here (configuration.md): with one slot
it costs nothing; with several slots at once a request's decode takes longer (mostly a cost per
request: on two slots at 4k tokens 4.27x plain's per token at 32 tokens, 1.92x at 160) and a
prompt prefills faster. This bench measures that on the real Gemma 3 270M, `-np N` slots at once
(as in the agents ramp), arms alternated (A B B A, or with ``--arms`` A B C C B A) on fresh servers:

- ``plain``: llama-server at its defaults (`--no-repack` only, which this CPU build needs);
- ``swa-full``: the same with `--swa-full`;
- ``swa-full-split``, ``plain-split``: the same with `--no-kv-unified` (each slot its own KV).

Each server gets N concurrent completions of a ~4k-token prompt (a different one per slot) and
decodes a fixed number of tokens (`ignore_eos`). Printed per arm: the mean decode ms/token and
prefill tokens/s over the slots, and each arm's ratio to the first (the baseline).

    .venv/bin/python bench/swa_full_bench.py               # -np 4, ~4k-token prompts, 64 tokens
    .venv/bin/python bench/swa_full_bench.py --words 150   # ~790-token prompts
    .venv/bin/python bench/swa_full_bench.py --smoke       # CI: 2 slots, ~250-token prompts, 8 tokens
    .venv/bin/python bench/swa_full_bench.py --arms plain,swa-full,swa-full-split   # + each slot its
                                                           # own KV stream (--no-kv-unified)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache.llama_process import LlamaServer, ServerConfig, free_port  # noqa: E402
from oc_prefix_cache.process import stop_on_sigterm  # noqa: E402
from oc_prefix_cache.realmodels import REAL_MODELS, ensure_real_model  # noqa: E402
from oc_prefix_cache.rig import ensure_rig  # noqa: E402
from oc_prefix_cache.settings import Settings  # noqa: E402

ARMS = {"plain": (), "swa-full": ("--swa-full",),
        # Each slot its own KV stream (`--no-kv-unified`), so a slot's attention spans only its own
        # cells: whether the pool's shared range is what `--swa-full` costs (measured: it is not).
        "swa-full-split": ("--swa-full", "--no-kv-unified"), "plain-split": ("--no-kv-unified",)}


def measure(binary: Path, model: Path, work: Path, *, flags: tuple[str, ...], slots: int, words: int,
            predict: int) -> dict[str, Any]:
    config = ServerConfig(binary=binary, model=model, port=free_port(), slot_dir=None, ctx_size=32768,
                          parallel=slots, extra_args=(*REAL_MODELS["gemma3"].server_args, *flags))
    server = LlamaServer(config=config, log_path=work / f"server-{config.port}.log")
    server.start()

    def one(i: int) -> dict[str, Any]:
        prompt = " ".join(f"word{i}_{j}" for j in range(words))
        body = {"prompt": prompt, "n_predict": predict, "ignore_eos": True, "cache_prompt": False}
        timings: dict[str, Any] = httpx.post(f"{server.url}/completion", json=body, timeout=1800).json()["timings"]
        return timings

    try:
        with ThreadPoolExecutor(slots) as pool:
            timings = list(pool.map(one, range(slots)))
    finally:
        server.stop()
    return {"decode_ms_per_token": statistics.mean(t["predicted_per_token_ms"] for t in timings),
            "prefill_tokens_per_s": statistics.mean(t["prompt_per_second"] for t in timings),
            "prompt_tokens": timings[0]["prompt_n"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--words", type=int, default=700, help="words per prompt (700: ~4.1k tokens)")
    parser.add_argument("--predict", type=int, default=64)
    parser.add_argument("--arms", default="plain,swa-full",
                        help=f"comma-separated, the first is the baseline; of {', '.join(ARMS)}")
    parser.add_argument("--smoke", action="store_true",
                        help="CI: 2 slots, 40 words (~250 tokens), 8 tokens each, so the script cannot rot")
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
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="ocpc-swa-") as tmp:
        for arm in [*arms, *reversed(arms)]:  # A B C C B A
            row = measure(rig.server, model, Path(tmp), flags=ARMS[arm], slots=args.slots, words=args.words,
                          predict=args.predict)
            results[arm].append(row)
            print(f"{arm:14s} decode {row['decode_ms_per_token']:7.1f} ms/token  prefill "
                  f"{row['prefill_tokens_per_s']:6.1f} tokens/s  ({row['prompt_tokens']} prompt tokens, "
                  f"{args.slots} slots at once)", flush=True)
    mean = {arm: {k: statistics.mean(r[k] for r in rows) for k in ("decode_ms_per_token", "prefill_tokens_per_s")}
            for arm, rows in results.items()}
    base = arms[0]
    for arm in arms[1:]:
        ratio = {k: mean[arm][k] / mean[base][k] for k in mean[base]}
        print(f"{arm}/{base}: decode time per token {ratio['decode_ms_per_token']:.2f}x, "
              f"prefill speed {ratio['prefill_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
