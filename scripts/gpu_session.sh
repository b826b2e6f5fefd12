#!/usr/bin/env bash
# Everything this project runs on the one-H200 machine; logs and results under $OUT.
# The GPU packages (cuDNN frontend, nvtx, FlashAttention-4 and its CuTe DSL) travel as wheels, in
# two device calls made back to back (see ../shared/tools/gpu-wheels.sh, which fills the folders):
#   device run, carry [".whl-a"]:         mkdir -p /tmp/wheels && cp .whl-a/* /tmp/wheels/
#   device run, carry [".whl-b", ".whl"]: source .whl-b/install.sh && bash scripts/gpu_session.sh tests
# Later calls on the same warm machine: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# Steps: tests check kernels bench (default: all). Each step's log lands in $OUT (at most 8 files
# come back, so the step logs are also packed into $OUT/results.tgz).
set -u
what=" ${*:-tests check kernels bench} "
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# FA4 compiles each kernel variant on first use; keep them on disk so every rank process reuses them
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
FINAL=${OUT:-/tmp/out}
OUT=/tmp/sinkprof-gpu
mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" . ; cp "$OUT/session.log" "$FINAL/" 2>/dev/null' EXIT
run() {  # name, seconds, command...: one step, its log, its exit code; a stuck step cannot eat the call
  local name=$1 secs=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/session.log"
  local t0=$(date +%s)
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/session.log"
  tail -n 15 "$OUT/$name.log"
}
SP="python3 -m sinkprof"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [[ $what == *" tests "* ]]; then
  run doctor 120 $SP doctor
  run gpu_tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
fi
if [[ $what == *" check "* ]]; then
  for backend in fa4 cudnn; do
    run check_${backend}_cp2 240 $SP check --device cuda --backend $backend --ranks 2 --comm p2p,a2a,a2a+p2p \
        --softmax all --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 --kv-heads 2 \
        --head-dim 64 --format json --output "$OUT/check_${backend}_cp2.json"
  done
  run check_fa4_cp4 300 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a,a2a+p2p --softmax all \
      --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 --kv-heads 4 --head-dim 64 \
      --format json --output "$OUT/check_fa4_cp4.json"
  run check_fa4_cp4_window 200 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask causal --window 127,0 --dtype bf16 --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 --kv-heads 4 \
      --head-dim 64 --format json --output "$OUT/check_fa4_cp4_window.json"
fi
if [[ $what == *" kernels "* ]]; then
  run kernel_bench 540 python3 scripts/bench_kernels.py --profile-step --out "$OUT/kernel_bench.json"
fi
if [[ $what == *" bench "* ]]; then
  run bench_te_cp2 150 $SP bench --profile te-sink --ranks 2 --warmup 2 --iters 5 --csv "$OUT/bench_te_cp2.csv" \
      --trace "$OUT/trace"
  run bench_te_sim 120 $SP bench --profile te-sink --simulate 2,4,8 --warmup 2 --iters 5 --csv "$OUT/bench_te_sim.csv"
fi
