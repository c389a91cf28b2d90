#!/usr/bin/env bash
# Set everything up (idempotent) and run the demo: move one request's KV between two processes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/pdxfer demo "$@"
