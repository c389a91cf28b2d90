#!/usr/bin/env bash
# Two hosts: A runs the bootstrap server, the vLLM prefill and the router; B the vLLM decode.
# Every process binds its host's address and advertises it to its peers; a shared secret
# authenticates the bootstrap and every control frame (docs/deployment.md).
#
#   # on both: the same secret file (>= 16 bytes), e.g. from your secret store
#   head -c 32 /dev/urandom | base64 > /run/secrets/pdxfer
#   # on A (10.0.0.1):
#   MODEL=/models/llama HOST_A=10.0.0.1 HOST_B=10.0.0.2 bash examples/vllm_pd/two_hosts.sh a
#   # on B (10.0.0.2):
#   MODEL=/models/llama HOST_A=10.0.0.1 HOST_B=10.0.0.2 bash examples/vllm_pd/two_hosts.sh b
#
# Open between A and B: 8998 (bootstrap), 8100/8200 (HTTP, from the router), and the
# control and transfer ports (ephemeral, both ways); clients reach A:8000.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${HOST_A:?the address of host A}" "${HOST_B:?the address of host B}"
SECRET_FILE="${SECRET_FILE:-/run/secrets/pdxfer}"
export PDXFER_SECRET_FILE="$SECRET_FILE"   # the bootstrap server and the router read it
BOOT="$HOST_A:8998"

case "${1:-}" in
  a)
    pdxfer bootstrap --host "$HOST_A" --port 8998 & PIDS+=($!)
    "${VLLM[@]}" --model "$MODEL" --host "$HOST_A" --port 8100 $VLLM_ARGS \
      --kv-transfer-config "$(kv_config kv_producer "{\"bootstrap\": \"$BOOT\",
        \"instance\": \"prefill-0\", \"host\": \"$HOST_A\", \"secret_file\": \"$SECRET_FILE\"}")" &
    PIDS+=($!)
    wait_http "http://$HOST_A:8100/health" "$START_TIMEOUT"
    wait_http "http://$HOST_B:8200/health" "$START_TIMEOUT"   # the decode on B
    pdxfer router --engine vllm --host 0.0.0.0 --advertise "$HOST_A" --port 8000 \
      --prefill "http://$HOST_A:8100,$BOOT,prefill-0" \
      --decode "http://$HOST_B:8200,decode-0" & PIDS+=($!)
    wait_http "http://$HOST_A:8000/health" 120
    echo "READY http://$HOST_A:8000/v1"
    ;;
  b)
    "${VLLM[@]}" --model "$MODEL" --host "$HOST_B" --port 8200 $VLLM_ARGS \
      --kv-transfer-config "$(kv_config kv_consumer "{\"bootstrap\": \"$BOOT\",
        \"instance\": \"decode-0\", \"host\": \"$HOST_B\", \"secret_file\": \"$SECRET_FILE\",
        \"l2_pages\": 4096, \"l3\": \"file\", \"l3_dir\": \"/var/cache/pdxfer\"}")" &
    PIDS+=($!)
    wait_http "http://$HOST_B:8200/health" "$START_TIMEOUT"
    echo "READY decode on http://$HOST_B:8200"
    ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
wait
