"""FlashAttention-4 tile kernels (PyPI ``flash-attn-4``, CuTe DSL; ``flash_attn.cute.interface``).

Forward: ``_flash_attn_fwd`` with ``learnable_sink`` (one logit per query head) when the tile
carries the sink, writing ``o`` and the natural-log ``lse`` (sink included) into buffers given to
it. Backward: ``_flash_attn_bwd`` driven with the given (merged) ``o`` and ``lse``, returning the
sink gradient when given the sink. FA4 reads ``[b, s, h, d]``; the ring's ``[b, h, s, d]`` views
are transposed back, so no layout is copied (bshd and sbhd alike).

Visibility: a tile's ``Band`` is trimmed to the part that sees anything (``base.trim_band``), so
``lo <= 0 <= hi``; FA4 aligns its masks to the bottom-right corner (``offset = n_kv - n_q``), so
the band becomes ``window_size_left = offset - lo`` and ``window_size_right = hi - offset``, both
non-negative after trimming, and ``causal`` when only ``hi = offset`` is bounded.

Groups of tiles (``plan.Step.groups``: a thd pack's documents at one ring step) run as one varlen
call: the rank's whole ``[t, h, d]`` rows with ``cu_seqlens_q`` holding where each tile's rows
start and ``seqused_q`` how many there are (the same for the keys), so the rows between tiles are
neither read nor written; every tile of the group must see all its rows and keys and have one FA4
window (else the group runs tile by tile).

A ring's backward keeps dq in FA4's own accumulator across the rank's tiles where it can
(``fa4_rows``; ``rows_backward``), and otherwise calls ``_flash_attn_bwd`` per tile.

FA4 has no bias input and takes bf16/fp16 only: bias tiles go to the cuDNN tiles when they can run
here, else to the torch tiles, and the reason is kept in ``refused()`` (what ``check`` reports);
fp32/fp64 tiles are the torch tiles' (the exact paths), as for cuDNN.

FA4 compiles each kernel variant on first use (seconds); set ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``
to keep compiled kernels on disk across processes (every rank is a process). The CuTe DSL reads
the process's command line at every compile (its own ``-diagnostic`` flag, through argparse,
which takes ``--h`` for ``--help`` and exits): FA4 is therefore called with ``sys.argv`` showing
only the program name.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections import OrderedDict
from typing import Optional

import torch

from ..options import Band, SinkStrategy
from . import fa4_rows
from .base import (INDEX_CACHE, IO_DTYPES, BackwardState, TileByTile, TileGrads, TileRowsBackward, add_rows_,
                   backward_trimmed, deliver, empty_bshd, forward_trimmed, one_tile_per_row, optional_module, trim_band)
from .torch_tiles import TorchTiles

log = logging.getLogger("sinkprof.fa4")

SINK_BACKWARD_MAJORS = (9, 10, 11)   # FA4's learnable-sink backward: sm90 (Hopper), sm100/sm110 (Blackwell)

_fa4, _IMPORT_ERROR = optional_module("flash_attn.cute.interface")   # the GPU extra


def version() -> Optional[str]:
    if _fa4 is None:
        return None
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("flash-attn-4")
    except PackageNotFoundError:
        return "unknown"


def unavailable_reason(device=None) -> Optional[str]:
    """None when the FA4 tiles can run on ``device`` (a CUDA device), else why not."""
    if _fa4 is None:
        return f"flash-attn-4 is not importable ({_IMPORT_ERROR}); pip install 'sinkprof[gpu]'"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] not in SINK_BACKWARD_MAJORS:
        return (f"FA4's learnable-sink backward needs sm90 or sm100 (Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}")
    return None


def fa4_window(band: Band, n_q: int, n_kv: int) -> tuple[bool, Optional[int], Optional[int]]:
    """``(causal, window_size_left, window_size_right)`` for a trimmed band (``lo <= 0 <= hi``) of an
    ``n_q x n_kv`` tile, in FA4's bottom-right-aligned convention."""
    offset = n_kv - n_q
    left = None if band.lo is None else offset - band.lo
    right = None if band.hi is None else band.hi - offset
    if left is None and right == 0:
        return True, None, None
    return False, left, right


@contextlib.contextmanager
def _program_name_only():
    """Hide the command line from the CuTe DSL's argument parsing (see the module docstring)."""
    argv = sys.argv
    sys.argv = argv[:1]
    try:
        yield
    finally:
        sys.argv = argv


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """The ``[b, s, h, d]`` view of a ``[b, h, s, d]`` tensor FA4 reads (no copy)."""
    return x.transpose(1, 2)


class FA4Tiles(TileByTile):
    """The tile kernel interface on FlashAttention-4; see the module docstring."""

    name = "fa4"
    sink_strategy = SinkStrategy.STEP0      # the faster one here (docs/benchmarks.md)
    rows_path = True                        # False: every backward tile through _flash_attn_bwd (for comparisons)
    concurrent = True                       # a call's scratch is its own (the bias fallback never runs beside)
    causal_pieces = True                    # the rows backward may cut a causal tile into pieces (fa4_rows.causal_cuts)
    unmasked_config = True                  # the rows backward runs FA4's configuration for unmasked tiles, masked too

    def __init__(self, device_index: int):
        self.device = torch.device("cuda", device_index)
        self._torch = TorchTiles()
        from . import unavailable_reason as backend_reason
        if backend_reason("cudnn", self.device) is None:
            from .cudnn import CudnnTiles
            self._bias_tiles = CudnnTiles(device_index)
        else:
            self._bias_tiles = self._torch
        self._refused: dict = {}
        self._varlen: OrderedDict = OrderedDict()   # each group's index tensors, made once: a warm ring is graph-safe

    def refused(self) -> dict:
        """What FA4 did not run, with the reason: what ``check`` notes and ``doctor`` reports."""
        refused = dict(self._refused)
        refused.update(getattr(self._bias_tiles, "refused", dict)())
        return refused

    def _refuse(self, key, reason: str):
        if key not in self._refused:
            self._refused[key] = reason
            log.warning("fa4 cannot run a tile (%s); %s", key[0], reason)

    def _bias_fallback(self, direction: str):
        self._refuse((f"{direction} bias",), f"FA4 has no bias input: bias tiles run on {self._bias_tiles.name}")
        return self._bias_tiles

    @staticmethod
    def _sink(sink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if sink is None else sink.reshape(-1)      # [1, h, 1, 1] -> [h], a view

    def forward(self, q, k, v, band, sink, bias, scale, *, out=None, lse=None):
        if q.dtype not in IO_DTYPES:
            return self._torch.forward(q, k, v, band, sink, bias, scale, out=out, lse=lse)
        if bias is not None:
            return self._bias_fallback("fwd").forward(q, k, v, band, sink, bias, scale, out=out, lse=lse)
        n_q, n_kv = q.shape[2], k.shape[2]
        trimmed = trim_band(band, n_q, n_kv)
        if trimmed is None or trimmed[0] != slice(0, n_q):
            return deliver(*forward_trimmed(self, q, k, v, band, sink, bias, scale, trimmed), out, lse)
        _, cols, band = trimmed
        if cols != slice(0, n_kv):
            k, v = k[:, :, cols], v[:, :, cols]
        causal, left, right = fa4_window(band, n_q, k.shape[2])
        o = empty_bshd(q, n_q) if out is None else out
        if lse is None:
            lse = torch.empty(q.shape[0], q.shape[1], n_q, dtype=torch.float32, device=q.device)
        with _program_name_only():
            _fa4._flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=causal,
                                 window_size_left=left, window_size_right=right,
                                 learnable_sink=self._sink(sink), return_lse=True, out=_bshd(o), lse=lse)
        return o, lse

    def backward(self, q, k, v, o, grad_out, lse, band, sink, bias, scale):
        if q.dtype not in IO_DTYPES:
            return self._torch.backward(q, k, v, o, grad_out, lse, band, sink, bias, scale)
        if bias is not None:
            return self._bias_fallback("bwd").backward(q, k, v, o, grad_out, lse, band, sink, bias, scale)
        n_q, n_kv = q.shape[2], k.shape[2]
        trimmed = trim_band(band, n_q, n_kv)
        if trimmed is None or trimmed != (slice(0, n_q), slice(0, n_kv), trimmed[2]):
            return backward_trimmed(self, q, k, v, o, grad_out, lse, band, sink, bias, scale, trimmed)
        causal, left, right = fa4_window(trimmed[2], n_q, n_kv)
        dq, dk, dv = empty_bshd(q, n_q), empty_bshd(k, n_kv), empty_bshd(v, n_kv)
        with _program_name_only():
            grads = _fa4._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _bshd(o.to(q.dtype)), _bshd(grad_out), lse,
                                         softmax_scale=scale, causal=causal, window_size_left=left,
                                         window_size_right=right, dq=_bshd(dq), dk=_bshd(dk), dv=_bshd(dv),
                                         learnable_sink=self._sink(sink))
        d_sink = None if sink is None else grads[3].reshape(sink.shape)
        return TileGrads(dq, dk, dv, d_sink, None)

    def rows_backward(self, state: BackwardState, *, scale: float, tiles, biased: bool):
        """FA4's accumulator across the rank's tiles (``fa4_rows``) when every tile qualifies, else
        tile after tile; the reason is logged (debug)."""
        why = self._rows_refusal(state, biased) if tiles else "no tiles"
        if why is None:
            cfg, why = fa4_rows.choose_configuration(_fa4, tiles, state.q.shape[2], state.q.shape[3],
                                                     state.out.shape[3], unmasked=self.unmasked_config)
        if why is not None:
            log.debug("fa4 backward tile by tile: %s", why)
            return TileRowsBackward(self, state, scale, single=one_tile_per_row(tiles))
        return fa4_rows.FA4RowsBackward(_fa4, state, scale, cfg, tiles=tiles, window=fa4_window,
                                        quiet=_program_name_only, causal_pieces=self.causal_pieces)

    def _rows_refusal(self, state: BackwardState, biased: bool) -> Optional[str]:
        if not self.rows_path:
            return "rows_path is off"
        if biased:
            return "bias tiles run on another backend"
        if state.q.dtype not in IO_DTYPES or state.lse.dtype != torch.float32:
            return f"{state.q.dtype} runs on the torch tiles"
        return fa4_rows.unavailable_reason(version(), self.device)

    # -- groups of tiles as one varlen call ---------------------------------------------------

    def _varlen_args(self, q, k, rows, cols, bands) -> Optional[dict]:
        """FA4's varlen arguments for a group, or None when it must run tile by tile."""
        if q.dtype not in IO_DTYPES or q.shape[0] != 1:
            return None
        windows = set()
        for r, c, band in zip(rows, cols, bands):
            n_q, n_kv = r.stop - r.start, c.stop - c.start
            trimmed = trim_band(band, n_q, n_kv)
            if trimmed is None or trimmed[:2] != (slice(0, n_q), slice(0, n_kv)):
                return None
            windows.add(fa4_window(trimmed[2], n_q, n_kv))
        if len(windows) != 1:
            return None
        causal, left, right = windows.pop()
        key = (tuple((r.start, r.stop) for r in rows), tuple((c.start, c.stop) for c in cols), q.shape[2], k.shape[2])
        if key in self._varlen:
            self._varlen.move_to_end(key)
        else:
            def index(parts, total):
                starts = [p.start for p in parts] + [total]
                return (torch.tensor(starts, dtype=torch.int32, device=q.device),
                        torch.tensor([p.stop - p.start for p in parts], dtype=torch.int32, device=q.device))
            (cu_q, used_q), (cu_k, used_k) = index(rows, q.shape[2]), index(cols, k.shape[2])
            self._varlen[key] = dict(cu_seqlens_q=cu_q, seqused_q=used_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                     max_seqlen_q=max(r.stop - r.start for r in rows),
                                     max_seqlen_k=max(c.stop - c.start for c in cols))
            if len(self._varlen) > INDEX_CACHE:   # packs that change every batch would grow it forever
                self._varlen.popitem(last=False)
        return dict(self._varlen[key], causal=causal, window_size_left=left, window_size_right=right)

    def forward_group(self, q, k, v, rows, cols, bands, sink, scale, *, out=None, lse=None):
        varlen = self._varlen_args(q, k, rows, cols, bands)
        if varlen is None:
            return super().forward_group(q, k, v, rows, cols, bands, sink, scale, out=out, lse=lse)
        if out is None:
            out = empty_bshd(q, q.shape[2])
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        with _program_name_only():
            _fa4._flash_attn_fwd(_bshd(q)[0], _bshd(k)[0], _bshd(v)[0], softmax_scale=scale,
                                 learnable_sink=self._sink(sink), return_lse=True, out=_bshd(out)[0], lse=lse[0],
                                 **varlen)
        return out, lse

    def backward_group(self, q, k, v, o, grad_out, lse, rows, cols, bands, sink, scale, *, dq=None):
        """One varlen call over the keys the group reads (from its first tile's first key to its last
        tile's last: under GQA FA4 zeroes and converts an fp32 dK/dV accumulator as long as the keys it
        is given); dq written straight into ``dq`` when that is a contiguous bshd tensor of q's dtype."""
        lo, hi = min(c.start for c in cols), max(c.stop for c in cols)
        span = tuple(slice(c.start - lo, c.stop - lo) for c in cols)
        varlen = self._varlen_args(q, k[:, :, lo:hi], rows, span, bands)
        if varlen is None:
            return super().backward_group(q, k, v, o, grad_out, lse, rows, cols, bands, sink, scale, dq=dq)
        direct = dq is not None and dq.dtype == q.dtype and _bshd(dq).is_contiguous()
        out_dq = dq if direct else empty_bshd(q, q.shape[2])
        dk, dv = empty_bshd(k, k.shape[2]), empty_bshd(v, v.shape[2])
        with _program_name_only():
            grads = _fa4._flash_attn_bwd(_bshd(q)[0], _bshd(k)[0, lo:hi], _bshd(v)[0, lo:hi], _bshd(o)[0],
                                         _bshd(grad_out)[0], lse[0], softmax_scale=scale, dq=_bshd(out_dq)[0],
                                         dk=_bshd(dk)[0, lo:hi], dv=_bshd(dv)[0, lo:hi],
                                         learnable_sink=self._sink(sink), **varlen)
        if dq is not None and not direct:
            add_rows_(dq, out_dq, rows, write=True)
        d_sink = None if sink is None else grads[3].reshape(sink.shape)
        return TileGrads(out_dq if dq is None else dq, dk, dv, d_sink, None)
