"""Benchmark (not a test): cuDNN tile kernels with and without the sink, and one rank's whole
ring schedule, forward and backward TFLOP/s. Needs a CUDA GPU and nvidia-cudnn-frontend.

    python scripts/bench_kernels.py --out docs/kernel_bench.json

Per tile (one tile = the whole sequence) it times: cuDNN vanilla; cuDNN with the native sink
(``step0``); ``post-merge`` = vanilla + the sink folded into the output (forward) and vanilla +
the closed-form sink gradient (backward); torch SDPA (vanilla) where comparable. Per ring
schedule it runs every tile of one rank's plan (K/V of the other ranks taken from memory, no
communication) for cp = 2, 4, 8 and reports the slowest rank, plus the host time per ring step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sinkprof.kernels import get_kernel  # noqa: E402
from sinkprof.options import Band, CPOptions, SinkStrategy, make_spec  # noqa: E402
from sinkprof.plan import ring_plan, shard  # noqa: E402
from sinkprof.ring import LocalDKV, LocalKV, run_backward, run_forward  # noqa: E402
from sinkprof.sink import sink_grad  # noqa: E402


def cuda_time(fn, warmup=3, iters=10) -> float:
    """Median milliseconds of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def visible_pairs(band: Band, n_q: int, n_kv: int) -> int:
    return band.count(n_q, n_kv)


def tile_bench(kernel, b, h, s, d, causal: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v, do = (rnd(b, s, h, d).permute(0, 2, 1, 3) for _ in range(4))
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    band = Band(None, 0) if causal else Band()
    scale = d ** -0.5
    flops = 4 * b * h * d * visible_pairs(band, s, s)
    out = {}

    o_v, lse_v = kernel.forward(q, k, v, band, None, None, scale)
    o_s, lse_s = kernel.forward(q, k, v, band, sink, None, scale)
    out["cudnn vanilla fwd"] = cuda_time(lambda: kernel.forward(q, k, v, band, None, None, scale))
    out["cudnn sink (step0) fwd"] = cuda_time(lambda: kernel.forward(q, k, v, band, sink, None, scale))

    def post_merge_fwd():
        o, lse = kernel.forward(q, k, v, band, None, None, scale)
        w = torch.sigmoid(lse - sink.view(1, -1, 1))
        o.mul_(w.unsqueeze(-1).to(o.dtype))
        return o, torch.logaddexp(lse, sink.view(1, -1, 1))
    out["post-merge fwd"] = cuda_time(post_merge_fwd)
    out["cudnn vanilla bwd"] = cuda_time(lambda: kernel.backward(q, k, v, o_v, do, lse_v, band, None, None, scale))
    out["cudnn sink (step0) bwd"] = cuda_time(lambda: kernel.backward(q, k, v, o_s, do, lse_s, band, sink, None, scale))

    def post_merge_bwd():
        kernel.backward(q, k, v, o_s, do, lse_s, band, None, None, scale)
        return sink_grad(o_s, do, lse_s, sink)
    out["post-merge bwd"] = cuda_time(post_merge_bwd)
    out["torch sdpa vanilla fwd"] = cuda_time(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o_t = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    out["torch sdpa vanilla bwd"] = cuda_time(lambda: torch.autograd.grad(o_t, (qg, kg, vg), do, retain_graph=True))
    return {name: {"ms": ms, "tflops": (flops * (2.5 if name.endswith("bwd") else 1.0)) / ms / 1e9}
            for name, ms in out.items()}


def ring_bench(kernel, cp, b, h, g, s, d, causal: bool, strategy, softmax: str) -> dict:
    spec = make_spec(softmax, "causal" if causal else "no_mask", None, "bshd")
    gen = torch.Generator(device="cuda").manual_seed(1)
    def rnd(heads):
        return torch.randn(b, s, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v, do = rnd(h), rnd(g), rnd(g), rnd(h)
    sink = (torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5) if softmax == "learnable" else None
    opts = CPOptions(spec, d ** -0.5, kernel, strategy)
    chunk = s // (2 * cp)
    ks = [shard(k, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    vs = [shard(v, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    per_rank = []
    for rank in range(cp):
        plan = ring_plan(cp, rank, chunk, spec.band)
        ql = shard(q, cp, rank, 1)
        dol = shard(do, cp, rank, 1).permute(0, 2, 1, 3)
        o_acc = torch.empty(ql.shape, dtype=torch.float32, device="cuda")
        lse = torch.empty(b, h, 2 * chunk, dtype=torch.float32, device="cuda")
        out = torch.empty_like(ql)
        qh = ql.permute(0, 2, 1, 3)

        def fwd():
            run_forward(plan, qh, LocalKV(ks, vs), sink, None, opts, o_acc.permute(0, 2, 1, 3), lse,
                        out.permute(0, 2, 1, 3))
        dq = torch.zeros(ql.shape, dtype=torch.float32, device="cuda").permute(0, 2, 1, 3)
        dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
        dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]

        def bwd():
            run_backward(plan, qh, out.permute(0, 2, 1, 3), dol, lse, LocalKV(ks, vs), LocalDKV(dks, dvs),
                         sink, None, opts, dq)
        fwd()
        flops = sum(4 * b * h * d * visible_pairs(t.band, t.q_rows.stop - t.q_rows.start,
                                                    t.kv_rows.stop - t.kv_rows.start)
                    for st in plan.steps for t in st.tiles)
        fwd_ms, bwd_ms = cuda_time(fwd), cuda_time(bwd)
        # host time to issue one forward ring, per step (the GPU runs behind; no sync inside)
        torch.cuda.synchronize()
        builds = getattr(kernel, "builds", 0)
        t0 = time.perf_counter()
        fwd()
        host_us = (time.perf_counter() - t0) / len(plan.steps) * 1e6
        torch.cuda.synchronize()
        per_rank.append(dict(rank=rank, fwd_ms=fwd_ms, bwd_ms=bwd_ms, flops=flops, host_us_per_step=host_us,
                             graph_builds_when_warm=getattr(kernel, "builds", 0) - builds))
    slow_f = max(r["fwd_ms"] for r in per_rank)
    slow_b = max(r["bwd_ms"] for r in per_rank)
    flops = max(r["flops"] for r in per_rank)
    return dict(cp=cp, causal=causal, softmax=softmax, strategy=strategy.value, fwd_ms=slow_f, bwd_ms=slow_b,
                fwd_tflops=flops / slow_f / 1e9, bwd_tflops=2.5 * flops / slow_b / 1e9,
                host_us_per_step=max(r["host_us_per_step"] for r in per_rank),
                graph_builds_when_warm=sum(r["graph_builds_when_warm"] for r in per_rank), ranks=per_rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--g", type=int, default=32)
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--cp", default="2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel = get_kernel("cudnn", "cuda")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cudnn": __import__("cudnn").backend_version(), "shape": vars(args), "tiles": {}, "rings": []}
    for causal in (True, False):
        report["tiles"]["causal" if causal else "no_mask"] = tile_bench(kernel, args.b, args.h, args.s, args.d, causal)
    for cp in (int(c) for c in args.cp.split(",")):
        for causal in (True, False):
            runs = [("vanilla", SinkStrategy.STEP0), ("learnable", SinkStrategy.STEP0),
                    ("learnable", SinkStrategy.POST_MERGE)]
            for softmax, strategy in runs:
                report["rings"].append(ring_bench(kernel, cp, args.b, args.h, args.g, args.s, args.d, causal,
                                                  strategy, softmax))
    report["refused"] = {str(k[0]) + " " + str(k[-4]): v for k, v in kernel.refused().items()}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    for mask, rows in report["tiles"].items():
        print(f"\n## tile b={args.b} h={args.h} s={args.s} d={args.d} bf16, {mask}")
        for name, r in rows.items():
            print(f"{name:28s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s")
    print("\n## ring schedule of the slowest rank (no communication)")
    for r in report["rings"]:
        print(f"cp={r['cp']} {'causal ' if r['causal'] else 'no_mask'} {r['softmax']:9s} {r['strategy']:10s} "
              f"fwd {r['fwd_tflops']:6.1f} TFLOP/s  bwd {r['bwd_tflops']:6.1f} TFLOP/s  "
              f"host {r['host_us_per_step']:6.1f} us/step  builds when warm {r['graph_builds_when_warm']}")
    if report["refused"]:
        print("\nrefused by cuDNN:", report["refused"])


if __name__ == "__main__":
    main()
