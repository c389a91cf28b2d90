#!/usr/bin/env bash
# Set everything up (idempotent) and run the demo: a batch through router, prefill and decode,
# every output checked against the colocated reference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/pdxfer demo "$@"
