"""Benchmark (not a test): the tile kernels of every GPU backend (cuDNN, FA4) with and without the
sink, FA4 called directly, and one rank's whole ring schedule on each backend against the FA4
monolithic kernel on the whole sequence. Needs a CUDA GPU (and the backends' packages).

    python scripts/bench_kernels.py --out kernel_bench.json
    python scripts/bench_kernels.py --rings h16-d128:2,4,8 --masks causal --profile-step

Tiles (one tile = the whole sequence): per backend, vanilla, the native sink (``step0``) and
``post-merge`` (vanilla + the sink folded into the output / vanilla + the closed-form sink
gradient); FA4 called directly through ``flash_attn.cute.interface`` on contiguous bshd tensors
(the figure the fa4 tiles must match); a gpt-oss window-(127, 0) tile.

Rings: per configuration (heads, K/V heads, head dim; s per rank fixed, so s = cp x s_rank), for
cp in the list and each mask, every backend runs the schedule of ranks 0, cp/2 and cp-1 (K/V of
the other ranks from memory, no communication) for vanilla, learnable ``step0`` and learnable
``post-merge``; the slowest is reported, and its rate against FA4's monolithic rate on the whole
sequence (vanilla against vanilla, learnable against FA4 with the sink) is the ring efficiency.

GPU times come from CUDA graph replays of each variant, alternated round after round: launch
cost stays out of the kernel figures, and clock drift hits every variant alike (plain repeated
runs of one kernel differed by up to 10% on the H200 of this workplace).
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

from sinkprof import fused  # noqa: E402
from sinkprof.kernels import get_kernel, unavailable_reason  # noqa: E402
from sinkprof.options import Band, CPOptions, KVSchedule, SinkStrategy, make_spec  # noqa: E402
from sinkprof.plan import shard  # noqa: E402
from sinkprof.ring import BackwardState, ForwardState, LocalDKV, LocalKV, run_backward, run_forward  # noqa: E402
from sinkprof.schedule import CommSchedule  # noqa: E402
from sinkprof.sink import fold_, sink_grad  # noqa: E402

BWD_FLOPS = 2.5     # a backward counted as 2.5 forwards


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


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def backends() -> list:
    return [name for name in ("cudnn", "fa4") if unavailable_reason(name, "cuda") is None]


def fa4_direct(q, k, v, band: Band, sink, scale):
    """FA4 through its own interface on bshd tensors: (forward, backward) closures."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    from sinkprof.kernels.fa4 import fa4_window
    causal, left, right = fa4_window(band, q.shape[1], k.shape[1])
    kw = dict(softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
              learnable_sink=None if sink is None else sink.reshape(-1))
    o, lse = _flash_attn_fwd(q, k, v, return_lse=True, **kw)[:2]
    do = torch.randn_like(o)
    return (lambda: _flash_attn_fwd(q, k, v, return_lse=True, **kw),
            lambda: _flash_attn_bwd(q, k, v, o, do, lse, **kw))


def tile_bench(b, h, g, s, d, band: Band, label: str) -> dict:
    """Every backend's tile on one whole-sequence tile, and FA4 called directly, interleaved."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (_rand(gen, b, s, h, d) for _ in range(2))
    k, v = (_rand(gen, b, s, g, d) for _ in range(2))
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    qh, kh, vh, doh = (x.permute(0, 2, 1, 3) for x in (q, k, v, do))
    scale = d ** -0.5
    flops = 4 * b * h * d * band.count(s, s)
    fwd, bwd = {}, {}
    for name in backends():
        kernel = get_kernel(name, "cuda")
        o_v, lse_v = kernel.forward(qh, kh, vh, band, None, None, scale)
        o_s, lse_s = kernel.forward(qh, kh, vh, band, sink, None, scale)

        def post_merge_fwd(kernel=kernel):  # one tile standing alone: the fold is a pass of its own
            o, lse = kernel.forward(qh, kh, vh, band, None, None, scale)
            fold_(o, o, lse, sink)

        def post_merge_bwd(kernel=kernel, o_s=o_s, lse_s=lse_s):
            kernel.backward(qh, kh, vh, o_s, doh, lse_s, band, None, None, scale)
            sink_grad(o_s, doh, lse_s, sink)
        fwd |= {f"{name} vanilla fwd": lambda k_=kernel: k_.forward(qh, kh, vh, band, None, None, scale),
                f"{name} sink (step0) fwd": lambda k_=kernel: k_.forward(qh, kh, vh, band, sink, None, scale),
                f"{name} post-merge fwd": post_merge_fwd}
        bwd |= {f"{name} vanilla bwd": lambda k_=kernel, o=o_v, l=lse_v: k_.backward(qh, kh, vh, o, doh, l, band,
                                                                                   None, None, scale),
                f"{name} sink (step0) bwd": lambda k_=kernel, o=o_s, l=lse_s: k_.backward(qh, kh, vh, o, doh, l, band,
                                                                                        sink, None, scale),
                f"{name} post-merge bwd": post_merge_bwd}
    if "fa4" in backends():
        for tag, a in (("vanilla", None), ("sink", sink)):
            f, bw = fa4_direct(q, k, v, band, a, scale)
            fwd[f"FA4 direct {tag} fwd"], bwd[f"FA4 direct {tag} bwd"] = f, bw
    timed = interleaved_ms(fwd) | interleaved_ms(bwd)
    return {"label": label, "shape": dict(b=b, h=h, g=g, s=s, d=d), "band": str(band),
            "kernels": {n: dict(r, tflops=flops * (BWD_FLOPS if n.endswith("bwd") else 1) / r["ms"] / 1e9)
                        for n, r in timed.items()}}


RUNS = [("vanilla", SinkStrategy.STEP0), ("learnable", SinkStrategy.STEP0), ("learnable", SinkStrategy.POST_MERGE)]


def _ring_fns(kernel, schedule, rank, qh, dol, ks, vs, sink, softmax, strategy, mask, d, rows_path=True):
    """(forward, backward) closures running one rank's whole schedule into preallocated buffers
    (the ring K/V schedule: every step reads its owner's whole shard in place, no gather);
    ``rows_path``: FA4's backward keeps dq across tiles (False: tile by tile)."""
    plan = schedule.plans[rank]
    b, h = qh.shape[:2]
    opts = CPOptions(make_spec(softmax, mask, None, "bshd"), d ** -0.5, kernel, strategy)
    a = sink if softmax == "learnable" else None
    # accumulators laid out as the ring lays them out (the user's bshd storage, seen as bhsd)
    o_acc = torch.empty_like(qh, dtype=torch.float32) if plan.accumulates else None
    lse = torch.empty(b, h, qh.shape[2], dtype=torch.float32, device="cuda")
    out = torch.empty_like(qh)
    dq = torch.empty_like(qh, dtype=torch.float32)
    dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    fwd_state = ForwardState(qh, o_acc, lse, out)
    bwd_state = BackwardState(qh, out, dol, lse, dq)

    def fwd():
        run_forward(plan, LocalKV(ks, vs, schedule, rank, "fwd"), state=fwd_state, sink=a, bias=None, opts=opts)

    def bwd():
        if kernel.name == "fa4":
            kernel.rows_path = rows_path
        run_backward(plan, LocalKV(ks, vs, schedule, rank, "bwd"), LocalDKV(dks, dvs), state=bwd_state, sink=a,
                     bias=None, opts=opts)
    return fwd, bwd


def ring_bench(cp, b, h, g, s_rank, d, mask: str, profile: bool, names: list) -> dict:
    """The slowest of ranks 0, cp/2, cp-1 per backend and variant, against FA4 monolithic;
    ``names``: backends, and ``fa4-per-tile`` (FA4 with its backward tile by tile)."""
    s = s_rank * cp
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, do = _rand(gen, b, s, h, d), _rand(gen, b, s, h, d)
    k, v = _rand(gen, b, s, g, d), _rand(gen, b, s, g, d)
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    band = make_spec("vanilla", mask, None, "bshd").band
    total = 4 * b * h * d * band.count(s, s)
    mono = {}
    if "fa4" in backends():
        for tag, a in (("vanilla", None), ("learnable", sink)):
            mono[f"fa4 {tag} fwd"], mono[f"fa4 {tag} bwd"] = fa4_direct(q, k, v, band, a, d ** -0.5)
    mono_ms = interleaved_ms(mono, calls=2, rounds=15)
    chunk = s // (2 * cp)
    ks = [shard(k, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    vs = [shard(v, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    rows = []
    for name in names:
        kernel = get_kernel(name.removesuffix("-per-tile"), "cuda")
        slowest = {}
        schedule = CommSchedule(KVSchedule.RING, cp, chunk, band)
        for rank in sorted({0, cp // 2, cp - 1}):
            plan = schedule.plans[rank]
            qh = shard(q, cp, rank, 1).permute(0, 2, 1, 3)
            dol = shard(do, cp, rank, 1).permute(0, 2, 1, 3)
            flops = sum(4 * b * h * d * t.band.count(t.q_rows.stop - t.q_rows.start, t.kv_rows.stop - t.kv_rows.start)
                        for st in plan.steps for t in st.tiles)
            fns, host = {}, {}
            for softmax, strategy in RUNS:
                variant = f"{softmax} {strategy.value}"
                fwd, bwd = _ring_fns(kernel, schedule, rank, qh, dol, ks, vs, sink, softmax, strategy, mask, d,
                                     rows_path=not name.endswith("-per-tile"))
                fwd(), bwd()
                host[variant] = (host_us(fwd) + host_us(bwd)) / (2 * len(plan.steps))
                fns[variant + " fwd"], fns[variant + " bwd"] = fwd, bwd
                if profile and rank == cp - 1 and (softmax, strategy) == RUNS[1]:
                    _profile_step(f"{name} cp={cp} {mask} rank {rank} {variant}", fwd, bwd)
            timed = interleaved_ms(fns, calls=2, rounds=15)
            for softmax, strategy in RUNS:
                variant = f"{softmax} {strategy.value}"
                row = dict(backend=name, cp=cp, mask=mask, variant=variant, rank=rank, flops=flops,
                           fwd_ms=timed[variant + " fwd"]["ms"], bwd_ms=timed[variant + " bwd"]["ms"],
                           host_us_per_step_eager=host[variant])
                best = slowest.get(variant)
                if best is None or row["fwd_ms"] + row["bwd_ms"] > best["fwd_ms"] + best["bwd_ms"]:
                    slowest[variant] = row
        for row in slowest.values():
            row["fwd_tflops"] = row["flops"] / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = BWD_FLOPS * row["flops"] / row["bwd_ms"] / 1e9
            tag = row["variant"].split()[0]
            if mono_ms:
                mono_fwd = total / mono_ms[f"fa4 {tag} fwd"]["ms"] / 1e9
                mono_bwd = BWD_FLOPS * total / mono_ms[f"fa4 {tag} bwd"]["ms"] / 1e9
                row |= dict(fa4_mono_fwd_tflops=mono_fwd, fa4_mono_bwd_tflops=mono_bwd,
                            fwd_vs_fa4_mono=row["fwd_tflops"] / mono_fwd, bwd_vs_fa4_mono=row["bwd_tflops"] / mono_bwd)
            rows.append(row)
    return {"cp": cp, "shape": dict(b=b, h=h, g=g, s=s, d=d), "mask": mask, "rows": rows}


def _profile_step(title: str, fwd, bwd) -> None:
    """Where one warm ring's time goes: the CUDA kernels of a forward and a backward, by total time."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd()
        bwd()
        torch.cuda.synchronize()
    print(f"\n## kernels of one warm ring, {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


CONFIGS = {"h16-d128": (16, 16, 128), "h32-d128": (32, 32, 128), "gpt-oss": (64, 8, 64)}


def _configs(text: str) -> list:
    """``name:cp,cp;name:cp`` -> [(name, [cp...])]."""
    out = []
    for part in filter(None, text.split(";")):
        name, _, cps = part.partition(":")
        out.append((name, [int(c) for c in cps.split(",")]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile-s", type=int, default=8192)
    ap.add_argument("--s-rank", type=int, default=8192, help="tokens per rank in the ring benchmarks")
    ap.add_argument("--rings", default="h16-d128:2,4,8;gpt-oss:2,4,8", help=f"configs from {sorted(CONFIGS)}")
    ap.add_argument("--masks", default="causal,no_mask")
    ap.add_argument("--ring-backends", default=None,
                    help="backends of the ring benchmarks, and fa4-per-tile (default: every backend here, and fa4-per-tile)")
    ap.add_argument("--skip-tiles", action="store_true")
    ap.add_argument("--profile-step", action="store_true", help="print the kernels of one warm ring per config")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backends": backends(),
              "fused sink kernels": fused.disabled_reason() or "on", "args": vars(args), "tiles": [], "rings": []}
    print("backends:", report["backends"], "| fused sink kernels:", report["fused sink kernels"])
    if not args.skip_tiles:
        for label, (h, g, d), band in (("h32 d128 causal", CONFIGS["h32-d128"], Band(None, 0)),
                                       ("h32 d128 no_mask", CONFIGS["h32-d128"], Band()),
                                       ("gpt-oss causal", CONFIGS["gpt-oss"], Band(None, 0)),
                                       ("gpt-oss window (127, 0)", CONFIGS["gpt-oss"], Band(-127, 0))):
            t = tile_bench(1, h, g, args.tile_s, d, band, label)
            report["tiles"].append(t)
            print(f"\n## tile {label}, s={args.tile_s} bf16 (graphed, interleaved)")
            for name, r in t["kernels"].items():
                print(f"{name:28s} {r['ms'] * 1e3:9.1f} us (spread {r['spread_ms'] * 1e3:.1f}) {r['tflops']:7.1f} TFLOP/s")
    ring_names = (args.ring_backends.split(",") if args.ring_backends else
                  backends() + (["fa4-per-tile"] if "fa4" in backends() else []))
    for name, cps in _configs(args.rings):
        h, g, d = CONFIGS[name]
        for cp in cps:
            for mask in args.masks.split(","):
                r = ring_bench(cp, 1, h, g, args.s_rank, d, mask, args.profile_step, ring_names)
                report["rings"].append(r | {"config": name})
                print(f"\n## ring {name} cp={cp} s={r['shape']['s']} {mask}: slowest rank's schedule, TFLOP/s "
                      "(and against FA4 monolithic)")
                for row in r["rows"]:
                    eff = (f" | vs FA4 mono fwd {row['fwd_vs_fa4_mono']:.3f} bwd {row['bwd_vs_fa4_mono']:.3f}"
                           if "fwd_vs_fa4_mono" in row else "")
                    print(f"{row['backend']:12s} {row['variant']:21s} rank {row['rank']}: fwd {row['fwd_tflops']:6.1f} "
                          f"bwd {row['bwd_tflops']:6.1f}{eff} | host {row['host_us_per_step_eager']:6.1f} us/step")
    refused = {}
    for name in backends():
        refused |= {f"{name}: {k[0]}": v for k, v in get_kernel(name, "cuda").refused().items()}
    report["refused"] = refused
    if refused:
        print("\nrefused:", refused)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
