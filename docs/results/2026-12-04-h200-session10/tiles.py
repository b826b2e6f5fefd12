"""FA4 rates by tile shape (what grouping a rank's steps into one call would buy), interleaved graphs."""
import sys
sys.path.insert(0, "scripts")
sys.argv = sys.argv[:1]
import torch
import bench_kernels as bk
from sinkprof.options import Band
gen = torch.Generator(device="cuda").manual_seed(0)
for (h, g, d), shapes in (((16, 16, 128), [(8192, 4096, "full"), (4096, 8192, "full"), (8192, 8192, "full"),
                                           (4096, 16384, "full"), (8192, 16384, "full"), (8192, 28672, "full"),
                                           (4096, 28672, "full"), (8192, 8192, "causal"), (65536, 65536, "causal"),
                                           (16384, 16384, "full")]),
                          ((64, 8, 64), [(8192, 4096, "full"), (4096, 8192, "full"), (8192, 8192, "full"),
                                         (8192, 16384, "full"), (4096, 16384, "full"), (8192, 8192, "causal"),
                                         (65536, 65536, "causal")])):
    fns, flops = {}, {}
    for sq, sk, m in shapes:
        band = Band(None, 0) if m == "causal" else Band()
        q, k, v = bk._rand(gen, 1, sq, h, d), bk._rand(gen, 1, sk, g, d), bk._rand(gen, 1, sk, g, d)
        f, b = bk.fa4_direct(q, k, v, band, None, d ** -0.5)
        name = f"q{sq} k{sk} {m}"
        fns[name + " fwd"], fns[name + " bwd"] = f, b
        flops[name] = 4 * h * d * band.count(sq, sk)
    out = bk.interleaved_ms(fns, calls=2, rounds=11)
    print(f"\n## h{h} g{g} d{d}: TFLOP/s (bwd as 2.5 fwd)")
    for name in flops:
        f, b = out[name + " fwd"]["ms"], out[name + " bwd"]["ms"]
        print(f"{name:26s} fwd {f*1e3:8.1f} us {flops[name]/f/1e9:6.1f}   bwd {b*1e3:8.1f} us {2.5*flops[name]/b/1e9:6.1f}")
