"""Fused CUDA kernels (Triton) for the passes of ``sink.py`` that touch every element of o.

Why: in eager torch a merge is seven launches and the multiply by a per-row weight broadcast over
``d`` does not vectorise; on the H200 that made the post-merge fold cost 5% of a ring's forward
and the merges a large share of every step's host time. Each kernel here is one launch and one
pass. ``sink.py`` keeps the formulas and the torch versions (CPU, fp64, the reference for the
tests), and calls these only where ``usable`` says so: CUDA tensors, fp32 accumulation,
``d <= 256`` contiguous, Triton importable, and ``SINKPROF_FUSED`` not set to ``0``. This module
is imported on the first CUDA tensor only, so CPU runs never import Triton.

Rows are addressed through their ``[b, h, s]`` strides, so bshd and sbhd views need no copies.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except Exception as _exc:  # pragma: no cover - CUDA machines only
    triton = None
    UNAVAILABLE = f"triton is not importable ({type(_exc).__name__}: {_exc})"
else:
    UNAVAILABLE = None

_IO = (torch.float32, torch.bfloat16, torch.float16)
MAX_D = 256


def disabled_reason() -> Optional[str]:
    """None when the fused kernels may run on CUDA here, else why not."""
    if os.environ.get("SINKPROF_FUSED", "1") == "0":
        return "SINKPROF_FUSED=0"
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    return None


_DISABLED = disabled_reason()


def usable(acc_dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """The fused kernels can replace the torch ones for these ``[b, h, s, d]`` tensors."""
    return _DISABLED is None and acc_dtype == torch.float32 and all(
        t.is_cuda and t.dtype in _IO and t.shape[-1] <= MAX_D and t.stride(-1) == 1 for t in tensors)


def _rows(x: torch.Tensor) -> tuple:
    """The ``[b, h, s]`` strides of a ``[b, h, s, d]`` or ``[b, h, s]`` tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


def _grid(rows: int, block: int) -> tuple:
    return (triton.cdiv(rows, block),)


BLOCK_ELEMS = 2048    # elements of o per program (best of 2048-16384 on the H200)
NUM_WARPS = 4


def _block_rows(d: int) -> int:
    return max(1, BLOCK_ELEMS // triton.next_power_of_2(d))


if triton is not None:
    @triton.jit
    def _row_offsets(rows, H, S, sb, sh, ss):
        s = rows % S
        bh = rows // S
        return (bh // H) * sb + (bh % H) * sh + s * ss

    @triton.jit
    def _merge_kernel(oa_ptr, la_ptr, o_ptr, l_ptr, R, H, S, D,
                      oa_sb, oa_sh, oa_ss, la_sb, la_sh, la_ss, o_sb, o_sh, o_ss, l_sb, l_sh, l_ss,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        cols = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (cols < D)[None, :]
        la = la_ptr + _row_offsets(rows, H, S, la_sb, la_sh, la_ss)
        l_acc = tl.load(la, mask=live, other=0.0)
        l_new = tl.load(l_ptr + _row_offsets(rows, H, S, l_sb, l_sh, l_ss), mask=live, other=0.0).to(tl.float32)
        diff = l_new - l_acc
        diff = tl.where(diff != diff, float("-inf"), diff)          # both rows empty: keep the accumulator
        w = 1.0 / (1.0 + tl.exp(-diff))                             # sigmoid: 0 at -inf, 1 at +inf
        top = tl.maximum(l_acc, l_new)
        gap = tl.where(top == float("-inf"), 0.0, -tl.abs(l_acc - l_new))
        tl.store(la, top + tl.log(1.0 + tl.exp(gap)), mask=live)     # logaddexp, -inf when both are
        oa = oa_ptr + _row_offsets(rows, H, S, oa_sb, oa_sh, oa_ss)[:, None] + cols[None, :]
        acc = tl.load(oa, mask=tile, other=0.0)
        new = tl.load(o_ptr + _row_offsets(rows, H, S, o_sb, o_sh, o_ss)[:, None] + cols[None, :],
                      mask=tile, other=0.0).to(tl.float32)
        w2 = w[:, None]
        lerp = tl.where(w2 < 0.5, acc + w2 * (new - acc), new - (new - acc) * (1.0 - w2))  # torch.lerp's form
        tl.store(oa, lerp, mask=tile)

    @triton.jit
    def _fold_kernel(out_ptr, oa_ptr, la_ptr, a_ptr, R, H, S, D,
                     out_sb, out_sh, out_ss, oa_sb, oa_sh, oa_ss, la_sb, la_sh, la_ss,
                     HAS_SINK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        cols = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (cols < D)[None, :]
        acc = tl.load(oa_ptr + _row_offsets(rows, H, S, oa_sb, oa_sh, oa_ss)[:, None] + cols[None, :],
                      mask=tile, other=0.0)
        if HAS_SINK:
            la = la_ptr + _row_offsets(rows, H, S, la_sb, la_sh, la_ss)
            lse = tl.load(la, mask=live, other=0.0)
            a = tl.load(a_ptr + (rows // S) % H, mask=live, other=0.0)
            w = 1.0 / (1.0 + tl.exp(a - lse))                       # sigmoid(lse - a); 0 for an empty row
            top = tl.maximum(lse, a)
            tl.store(la, top + tl.log(1.0 + tl.exp(-tl.abs(lse - a))), mask=live)   # logaddexp(lse, a)
            acc = acc * w[:, None]
        out = out_ptr + _row_offsets(rows, H, S, out_sb, out_sh, out_ss)[:, None] + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile)

    @triton.jit
    def _sink_grad_kernel(g_ptr, o_ptr, do_ptr, l_ptr, a_ptr, R, H, S, D, o_sb, o_sh, o_ss,
                          do_sb, do_sh, do_ss, l_sb, l_sh, l_ss, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        cols = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (cols < D)[None, :]
        o = tl.load(o_ptr + _row_offsets(rows, H, S, o_sb, o_sh, o_ss)[:, None] + cols[None, :],
                    mask=tile, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + _row_offsets(rows, H, S, do_sb, do_sh, do_ss)[:, None] + cols[None, :],
                     mask=tile, other=0.0).to(tl.float32)
        lse = tl.load(l_ptr + _row_offsets(rows, H, S, l_sb, l_sh, l_ss), mask=live, other=0.0)
        a = tl.load(a_ptr + (rows // S) % H, mask=live, other=0.0)
        tl.store(g_ptr + rows, -tl.exp(a - lse) * tl.sum(o * do, axis=1), mask=live)


def merge_(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """``sink.merge_`` in one pass."""
    b, h, s, d = o_acc.shape
    block = _block_rows(d)
    _merge_kernel[_grid(b * h * s, block)](o_acc, lse_acc, o, lse, b * h * s, h, s, d, *_rows(o_acc),
                                           *_rows(lse_acc), *_rows(o), *_rows(lse), BLOCK_R=block,
                                           BLOCK_D=triton.next_power_of_2(d), num_warps=NUM_WARPS)


def fold_(out: torch.Tensor, o_acc: torch.Tensor, lse_acc: torch.Tensor, sink: Optional[torch.Tensor]) -> None:
    """``sink.fold_`` in one pass: ``out = o * sigmoid(lse - a)`` and ``lse = lse'`` with a
    sink, ``out = o`` (cast to out's dtype) without."""
    b, h, s, d = o_acc.shape
    a = lse_acc if sink is None else sink.reshape(-1).to(torch.float32).contiguous()
    block = _block_rows(d)
    _fold_kernel[_grid(b * h * s, block)](out, o_acc, lse_acc, a, b * h * s, h, s, d, *_rows(out),
                                          *_rows(o_acc), *_rows(lse_acc), HAS_SINK=sink is not None,
                                          BLOCK_R=block, BLOCK_D=triton.next_power_of_2(d),
                                          num_warps=NUM_WARPS)


def sink_grad_rows(o: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Each row's term of ``sink.sink_grad``, ``-exp(a_h - lse') * rowsum(dO * o')``, as fp32
    ``[b, h, s]`` in one pass (sum over b and s for the gradient)."""
    b, h, s, d = o.shape
    rows = torch.empty(b, h, s, dtype=torch.float32, device=o.device)
    a = sink.reshape(-1).to(torch.float32).contiguous()
    block = _block_rows(d)
    _sink_grad_kernel[_grid(b * h * s, block)](rows, o, grad_out, lse, a, b * h * s, h, s, d, *_rows(o),
                                               *_rows(grad_out), *_rows(lse), BLOCK_R=block,
                                               BLOCK_D=triton.next_power_of_2(d), num_warps=NUM_WARPS)
    return rows
