#!/usr/bin/env bash
# Idempotent: a second environment, .venv-sglang, holding SGLang's Python code for the SGLang
# integration tests on a machine without a GPU. Run by scripts/test.sh after scripts/setup.sh
# (which installed the Debian libraries Mooncake needs); never by scripts/demo.sh.
#
# sglang==0.5.23's wheel pins a CUDA stack; its disaggregation modules, plugin loader and
# prefill/decode queues do not need it. So: torch==2.13.0 (CPU) first, sglang without its
# dependencies, then the light packages those modules import, then pdxfer (editable, so its
# `sglang.srt.plugins` entry point exists). triton, torchvision and IPython are replaced by
# stubs that live only in this environment (tests/sglang_env/): on a GPU machine install
# `pdxfer[sglang]` next to a real SGLang instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV=.venv-sglang
# shellcheck source=scripts/pip_log.sh
source "$ROOT/scripts/pip_log.sh"
PIPLOG="$ROOT/$VENV/pip-install.log"  # every pip run's full output (resolver warnings included)
SGLANG=sglang==0.5.23
LIGHT=(numpy orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm aiohttp
       "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
       "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser einops
       setproctitle uvicorn fastapi)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-sglang] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$ROOT/$VENV/bin/python"
stamp="$VENV/.pdxfer-sglang-installed"
hash=$(cat scripts/setup_sglang.sh pyproject.toml setup.py pdxfer/tiers/_ntcopy.c tests/sglang_env/pdxfer_sglang_stubs.py \
       | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
  exit 0
fi
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  echo "[setup-sglang] installing torch==2.13.0 (CPU build)"
  pip_logged "$PIPLOG" "$VPY" install torch==2.13.0
fi
echo "[setup-sglang] installing $SGLANG (no dependencies) and the packages its disaggregation code imports"
pip_logged "$PIPLOG" "$VPY" install --no-deps "$SGLANG"
pip_logged "$PIPLOG" "$VPY" install "${LIGHT[@]}" "torch==2.13.0"
echo "[setup-sglang] installing pdxfer (editable, with the sglang.srt.plugins entry point)"
pip_logged "$PIPLOG" "$VPY" install -e ".[cpu]" "torch==2.13.0"
# The stubs: a .pth line runs at interpreter start, before any `import sglang`.
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp tests/sglang_env/pdxfer_sglang_stubs.py "$site/"
echo "import pdxfer_sglang_stubs" > "$site/pdxfer_sglang_stubs.pth"
"$VPY" -c 'import sglang.srt.disaggregation.common.conn, sglang.srt.plugins' \
  || { echo "[setup-sglang] sglang does not import" >&2; exit 1; }
echo "$hash" > "$stamp"
