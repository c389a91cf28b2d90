#!/usr/bin/env bash
# Build the carry set for scripts/gpu_check.sh: everything a bare CUDA 13 machine with
# python3.12 + PyTorch (and no network) lacks to run pdxfer, as trimmed cp312 wheels in .whl/.
#
#   bash scripts/gpu_wheels.sh [--transport both|mooncake|nixl]
#
# - the CUDA 13 builds of the transports (mooncake-transfer-engine-cuda13, nixl-cu13), the
#   versions whose CPU builds the suite runs here, trimmed by scripts/trim_wheel.py to what
#   pdxfer loads (`mooncake.engine`; `nixl_cu13` with its UCX plugin and UCX's modules);
# - pdxfer's dependencies missing from such a machine (pyzmq, msgspec, blake3; it has numpy,
#   torch, aiohttp, prometheus_client, xxhash, pytest, pytest-timeout and hypothesis);
# - syslibs.tar.gz: manylinux builds of the system libraries Mooncake's engine links
#   (libibverbs, libmlx5, libnuma, libcurl), taken from NIXL's wheel, which bundles them;
#   gpu_check.sh puts them on LD_LIBRARY_PATH only where the machine lacks them.
# It prints the total, and fails if the project plus .whl/ exceed the 64 MiB that travel
# (then build one transport per run with --transport).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TRANSPORT=both
while [ $# -gt 0 ]; do
  case "$1" in
    --transport) TRANSPORT="$2"; shift 2 ;;
    *) echo "usage: $0 [--transport both|mooncake|nixl]" >&2; exit 2 ;;
  esac
done
case "$TRANSPORT" in both|mooncake|nixl) ;; *) echo "bad --transport $TRANSPORT" >&2; exit 2 ;; esac

MOONCAKE=mooncake-transfer-engine-cuda13==0.3.13.post1
NIXL=nixl-cu13==1.5.1
DEPS=(pyzmq==27.3.0 msgspec==0.22.0 blake3==1.0.11)   # the versions the suite runs here
PY=$(command -v python3)
[ -x .venv/bin/python ] && PY=.venv/bin/python
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)

RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
rm -rf .whl && mkdir -p .whl
want=("${DEPS[@]}")
[ "$TRANSPORT" != mooncake ] && want+=("$NIXL")
[ "$TRANSPORT" != nixl ] && want+=("$MOONCAKE" "$NIXL")   # NIXL's wheel: the system libraries
"$PY" -m pip download -q "${PLAT[@]}" -d "$RAW" "${want[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

for w in "$RAW"/*.whl; do
  case "$(basename "$w")" in
    mooncake_transfer_engine_cuda13-*)
      "$PY" scripts/trim_wheel.py "$w" .whl --root 'mooncake/engine\.so' ;;
    nixl_cu13-*)
      if [ "$TRANSPORT" != mooncake ]; then
        "$PY" scripts/trim_wheel.py "$w" .whl --root 'nixl_cu13/_(bindings|utils)\..*\.so' \
          --root '\.nixl_cu13\.mesonpy\.libs/plugins/libplugin_UCX\.so' \
          --root 'nixl_cu13\.libs/ucx/lib.*\.so\.0\.0\.0' --drop perftest --drop '^nixl_ep_'
      fi
      if [ "$TRANSPORT" != nixl ]; then
        # the bundled (manylinux) copies, named as Mooncake's engine asks for them
        S="$RAW/syslibs" && mkdir -p "$S"
        (cd "$RAW" && unzip -q -o "$w" 'nixl_cu13.libs/libcurl-*' 'nixl_cu13.libs/libibverbs-*' \
          'nixl_cu13.libs/libmlx5-*' 'nixl_cu13.libs/libnuma-*' 'nixl_cu13.libs/libnl-*' \
          'nixl_cu13.libs/libzstd-*')
        for f in "$RAW"/nixl_cu13.libs/*; do
          b=$(basename "$f")
          case "$b" in
            libcurl-*) cp "$f" "$S/libcurl.so.4" ;;
            libibverbs-*) cp "$f" "$S/libibverbs.so.1" ;;
            libmlx5-*) cp "$f" "$S/libmlx5.so.1" ;;
            libnuma-*) cp "$f" "$S/libnuma.so.1" ;;
          esac
          cp "$f" "$S/$b"   # their own NEEDED names (found through their RPATH $ORIGIN)
        done
        tar -C "$S" -czf .whl/syslibs.tar.gz .
      fi ;;
    *) cp "$w" .whl/ ;;
  esac
done

whl=$(du -cb .whl/* | tail -1 | cut -f1)
proj=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
ls -l .whl
echo "transport: $TRANSPORT; .whl/ $((whl / 1048576)) MiB + project $((proj / 1048576)) MiB" \
     "= $(((whl + proj) / 1048576)) MiB of the 64 MiB that travel"
if [ $((whl + proj)) -ge $((64 * 1048576)) ]; then
  echo "too big: build one transport per run (--transport mooncake, then --transport nixl)" >&2
  exit 1
fi
