#!/usr/bin/env bash
# The test command (README): set up everything on a fresh machine, then run every test.
# Needs only the README's prerequisites (Python >= 3.11 with venv, make, git, a C++
# compiler, CMake, Node.js 20 with npm); every other tool comes from a registry package
# through the test extra (ripgrep from its PyPI wheel, into .venv/bin).
# tests/test_packaging.py builds the sdist and wheel and runs install/uninstall from the
# wheel in a fresh virtualenv (no editable install, temporary HOME and OpenCode config).
# Idempotent: the venv is reused, the llama-server build and tiny models are cached
# under ~/.cache/oc-prefix-cache/rig (keyed by the pinned sdist version), OpenCode under
# ~/.cache/oc-prefix-cache/opencode-<version>, the peer under ~/.cache/oc-prefix-cache/peer.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'

# The agents' binaries for the end-to-end tests (npm, PyPI), downloaded while the server
# compiles (tests/harness_bins.py; cached per version; a failure here is retried by the test).
bins_log=$(mktemp)
.venv/bin/python -m tests.harness_bins >"$bins_log" 2>&1 &
bins_pid=$!

# The real llama-server and tiny models: built once, cached; fails loudly if it cannot.
.venv/bin/ocpc rig build
wait "$bins_pid" || true
echo "== agents' binaries"
cat "$bins_log"
rm -f "$bins_log"

echo "== mypy"
.venv/bin/mypy

log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "== pytest"
set +e
.venv/bin/python -m pytest --durations=40 "$@" 2>&1 | tee "$log"
code=${PIPESTATUS[0]}
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
[ "$code" -eq 0 ] || exit "$code"
py_passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+' || echo 0)

echo "== node --test (the OpenCode plugin)"
# A glob, not the folder: Node >= 21 takes a folder argument as a file to run.
node --test plugin-js/test/*.test.mjs 2>&1 | tee "$log"
node_passed=$(grep -E '^# pass ' "$log" | grep -Eo '[0-9]+' || echo 0)

# The benchmarks in smoke mode, so they cannot rot (full runs: docs/performance.md).
echo "== bench (smoke)"
.venv/bin/python bench/prepare_bench.py --smoke --models qwen35
node bench/failopen_bench.mjs --calls 20
.venv/bin/python bench/peer_bench.py --smoke
.venv/bin/python bench/proxy_bench.py --smoke
.venv/bin/python bench/sessions_bench.py --smoke
.venv/bin/python bench/families_bench.py --smoke
.venv/bin/python bench/fatkv_bench.py --smoke
.venv/bin/python bench/warmstart_bench.py --smoke
.venv/bin/python bench/router_load_bench.py --smoke
.venv/bin/python bench/agents_bench.py --smoke

echo "tests: $((py_passed + node_passed)) passed, 0 failed"
