#!/usr/bin/env bash
# A short development call on the H200 (after the wheel calls of scripts/gpu_session.sh): the
# tests named by $1 (a pytest -k expression) and the ring benchmark arguments in $2.
set -u
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
timeout "${3:-300}" python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "$1" 2>&1 2>&1 | tail -60 | tee "$OUTDIR/dev_tests.log"
[ -n "${2:-}" ] && timeout "${4:-200}" python3 scripts/bench_kernels.py --skip-tiles $2 --out "$OUTDIR/dev_ring.json" 2>&1 | tail -60 | tee "$OUTDIR/dev_ring.log"
exit 0
