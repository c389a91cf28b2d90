#!/usr/bin/env bash
# pdxfer on a GPU, in one command: KV moved between two processes on one CUDA device over
# Mooncake TCP and NIXL, checked byte for byte, plus GB/s beside torch's own copies.
#
#   bash scripts/gpu_check.sh OUTDIR [--cpu] [--transport both|tcp|nixl] [--scale N]
#                                    [--budget SECONDS]
#
# On a CUDA machine with python3 + PyTorch (CUDA 13) it installs the wheels that
# scripts/gpu_wheels.sh put in .whl/ (no network needed) into a work folder and puts them on
# PYTHONPATH; where pdxfer's dependencies and the transports are already installed, an
# empty .whl/ is fine. --cpu runs the same steps on host memory with the packages already
# installed (the suite runs it: tests/integration/test_gpu_check.py).
#
# Steps, each timed and bounded by `timeout` (limits sum to 9 minutes; --scale N multiplies
# them), and all of them by --budget (default 500 s, times --scale): a step gets at most what
# is left of it, none starts with under 10 s left, so the whole run ends inside 9 minutes
# (a device lent for one 10-minute command keeps a minute to spare):
#   wheels           install .whl/, import everything the check loads
#   probe            scripts/gpu_probe.py: the raw paths with no pdxfer endpoint, 512 MiB
#                    (--cpu: 32 MiB) as 32 KiB / 512 KiB / 32 MiB descriptors: NIXL at 1-8
#                    UCX threads (UCX_PROTO_INFO=y: which UCX transport), Mooncake tcp and
#                    nvlink_intra, torch IPC gather / copy / scatter; checked word for word
#   pytest_gpu       pytest tests/gpu (device pools digest like host ones)
#   transfers.tcp    scripts/gpu_check.py transfers: pages into device pages, host landing
#   transfers.nixl   from a device prefill, TP 2 -> 1, integrity sampled/full + a corrupted
#                    page caught, L2 restore into device pages
#   bulk             GB/s of pdxfer over each transport (nvlink: Mooncake nvlink_intra, on a
#                    GPU whose wheel has it), direct and packed (<transport>_pack: gathered,
#                    one large write, scattered; checked byte for byte) in the probe's
#                    shape, torch device-to-device and pinned host-to-device; pdxfer's best
#                    against the best raw path (bulk.pdxfer_ratio_vs_best_raw) and the
#                    device copy
#   stream           scripts/gpu_stream.py: toy prefill and decode workers computing on the
#                    device (--torch-device: two processes on one GPU) behind the router,
#                    the prefill streaming KV layer by layer, against a colocated toy on the
#                    same device: TTFT at 2k and 8k tokens (--cpu: 128 and 512),
#                    stream.ttft_ms_pd_8k, stream.ttft_ratio_vs_colocated_8k, ...; every
#                    output equal to colocated's
# Writes OUTDIR/gpu_check.json (flat dotted keys: every verdict and figure, each step's
# <step>.step_s and <step>.limit_s, `all_passed`), again after every step (a run cut short
# leaves what it measured, `complete` false), and OUTDIR/log, nothing else there (a device
# tool may bring back only a few files); the
# installed wheels and the steps' parts live in a work folder ($GPU_CHECK_WORK, else under
# /tmp). Exits 0 only if every step passed. A run the docs quote is committed as
# benchmarks/results/gpu_check.json, with its row in benchmarks/results/README.md.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${1:?usage: $0 OUTDIR [--cpu] [--transport both|tcp|nixl] [--scale N] [--budget S]}"
shift
CPU=0 TRANSPORT=both SCALE=1 BUDGET=500
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1; shift ;;
    --transport) TRANSPORT="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$TRANSPORT" in both) TRANSPORTS="tcp nixl" ;; tcp|nixl) TRANSPORTS="$TRANSPORT" ;;
  *) echo "bad --transport $TRANSPORT" >&2; exit 2 ;; esac
case "$TRANSPORT" in
  both) PATHS=nixl,mooncake,ipc; BULK=tcp,nixl,nvlink,tcp_pack,nixl_pack,nvlink_pack
    STREAM_T=nixl,tcp ;;
  tcp) PATHS=mooncake,ipc; BULK=tcp,nvlink,tcp_pack,nvlink_pack; STREAM_T=tcp ;;
  nixl) PATHS=nixl,ipc; BULK=nixl,nixl_pack; STREAM_T=nixl ;; esac
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/pdxfer-gpu-check.XXXXXX")}"
mkdir -p "$WORK/parts"
rm -f "$WORK"/parts/*.json "$WORK/info.json" "$OUTDIR/gpu_check.json"
: > "$WORK/steps.tsv"
exec > >(tee "$OUTDIR/log") 2>&1
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR

if [ "$CPU" = 1 ]; then
  DEVICE=cpu
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  BULK_ARGS=(--quick)
  STREAM_ARGS=(--sizes 128,512 --rounds 1)
else
  DEVICE=cuda:0
  PY=python3
  BULK_ARGS=()
  STREAM_ARGS=(--sizes 2048,8192 --rounds 3)
fi
START=$(date +%s)
END=$(( START + BUDGET * SCALE ))
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_S COMMAND...: run it bounded (by its limit and what is left of the
# budget), record (name, rc, seconds, limit), write the JSON so far; a shell function runs in
# this shell (its exports must stay) and bounds its own commands with $LIMIT
step() {
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local left=$(( END - $(date +%s) ))
  if [ "$left" -lt 10 ]; then
    echo "=== $name: SKIPPED, ${left}s of the budget left"
    printf '%s\t%s\t%s\t%s\n' "$name" 125 0 0 >> "$WORK/steps.tsv"
    fold 0
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  local t0; t0=$(date +%s%N)
  if declare -F "$1" >/dev/null; then
    LIMIT=$limit "$@"
  else
    timeout -k 10 "$limit" "$@"
  fi
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local secs="$((ms / 1000)).$(printf %03d $((ms % 1000)))"
  [ "$rc" = 124 ] && echo "=== $name: TIMED OUT after ${limit}s"
  echo "=== $name: rc=$rc in ${secs}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$limit" >> "$WORK/steps.tsv"
  fold 0
}

# fold FINAL: every part and step record into one flat JSON (plain python: works when
# nothing imports); FINAL=1 at the end (then `complete`, and the exit status), 0 after a step
fold() {
  "$PY" - "$WORK" "$OUTDIR" "$1" "$START" "$((BUDGET * SCALE))" <<'EOF'
import json, pathlib, sys, time
d, final = pathlib.Path(sys.argv[1]), sys.argv[3] == "1"
out = json.loads((d / "info.json").read_text()) if (d / "info.json").exists() else {}
ok, names = True, []
for line in filter(None, (d / "steps.tsv").read_text().split("\n")):
    name, rc, secs, limit = line.split("\t")
    names.append(name)
    part = d / "parts" / f"{name}.json"
    try:
        body = json.loads(part.read_text()) if part.exists() else {}
    except ValueError:
        body = {}
    out.update({f"{name}.{k}": v for k, v in body.items()})
    passed = rc == "0" and body.get("ok", True) is True
    out.update({f"{name}.rc": int(rc), f"{name}.step_s": float(secs),
                f"{name}.limit_s": int(limit), f"{name}.passed": passed})
    ok = ok and passed
out.update(complete=final, budget_s=int(sys.argv[5]),
           total_s=round(time.time() - int(sys.argv[4]), 1))
out["all_passed"] = ok and final and len(names) > 1
(pathlib.Path(sys.argv[2]) / "gpu_check.json").write_text(json.dumps(out, indent=1, sort_keys=True))
if final:
    for k in sorted(out):
        if (k.endswith((".passed", ".step_s", "ratio_vs_best_raw", "fraction_of_d2d", ".path"))
                or ".gb_per_s" in k or k.startswith("stream.ttft")
                or k in ("gpu", "all_passed", "total_s")):
            print(f"{k} = {out[k]}")
sys.exit(0 if out["all_passed"] else 1)
EOF
}

wheels() {
  if [ "$CPU" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    local site="$WORK/site"
    rm -rf "$site" && mkdir -p "$site"
    timeout "$LIMIT" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      .whl/*.whl || return 1
    export PYTHONPATH="$ROOT:$site${PYTHONPATH#"$ROOT"}"
    # libcudart.so.13 as PyTorch's CUDA wheels install it (nvidia/cu13/lib)
    local cudart
    cudart=$("$PY" -c 'import glob, os, site, sys
for p in site.getsitepackages() + sys.path:
    for f in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libcudart.so.*")) + glob.glob(os.path.join(p, "nvidia", "cuda_runtime", "lib", "libcudart.so.*")):
        print(os.path.dirname(f)); raise SystemExit' 2>/dev/null)
    [ -n "$cudart" ] && export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if [ -f "$site/mooncake/engine.so" ] && [ -f .whl/syslibs.tar.gz ] && { ! command -v ldd >/dev/null \
        || ldd "$site/mooncake/engine.so" | grep -E 'lib(curl|ibverbs|mlx5|numa)[^ ]* => not found'; }; then
      echo "the system lacks the libraries above: using the manylinux copies from .whl/syslibs.tar.gz"
      mkdir -p "$site/_syslibs" && tar -C "$site/_syslibs" -xzf .whl/syslibs.tar.gz
      export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$site/_syslibs"
    fi
    [ -f "$site/mooncake/engine.so" ] && command -v ldd >/dev/null \
      && ldd "$site/mooncake/engine.so" | grep 'not found'
  fi
  echo "PYTHONPATH=$PYTHONPATH"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  timeout "$LIMIT" "$PY" - "$DEVICE" "$WORK/info.json" "$TRANSPORT" <<'EOF'
import json, platform, subprocess, sys, time
import torch
dev, path, transport = sys.argv[1:4]
info = {"mode": "cpu" if dev == "cpu" else "gpu", "device": dev, "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda or "",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
except OSError:
    pass
if dev != "cpu":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1))
import blake3, msgspec, xxhash, zmq  # noqa: E401,F401 - pdxfer's dependencies
import pdxfer  # noqa: F401
from pdxfer.transport.mooncake import _load_engine
from pdxfer.transport.nixl import _load
if transport in ("both", "tcp"):
    info["mooncake"] = _load_engine().__module__
if transport in ("both", "nixl"):
    info["nixl"] = _load().__name__
print(json.dumps(info, indent=1))
json.dump(info, open(path, "w"))
EOF
}

# the stream step: no round starts in its last 30 s (teardown, and a round that overruns)
stream() {
  timeout -k 10 "$LIMIT" "$PY" scripts/gpu_stream.py --device "$DEVICE" --transport "$STREAM_T" \
    --budget-s $(( LIMIT > 60 ? LIMIT - 30 : LIMIT / 2 )) --json "$WORK/parts/stream.json" \
    "${STREAM_ARGS[@]}"
}

step wheels 40 wheels
# (stop here if nothing imports: every later step would only time out)
if [ "$(tail -1 "$WORK/steps.tsv" | cut -f2)" = 0 ]; then
  step probe 100 env UCX_PROTO_INFO=y "$PY" scripts/gpu_probe.py --device "$DEVICE" \
    --paths "$PATHS" --json "$WORK/parts/probe.json" "${BULK_ARGS[@]}"
  step pytest_gpu 40 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
  for t in $TRANSPORTS; do
    step "transfers.$t" 60 "$PY" scripts/gpu_check.py transfers --device "$DEVICE" \
      --transport "$t" --json "$WORK/parts/transfers.$t.json"
  done
  step bulk 90 "$PY" scripts/gpu_check.py bulk --device "$DEVICE" --transport "$BULK" \
    --raw "$WORK/parts/probe.json" --json "$WORK/parts/bulk.json" "${BULK_ARGS[@]}"
  step stream 150 stream
fi
fold 1
rc=$?
echo "=== gpu_check: $([ $rc = 0 ] && echo ALL PASSED || echo FAILED); $OUTDIR/gpu_check.json"
[ -z "${GPU_CHECK_WORK:-}" ] && rm -rf "$WORK"
exit $rc
