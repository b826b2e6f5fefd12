#!/usr/bin/env bash
# Everything this project runs on the one-H200 machine, in one call; logs and results under $OUT.
# Usage (device tool, carrying .whl): bash scripts/gpu_session.sh [tests] [check] [kernels] [bench] (default: all)
# Everything lands in one archive, $OUT/results.tgz (the device tool returns at most 8 files).
set -u
what=" ${*:-tests check kernels bench} "
SITE=/tmp/sinkprof-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
FINAL=${OUT:-/tmp/out}
OUT=/tmp/sinkprof-gpu
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
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
  run gpu_tests 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py
fi
if [[ $what == *" check "* ]]; then
  run check_cp2 300 $SP check --device cuda --backend cudnn --nproc 2 --comm p2p,a2a --softmax all --mask all \
      --dtype bf16,fp16 --sink-strategy all --sink-grad all --b 2 --s 2048 --h 8 --g 2 --d 64 \
      --format json --output "$OUT/check_cuda_cp2.json"
  run check_cp4 300 $SP check --device cuda --backend cudnn --nproc 4 --comm p2p,a2a --softmax all --mask all \
      --dtype bf16 --sink-strategy all --sink-grad all --b 2 --s 2048 --h 8 --g 4 --d 64 \
      --format json --output "$OUT/check_cuda_cp4.json"
fi
if [[ $what == *" kernels "* ]]; then
  run kernel_bench 400 python3 scripts/bench_kernels.py --out "$OUT/kernel_bench.json"
  run launch_cost 60 python3 scripts/launch_cost.py
fi
if [[ $what == *" bench "* ]]; then
  run bench_te_cp2 150 $SP bench --profile te-sink --nproc 2 --warmup 2 --iters 5 --csv "$OUT/bench_te_cp2.csv" \
      --trace "$OUT/trace"
  run bench_te_sim 120 $SP bench --profile te-sink --simulate 2,4,8 --warmup 2 --iters 5 --csv "$OUT/bench_te_sim.csv"
fi
