"""Whether two of a rank's FA4 calls run faster side by side (two streams) than one after the other.

A ring's step-0 call is causal; its tail (the last blocks of the longest rows or keys) may leave
SMs idle that the next call could fill if it ran on another stream. This times, for each pair of a
causal ``n x n`` call and a full ``n/2 x 2n`` call (the shapes of a zigzag rank's step 0 and of a
joined run), each call alone, the two in series and the two on two streams, forward and backward,
as interleaved CUDA-graph replays.

    python3 scripts/overlap_probe.py [--n 8192] [--shapes h16-d128,gpt-oss]
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
    ap.add_argument("--n", type=int, default=8192, help="rows of the causal call")
    ap.add_argument("--shapes", default="h16-d128,gpt-oss")
    args = ap.parse_args()
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown or args.n < 256 or args.n % 256:
        ap.error(f"--shapes: {unknown} not in {sorted(SHAPES)}" if unknown else
                 f"--n {args.n}: give a multiple of 256 (the full call has n/2 rows)")
    fa4 = fa4_interface_or_exit(ap)
    dev = torch.device("cuda")
    n = args.n
    for name in args.shapes.split(","):
        h, g, d = SHAPES[name]
        scale = d ** -0.5

        def qkv(nq, nk):
            q = torch.randn(1, nq, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, nk, g, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, nk, g, d, device=dev, dtype=torch.bfloat16)
            return q, k, v

        calls = {}
        for label, nq, nk, causal in (("causal", n, n, True), ("full", n // 2, 2 * n, False)):
            q, k, v = qkv(nq, nk)
            o = torch.empty_like(q)
            lse = torch.empty(1, h, nq, device=dev, dtype=torch.float32)
            do = torch.randn_like(q)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def fwd(q=q, k=k, v=v, o=o, lse=lse, causal=causal):
                fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, out=o, lse=lse)

            def bwd(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv, causal=causal):
                fa4._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=scale, causal=causal, dq=dq, dk=dk, dv=dv)
            fwd()
            bwd()
            calls[("fwd", label)], calls[("bwd", label)] = fwd, bwd
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        for direction in ("fwd", "bwd"):
            a, b = calls[(direction, "causal")], calls[(direction, "full")]

            def series(a=a, b=b):
                a()
                b()

            def parallel(a=a, b=b):
                side.wait_stream(torch.cuda.current_stream())
                a()
                with torch.cuda.stream(side):
                    b()
                torch.cuda.current_stream().wait_stream(side)
            t = interleaved_ms({"causal": a, "full": b, "series": series, "parallel": parallel}, rounds=21)
            ms = {k: v["ms"] for k, v in t.items()}
            print(f"{name} {direction} n={n}: causal {ms['causal']:.3f} ms, full {ms['full']:.3f} ms, "
                  f"sum {ms['causal'] + ms['full']:.3f}, series {ms['series']:.3f}, parallel {ms['parallel']:.3f} "
                  f"(parallel / series {ms['parallel'] / ms['series']:.3f}; spreads "
                  + ", ".join(f"{k} {v['spread_ms']:.3f}" for k, v in t.items()) + ")", flush=True)


if __name__ == "__main__":
    main()
