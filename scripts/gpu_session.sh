#!/usr/bin/env bash
# Everything this project runs on the one-H200 machine; logs and results under $OUT.
# The GPU packages (cuDNN frontend, nvtx, FlashAttention-4 and its CuTe DSL) travel as wheels, in
# two device calls made back to back (../shared/tools/gpu-wheels.sh fills the folders; since this checkout
# and its wheels outgrew one call's 64 MiB, scripts/gpu_wheels_xz.sh then repacks them):
#   device run, carry [".whl-a"]:         mkdir -p /tmp/wheels && cp .whl-a/* /tmp/wheels/
#   device run, carry [".whl-b", ".whl"]: source .whl-b/install.sh && bash scripts/gpu_session.sh tests
# Later calls on the same warm machine: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# Steps: tests check window scale bench kernels rings final session3 final3 pack packprof matrix_bf16 matrix_fp16
# session4 rings4 verify5 cudnn5 passes5 rings5 final5 verify6 gather6 gather6b verify6b layout7 layout7b layout7c layout7d
# layout8 layout8b layout8t layout8p layout8v verify9 rings9 rings9d prof9 final9 verify10 rings11 prof11 verify11 verify12 runs12 rings12 tests12 final12 prof12 verify13 ab13
# verify14 ab14 verify15 rows15 prio15 beside16 beside16b verify16 pieces17 verify17 verify17b config18 matrix18_2 matrix18_4 verify18
# session20 session20b session20c prof21 verify21 rings21 rings21b layout21 prof22 chain22 launch22 launch22b census23 rounds23 rest24 verify27
# verify28 shapes28
# (default: tests check window scale bench). Any ring cell as a step of its own, so that a call holds what its time
# allows: ring:CONFIG:CPS:MASKS:BACKENDS (scripts/bench_kernels.py's --rings, --masks and --ring-backends; the
# launch hidden, rounds equal), e.g. ring:gpt-oss:8:causal:fa4+null,fa4+comm; its seconds: RING_S (default 270).
# session3 and pack are one device call each, pack after session3 on the same warm machine (FA4's compile cache
# on disk then holds the gpt-oss bf16 sink kernels the prediction compiled). Each step's log lands in $OUT (at most 8 files
# come back, so the step logs are also packed into $OUT/results.tgz).
set -u
what=" ${*:-tests check window scale bench} "
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# FA4 compiles each kernel variant on first use; keep them on disk so every rank process reuses them
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
FINAL=${OUT:-/tmp/out}
OUT=/tmp/sinkprof-gpu
mkdir -p "$OUT" "$FINAL"
smi=
trap '[[ -n $smi ]] && kill $smi 2>/dev/null; tar czf "$FINAL/results.tgz" -C "$OUT" . ; cp "$OUT/session.log" "$FINAL/" 2>/dev/null' EXIT
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
  run check_fa4_cp4 240 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a,a2a+p2p --softmax all \
      --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 --kv-heads 4 --head-dim 64 \
      --format json --output "$OUT/check_fa4_cp4.json"
fi
if [[ $what == *" window "* ]]; then
  run check_fa4_cp4_window 150 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask causal --window 127,0 --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 2 --seq-len 2048 \
      --heads 8 --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_cp4_window.json"
fi
if [[ $what == *" scale "* ]]; then   # check at the lengths people train at (the README quotes the times)
  for s in 32768 131072; do
    run check_scale_$s 200 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax learnable --mask causal \
        --dtype bf16 --batch 1 --seq-len $s --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_scale_$s.json"
  done
fi
if [[ $what == *" bench "* ]]; then
  # plan-driven communication: the windowed layer's K/V rows shrink with --kv-schedule direct
  run bench_window 200 $SP bench --profile gpt-oss-120b --ranks 4 --seq-len 32768 --kv-schedule ring,direct --warmup 2 \
      --iters 5 --csv "$OUT/bench_window.csv"
  run report_window 60 $SP report "$OUT/bench_window.csv"
  run bench_te_cp2 120 $SP bench --profile te-sink --ranks 2 --warmup 2 --iters 5 --csv "$OUT/bench_te_cp2.csv"
  run report_te 60 $SP report "$OUT/bench_te_cp2.csv" --html "$OUT/te-sink-cp2.html" --plot "$OUT/te-plots"
  # cluster-scale prediction from this GPU's compute: gpt-oss-120b at 128k, full causal and window-128 layers
  run predict_gptoss 200 $SP bench --profile gpt-oss-120b --seq-len 131072 --simulate 8,16 --link h200-nvlink --warmup 2 \
      --iters 5 --csv "$OUT/gptoss120b-128k-pred.csv"
  run report_predict 60 $SP report "$OUT/gptoss120b-128k-pred.csv"
fi
if [[ $what == *" kernels "* ]]; then
  run kernel_bench 540 python3 scripts/bench_kernels.py --profile-step --out "$OUT/kernel_bench.json"
fi
if [[ $what == *" rings "* ]]; then
  run ring_bench 300 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:8" --out "$OUT/ring_bench.json"
fi
if [[ $what == *" final "* ]]; then   # what the fixes after the second session of 2026-12-03 unblocked
  run predict_gptoss 90 $SP bench --profile gpt-oss-120b --seq-len 131072 --simulate 8,16 --link h200-nvlink --warmup 2 \
      --iters 5 --csv "$OUT/gptoss120b-128k-pred.csv"
  run report_predict 15 $SP report "$OUT/gptoss120b-128k-pred.csv"
  run check_scale_131072 70 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax learnable --mask causal \
      --dtype bf16 --batch 1 --seq-len 131072 --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_scale_131072.json"
  run gpu_graph_tests 45 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "cuda_graph and causal"
  run check_thd_fa4 45 $SP check --device cuda --backend fa4 --ranks 2 --qkv-format thd --seqlens 512,1536,2048 \
      --comm p2p,a2a --softmax all --mask causal --dtype bf16,fp16 --heads 8 --kv-heads 2 --head-dim 64 --format json \
      --output "$OUT/check_thd_fa4.json"
fi
if [[ $what == *" final3 "* ]]; then   # <= 540 s: FA4's rows backward and varlen groups, the ring figures, the pack
  run gpu_tests_fa4 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack or (ring_schedule and fa4) or fa4_rows"
  run ring_bench 280 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:2,4,8" --ring-backends fa4 \
      --out "$OUT/ring_bench.json"
  run pack_bench 100 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --pack-len 65536 \
      --pack-docs 2048-16384 --ring-backends fa4 --out "$OUT/pack_bench.json"
fi
if [[ $what == *" session3 "* ]]; then   # <= 560 s of limits: the 128k prediction, then thd on fa4 (issue 15's check)
  # bench --simulate builds the 128k inputs (fp64 on the CPU, 1.2 G draws, ~40 s there) once (it built them for each
  # of its 4 (layer, cp) cases, which is what stopped the last attempt at 90 s). Then ~60 s of
  # FA4 compiles and ~2 s per iteration for the 4 cases (8 + 16 ranks of the full layer at ~120 ms / ~60 ms each):
  # ~150 s in all. The page of its 15.5k rows took 21 s of CPU here
  pred="$OUT/gptoss120b-128k-pred.csv"
  run predict_gptoss 220 $SP bench --profile gpt-oss-120b --seq-len 131072 --simulate 8,16 \
      --link h200-nvlink --warmup 2 --iters 5 --csv "$pred"
  [[ -f $pred ]] || pred="$pred.partial"    # stopped early: report the rows measured
  run report_predict 40 $SP report "$pred" --html "$OUT/gptoss120b-128k-pred.html"
  # thd at 2 and 4 ranks, one command per (ranks, dtype): check writes its JSON at the end, so a command stopped
  # by its limit keeps nothing. The 2-rank run compiles the dtype's FA4 kernels (cold: the last attempt spent its
  # 45 s compiling), the 4-rank run after it finds them in the disk cache: 6 and 9 cases of ~3-4 s each.
  # --kv-heads 4: a2a over 4 ranks splits the K/V heads too (the last attempt's g = 2 is refused there)
  for dtype in bf16 fp16; do
    for ranks in 2 4; do
      comms=p2p,a2a limit=90; [[ $ranks == 4 ]] && comms=p2p,a2a,a2a+p2p limit=60
      run check_thd_fa4_cp${ranks}_$dtype $limit $SP check --device cuda --backend fa4 --ranks $ranks --qkv-format thd \
          --seqlens 512,1536,2048 --comm $comms --softmax all --mask causal --dtype $dtype --heads 8 --kv-heads 4 \
          --head-dim 64 --format json --output "$OUT/check_thd_fa4_cp${ranks}_$dtype.json"
    done
  done
fi
if [[ $what == *" pack "* ]]; then   # issue 15's speed target: a 64k pack of 2k-16k documents at cp 8 against FA4 varlen
  run pack_bench 150 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --pack-len 65536 \
      --pack-docs 2048-16384 --ring-backends fa4 --out "$OUT/pack_bench.json"
fi
if [[ $what == *" packprof "* ]]; then   # where the pack ring's time goes: the kernels of one warm ring of rank cp-1
  run pack_profile 150 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --pack-len 65536 \
      --pack-docs 2048-16384 --ring-backends fa4 --profile-step --out "$OUT/pack_profile.json"
fi
for dtype in bf16 fp16; do   # issue 11's check at 4 ranks, one dtype per device call (72 cases, ~4 s each)
  if [[ $what == *" matrix_$dtype "* ]]; then
    run check_fa4_cp4_$dtype 540 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a,a2a+p2p --softmax all \
        --mask all --dtype $dtype --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 --kv-heads 4 \
        --head-dim 64 --format json --output "$OUT/check_fa4_cp4_$dtype.json"
  fi
done
if [[ $what == *" session4 "* ]]; then   # <= 330 s: the one-pass merge and the pack's one-pass adds on the GPU (FA4)
  run gpu_tests_merge 330 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "fused or (ring_schedule and fa4) or (cuda_graph and fa4) or pack or fa4_rows"
fi
if [[ $what == *" rings4 "* ]]; then   # <= 460 s: the pack (with its kernels), then issue 11's table
  run pack_bench 130 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --pack-len 65536 \
      --pack-docs 2048-16384 --ring-backends fa4 --profile-step --out "$OUT/pack_bench.json"
  run ring_bench 320 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:2,4,8" \
      --ring-backends fa4 --out "$OUT/ring_bench.json"
fi
if [[ $what == *" verify5 "* ]]; then   # <= 300 s: the GPU code changed after the fourth session's runs, and where
  # the h16 d128 causal cp 2 ring's time goes (the worst of issue 11's table)
  run gpu_tests_verify 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "fused or pack or fa4_rows"
  run ring_profile 100 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2" --masks causal \
      --ring-backends fa4,cudnn --profile-step --out "$OUT/ring_profile.json"
fi
if [[ $what == *" cudnn5 "* ]]; then   # <= 540 s: issue 11's table on cudnn, against FA4 monolithic in the same run
  run ring_bench_cudnn 540 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:2,4,8" \
      --ring-backends cudnn --out "$OUT/ring_bench_cudnn.json"
fi
if [[ $what == *" passes5 "* ]]; then   # <= 380 s: dK/dV added into the arriving sum, dq written once in q's dtype
  run gpu_tests_passes 280 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "(ring_schedule and fa4) or cuda_graph or fa4_rows or pack"
  run check_fa4_cp2_passes 100 $SP check --device cuda --backend fa4 --ranks 2 --comm p2p --softmax all --mask all \
      --kv-schedule ring,direct --dtype bf16 --sink-strategy all --batch 2 --seq-len 2048 --heads 8 --kv-heads 4 \
      --head-dim 64 --format json --output "$OUT/check_fa4_cp2_passes.json"
fi
if [[ $what == *" rings5 "* ]]; then   # <= 480 s: the ring's own code (P2PAttention over a loopback communicator)
  # beside the bare schedule, then the same loopback ring at 8d0fa19 (build/old: that commit's library, this script)
  run ring_bench_comm 300 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring_bench_comm.json"
  if [[ -d build/old ]]; then
    run ring_bench_comm_before 170 python3 build/old/scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
        --ring-backends fa4+comm --out "$OUT/ring_bench_comm_before.json"
  fi
fi
if [[ $what == *" final5 "* ]]; then   # <= 400 s: K beside V in the ring's buffers, a row range sent from the shard
  run check_fa4_cp2_b1 90 $SP check --device cuda --backend fa4 --ranks 2 --comm p2p --softmax all --mask all \
      --kv-schedule ring,direct --dtype bf16 --sink-strategy all --batch 1 --seq-len 4096 --heads 8 --kv-heads 4 \
      --head-dim 64 --format json --output "$OUT/check_fa4_cp2_b1.json"
  run gpu_tests_graphs 90 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "cuda_graph"
  run ring_bench_final 200 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring_bench_final.json"
fi
if [[ $what == *" verify6 "* ]]; then   # <= 560 s: what changed after the fifth session's runs (the ring schedule's
  # dK/dV wait, the lazy send buffer, fused K/V in place, a2a+p2p's stacked scatter), on fp16 and at 4 ranks
  run gpu_tests_verify6 260 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "pack or (ring_schedule and fa4) or cuda_graph or fa4_rows or fused"
  run check_fa4_cp4_fp16 200 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a,a2a+p2p --softmax all \
      --mask all --kv-schedule ring,direct --dtype fp16 --sink-strategy all --batch 1 --seq-len 4096 --heads 8 --kv-heads 4 \
      --head-dim 64 --format json --output "$OUT/check_fa4_cp4_fp16.json"
  run check_thd_fa4_cp4 90 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd --seqlens 512,1536,2048 \
      --comm p2p,a2a,a2a+p2p --softmax all --mask causal --window 127,0 --dtype bf16 --heads 8 --kv-heads 4 \
      --head-dim 64 --format json --output "$OUT/check_thd_fa4_cp4.json"
fi
if [[ $what == *" gather6 "* ]]; then   # <= 560 s: the allgather K/V schedule: issue 15's pack, then its tests and checks
  run pack_bench_gather 300 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --pack-len 65536 \
      --pack-docs 2048-16384 --ring-backends fa4,fa4+comm --kv-schedules ring,allgather --out "$OUT/pack_bench_gather.json"
  run gpu_tests_gather 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "allgather"
  run check_gather_cp4 100 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --kv-schedule allgather \
      --qkv-format thd,bshd --seqlens 512,1536,2048 --softmax all --mask causal --dtype bf16,fp16 --sink-strategy all \
      --heads 8 --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_gather_cp4.json"
fi
if [[ $what == *" gather6b "* ]]; then   # <= 560 s: gather6's check in two parts (80 cases outran 100 s), then
  # issue 11's shapes at cp 8 under allgather beside the ring
  run check_gather_thd_cp4 200 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --kv-schedule allgather \
      --qkv-format thd --seqlens 512,1536,2048 --softmax all --mask causal --dtype bf16,fp16 --sink-strategy all \
      --heads 8 --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_gather_thd_cp4.json"
  run check_gather_bshd_cp4 80 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --kv-schedule allgather \
      --softmax all --mask all --dtype bf16 --batch 1 --seq-len 4096 --heads 8 --kv-heads 4 --head-dim 64 \
      --format json --output "$OUT/check_gather_bshd_cp4.json"
  run ring_bench_gather 270 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8;gpt-oss:8" \
      --ring-backends fa4 --kv-schedules ring,allgather --out "$OUT/ring_bench_gather.json"
fi
if [[ $what == *" verify6b "* ]]; then   # <= 220 s: the packs on fa4 after the group kernels took a band per tile
  # and grouped by corner band, with the corrected allgather count
  run gpu_tests_packs 210 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack"
fi
if [[ $what == *" layout7 "* ]]; then   # <= 560 s: the balanced pack layout (issue 15)
  run pack_layout 240 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts zigzag,balanced --out "$OUT/pack_layout.json"
  run check_thd_balanced 120 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd \
      --seqlens 2048,512,1536,1022,6,3068 --pack-layout balanced --softmax all --mask all --dtype bf16,fp16 \
      --sink-strategy all --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_thd_balanced.json"
  run gpu_tests_layout 190 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "balanced or (cuda_graph and allgather)"
fi
if [[ $what == *" layout7b "* ]]; then   # <= 520 s: a group's backward over the keys it reads, dq written in place
  run pack_layout_b 200 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts zigzag,balanced --profile-step --out "$OUT/pack_layout_b.json"
  run gpu_tests_groups 320 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack or allgather or cuda_graph"
fi
if [[ $what == *" layout7c "* ]]; then   # <= 420 s: after review, the pack tests, the 4-rank check and the bench again
  run gpu_tests_packs_c 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack_under_allgather or balanced"
  run check_thd_balanced_c 130 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd \
      --seqlens 2048,512,1536,1022,6,3068 --pack-layout balanced --softmax all --mask all --dtype bf16 \
      --sink-strategy all --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_thd_balanced_c.json"
  run pack_layout_c 100 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4 --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_layout_c.json"
fi
if [[ $what == *" layout7d "* ]]; then   # <= 170 s: allgather moving only the rows a rank reads, on the GPU
  run check_thd_balanced_d 90 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd \
      --seqlens 2048,512,1536,1022,6,3068 --pack-layout balanced --softmax vanilla,learnable --mask all --dtype bf16 \
      --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_thd_balanced_d.json"
  run pack_layout_d 75 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4+comm --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_layout_d.json"
fi
if [[ $what == *" layout8 "* ]]; then   # <= 360 s: the balanced layout from two-ended fills (fewest keys read), bench and check
  run pack_layout8 200 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_layout8.json"
  run check_thd_balanced8 150 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd \
      --seqlens 2048,512,1536,1022,6,3068 --pack-layout balanced --softmax all --mask all --dtype bf16,fp16 \
      --sink-strategy all --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_thd_balanced8.json"
fi
if [[ $what == *" layout8b "* ]]; then   # <= 100 s: the bench again after LocalDKV writes a covered step's dK/dV
  run pack_layout8b 100 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_layout8b.json"
fi
if [[ $what == *" layout8t "* ]]; then   # <= 340 s: the GPU tests of packs, allgather (the balanced layout's) and graphs
  run gpu_tests_layout8 340 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack or allgather or cuda_graph"
fi
if [[ $what == *" layout8p "* ]]; then   # <= 220 s: the corrected varlen count, and where a rank's time goes
  run gpu_tests_gather8 90 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "pack_under_allgather"
  run pack_layout8p 130 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts balanced --profile-step --out "$OUT/pack_layout8p.json"
fi
if [[ $what == *" layout8v "* ]]; then   # <= 330 s: the balanced layout's GPU tests and check after the fills' rework
  run gpu_tests_layout8v 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "balanced or pack_under_allgather"
  run check_thd_balanced8v 120 $SP check --device cuda --backend fa4 --ranks 4 --qkv-format thd \
      --seqlens 2048,512,1536,1022,6,3068 --pack-layout balanced --softmax all --mask all --dtype bf16 \
      --sink-strategy all --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_thd_balanced8v.json"
fi
if [[ $what == *" verify9 "* ]]; then   # <= 560 s: direct steps' dK/dV kept and sent in K/V's dtype, written by FA4
  run gpu_tests_verify9 270 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "fa4_rows or (ring_schedule and fa4) or cuda_graph or pack"
  run check_direct9_bf16_mha 130 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask all --kv-schedule direct --dtype bf16 --sink-strategy all --batch 2 --seq-len 4096 --heads 8 --kv-heads 8 \
      --head-dim 128 --format json --output "$OUT/check_direct9_bf16_mha.json"
  run check_direct9_fp16_gqa 130 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax all \
      --mask all --kv-schedule direct --dtype fp16 --sink-strategy all --qkv-format sbhd --batch 1 --seq-len 4096 \
      --heads 8 --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_direct9_fp16_gqa.json"
fi
if [[ $what == *" rings9 "* ]]; then   # <= 560 s: issue 11's rings at this commit, then at 382095f (build/old)
  run ring_bench9 330 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring_bench9.json"
  if [[ -d build/old ]]; then
    run ring_bench9_before 200 python3 build/old/scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
        --ring-backends fa4+comm --out "$OUT/ring_bench9_before.json"
  fi
fi
if [[ $what == *" rings9d "* ]]; then   # <= 480 s: the same under direct, the K/V schedule cp_attention takes here
  run gpu_tests_dkv9 60 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "writes_a_tiles_dkv"
  run ring_bench9d 260 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
      --ring-backends fa4,fa4+comm --kv-schedules direct --out "$OUT/ring_bench9d.json"
  if [[ -d build/old ]]; then
    run ring_bench9d_before 160 python3 build/old/scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8;gpt-oss:8" \
        --ring-backends fa4+comm --kv-schedules direct --out "$OUT/ring_bench9d_before.json"
  fi
fi
if [[ $what == *" prof9 "* ]]; then   # <= 150 s: where rank 7's time goes in issue 11's worst cell, the ring's own code
  run ring_prof9 150 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" --masks causal \
      --ring-backends fa4+comm --kv-schedules direct --profile-step --out "$OUT/ring_prof9.json"
fi
if [[ $what == *" final9 "* ]]; then   # <= 330 s: a direct backward's kept partials summed in one pass at the end
  run gpu_tests_final9 110 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "sum_of_kept or writes_a_tiles_dkv or cuda_graph"
  run check_final9 70 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax all --mask all \
      --kv-schedule direct --dtype bf16 --sink-strategy step0 --batch 2 --seq-len 4096 --heads 8 --kv-heads 8 \
      --head-dim 128 --format json --output "$OUT/check_final9.json"
  run ring_bench_final9 150 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,8" \
      --ring-backends fa4+comm --kv-schedules direct --out "$OUT/ring_bench_final9.json"
fi
if [[ $what == *" verify10 "* ]]; then   # <= 590 s: what changed after the ninth session's last GPU run (not yet run):
  # the fused row pass into bf16 parts, FA4's group copy fallback, the emulator's whole-shard parts, fp32/fp64
  # keeping nothing; then issue 11's rings at cp 4 and gpt-oss shapes at the one-sum commit
  run gpu_tests_verify10 300 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "direct_backward_on_fa4 or sum_of_kept or writes_a_tiles_dkv or pack or cuda_graph or fa4_rows"
  run ring_bench10 280 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:4;gpt-oss:4,8" \
      --ring-backends fa4+comm --out "$OUT/ring_bench10.json"
fi
if [[ $what == *" verify11 "* ]]; then   # <= 120 s: the home dK/dV in K/V's dtype (f1d3a23), before rings11 and prof11
  run gpu_tests_verify11 120 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py \
      -k "sum_of_kept or direct_backward_on_fa4 or cuda_graph"
fi
if [[ $what == *" verify12 "* ]]; then   # <= 560 s: not yet run. Issue 15's pack with the loopback honestly fed
  # (its figures were taken with zero K/V), and the 4-rank direct check at the home-dK/dV-in-K/V-dtype code
  run pack_bench12 300 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_bench12.json"
  run check_direct12 260 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask all --kv-schedule direct --dtype bf16,fp16 --sink-strategy all --batch 2 --seq-len 4096 --heads 8 \
      --kv-heads 4 --head-dim 128 --format json --output "$OUT/check_direct12.json"
fi
if [[ $what == *" final12 "* ]]; then   # <= 480 s: one call for what little device time is left: the joined runs'
  # GPU tests, the 4-rank check with b = 1 (bf16, fewer cases), and issue 11's rings at cp 4 and 8
  run gpu_tests_final12 150 python3 -m pytest -q -x tests/test_gpu.py -k "joined_runs or (cuda_graph and fa4)"
  run check_final12 90 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax vanilla,learnable \
      --mask all --kv-schedule direct --dtype bf16 --sink-strategy step0 --batch 1 --seq-len 8192 --heads 8 \
      --kv-heads 4 --head-dim 128 --format json --output "$OUT/check_final12.json"
  run ring_bench_final12 230 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:4,8;gpt-oss:8" \
      --masks causal --ring-backends fa4+comm --out "$OUT/ring_bench_final12.json"
fi
if [[ $what == *" runs12 "* ]]; then   # <= 560 s: the forward's joined runs of steps on the GPU: its tests (fa4 and
  # cudnn tiles, b 1 and sbhd, cp 2-8), graph capture, the home dK/dV tests, and the 4-rank check with b = 1 (runs joined)
  run gpu_tests_runs12 300 python3 -m pytest -q tests/test_gpu.py \
      -k "joined_runs or cuda_graph or sum_of_kept or direct_backward_on_fa4"
  run check_runs12 250 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask all --kv-schedule direct --dtype bf16,fp16 --sink-strategy all --batch 1 --seq-len 8192 --heads 8 \
      --kv-heads 4 --head-dim 128 --format json --output "$OUT/check_runs12.json"
fi
if [[ $what == *" rings12 "* ]]; then   # <= 560 s: issue 11's rings at HEAD, with each rank's calls standalone and
  # joined into runs timed in the same run (what bigger calls would give)
  run ring_bench12 560 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:8" \
      --ring-backends fa4+comm --out "$OUT/ring_bench12.json"
fi
if [[ $what == *" tests12 "* ]]; then   # <= 560 s: the GPU tests of the home dK/dV in K/V's dtype and of graph capture
  run gpu_tests12 560 python3 -m pytest -q -x tests/test_gpu.py -k "sum_of_kept or direct_backward_on_fa4 or cuda_graph"
fi
if [[ $what == *" rings11 "* ]]; then   # <= 420 s: issue 11's rings with the loopback feeding normal values, not zeros
  run ring_bench11 420 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:8" \
      --ring-backends fa4+comm --out "$OUT/ring_bench11.json"
fi
if [[ $what == *" verify13 "* ]]; then   # <= 560 s: K and V moved apart under direct (no stacking copy): the
  # GPU tests of the direct ring and graph capture on fa4, a 4-rank check, issue 11's rings
  run gpu_tests13 150 python3 -m pytest -q -x tests/test_gpu.py -k "direct_backward_on_fa4 or (cuda_graph and fa4)"
  run check13 120 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax vanilla,learnable \
      --mask all --kv-schedule direct --dtype bf16 --sink-strategy step0 --batch 1 --seq-len 8192 --heads 8 \
      --kv-heads 4 --head-dim 128 --format json --output "$OUT/check13.json"
  run ring_bench13 230 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4,8;gpt-oss:8" \
      --ring-backends fa4+comm --out "$OUT/ring_bench13.json"
fi
if [[ $what == *" ab13 "* ]]; then   # <= 300 s: K and V moved apart under direct, against the stacked K/V of
  # 1519f61 (its sinkprof and scripts in build/old, carried), back to back in one call; then the 4-rank direct checks
  # (AB_RINGS, AB_OLD_S, AB_NEW_S, AB_TESTS_S: what and how long, for a smaller budget)
  for v in old new; do
    bench=scripts/bench_kernels.py; [[ $v == old ]] && bench=build/old/scripts/bench_kernels.py
    run ring_bench13_$v $([[ $v == old ]] && echo ${AB_OLD_S:-120} || echo ${AB_NEW_S:-100}) python3 $bench --skip-tiles \
        --rings "${AB_RINGS:-h16-d128:2,4}" --ring-backends fa4+comm --out "$OUT/ring_bench13_$v.json"
  done
  run gpu_tests13 ${AB_TESTS_S:-80} python3 -m pytest -q -x tests/test_gpu.py -k "direct_backward_on_fa4"
fi
if [[ $what == *" verify14 "* ]]; then   # <= 540 s: the backward's joined runs (and K and V apart) on the GPU:
  # the joined runs forward and backward on fa4 (emulated ring, cp 2-8), the 4-rank direct ring
  # on fa4 in every layout, a 4-rank check of both dtypes and masks
  run gpu_tests14 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "(joined_runs and fa4) or direct_backward_on_fa4 or (cuda_graph and fa4)"
  run check14 200 $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax vanilla,learnable \
      --mask all --kv-schedule direct --dtype bf16,fp16 --sink-strategy all --batch 1 --seq-len 8192 --heads 8 \
      --kv-heads 4 --head-dim 128 --format json --output "$OUT/check14.json"
fi
if [[ $what == *" ab14 "* ]]; then   # <= 330 s: the backward's joined runs against the step-by-step backward
  # of 7bdca7f (its sinkprof and scripts in build/old, carried), back to back in one call
  for v in old new; do
    bench=scripts/bench_kernels.py; [[ $v == old ]] && bench=build/old/scripts/bench_kernels.py
    run ring_bench14_$v ${AB_S:-160} python3 $bench --skip-tiles --rings "${AB_RINGS:-h16-d128:4,8}" \
        --ring-backends fa4+comm --out "$OUT/ring_bench14_$v.json"
  done
fi
if [[ $what == *" verify15 "* ]]; then   # <= 480 s: RankPlan.computes (8fcd160) on the real direct ring on fa4
  # and in graph capture; issue 11's rings against FA4 monolithic timed in each rank's own run, and
  # every timed rank's forward and backward graph profiled (the time no kernel runs)
  run gpu_tests15 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "direct_backward_on_fa4 or (cuda_graph and fa4)"
  run ring_prof15 ${PROF_S:-320} python3 scripts/bench_kernels.py --skip-tiles --rings "${RINGS:-h16-d128:2,4,8;gpt-oss:8}" \
      --ring-backends fa4+comm --profile-step --out "$OUT/ring_prof15.json"
fi
if [[ $what == *" rows15 "* ]]; then   # <= 400 s: joined runs of up to 64k K/V rows against the 16k cap, each run
  # against FA4 monolithic timed beside it (ROWS_RINGS: which)
  for rows in 16384 65536; do
    run ring_rows15_$rows ${ROWS_S:-200} python3 scripts/bench_kernels.py --skip-tiles --rings "${ROWS_RINGS:-h16-d128:8;gpt-oss:8}" \
        --ring-backends fa4+comm --run-rows $rows --out "$OUT/ring_rows15_$rows.json"
  done
fi
if [[ $what == *" prio15 "* ]]; then   # <= 540 s: the loopback's copies (NCCL's kernels stand-in) against the FA4
  # calls for SMs: normal priority, high priority, high priority with the full tiles non-persistent
  # (a covering window); each run against FA4 monolithic timed beside it (PRIO_RINGS, PRIO_MASKS, PRIO_S)
  for v in normal high window; do
    extra="--loopback-priority high"; [[ $v == normal ]] && extra=""; [[ $v == window ]] && extra="$extra --fa4-full-window"
    run ring_prio15_$v ${PRIO_S:-175} python3 scripts/bench_kernels.py --skip-tiles --rings "${PRIO_RINGS:-h16-d128:4,8}" \
        --masks "${PRIO_MASKS:-causal,no_mask}" --ring-backends fa4+comm $extra --out "$OUT/ring_prio15_$v.json"
  done
fi
if [[ $what == *" beside16 "* ]]; then   # <= 420 s: step 0 on a second stream beside the next step (ring.Beside):
  # the GPU tests that run it (emulated rings, graph capture), then the real ring over NCCL on fa4 (ranks
  # sharing the GPU) under each K/V schedule
  run gpu_tests16 ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "beside or direct_backward_on_fa4 or (cuda_graph and fa4) or rows_backward"
  run check_fa4_beside16 ${CHECK_S:-180} $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax all \
      --mask all --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 1 --seq-len 4096 --heads 8 \
      --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_fa4_beside16.json"
fi
if [[ $what == *" verify16 "* ]]; then   # <= 560 s: after the review mend (610091f), every GPU test on fa4 (packs,
  # allgather, both layouts and dtypes: step 0 runs beside wherever fa4 runs) and graph capture, and the
  # 4-rank fa4 check under every K/V schedule (that first: the tests may not all fit)
  run check_fa4_verify16 ${CHECK_S:-180} $SP check --device cuda --backend fa4 --ranks 4 --comm p2p --softmax all \
      --mask all --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 1 --seq-len 4096 --heads 8 \
      --kv-heads 2 --head-dim 64 --format json --output "$OUT/check_fa4_verify16.json"
  run gpu_tests16v ${TESTS_S:-360} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "fa4 or beside or cuda_graph"
fi
if [[ $what == *" beside16b "* ]]; then   # <= 300 s: the ring with step 0 beside against the one-stream ring, both
  # against FA4 monolithic timed in the same run (BESIDE_RINGS, BESIDE_MASKS, BESIDE_S)
  run ring_beside16 ${BESIDE_S:-280} python3 scripts/bench_kernels.py --skip-tiles --rings "${BESIDE_RINGS:-h16-d128:2,4,8}" \
      --masks "${BESIDE_MASKS:-causal}" --ring-backends fa4+comm --one-stream-too --out "$OUT/ring_beside16.json"
fi
if [[ $what == *" pieces17 "* ]]; then   # <= 560 s: a causal tile's backward cut by keys into pieces on streams of
  # their own (fa4_rows.causal_cuts): the tile alone whole and cut against the model, the GPU tests that
  # run the pieces, then the ring against its causal tiles whole, in one interleaved run (PIECES_RINGS)
  run pieces_probe17 ${PROBE_S:-200} python3 scripts/pieces_probe.py --n 4096,8192,16384 --shapes h16-d128,gpt-oss
  run gpu_tests17 ${TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "pieces"
  run ring_pieces17 ${RING_S:-170} python3 scripts/bench_kernels.py --skip-tiles --rings "${PIECES_RINGS:-h16-d128:2,4,8}" \
      --masks causal --ring-backends fa4+comm --whole-causal-too --out "$OUT/ring_pieces17.json"
fi
if [[ $what == *" verify17 "* ]]; then   # <= 580 s: sinkprof check on fa4 at 2 and 4 ranks over p2p, a2a and a2a+p2p
  # (step 0 beside the next step, and at 2 ranks with 16 heads of 8k rows its backward in pieces), then the
  # GPU tests on fa4 as far as the time goes
  run check_fa4_cp2_17 ${CHECK2_S:-150} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p,a2a,a2a+p2p \
      --softmax all --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 1 --seq-len 8192 --heads 16 \
      --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_cp2_17.json"
  run check_fa4_cp4_17 ${CHECK4_S:-200} $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a,a2a+p2p \
      --softmax all --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 2 --seq-len 2048 --heads 8 \
      --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_cp4_17.json"
  run check_fa4_window17 ${WINDOW_S:-120} $SP check --device cuda --backend fa4 --ranks 4 --comm p2p,a2a+p2p --softmax all \
      --mask causal --window 127,0 --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 2 \
      --seq-len 2048 --heads 8 --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_window17.json"
  run gpu_tests17v ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "fa4 and not pieces"
fi
if [[ $what == *" verify17b "* ]]; then   # <= 480 s: verify17's checks cut to fit (they ran out of time there): the
  # pieces' GPU tests, then at 2 ranks (16 heads of 8k rows: step 0 and a2a's one tile in pieces) p2p and
  # a2a, and at 4 ranks a2a and a2a+p2p (p2p ran under every K/V schedule in verify16)
  run gpu_tests17b ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "pieces"
  run check_fa4_cp2_17b ${CHECK2_S:-170} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p,a2a \
      --softmax all --mask causal --dtype bf16 --sink-strategy all --sink-grad full --batch 1 --seq-len 8192 --heads 16 \
      --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_cp2_17b.json"
  run check_fa4_cp4_17b ${CHECK4_S:-190} $SP check --device cuda --backend fa4 --ranks 4 --comm a2a,a2a+p2p \
      --softmax all --mask all --dtype bf16 --sink-strategy all --sink-grad full --batch 2 --seq-len 2048 --heads 8 \
      --kv-heads 4 --head-dim 64 --format json --output "$OUT/check_fa4_cp4_17b.json"
fi
if [[ $what == *" config18 "* ]]; then   # <= 500 s: a ring's full tiles under the causal rank's backward configuration
  # (FA4's for masked tiles, 64-row blocks at d128) against FA4's own for unmasked ones (80-row blocks), then the
  # GPU tests of the rows backward (tiles off the blocks) and the pieces, then the ring under both (CONFIG_RINGS)
  run config_probe18 ${PROBE_S:-100} python3 scripts/config_probe.py
  run gpu_tests18 ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "rows_backward_matches or pieces"
  run ring_config18 ${RING_S:-190} python3 scripts/bench_kernels.py --skip-tiles --rings "${CONFIG_RINGS:-h16-d128:2,4,8}" \
      --masks causal --ring-backends fa4+comm --masked-config-too --out "$OUT/ring_config18.json"
fi
for cp in 2 4; do   # <= 560 s each: issue 11's check matrix on fa4 at 2 or 4 ranks, one invocation (and JSON) per
  # --comm, so a step that runs out of time loses one of them: every softmax type, mask, dtype, strategy and contract
  if [[ $what == *" matrix18_$cp "* ]]; then
    for comm in p2p a2a a2a+p2p; do
      run check_fa4_cp${cp}_${comm/+/_}_18 ${CHECK_S:-180} $SP check --device cuda --backend fa4 --ranks $cp --comm $comm \
          --softmax all --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 1 --seq-len 2048 \
          --heads 8 --kv-heads 4 --head-dim 64 --run-timeout 170 --format json --output "$OUT/check_fa4_cp${cp}_${comm/+/_}_18.json"
    done
  fi
done
if [[ $what == *" verify18 "* ]]; then   # <= 540 s: what has not run on a GPU since the eighteenth session's runs
  # (8d1711e: choose_configuration's fallback, the left-bound rule, lse copies for the tiles' starts): the rows
  # backward's and the pieces' tests, then check at head dim 128 (where the configurations differ) on one sequence,
  # a thd pack (its documents' tiles end off the 80-row blocks: the masked configuration) and a window
  run gpu_tests18v ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "rows_backward_matches or pieces or (beside and fa4)"
  run check_fa4_d128_18v ${CHECK_S:-150} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p,a2a --softmax all \
      --mask all --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 1 --seq-len 8192 --heads 8 \
      --kv-heads 8 --head-dim 128 --run-timeout 140 --format json --output "$OUT/check_fa4_d128_18v.json"
  run check_fa4_thd_d128_18v ${THD_S:-100} $SP check --device cuda --backend fa4 --ranks 2 --qkv-format thd \
      --seqlens 1536,2560,4096 --softmax learnable --mask causal --dtype bf16 --heads 8 --kv-heads 8 --head-dim 128 \
      --run-timeout 90 --format json --output "$OUT/check_fa4_thd_d128_18v.json"
  run check_fa4_window_d128_18v ${WINDOW_S:-80} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p --softmax all \
      --mask causal --window 1000,0 --dtype bf16 --sink-strategy all --sink-grad full --batch 1 --seq-len 8192 \
      --heads 8 --kv-heads 8 --head-dim 128 --run-timeout 70 --format json --output "$OUT/check_fa4_window_d128_18v.json"
fi
if [[ $what == *" prof12 "* ]]; then   # <= 420 s: where the forward's time goes at cp 2 and 4 (the ring's own code
  # against its calls standalone: 0.91-0.92 against 0.97-0.98 in rings12), then issue 15's pack honestly fed
  run ring_prof12 200 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4" \
      --ring-backends fa4+comm --kv-schedules direct --profile-step --out "$OUT/ring_prof12.json"
  run pack_bench12 300 python3 scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 \
      --ring-backends fa4,fa4+comm --kv-schedules allgather --pack-layouts balanced --out "$OUT/pack_bench12.json"
fi
if [[ $what == *" prof11 "* ]]; then   # <= 150 s: every timed rank's kernels one by one, h16 cp 8 causal
  run ring_prof11 150 python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" --masks causal \
      --ring-backends fa4+comm --profile-step --out "$OUT/ring_prof11.json"
fi
if [[ $what == *" session20 "* ]]; then   # <= 560 s: the loopback's copies beside an FA4 call (DMA or SM copies),
  # the CLI's GPU path since ab019af (check on fa4 at 2 ranks), then issue 11's h16 table for the bare schedule (the
  # issue's own measure: no communication) and the ring's own code over the loopback, in one interleaved run a config
  run copy_probe20 ${PROBE_S:-90} python3 scripts/copy_probe.py
  run check_fa4_20 ${CHECK_S:-150} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p,a2a --softmax all \
      --mask all --kv-schedule all --dtype bf16,fp16 --sink-strategy all --sink-grad full --batch 1 --seq-len 4096 \
      --heads 8 --kv-heads 4 --head-dim 64 --run-timeout 140 --format json --output "$OUT/check_fa4_20.json"
  run ring20 ${RING_S:-300} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring20.json"
fi
if [[ $what == *" session20b "* ]]; then   # <= 560 s: the same at h16 cp 8 and gpt-oss cp 2
  run ring20b ${RING_S:-540} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8;gpt-oss:2" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring20b.json"
fi
if [[ $what == *" session20c "* ]]; then   # <= 560 s: the same at gpt-oss cp 4 and 8
  run ring20c ${RING_S:-540} python3 scripts/bench_kernels.py --skip-tiles --rings "gpt-oss:4,8" \
      --ring-backends fa4,fa4+comm --out "$OUT/ring20c.json"
fi
if [[ $what == *" verify21 "* ]]; then   # <= 420 s: what has not run on a GPU since the twentieth session's runs
  # (f5ed267..0c36c16: cp_attention's argument check, its gather over NCCL, differentiable_once, the offset's version
  # hook, the lazy import): the graph-capture tests and the NCCL gather, then check on fa4 at 2 and at 4 ranks
  run gpu_tests21 ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "graph or cp_attention or nccl"
  run check_fa4_21 ${CHECK_S:-130} $SP check --device cuda --backend fa4 --ranks 2 --comm p2p,a2a --softmax all \
      --mask all --dtype bf16,fp16 --sink-strategy all --sink-grad all --batch 1 --seq-len 4096 \
      --heads 8 --kv-heads 4 --head-dim 64 --run-timeout 120 --format json --output "$OUT/check_fa4_21.json"
  run check_fa4_cp4_21 ${CHECK4_S:-120} $SP check --device cuda --backend fa4 --ranks 4 --comm a2a+p2p --softmax all \
      --mask causal --window 127,0 --kv-schedule all --dtype bf16 --sink-strategy all --sink-grad full --batch 1 \
      --seq-len 4096 --heads 8 --kv-heads 4 --head-dim 64 --run-timeout 110 --format json --output "$OUT/check_fa4_cp4_21.json"
fi
if [[ $what == *" rings21 "* ]]; then   # <= 300 s: issue 11's h16 table with the ring's own code without communication
  # (fa4+null: P2PAttention, no message moved) between the bare schedule and the loopback, in one interleaved run a config
  run ring21 ${RING_S:-290} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:2,4" \
      --ring-backends fa4,fa4+null,fa4+comm --out "$OUT/ring21.json"
fi
if [[ $what == *" rings21b "* ]]; then   # <= 540 s: the same at h16 cp 8 and gpt-oss cp 2
  run ring21b ${RING_S:-530} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8;gpt-oss:2" \
      --ring-backends fa4,fa4+null,fa4+comm --out "$OUT/ring21b.json"
fi
if [[ $what == *" layout21 "* ]]; then   # <= 120 s: does FA4 read K/V faster head-major (the bare schedule's gathered
  # runs) than token-major (the ring's buffers)? the bare forward ran 6 points above the ring's code at h16 cp 8 causal
  run layout_probe21 ${PROBE_S:-110} python3 scripts/layout_probe.py --kv-rows 28672,8192
fi
if [[ $what == *" prof22 "* ]]; then   # <= 400 s: the bare schedule and the ring's own code without messages at h16 cp 8
  # causal, profiled in one run: where the ring's code loses its 6 points of the forward
  run ring_prof22 ${RING_S:-390} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" --masks causal \
      --ring-backends fa4,fa4+null --profile-step --out "$OUT/ring_prof22.json"
fi
if [[ $what == *" chain22 "* ]]; then   # <= 300 s: do the loopback's chained copies cost its forward its 1-4 points
  # (twenty-first session's profile: the copies after a post's first waited for the call issued after them)? the
  # ring's own code with no messages, over the loopback, and over the loopback with every copy issued at once
  run ring_chain22 ${RING_S:-290} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:4,8" --masks causal \
      --ring-backends fa4+null,fa4+comm,fa4+comm-concurrent --out "$OUT/ring_chain22.json"
fi
if [[ $what == *" launch22 "* ]]; then   # <= 220 s: the twenty-second session's profile ran the bare schedule's and
  # the ring's forward graphs in the same 3.03 ms, while the timed rounds put the ring's 4 points lower; the ring's graph
  # took 417 us to launch, the bare one's 69: each timed round starts on an idle GPU, so its figure holds the launch.
  # The same rings with the launch waited for (as before) and hidden behind a GPU sleep, h16 cp 8 causal
  run ring_launch22_waited ${RING_S:-110} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" \
      --masks causal --ring-backends fa4,fa4+null --launch waited --out "$OUT/ring_launch22_waited.json"
  run ring_launch22_hidden ${RING_S:-110} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" \
      --masks causal --ring-backends fa4,fa4+null --launch hidden --out "$OUT/ring_launch22_hidden.json"
fi
if [[ $what == *" launch22b "* ]]; then   # <= 220 s: the same with the launch hidden, over the loopback too and at cp 4
  run ring_launch22b ${RING_S:-210} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:4,8" \
      --masks causal --ring-backends fa4+null,fa4+comm --launch hidden --out "$OUT/ring_launch22b.json"
fi
if [[ $what == *" census23 "* ]]; then   # <= 200 s: what each graph's launch submits (graph_census, new after the
  # twenty-second session's last GPU run): its test, then the bare schedule's and the ring's graphs at h16 cp 8 causal,
  # nodes by type beside their kernels and launch times
  run census_test23 ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider tests/test_bench_pack.py -k census
  run ring_census23 ${RING_S:-130} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" --masks causal \
      --ring-backends fa4,fa4+null --profile-step --launch hidden --out "$OUT/ring_census23.json"
fi
SMI_QUERY=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active
if [[ $what == *" rounds23 "* ]]; then   # <= 2 x 200 s: with two calls a replay, the twenty-third session's rings ran
  # 8% faster with a 2 ms GPU sleep before each round (hiding the launch), FA4's monolithic call 2%. Is it the launch,
  # or the rest the sleep gives a short round? Every round as long (--rounds equal), the launch waited for and hidden,
  # h16 cp 8 causal; the SM clock, power and throttle reasons every 200 ms beside both runs (read only)
  nvidia-smi --query-gpu=$SMI_QUERY --format=csv -lms 200 > "$OUT/smi_rounds23.csv" 2>&1 &
  smi=$!
  run ring_rounds23_hidden ${RING_S:-170} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" \
      --masks causal --ring-backends fa4+null --launch hidden --rounds equal --out "$OUT/ring_rounds23_hidden.json"
  run ring_rounds23_waited ${RING_S:-120} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" \
      --masks causal --ring-backends fa4+null --launch waited --rounds equal --out "$OUT/ring_rounds23_waited.json"
  kill $smi; smi=
fi
if [[ $what == *" rest24 "* ]]; then   # <= 3 x 130 s: the rest and the launch apart, under fixed rounds (one call a
  # replay) at h16 cp 8 causal: the launch waited for, the GPU rested 2 ms before each round with the launch still
  # waited for, and the launch hidden by a 2 ms GPU sleep; clock and power beside them
  nvidia-smi --query-gpu=$SMI_QUERY --format=csv -lms 200 > "$OUT/smi_rest24.csv" 2>&1 &
  smi=$!
  for launch in waited rested hidden; do
    run ring_rest24_$launch ${RING_S:-130} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:8" \
        --masks causal --ring-backends fa4+null --launch $launch --rounds fixed --out "$OUT/ring_rest24_$launch.json"
  done
  kill $smi; smi=
fi
if [[ $what == *" verify27 "* ]]; then   # <= 560 s: what has not run on a GPU since the twenty-fifth session
  # (b0cc895..2135ee6: the torch tiles in place, the GPU backends' bias fallback through them; bench's case identity,
  # its CSV columns and faults; the launcher's store probe under torchrun): the GPU tests, then bench and report on fa4
  # with a bias, then check under torchrun over NCCL
  run gpu_tests27 ${TESTS_S:-330} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  run bench27 ${BENCH_S:-100} $SP bench --device cuda --backend fa4 --ranks 2 --seq-len 2048 --heads 8 --kv-heads 4 \
      --head-dim 64 --bias --warmup 2 --iters 5 --csv "$OUT/bench27.csv"
  run report27 ${REPORT_S:-40} $SP report "$OUT/bench27.csv"
  run torchrun27 ${TORCHRUN_S:-90} python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m sinkprof check --device cuda \
      --backend fa4 --softmax learnable --seq-len 2048 --heads 8 --kv-heads 4 --head-dim 64 --timeout 60
fi
if [[ $what == *" verify28 "* ]]; then   # <= 480 s: what has not run on a GPU since the twenty-seventh session
  # (2135ee6..): the fused Triton kernels with a -inf sink, the ring schedule through them, the balanced pack's
  # fp16 cells not reached then; bench (its columns through Case.columns) and report on fa4 with a bias
  run gpu_tests28 ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "fused or ring_schedule or (balanced_layout_on_fa4 and dtype1)"
  run bench28 ${BENCH_S:-100} $SP bench --device cuda --backend fa4 --ranks 2 --seq-len 2048 --heads 8 --kv-heads 4 \
      --head-dim 64 --bias --warmup 2 --iters 5 --csv "$OUT/bench28.csv"
  run report28 ${REPORT_S:-40} $SP report "$OUT/bench28.csv"
fi
if [[ $what == *" shapes28 "* ]]; then   # <= 200 s: FA4's sm90 backward (main kernel) on the call shapes a backward
  # that carries rows (q, dO) rather than K/V would run at h16 d128 causal (docs/design.md, section 7: every call
  # 8192 rows or more), beside the K/V-carrying ring's own shapes and the monolithic causal call at 64k
  run config_probe28 ${PROBE_S:-200} python3 scripts/config_probe.py \
      --tiles 4096x8192,4096x16384,4096x32768,8192x4096,8192x16384,16384x4096,32768x4096,57344x4096,12288x8192,16384x8192,28672x8192 \
      --causal 8192,65536
fi
set -f   # a cell is words, not a pattern
for cell in $what; do   # ring:CONFIG:CPS:MASKS:BACKENDS
  [[ $cell == ring:* ]] || continue
  IFS=: read -r _ cfg cps masks backends extra <<< "$cell"
  if [[ -z $cfg || -z $cps || -z $masks || -z $backends || -n $extra ]]; then
    echo "== $cell: not ring:CONFIG:CPS:MASKS:BACKENDS (e.g. ring:gpt-oss:8:causal:fa4+null,fa4+comm); skipped" \
        | tee -a "$OUT/session.log"
    continue
  fi
  name="ring_${cfg}_${cps//,/-}_${masks//,/-}_${backends//[,+]/-}"
  run "$name" ${RING_S:-270} python3 scripts/bench_kernels.py --skip-tiles --rings "$cfg:$cps" --masks "$masks" \
      --ring-backends "$backends" --launch hidden --out "$OUT/$name.json"
done
set +f
if [[ $what == *" prof21 "* ]]; then   # <= 300 s: where the loopback ring's forward loses 4-9 points against the bare
  # schedule at h16 d128 (twentieth session): the ring's own code with and without its messages profiled in one run
  run ring_prof21 ${RING_S:-240} python3 scripts/bench_kernels.py --skip-tiles --rings "h16-d128:4" --masks causal \
      --ring-backends fa4+null,fa4+comm --profile-step --out "$OUT/ring_prof21.json"
  run copy_probe21 ${PROBE_S:-60} python3 scripts/copy_probe.py
fi
