#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite: lint, then pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh -k transfer -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PDXFER_EXTRAS="${PDXFER_EXTRAS:-cpu,test,bench,nixl,vllm}" bash scripts/setup.sh
.venv/bin/ruff check pdxfer tests scripts examples
exec .venv/bin/python -m pytest -q "$@"
