#!/usr/bin/env bash
# A short development call on the H200 (after the wheel calls of scripts/gpu_session.sh): the GPU
# tests selected by $1 (a pytest -k expression, limit $3 s) and scripts/bench_kernels.py with the
# arguments $2 (limit $4 s); full logs under $OUT.
set -u
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
timeout "${3:-300}" python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "$1" > "$OUTDIR/dev_tests.log" 2>&1
tail -40 "$OUTDIR/dev_tests.log"
if [ -n "${2:-}" ]; then
  timeout "${4:-200}" python3 scripts/bench_kernels.py --skip-tiles $2 --out "$OUTDIR/dev_ring.json" > "$OUTDIR/dev_ring.log" 2>&1
  tail -70 "$OUTDIR/dev_ring.log"
fi
exit 0
