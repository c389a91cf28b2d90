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
# pytest in two phases: the tests that start no engine side by side (their time is mostly
# waiting: deadlines, restarts, network shaping), then those that start vLLM or SGLang
# (marked `engine`), one module at a time, as each needs the machine's cores and memory.
# A phase that selects nothing (exit 5) is not a failure; both phases always run.
JOBS="${PYTEST_JOBS:-4}"
rc=0
.venv/bin/python -m pytest -q -m "not engine" -n "$JOBS" --dist loadfile "$@" || rc=$?
[ "$rc" = 5 ] && rc=0
rc2=0
.venv/bin/python -m pytest -q -m engine "$@" || rc2=$?
[ "$rc2" = 5 ] && rc2=0
[ "$rc" = 0 ] && rc=$rc2
exit "$rc"
