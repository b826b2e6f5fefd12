"""What a loopback message costs an FA4 call beside it. ``bench_kernels.Loopback`` makes a message
a same-device copy (``dst.copy_(src)`` on a stream of its own): for contiguous tensors a
``cudaMemcpyAsync``, which issued eagerly runs on the copy engines (``Memcpy DtoD``) but which a
CUDA graph, as the rings are timed, may run as a copy kernel on the SMs; for strided ones a copy
kernel (here a transpose, whose access pattern also makes it slower). A kernel beside an FA4 call
competes for its SMs, a DMA copy only for its memory bandwidth (docs/design.md, section 7).

Each variant is a CUDA graph replayed in the interleaved rounds of ``bench_kernels.interleaved_ms``:
the FA4 call alone, each copy alone, and the call with the copy issued on a second stream just
before it (the ring posts a message before the call that should hide it) or just after it; then
the profiler's name for each copy, issued eagerly and replayed in a graph (a ``Memcpy DtoD``
activity, or a kernel: a graph may run a device-to-device memcpy node as one).

    python3 scripts/copy_probe.py [--mib 64,256] [--heads 16] [--head-dim 128] [--rows 8192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import fa4_interface_or_exit, positive_ints, probe_ms  # noqa: E402


def beside(call, copy, first: bool):
    """``call`` on the current stream and ``copy`` on a second one, the copy issued first (or
    last); both joined before returning, so a graph of it ends when both are done."""
    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        if not first:
            call()
        with torch.cuda.stream(side):
            copy()
        if first:
            call()
        main.wait_stream(side)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="64,256", help="copy sizes in MiB, comma-separated")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8192, help="rows = keys of the FA4 calls")
    args = ap.parse_args()
    sizes = positive_ints(ap, "--mib", args.mib, "positive whole MiB", "64,256")
    fa4 = fa4_interface_or_exit(ap)
    dev = torch.device("cuda")
    h, d, n = args.heads, args.head_dim, args.rows
    q, k, v = (torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    calls = {"fa4 fwd full": lambda: fa4._flash_attn_fwd(q, k, v, return_lse=True),
             "fa4 fwd causal": lambda: fa4._flash_attn_fwd(q, k, v, return_lse=True, causal=True)}
    copies = {}
    for mib in sizes:
        elems = mib * 2 ** 20 // 2
        src = torch.randn(elems, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        square = src.view(-1, 1024)
        dst_t = torch.empty(square.shape[::-1], device=dev, dtype=torch.bfloat16)
        copies[f"copy {mib} MiB contiguous"] = lambda dst=dst, src=src: dst.copy_(src)
        copies[f"copy {mib} MiB strided"] = lambda dst=dst_t, src=square: dst.copy_(src.t())
    fns = dict(calls) | dict(copies)
    for cname, call in calls.items():
        for kname, copy in copies.items():
            fns[f"{cname} + {kname} (copy first)"] = beside(call, copy, first=True)
            fns[f"{cname} + {kname} (copy after)"] = beside(call, copy, first=False)
    timed = probe_ms(fns)
    print(f"{torch.cuda.get_device_name()}: h{h} d{d}, {n} x {n}, bf16; median ms per call (spread)")
    for name, r in timed.items():
        print(f"  {name:64s} {r['ms']:8.3f}  ({r['spread_ms']:.3f})")
    for cname in calls:
        for kname in copies:
            alone = timed[cname]["ms"] + timed[kname]["ms"]
            for order in ("copy first", "copy after"):
                both = timed[f"{cname} + {kname} ({order})"]["ms"]
                hidden = (alone - both) / timed[kname]["ms"]
                print(f"  {cname} + {kname} ({order}): {both:.3f} ms; the copy's "
                      f"{timed[kname]['ms']:.3f} ms {100 * hidden:.0f}% hidden")
    from torch.profiler import ProfilerActivity, profile
    from bench_kernels import capture
    for kname, copy in copies.items():   # what runs the copy, issued eagerly and replayed in a graph
        graph = capture(copy, 1)
        for how, run in (("eager", copy), ("graph", graph.replay)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            names = sorted({e.name[:80] for e in prof.events() if e.device_type.name == "CUDA"})
            print(f"  {kname}, {how}: {names}")


if __name__ == "__main__":
    main()
