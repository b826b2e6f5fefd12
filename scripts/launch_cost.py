"""Benchmark (not a test): what one launch costs the host on this machine, which bounds the
host time of an eager ring step. Needs a CUDA GPU and nvidia-cudnn-frontend.

    python scripts/launch_cost.py

Host microseconds per call, issued back to back without syncs (the GPU runs behind): a tiny
torch kernel, a cuDNN frontend SDPA execute of a cached graph (through the tile wrapper and
bare), one fused Triton merge, the torch merge it replaced, and the replay of a CUDA graph
holding 20 tiny kernels.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import host_us  # noqa: E402  (this script's folder is on sys.path)
from sinkprof import fused, sink  # noqa: E402
from sinkprof.kernels import get_kernel  # noqa: E402
from sinkprof.options import Band  # noqa: E402


CALLS = 200   # back-to-back calls per figure


def main() -> None:
    tiny = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tiny.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(20):
            tiny.add_(1)
    kernel = get_kernel("cudnn", "cuda")
    q = torch.randn(1, 1024, 32, 128, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3)
    kernel.forward(q, q, q, Band(), None, None, 0.1)
    g = next(iter(kernel._graphs.values()))
    o, stats = torch.empty_like(q), torch.empty(1, 32, 1024, 1, device="cuda")
    pack = {g.tensors[n]: t for n, t in dict(q=q, k=q, v=q, o=o, stats=stats).items()}
    o_acc, lse_acc = torch.zeros(q.shape, device="cuda"), torch.zeros(1, 32, 1024, device="cuda")
    parts_o, parts_lse = q.unsqueeze(0), torch.zeros(1, 1, 32, 1024, device="cuda")

    def torch_merge():
        saved, fused._DISABLED = fused._DISABLED, "measuring the torch form"
        try:
            sink.merge_parts_(o_acc, lse_acc, parts_o, parts_lse)
        finally:
            fused._DISABLED = saved
    rows = {
        "tiny torch kernel (x.add_(1))": host_us(lambda: tiny.add_(1), CALLS),
        "cuDNN tile forward, cached graph (CudnnTiles.forward)": host_us(lambda: kernel.forward(q, q, q, Band(), None, None, 0.1), CALLS),
        "cuDNN frontend execute alone": host_us(lambda: g.graph.execute(pack, g.workspace, handle=kernel.handle), CALLS),
        "torch merge (sink.merge_parts_ without fused kernels)": host_us(torch_merge, CALLS),
        "CUDA graph replay of 20 tiny kernels": host_us(graph.replay, CALLS),
    }
    if fused.disabled_reason() is None:
        rows["fused Triton merge (sink.merge_parts_)"] = host_us(lambda: sink.merge_parts_(o_acc, lse_acc, parts_o, parts_lse), CALLS)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, fused kernels: "
          f"{fused.disabled_reason() or 'on'}")
    for name, us in rows.items():
        print(f"{name:58s} {us:7.1f} us/call (host)")


if __name__ == "__main__":
    main()
