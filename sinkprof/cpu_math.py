"""A workaround for a silent CPU precision bug: oneMKL picks the kernel of each vector math
function (``exp``, ``log``, ...) on its first call, and when that first call runs on several of
torch's intra-op threads at once, one of them can run a low-accuracy kernel over its whole chunk
(pytorch/pytorch#188792). Here a fresh process's first sizable ``exp`` differed from the next one
by up to 3e-9 relative in about one process of eight (fp32 and fp64; ``log`` likewise), enough to
fail fp64 comparisons at 1e-10. Calling each function once on a small tensor, on one thread,
settles the choice before any multi-threaded call: ``import sinkprof`` does it.
"""
from __future__ import annotations

import torch

FUNCTIONS = ("exp", "log", "log1p", "expm1", "sqrt", "tanh", "sigmoid")


def settle_vector_math() -> None:
    """Call each of ``FUNCTIONS`` once per float dtype on a few elements (one chunk, one thread)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((64,), 0.5, dtype=dtype)
        for name in FUNCTIONS:
            getattr(torch, name)(x)
