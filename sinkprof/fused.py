"""Fused CUDA kernels (Triton) for the passes of ``sink.py`` that touch every element of o.

Why: in eager torch a merge is many launches and the multiply by a per-row weight broadcast over
``d`` does not vectorise; on the H200 that made the post-merge fold cost 5% of a ring's forward
and the merges a large share of every step's host time. Each kernel here is one launch and one
pass: the merge of a ring's later results (``merge_parts_``) reads each of them once, so merging n
parts in one pass moves ~2(n+1) bytes per element of o where n merges of two would move ~10n.
``sink.py`` keeps the formulas and the torch versions (CPU, fp64, the reference for the tests),
and calls these only where ``usable`` says so: CUDA tensors, fp32 accumulation,
``d <= 256`` contiguous, Triton importable, and ``SINKPROF_FUSED`` not set to ``0``. This module
is imported on the first CUDA tensor only, so CPU runs never import Triton.

Rows are addressed through their ``[b, h, s]`` strides, so bshd and sbhd views need no copies.
"""
from __future__ import annotations

import math
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
    def _merge_parts_kernel(dst_ptr, o_ptr, l_ptr, po_ptr, pl_ptr, a_ptr, R, H, S, D,
                            dst_sb, dst_sh, dst_ss, o_sb, o_sh, o_ss, l_sb, l_sh, l_ss,
                            po_sn, po_sb, po_sh, po_ss, pl_sn, pl_sb, pl_sh, pl_ss, N: tl.constexpr,
                            HAS_SINK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        cols = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (cols < D)[None, :]
        la = l_ptr + _row_offsets(rows, H, S, l_sb, l_sh, l_ss)
        pl = pl_ptr + _row_offsets(rows, H, S, pl_sb, pl_sh, pl_ss)
        po = po_ptr + _row_offsets(rows, H, S, po_sb, po_sh, po_ss)[:, None] + cols[None, :]
        po_sn = po_sn.to(tl.int64)     # a buffer's offset, n * stride, passes 2^31 elements at long contexts
        pl_sn = pl_sn.to(tl.int64)
        l_o = tl.load(la, mask=live, other=float("-inf"))
        top = l_o
        for n in tl.static_range(N):
            top = tl.maximum(top, tl.load(pl + n * pl_sn, mask=live, other=float("-inf")))
        ref = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(l_o - ref)                                        # 0 where the rows' result so far is empty
        acc = tl.load(o_ptr + _row_offsets(rows, H, S, o_sb, o_sh, o_ss)[:, None] + cols[None, :],
                      mask=tile, other=0.0).to(tl.float32)
        merged = w[:, None] * acc
        total = w
        for n in tl.static_range(N):
            w_n = tl.exp(tl.load(pl + n * pl_sn, mask=live, other=float("-inf")) - ref)
            part = tl.load(po + n * po_sn, mask=tile & (w_n > 0.0)[:, None], other=0.0).to(tl.float32)
            merged += w_n[:, None] * part                            # rows a part does not cover: never read
            total += w_n
        seen = total > 0.0
        merged = tl.where(seen[:, None], merged / tl.where(seen, total, 1.0)[:, None], acc)
        lse = tl.where(seen, ref + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        if HAS_SINK:                                                # fold: o * sigmoid(lse - a), lse' = logaddexp(lse, a)
            a = tl.load(a_ptr + (rows // S) % H, mask=live, other=0.0)
            off = a == float("-inf")                                 # a head without a sink keeps o' and lse'
            merged = merged * tl.where(off, 1.0, 1.0 / (1.0 + tl.exp(a - lse)))[:, None]
            lse = tl.where(off, lse, tl.maximum(lse, a) + tl.log(1.0 + tl.exp(-tl.abs(lse - a))))
        tl.store(la, lse, mask=live)
        dst = dst_ptr + _row_offsets(rows, H, S, dst_sb, dst_sh, dst_ss)[:, None] + cols[None, :]
        tl.store(dst, merged.to(dst_ptr.dtype.element_ty), mask=tile)

    @triton.jit
    def _add_rows_kernel(dst_ptr, src_ptr, idx_ptr, R, H, S, D, dst_sb, dst_sh, dst_ss, src_sb, src_sh, src_ss,
                         WRITE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        cols = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (cols < D)[None, :]
        s = tl.load(idx_ptr + rows % S, mask=live, other=0).to(tl.int64)   # the row's place in the sequence
        bh = rows // S
        b, h = bh // H, bh % H
        src = src_ptr + (b * src_sb + h * src_sh + s * src_ss)[:, None] + cols[None, :]
        dst = dst_ptr + (b * dst_sb + h * dst_sh + s * dst_ss)[:, None] + cols[None, :]
        x = tl.load(src, mask=tile, other=0.0).to(tl.float32)
        if not WRITE:
            x += tl.load(dst, mask=tile, other=0.0).to(tl.float32)
        tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=tile)

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
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(a - lse))   # lse' >= a: -inf only where a is
        tl.store(g_ptr + rows, -weight * tl.sum(o * do, axis=1), mask=live)


if triton is not None:
    @triton.jit
    def _sum_partials_kernel(out_ptr, acc_ptr, buf_ptr, table_ptr, n_ptr, OUTER, S, INNER, J,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)          # (plane, outer, s) of a [2, outer, S, inner] buffer
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = cols < INNER
        s = row % S
        po = row // S                                # plane * OUTER + outer
        x = tl.load(acc_ptr + row * INNER + cols, mask=live, other=0.0).to(tl.float32)
        base = tl.zeros((), dtype=tl.int64)
        for j in range(J):
            m = tl.load(table_ptr + s * J + j).to(tl.int64)      # the row's place in partial j, -1: not in it
            n = tl.load(n_ptr + j)
            x += tl.load(buf_ptr + base + (po * n + m) * INNER + cols, mask=live & (m >= 0), other=0.0).to(tl.float32)
            base += 2 * OUTER * n * INNER
        tl.store(out_ptr + row * INNER + cols, x.to(out_ptr.dtype.element_ty), mask=live)


def sum_partials(out: torch.Tensor, acc: torch.Tensor, buf: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 seq_dim: int) -> None:
    """``out = acc + sum_j partial_j`` over the rows each partial carries, in one pass (``ring.DirectDKV``):
    ``acc``, ``out`` contiguous ``[2, ..., S, ...]`` (sequence at ``seq_dim``), the partials one
    after another in ``buf``, partial j laid out as ``acc`` with ``rows[j]`` rows; ``table``
    ``[S, J]`` int32: each row's place in partial j, or -1."""
    outer, s, inner = math.prod(acc.shape[1:seq_dim]), acc.shape[seq_dim], math.prod(acc.shape[seq_dim + 1:])
    block = min(triton.next_power_of_2(inner), 4096)
    _sum_partials_kernel[(2 * outer * s, triton.cdiv(inner, block))](out, acc, buf, table, rows, outer, s, inner,
                                                                    table.shape[1], BLOCK=block, num_warps=NUM_WARPS)


def merge_parts_(o: torch.Tensor, lse: torch.Tensor, parts_o: torch.Tensor, parts_lse: torch.Tensor, *,
                 into: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None) -> None:
    """``sink.merge_parts_`` in one pass (the fold included when ``sink`` is given)."""
    b, h, s, d = o.shape
    dst = o if into is None else into
    n = parts_o.shape[0]
    po, pl = (parts_o, parts_lse) if n else (o.unsqueeze(0), lse.unsqueeze(0))   # no parts: never read
    a = lse if sink is None else sink.reshape(-1).to(torch.float32).contiguous()
    block = _block_rows(d)
    _merge_parts_kernel[_grid(b * h * s, block)](dst, o, lse, po, pl, a, b * h * s, h, s, d, *_rows(dst), *_rows(o),
                                                 *_rows(lse), po.stride(0), *_rows(po[0]), pl.stride(0), *_rows(pl[0]),
                                                 N=n, HAS_SINK=sink is not None, BLOCK_R=block,
                                                 BLOCK_D=triton.next_power_of_2(d), num_warps=NUM_WARPS)


def add_rows_(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor, *, write: bool) -> None:
    """``dst[:, :, index] += src[:, :, index]`` (``=`` with ``write``) for ``[b, h, s, d]`` views and
    an int32 ``index`` of sequence positions, in one pass."""
    b, h, _, d = dst.shape
    n = index.shape[0]
    block = _block_rows(d)
    _add_rows_kernel[_grid(b * h * n, block)](dst, src, index, b * h * n, h, n, d, *_rows(dst), *_rows(src),
                                              WRITE=write, BLOCK_R=block, BLOCK_D=triton.next_power_of_2(d),
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
