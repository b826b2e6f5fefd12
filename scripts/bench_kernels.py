"""Benchmark (not a test): cuDNN tile kernels with and without the sink, and one rank's whole
ring schedule, forward and backward TFLOP/s. Needs a CUDA GPU and nvidia-cudnn-frontend.

    python scripts/bench_kernels.py --out docs/kernel_bench.json

Per tile (one tile = the whole sequence) it times: cuDNN vanilla; cuDNN with the native sink
(``step0``); ``post-merge`` = vanilla + the sink folded into the output (forward) and vanilla +
the closed-form sink gradient (backward); torch SDPA (vanilla) where comparable. Per ring
schedule it runs every tile of one rank's plan (K/V of the other ranks taken from memory, no
communication) for cp = 1, 2, 4, 8 and reports the slowest rank, plus the host time per ring
step, issued eagerly and as a CUDA graph replay.

GPU times come from CUDA graph replays of each variant, alternated round after round: launch
cost stays out of the kernel figures, and clock drift hits every variant alike (plain repeated
runs of one kernel differed by up to 10% on the H200 of this workplace). Merges, folds and deltas
use the fused kernels when they are on (the report says; ``SINKPROF_FUSED=0`` turns them off).
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
from sinkprof.ring import BackwardState, ForwardState, LocalDKV, LocalKV, run_backward, run_forward  # noqa: E402
from sinkprof import fused  # noqa: E402
from sinkprof.sink import fold_, sink_grad  # noqa: E402


def capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn``, warmed on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def interleaved_ms(fns: dict, calls: int = 4, rounds: int = 25) -> dict:
    """GPU milliseconds per call of each function: each one captured (so host launch cost and
    gaps are out of the figure), then replayed in alternating order, round after round, so clock
    and thermal drift hit every variant alike. Median and spread (max - min) over the rounds."""
    graphs = {name: capture(fn, calls) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        for name in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
            start.record()
            graphs[name].replay()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) / calls)
    del graphs
    return {name: {"ms": statistics.median(t), "spread_ms": max(t) - min(t)} for name, t in times.items()}


def eager_ms(fn, rounds: int = 15) -> dict:
    """GPU milliseconds per call, issued eagerly (for what cannot be captured)."""
    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return {"ms": statistics.median(times), "spread_ms": max(times) - min(times)}


def host_us(fn, calls: int = 20) -> float:
    """Host microseconds to issue one call of ``fn`` (the GPU runs behind; no sync inside)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


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

    o_v, lse_v = kernel.forward(q, k, v, band, None, None, scale)
    o_s, lse_s = kernel.forward(q, k, v, band, sink, None, scale)

    def post_merge_fwd():  # one tile standing alone: the fold is a pass of its own over o
        o, lse = kernel.forward(q, k, v, band, None, None, scale)
        fold_(o, o, lse, sink)
        return o, lse

    def post_merge_bwd():
        kernel.backward(q, k, v, o_s, do, lse_s, band, None, None, scale)
        return sink_grad(o_s, do, lse_s, sink)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o_t = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    fwd = interleaved_ms({
        "cudnn vanilla fwd": lambda: kernel.forward(q, k, v, band, None, None, scale),
        "cudnn sink (step0) fwd": lambda: kernel.forward(q, k, v, band, sink, None, scale),
        "post-merge fwd": post_merge_fwd,
        "torch sdpa vanilla fwd": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
    })
    bwd = interleaved_ms({
        "cudnn vanilla bwd": lambda: kernel.backward(q, k, v, o_v, do, lse_v, band, None, None, scale),
        "cudnn sink (step0) bwd": lambda: kernel.backward(q, k, v, o_s, do, lse_s, band, sink, None, scale),
        "post-merge bwd": post_merge_bwd,
    })
    # autograd runs a backward on the stream of its forward, outside any capture: timed eagerly
    bwd["torch sdpa vanilla bwd (eager)"] = eager_ms(lambda: torch.autograd.grad(o_t, (qg, kg, vg), do,
                                                                              retain_graph=True))
    out = {}
    for name, r in {**fwd, **bwd}.items():
        out[name] = dict(r, tflops=flops * (2.5 if " bwd" in name else 1.0) / r["ms"] / 1e9)
    return out


RUNS = [("vanilla", SinkStrategy.STEP0), ("learnable", SinkStrategy.STEP0), ("learnable", SinkStrategy.POST_MERGE)]


def ring_bench(kernel, cp, b, h, g, s, d, causal: bool) -> list:
    """Every variant of ``RUNS`` on the slowest rank's schedule: GPU time from interleaved graph
    replays, host time per step issued eagerly and as one graph replay."""
    mask = "causal" if causal else "no_mask"
    gen = torch.Generator(device="cuda").manual_seed(1)
    def rnd(heads):
        return torch.randn(b, s, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v, do = rnd(h), rnd(g), rnd(g), rnd(h)
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    chunk = s // (2 * cp)
    ks = [shard(k, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    vs = [shard(v, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    results = {}
    for rank in range(cp):
        plan = ring_plan(cp, rank, chunk, make_spec("vanilla", mask, None, "bshd").band)
        qh = shard(q, cp, rank, 1).permute(0, 2, 1, 3)
        dol = shard(do, cp, rank, 1).permute(0, 2, 1, 3)
        flops = sum(4 * b * h * d * visible_pairs(t.band, t.q_rows.stop - t.q_rows.start,
                                                    t.kv_rows.stop - t.kv_rows.start)
                    for st in plan.steps for t in st.tiles)
        fns, host = {}, {}
        for softmax, strategy in RUNS:
            opts = CPOptions(make_spec(softmax, mask, None, "bshd"), d ** -0.5, kernel, strategy)
            a = sink if softmax == "learnable" else None
            o_acc = torch.empty(qh.shape, dtype=torch.float32, device="cuda")
            lse = torch.empty(b, h, 2 * chunk, dtype=torch.float32, device="cuda")
            out = torch.empty_like(qh)
            dq = torch.zeros(qh.shape, dtype=torch.float32, device="cuda")
            dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
            dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]

            def fwd(plan=plan, opts=opts, a=a, o_acc=o_acc, lse=lse, out=out):
                run_forward(plan, LocalKV(ks, vs), state=ForwardState(qh, o_acc, lse, out), sink=a, bias=None,
                            opts=opts)

            def bwd(plan=plan, opts=opts, a=a, lse=lse, out=out, dq=dq, dks=dks, dvs=dvs):
                run_backward(plan, LocalKV(ks, vs), LocalDKV(dks, dvs), state=BackwardState(qh, out, dol, lse, dq),
                             sink=a, bias=None, opts=opts)
            name = f"{softmax} {strategy.value}"
            fwd()
            bwd()                                    # warm: every graph of this schedule built
            builds = getattr(kernel, "builds", 0)
            steps = len(plan.steps)
            host[name] = dict(fwd=host_us(fwd) / steps, bwd=host_us(bwd) / steps)
            host[name]["builds"] = getattr(kernel, "builds", 0) - builds
            graph = capture(lambda: (fwd(), bwd()), 1)
            host[name]["graphed"] = host_us(graph.replay) / (2 * steps)
            del graph
            fns[name + " fwd"], fns[name + " bwd"] = fwd, bwd
        timed = interleaved_ms(fns, calls=2, rounds=25)
        for softmax, strategy in RUNS:
            name = f"{softmax} {strategy.value}"
            row = dict(cp=cp, causal=causal, softmax=softmax, strategy=strategy.value, rank=rank, flops=flops,
                       fwd_ms=timed[name + " fwd"]["ms"], bwd_ms=timed[name + " bwd"]["ms"],
                       host_us_per_step_eager_fwd=host[name]["fwd"], host_us_per_step_eager_bwd=host[name]["bwd"],
                       host_us_per_step_graphed=host[name]["graphed"], graph_builds_when_warm=host[name]["builds"])
            slowest = results.get(name)
            if slowest is None or row["fwd_ms"] + row["bwd_ms"] > slowest["fwd_ms"] + slowest["bwd_ms"]:
                results[name] = row
    rows = list(results.values())
    for r in rows:
        r["fwd_tflops"] = r["flops"] / r["fwd_ms"] / 1e9
        r["bwd_tflops"] = 2.5 * r["flops"] / r["bwd_ms"] / 1e9
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--g", type=int, default=32)
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--cp", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernel = get_kernel("cudnn", "cuda")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cudnn": __import__("cudnn").backend_version(), "shape": vars(args),
              "fused sink kernels": fused.disabled_reason() or "on", "tiles": {}, "rings": []}
    for causal in (True, False):
        report["tiles"]["causal" if causal else "no_mask"] = tile_bench(kernel, args.b, args.h, args.s, args.d, causal)
    for cp in (int(c) for c in args.cp.split(",")):
        for causal in (True, False):
            report["rings"] += ring_bench(kernel, cp, args.b, args.h, args.g, args.s, args.d, causal)
    report["refused"] = {str(k[0]) + " " + str(k[-4]): v for k, v in kernel.refused().items()}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print("fused sink kernels:", report["fused sink kernels"])
    for mask, rows in report["tiles"].items():
        print(f"\n## tile b={args.b} h={args.h} s={args.s} d={args.d} bf16, {mask} (graphed, interleaved)")
        for name, r in rows.items():
            print(f"{name:28s} {r['ms']:8.3f} ms (spread {r['spread_ms']:.3f}) {r['tflops']:7.1f} TFLOP/s")
    print("\n## ring schedule of the slowest rank (no communication; GPU time from graph replays)")
    for r in report["rings"]:
        print(f"cp={r['cp']} {'causal ' if r['causal'] else 'no_mask'} {r['softmax']:9s} {r['strategy']:10s} "
              f"fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f} TFLOP/s | host us/step eager "
              f"fwd {r['host_us_per_step_eager_fwd']:6.1f} bwd {r['host_us_per_step_eager_bwd']:6.1f} "
              f"graphed {r['host_us_per_step_graphed']:5.1f} | builds when warm {r['graph_builds_when_warm']}")
    if report["refused"]:
        print("\nrefused by cuDNN:", report["refused"])


if __name__ == "__main__":
    main()
