#!/usr/bin/env bash
# A bootstrap server, a vLLM prefill, a vLLM decode and pdxfer's router, all on 127.0.0.1.
# Ctrl-C (or SIGTERM) stops all four.
#
#   MODEL=/path/to/model bash examples/vllm_pd/one_host.sh
#   python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
#
# Ports (override with the variables): router 8000, prefill 8100, decode 8200, bootstrap 8998.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ROUTER_PORT="${ROUTER_PORT:-8000}" PREFILL_PORT="${PREFILL_PORT:-8100}"
DECODE_PORT="${DECODE_PORT:-8200}" BOOTSTRAP_PORT="${BOOTSTRAP_PORT:-8998}"
BOOT="127.0.0.1:$BOOTSTRAP_PORT"

pdxfer bootstrap --port "$BOOTSTRAP_PORT" & PIDS+=($!)

# prefill: registers its ranks with the bootstrap server, sends each request's KV blocks
"${VLLM[@]}" --model "$MODEL" --port "$PREFILL_PORT" $VLLM_ARGS \
  --kv-transfer-config "$(kv_config kv_producer \
    "{\"bootstrap\": \"$BOOT\", \"instance\": \"prefill-0\"}")" & PIDS+=($!)

# decode: receives KV into the blocks its scheduler allocated; restores repeated prefixes
# from host memory (l2_pages); looks up only the bootstrap server it is given
"${VLLM[@]}" --model "$MODEL" --port "$DECODE_PORT" $VLLM_ARGS \
  --kv-transfer-config "$(kv_config kv_consumer \
    "{\"bootstrap\": \"$BOOT\", \"instance\": \"decode-0\", \"l2_pages\": 256}")" & PIDS+=($!)

wait_http "http://127.0.0.1:$PREFILL_PORT/health" "$START_TIMEOUT"
wait_http "http://127.0.0.1:$DECODE_PORT/health" "$START_TIMEOUT"

# the front door: OpenAI API, tokenizes with the model's tokenizer, pairs prefill and decode
pdxfer router --engine vllm --port "$ROUTER_PORT" \
  --prefill "http://127.0.0.1:$PREFILL_PORT,$BOOT,prefill-0" \
  --decode "http://127.0.0.1:$DECODE_PORT,decode-0" & PIDS+=($!)
wait_http "http://127.0.0.1:$ROUTER_PORT/health" 300
echo "READY http://127.0.0.1:$ROUTER_PORT/v1"
wait
