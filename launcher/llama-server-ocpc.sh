#!/usr/bin/env bash
# Plain-shell launcher: llama-server with the flags ocpc needs, plus the ocpc daemon.
# For people who prefer a script to `ocpc launch` (which does the same, and checks more).
#
#   launcher/llama-server-ocpc.sh MODEL.gguf [extra llama-server args...]
#
# Env: LLAMA_SERVER (binary, default: llama-server on PATH), OCPC_SERVER_PORT (8080),
#      OC_PREFIX_CACHE_SLOT_DIR (default: `ocpc paths --json` "slots").
set -euo pipefail
# Private: the slot folder made here is 0700 and the server's slot files 0600 (each decodes to
# the whole prompt with the model's tokenizer).
umask 077
model=${1:?usage: $0 MODEL.gguf [extra llama-server args]}
shift
server=${LLAMA_SERVER:-llama-server}
port=${OCPC_SERVER_PORT:-8080}
slots=${OC_PREFIX_CACHE_SLOT_DIR:-$(ocpc paths --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["slots"])')}
mkdir -p "$slots"

# Why each flag: docs/configuration.md ("ocpc launch defaults").
"$server" -m "$model" --host 127.0.0.1 --port "$port" \
  --slot-save-path "$slots/" -np 1 --ctx-checkpoints 32 --checkpoint-min-step 1024 \
  -ub 512 --cache-ram 8192 --metrics "$@" &
server_pid=$!
OC_PREFIX_CACHE_BASE_URL="http://127.0.0.1:$port" ocpc daemon --server-bin "$(command -v "$server")" &
daemon_pid=$!
# On stop: park the live conversations first (at most 10 s), then stop both.
trap 'ocpc park --timeout 10 || true; kill -TERM "$server_pid" "$daemon_pid" 2>/dev/null; wait' INT TERM
wait -n "$server_pid" "$daemon_pid"
kill -TERM "$server_pid" "$daemon_pid" 2>/dev/null || true
wait
