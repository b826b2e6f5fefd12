"""Does FA4 run faster when K/V are zeros? One full tile q 4096 x k 8192, h16 d128, interleaved graphs."""
import sys, json
sys.path.insert(0, "scripts")
sys.argv = sys.argv[:1]
import torch
import bench_kernels as bk
from sinkprof.options import Band
gen = torch.Generator(device="cuda").manual_seed(0)
q = bk._rand(gen, 1, 4096, 16, 128)
k, v = bk._rand(gen, 1, 8192, 16, 128), bk._rand(gen, 1, 8192, 16, 128)
fns = {}
for tag, (kk, vv) in {"random": (k, v), "zeros": (torch.zeros_like(k), torch.zeros_like(v)),
                      "random K, zero V": (k, torch.zeros_like(v))}.items():
    f, b = bk.fa4_direct(q, kk, vv, Band(), None, 128 ** -0.5)
    fns[f"{tag} fwd"], fns[f"{tag} bwd"] = f, b
out = bk.interleaved_ms(fns)
for n, r in out.items():
    print(f"{n:24s} {r['ms']*1e3:8.1f} us  (spread {r['spread_ms']*1e3:.1f})")
