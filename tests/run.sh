#!/usr/bin/env bash
# The test command (README): set up everything on a fresh machine, then run every test.
# Needs only the README's prerequisites (Python >= 3.11 with venv, make, git, a C++
# compiler, CMake, Node.js 20 with npm); every other tool comes from a registry package
# through the test extra (ripgrep from its PyPI wheel, into .venv/bin).
# tests/unit/test_packaging.py builds the sdist and wheel and runs install/uninstall from the
# wheel in a fresh virtualenv (no editable install, temporary HOME and OpenCode config).
# Idempotent: the venv is reused, the llama-server build and tiny models are cached
# under ~/.cache/oc-prefix-cache/rig, keyed by the pinned sdist version, the arch, a digest of
# the CPU's flags and the compilers' versions (a native build from another CPU could die with
# SIGILL, so a cache restored from another machine builds again: `ocpc rig info`), OpenCode under
# ~/.cache/oc-prefix-cache/opencode-<version>, the peer under ~/.cache/oc-prefix-cache/peer.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'

# Every step prints the seconds since the start, so a CI log says where the time went.
started=$SECONDS
step() { echo "== $1 (at $((SECONDS - started)) s)"; }

# The agents' binaries for the end-to-end tests (npm, PyPI), downloaded while the server
# compiles (tests/harness_bins.py; cached per version; a failure here is retried by the test).
bins_log=$(mktemp)
rig_log=$(mktemp)
log=$(mktemp)
# A failed step stops the jobs in the background too (the build, the end-to-end tests: pytest
# stops the servers its tests started on SIGTERM).
stop_jobs() {
  kill $(jobs -p) 2>/dev/null || true
  rm -f "$log" "$bins_log" "$rig_log" "${e2e_log:-}"
}
trap stop_jobs EXIT
.venv/bin/python -m tests.harness_bins >"$bins_log" 2>&1 &
bins_pid=$!
# The real llama-server and tiny models: built once, cached (a cold build is 10-20 minutes on
# two cores), so the tests that need no server run while it compiles.
# --matrix: also llama-server alone for the older builds of the compatibility matrix (b11393, b10502:
# tests/rig/test_matrix.py, marker `matrix`), each cached per version and machine like the pinned one.
.venv/bin/ocpc rig build --matrix >"$rig_log" 2>&1 &
rig_pid=$!

step "mypy"
.venv/bin/mypy
# The house (docs/design.md): the layers as import-linter contracts (a wrong import fails here,
# named), and one style over the package, the tests and the benches.
step "lint-imports, ruff"
.venv/bin/lint-imports --no-cache
.venv/bin/ruff check .
.venv/bin/ruff format --check .

# pytest's exit 5 (no test collected) is a failure here: a filter or a collection error ate them.
# run_pytest LOG ARGS...: pytest's output goes to the terminal and to LOG; a failure ends the run.
passed=0
run_pytest() {
  local out=$1
  shift
  set +e
  .venv/bin/python -m pytest "$@" 2>&1 | tee "$out"
  local code=${PIPESTATUS[0]}
  set -e
  judge_pytest "$code" "$out"
}
# judge_pytest CODE LOG: end the run unless pytest passed; count what passed.
judge_pytest() {
  if [ "$1" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
  fi
  [ "$1" -eq 0 ] || exit "$1"
  passed=$((passed + $(grep -Eo '[0-9]+ passed' "$2" | tail -1 | grep -Eo '[0-9]+' || echo 0)))
}

# Two pytest workers (pytest-xdist, `--dist worksteal`: a worker that runs out takes the other's
# queue), each test's servers on one thread: much of a test is waiting (a server's start, a deadline,
# a poll), and on two cores two 1-thread servers prefill more than one 2-thread server (an 8k-token
# prompt: 5.2 s on one thread, 3.3 s on two). Measured 2026-12-05 on this 2-core machine:
# tests/rig/engine/test_prepare.py 317 -> 219 s, tests/rig/engine/test_parking.py 254 -> 149 s, the
# tests that need no server 155 -> 88 s, the rig tests but the end-to-end ones 989 s against 2,116 s
# the day before.
# Three workers were slower than two (test_parking.py 167 s).
parallel=(-n 2 --dist worksteal)

if [ $# -eq 0 ]; then
  # The tests by marker, not by folder: tests/unit/ holds the tests that need no server and tests/rig/
  # the rig's, but a file of both kinds stays whole where most of its tests are (test_daemon.py's
  # own unit tests live under tests/rig/, a few rig tests under tests/unit/). tests/e2e/: the agents'
  # end-to-end tests (all marked `rig`), run on their own below.
  step "pytest: the tests that need no server (while it compiles)"
  run_pytest "$log" -m "not rig" --durations=10 "${parallel[@]}"
fi
step "the rig (llama-server built from the pinned sdist, the tiny models)"
if ! wait "$rig_pid"; then
  cat "$rig_log"
  exit 1
fi
cat "$rig_log"
wait "$bins_pid" || true
step "agents' binaries"
cat "$bins_log"

# The benchmarks in smoke mode, so they cannot rot (full runs: docs/performance.md).
smoke() { step "bench: ${*:2}"; "$@"; }
# Beside the end-to-end tests, the longer of the two: the benches yield the cores to them (niced).
smoke_beside() { step "bench (niced): ${*:2}"; nice -n 10 "$@"; }

if [ $# -eq 0 ]; then
  step "pytest: the tests on the real server but the agents' end-to-end ones (two workers)"
  OCPC_TEST_SERVER_THREADS=1 run_pytest "$log" -m "rig and not alone" --durations=40 \
    --ignore=tests/e2e "${parallel[@]}"
  step "pytest: the tests that read every llama-server on this machine (alone)"
  run_pytest "$log" -m "rig and alone" --durations=5 --ignore=tests/e2e

  # The agents' end-to-end tests run beside the plugin's tests and the benches on the tiny models:
  # an agent's binary spends most of its session starting up on one core (Kilo ~25 s a run,
  # OpenHands and Aider their imports) while its server idles. Their servers run on one thread
  # (OCPC_TEST_SERVER_THREADS): with 2-thread test servers, two pytest runs side by side on 2 cores
  # did ~15.5 min of their one-after-the-other work in 18 min, and a concurrency test failed.
  # Measured 2026-12-05: the end-to-end tests took 940 s beside the benches (the benches 527 s),
  # against ~1,060 s for both one after the other; with the benches niced, 780 s (the benches
  # 483 s; one run each, hours apart).
  step "pytest: the agents' end-to-end tests (in the background, beside the next steps)"
  e2e_log=$(mktemp)
  OCPC_TEST_SERVER_THREADS=1 .venv/bin/python -m pytest -m rig --durations=20 tests/e2e >"$e2e_log" 2>&1 &
  e2e_pid=$!
  step "node --test (the OpenCode plugin)"
  # A glob, not the folder: Node >= 21 takes a folder argument as a file to run.
  node --test plugin-js/test/*.test.mjs 2>&1 | tee "$log"
  node_passed=$(grep -E '^# pass ' "$log" | grep -Eo '[0-9]+' || echo 0)
  smoke_beside .venv/bin/python bench/prepare_bench.py --smoke --models qwen35
  smoke_beside node bench/failopen_bench.mjs --calls 20
  smoke_beside .venv/bin/python bench/peer_bench.py --smoke
  smoke_beside .venv/bin/python bench/proxy_bench.py --smoke
  smoke_beside .venv/bin/python bench/sessions_bench.py --smoke
  smoke_beside .venv/bin/python bench/fatkv_bench.py --smoke
  smoke_beside .venv/bin/python bench/warmstart_bench.py --smoke
  smoke_beside .venv/bin/python bench/router_load_bench.py --smoke
  # Two of the three Gemma benches too: the tiny-model benches ended ~350 s before the end-to-end
  # tests in a full run on 2026-12-05 (477 s against 824), and these two take ~130 s alone.
  smoke_beside .venv/bin/python bench/families_bench.py --smoke
  smoke_beside .venv/bin/python bench/swa_full_bench.py --smoke
  step "the agents' end-to-end tests"
  e2e_code=0
  wait "$e2e_pid" || e2e_code=$?
  cat "$e2e_log"
  judge_pytest "$e2e_code" "$e2e_log"

  # The agents' ramp last, alone: it loads both cores for ~4 minutes, and its turns are timed.
  smoke .venv/bin/python bench/agents_bench.py --smoke
  # Many boxes behind smg: cache-aware over plain servers, ocpc's gateway as it runs by default, and
  # with a shared store (~3 minutes; its turns are timed too, so alone as well).
  smoke .venv/bin/python bench/boxes_bench.py --smoke --arms b,cm,cms
else
  step "pytest $*"
  run_pytest "$log" --durations=40 "$@"
  node_passed=0
fi

step "done"
echo "tests: $((passed + node_passed)) passed, 0 failed"
