# Sourced by scripts/setup.sh and scripts/setup_sglang.sh: run pip with its whole output in a
# log file, so set-up prints only its own one-line steps. pip's resolver warnings (e.g.
# SGLang's dependencies that .venv-sglang keeps out on purpose) go to the log; on a failure
# the last lines and the log's path are printed.
# usage: pip_logged LOGFILE PYTHON pip-arguments...
pip_logged() {
  local log="$1" py="$2"
  shift 2
  mkdir -p "$(dirname "$log")"
  echo "### $(date -u +%FT%TZ) pip $*" >> "$log"
  if ! "$py" -m pip "$@" >> "$log" 2>&1; then
    echo "[setup] pip $* failed; the last lines of its log ($log):" >&2
    tail -n 25 "$log" >&2
    echo "[setup] full pip log: $log" >&2
    return 1
  fi
}
