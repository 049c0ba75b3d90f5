"""What a body normalisation does to the model's answers: the same captured requests, with and
without it, answered greedily by the real model of the rig (Gemma 3 270M), token for token.

A normalisation that moves text (Claude Code's ``environment-to-system``) changes the prompt the
model reads, so it may change the answer; this says how often and where, so that docs/harnesses.md
can state its effect and the default can follow it. Requests: Claude Code 2.1.332's captured
main-agent requests (first requests in project A, a second turn, a first request with attribution
off, another HOME; and two main-agent turns of the subagent capture). Each is answered twice,
``--off`` (the normalisation switched off, i.e. the environment entry in place, as a user message)
and on, with ``temperature 0``, ``top_k 1`` and the same seed; the answers are compared as token
ids (``/completion`` on the rendered prompt, so the server's own template renders both).

    .venv/bin/python bench/normalise_bench.py                    # environment-to-system
    .venv/bin/python bench/normalise_bench.py --tokens 64 --json bench/results/normalise-NAME.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oc_prefix_cache import loopback
from oc_prefix_cache.chat.anthropic import to_chat
from oc_prefix_cache.harness.base import Incoming
from oc_prefix_cache.harness.claude_code import ClaudeCodeAdapter
from oc_prefix_cache.llama.server_process import LlamaServer, ServerConfig, free_port
from oc_prefix_cache.llama.supervisor import stop_on_sigterm
from oc_prefix_cache.rig.build import ensure_rig
from oc_prefix_cache.rig.real_models import REAL_MODELS, ensure_real_model
from oc_prefix_cache.settings import Settings

DATA = ROOT / "tests" / "data"
REQUESTS = {
    "A1 (first request)": DATA / "claude-code-2.1.332" / "A1.json",
    "A2 (first request)": DATA / "claude-code-2.1.332" / "A2.json",
    "A2 turn 2": DATA / "claude-code-2.1.332" / "A2-continue.json",
    "A3 (attribution off)": DATA / "claude-code-2.1.332" / "A3-attr0.json",
    "main agent, turn 1": DATA / "claude-code-2.1.332-subagent" / "0001-POST-v1_messages.json",
    "main agent, after a subagent": DATA / "claude-code-2.1.332-subagent" / "0004-POST-v1_messages.json",
}


def incoming(path: Path) -> Incoming:
    data = json.loads(path.read_text())
    pairs = data["headers"].items() if isinstance(data["headers"], dict) else data["headers"]
    return Incoming(api="anthropic", headers={str(k).lower(): str(v) for k, v in pairs}, body=data["body_json"])


def answer(url: str, chat: dict[str, Any], tokens: int) -> tuple[list[int], str, int]:
    """Greedy token ids and text of the model's answer to ``chat``, and the prompt's token count."""
    prompt = loopback.post(f"{url}/apply-template", json=chat, timeout=60).json()["prompt"]
    data = loopback.post(
        f"{url}/completion",
        timeout=600,
        json={
            "prompt": prompt,
            "n_predict": tokens,
            "temperature": 0,
            "top_k": 1,
            "seed": 1,
            "cache_prompt": False,
            "return_tokens": True,
        },
    ).json()
    return list(data.get("tokens") or []), str(data.get("content") or ""), int(data["timings"]["prompt_n"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--normalisation", default="environment-to-system")
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per answer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = Settings.from_env()
    rig = ensure_rig(settings)
    model = ensure_real_model(rig, settings, "gemma3")
    on, off = ClaudeCodeAdapter(), ClaudeCodeAdapter(off=frozenset({args.normalisation}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="ocpc-normalise-") as work:
        config = ServerConfig(
            binary=rig.server,
            model=model,
            port=free_port(),
            slot_dir=None,
            ctx_size=32768,
            parallel=1,
            extra_args=REAL_MODELS["gemma3"].server_args,
        )
        server = LlamaServer(config=config, log_path=Path(work) / "llama-server.log")
        server.start()
        try:
            for name, path in REQUESTS.items():
                request = incoming(path)
                with_it, changes = on.normalise(request)
                if args.normalisation not in changes:
                    rows.append({"request": name, "applies": False})
                    print(f"{name:32} the normalisation does not apply")
                    continue
                without_it, _ = off.normalise(request)
                a_tokens, a_text, a_prompt = answer(server.url, to_chat(without_it), args.tokens)
                b_tokens, b_text, b_prompt = answer(server.url, to_chat(with_it), args.tokens)
                same = next(
                    (i for i, (x, y) in enumerate(zip(a_tokens, b_tokens, strict=False)) if x != y),
                    min(len(a_tokens), len(b_tokens)),
                )
                identical = a_tokens == b_tokens
                rows.append(
                    {
                        "request": name,
                        "applies": True,
                        "identical": identical,
                        "first_difference": same,
                        "tokens": [len(a_tokens), len(b_tokens)],
                        "prompt_tokens": [a_prompt, b_prompt],
                        "off": a_text,
                        "on": b_text,
                    }
                )
                verdict = "identical" if identical else f"differs from token {same}"
                print(f"{name:32} {verdict:22} prompt {a_prompt:,} -> {b_prompt:,} tokens")
                if not identical:
                    print(f"    off: {a_text[:160]!r}\n    on:  {b_text[:160]!r}")
        finally:
            server.stop()
    applied = [r for r in rows if r["applies"]]
    same = sum(1 for r in applied if r["identical"])
    print(
        f"\n{args.normalisation}: {same} of {len(applied)} answers identical token for token "
        f"({args.tokens} tokens each, greedy, Gemma 3 270M)"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"normalisation": args.normalisation, "tokens": args.tokens, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    stop_on_sigterm()  # a timeout's SIGTERM stops the servers this bench started
    sys.exit(main())
