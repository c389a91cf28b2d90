#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite: lint, types, the docs site build
# (strict: a broken link or a page missing from nav fails), then pytest.
# (scripts/demo.sh does not install SGLang's environment; only the tests need it.)
# Extra arguments go to pytest, e.g. scripts/test.sh -k transfer -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PDXFER_EXTRAS="${PDXFER_EXTRAS:-cpu,router,test,bench,nixl,vllm}" bash scripts/setup.sh
bash scripts/setup_sglang.sh   # SGLang's code in .venv-sglang, for the SGLang backend's tests
.venv/bin/ruff check pdxfer tests scripts examples benchmarks
.venv/bin/ruff format --check pdxfer tests scripts examples benchmarks
.venv/bin/mypy   # pdxfer/, configured in pyproject.toml ([tool.mypy]); cache in .mypy_cache
.venv/bin/mkdocs build --strict --quiet   # into site/ (ignored)
exec .venv/bin/python -m pytest -q "$@"
