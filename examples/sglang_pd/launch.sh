#!/usr/bin/env bash
# SGLang prefill and decode with pdxfer as the disaggregation transfer backend, and SGLang's
# router in front (docs/sglang.md). Untested on a GPU so far: these are the launch lines the
# CPU tests stand for (they drive SGLang's real classes, not whole servers).
#
# Install, on each GPU node (Mooncake with CUDA; pdxfer's plugin entry point comes with it):
#   pip install "sglang==0.5.23" torch "pdxfer[cuda,sglang]"
# The same shared secret on both nodes turns on pdxfer's access control:
#   export PDXFER_SECRET_FILE=/run/secrets/pdxfer
# Decodes will look up only trusted bootstrap servers (being added: docs/sglang.md).
#
#   MODEL=/models/llama bash examples/sglang_pd/launch.sh prefill     # on the prefill node
#   MODEL=/models/llama bash examples/sglang_pd/launch.sh decode      # on the decode node
#   PREFILL=10.0.0.1 DECODE=10.0.0.2 bash examples/sglang_pd/launch.sh router
#
# Leave IB_DEVICE empty for TCP; set it (e.g. mlx5_0) for RDMA.
set -euo pipefail
IB_DEVICE="${IB_DEVICE:-}"
IB=(); [ -n "$IB_DEVICE" ] && IB=(--disaggregation-ib-device "$IB_DEVICE")
export SGLANG_PLUGINS="${SGLANG_PLUGINS:-pdxfer}"   # load pdxfer's plugin only

case "${1:-}" in
  prefill)  # its bootstrap server is SGLang's, on 8998; pdxfer's runs behind it
    exec python -m sglang.launch_server --model-path "${MODEL:?}" --tp "${TP:-1}" --port 30000 \
      --disaggregation-mode prefill --disaggregation-transfer-backend pdxfer \
      --disaggregation-bootstrap-port 8998 "${IB[@]}" ;;
  decode)
    exec python -m sglang.launch_server --model-path "${MODEL:?}" --tp "${TP:-1}" --port 30001 \
      --disaggregation-mode decode --disaggregation-transfer-backend pdxfer "${IB[@]}" ;;
  router)   # SGLang's router pairs them as with any backend
    exec python -m sglang_router.launch_router --pd-disaggregation \
      --prefill "http://${PREFILL:?}:30000" 8998 --decode "http://${DECODE:?}:30001" --port 8000 ;;
  *) echo "usage: $0 prefill|decode|router" >&2; exit 2 ;;
esac
