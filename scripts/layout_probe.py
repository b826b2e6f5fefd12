"""Does FA4 read K/V faster head-major than token-major? The bare schedule of ``bench_kernels``
gathers a joined run's K/V once into head-major storage (``[b, h, s, d]`` contiguous, seen as
bshd), while the ring's buffers, like the user's tensors, are token-major (``[b, s, h, d]``
contiguous), each row's K beside its V in one buffer (``[b, s, 2, g, d]``: the stride from one
token to the next is twice K's own); at h16 cp 8 causal the bare forward ran 6 points above the
ring's own code without messages, with the same calls of the same shapes (docs/benchmarks.md,
twenty-first session).

Each row: an FA4 call (forward, then backward) on one tile of ``--q-rows`` queries and
``--kv-rows`` keys, full band, bf16, with q token-major and K/V in three layouts of the same
values: token-major (``[b, s, g, d]`` each), K beside V (the ring's buffers) and head-major, as
CUDA graphs replayed in the interleaved rounds of ``bench_kernels.interleaved_ms``.

    python3 scripts/layout_probe.py [--heads 16] [--kv-heads 16] [--head-dim 128] [--q-rows 4096]
                                    [--kv-rows 28672,8192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import fa4_interface_or_exit, positive_ints, probe_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-rows", type=int, default=4096)
    ap.add_argument("--kv-rows", default="28672,8192", help="key counts, comma-separated")
    args = ap.parse_args()
    kv_rows = positive_ints(ap, "--kv-rows", args.kv_rows, "positive key counts", "28672,8192")
    fa4 = fa4_interface_or_exit(ap)
    h, g, d, n = args.heads, args.kv_heads, args.head_dim, args.q_rows
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, do = randn(1, n, h, d), randn(1, n, h, d)
    fns, flops = {}, {}
    for m in kv_rows:
        k, v = randn(1, m, g, d), randn(1, m, g, d)
        head_major = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v)]   # same values
        beside = torch.stack((k, v), dim=2).unbind(2)   # [b, m, 2, g, d]: a row's K, then its V
        for name, (kk, vv) in (("token-major", (k, v)), ("K beside V", beside), ("head-major", head_major)):
            o, lse = fa4._flash_attn_fwd(q, kk, vv, return_lse=True)[:2]
            key = f"{n}x{m} K/V {name}"
            fns[f"{key} fwd"] = lambda kk=kk, vv=vv: fa4._flash_attn_fwd(q, kk, vv, return_lse=True)
            fns[f"{key} bwd"] = lambda kk=kk, vv=vv, o=o, lse=lse: fa4._flash_attn_bwd(q, kk, vv, o, do, lse)
            flops[f"{key} fwd"], flops[f"{key} bwd"] = 4 * h * d * n * m, 2.5 * 4 * h * d * n * m
    timed = probe_ms(fns)
    print(f"{torch.cuda.get_device_name()}: h{h} g{g} d{d}, full band, bf16; median ms per call (spread), TFLOP/s")
    for name, r in timed.items():
        print(f"  {name:44s} {r['ms']:8.3f}  ({r['spread_ms']:.3f})  {flops[name] / r['ms'] / 1e9:7.1f}")
    for m in kv_rows:
        for phase in ("fwd", "bwd"):
            token, beside, head = (timed[f"{n}x{m} K/V {name} {phase}"]["ms"]
                                   for name in ("token-major", "K beside V", "head-major"))
            print(f"  {n}x{m} {phase}: against token-major K/V, K beside V takes {beside / token:.3f}x the time, "
                  f"head-major {head / token:.3f}x")


if __name__ == "__main__":
    main()
