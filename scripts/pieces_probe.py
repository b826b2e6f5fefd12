"""How fast FA4's backward of one causal ``n x n`` tile runs whole, and cut by keys into pieces on
streams of their own (``sinkprof.kernels.fa4_rows.causal_cuts``), against what the dispatch model
predicts.

The tile runs through the rows backward (``FA4RowsBackward.tile``: the main kernels, and under GQA
the dK/dV conversion), as a ring's step 0 does, as interleaved CUDA-graph replays: whole, at half,
at a half and three quarters, and FA4's own ``_flash_attn_bwd`` on the same tile for scale.

    python3 scripts/pieces_probe.py [--n 4096,8192,16384] [--shapes h16-d128,gpt-oss]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import fa4_interface_or_exit, interleaved_ms  # noqa: E402

SHAPES = {"h16-d128": (16, 16, 128), "gpt-oss": (64, 8, 64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4096,8192,16384", help="the tile's rows (= keys), comma-separated")
    ap.add_argument("--shapes", default="h16-d128,gpt-oss")
    args = ap.parse_args()
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    try:
        sizes = [int(x) for x in args.n.split(",")]
    except ValueError:
        sizes = []
    if unknown or not sizes or any(n < 512 or n % 512 for n in sizes):
        ap.error(f"--shapes: {unknown} not in {sorted(SHAPES)}" if unknown else
                 f"--n {args.n}: give multiples of 512, comma-separated")
    fa4 = fa4_interface_or_exit(ap)
    from sinkprof.kernels import get_kernel
    from sinkprof.kernels import fa4_rows
    from sinkprof.kernels.base import BackwardState
    from sinkprof.options import Band
    from sinkprof.plan import ring_plan
    kernel = get_kernel("fa4", "cuda")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs")
    for name in args.shapes.split(","):
        h, g, d = SHAPES[name]
        scale = d ** -0.5
        for n in sizes:
            def rand(heads, n=n):
                return torch.randn(1, heads, n, d, device=dev).to(torch.bfloat16)
            q, out, do, k, v = rand(h), rand(h), rand(h), rand(g), rand(g)
            lse = torch.randn(1, h, n, device=dev) + 8
            tiles = ring_plan(2, 0, n // 2, Band(None, 0)).backward_steps[0].tiles
            rows_bwd = kernel.rows_backward(BackwardState(q, out, do, lse, torch.empty_like(q)), scale=scale,
                                            tiles=tiles, biased=False)
            assert isinstance(rows_bwd, fa4_rows.FA4RowsBackward)
            tile_n, tile_m = rows_bwd.cfg.n_block_size, rows_bwd.block
            variants = dict(zip(("whole", "half", "half+3/4"), fa4_rows.candidate_cuts(n, tile_n, tile_m)))
            fns = {}
            for label, cuts in variants.items():
                def run(cuts=cuts):
                    saved = fa4_rows.causal_cuts
                    fa4_rows.causal_cuts = lambda *a: cuts
                    try:
                        rows_bwd.tile(slice(0, n), k, v, Band(None, 0), None, None, first=True)
                    finally:
                        fa4_rows.causal_cuts = saved
                run()
                fns[label] = run
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def direct():
                fa4._flash_attn_bwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
                                    do.transpose(1, 2), lse, softmax_scale=scale, causal=True, dq=dq.transpose(1, 2),
                                    dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))
            direct()
            fns["FA4 call"] = direct
            torch.cuda.synchronize()
            t = interleaved_ms(fns, calls=4, rounds=21)
            flops = 2.5 * 4 * h * d * n * (n + 1) / 2
            whole = t["whole"]["ms"]
            chosen = fa4_rows.causal_cuts(n, h, tile_n, tile_m, sms)
            line = []
            for label, cuts in variants.items():
                model = (fa4_rows.predicted_time(n, (), h, tile_n, tile_m, sms)
                         / fa4_rows.predicted_time(n, cuts, h, tile_n, tile_m, sms))
                line.append(f"{label} {t[label]['ms']:.3f} ms ({whole / t[label]['ms']:.3f}x, model {model:.3f}x, "
                            f"{flops / t[label]['ms'] / 1e9:.0f} TFLOP/s)")
            print(f"{name} n={n}: " + "; ".join(line) + f"; FA4 call {t['FA4 call']['ms']:.3f} ms; "
                  f"causal_cuts picks {chosen}; spreads " + ", ".join(f"{k} {x['spread_ms']:.3f}" for k, x in t.items()),
                  flush=True)


if __name__ == "__main__":
    main()
