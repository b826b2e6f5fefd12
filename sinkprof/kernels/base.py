"""Tile kernels behind one interface (docs/design.md, section 7).

A tile is one rectangle of the attention matrix: ``q`` ``[b, h, n_q, d]`` against ``k``, ``v``
``[b, g, n_kv, d]`` (strided views are fine), with visibility given by a ``Band``. The forward
returns ``(o, lse)``; the backward takes the *given* ``lse`` and ``o`` (the final merged ones in a
ring) so it can be driven exactly like a fused kernel driven with merged stats. A tile given a
sink adds it to its softmax (forward) and returns its rows' sink gradient (backward).

A ring's backward runs through ``rows_backward``: one object per rank and backward pass that
takes that rank's tiles in plan order and keeps their rows' dq, so that a kernel able to
accumulate dq across tiles in its own format (FA4, ``fa4_rows``) does so, and every other kernel
adds each tile's dq to the ring's accumulator (``TileRowsBackward``).
"""
from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..options import Band, SinkStrategy, accum_dtype
from ..sink import fused_for


@dataclass
class TileGrads:
    dq: Optional[torch.Tensor]        # [b, h, n_q, d], accumulator dtype; None where a RowsBackward keeps dq
    dk: Optional[torch.Tensor]        # [b, g, n_kv, d]; None where written into the ``dkv`` given
    dv: Optional[torch.Tensor]        # [b, g, n_kv, d]; as dk
    d_sink: Optional[torch.Tensor]    # [1, h, 1, 1] when the tile carries the sink
    d_bias: Optional[torch.Tensor]    # the bias tile's own shape when a bias is given


class TileKernel(Protocol):
    name: str
    sink_strategy: SinkStrategy       # the strategy cp_attention uses here by default: the faster one
    concurrent: bool                  # two calls may run at once on two CUDA streams (nothing shared
                                      # between calls): a ring runs step 0 beside the next step (ring.Beside)

    def forward(self, q, k, v, band: Band, sink, bias, scale: float, *, out=None,
                lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (o ``[b, h, n_q, d]`` in q's dtype, lse ``[b, h, n_q]`` fp32/fp64, sink included),
        written into ``out`` and ``lse`` when they are given (views of the caller's buffers)."""

    def backward(self, q, k, v, o, grad_out, lse, band: Band, sink, bias, scale: float) -> TileGrads:
        """Gradients of the tile's rows, recomputed with the given ``lse`` and ``o``."""

    def rows_backward(self, state: "BackwardState", *, scale: float, tiles, biased: bool) -> "RowsBackward":
        """The backward of one rank's rows over ``tiles`` (every ``plan.Tile`` it will be given)."""

    def forward_group(self, q, k, v, rows: tuple[slice, ...], cols: tuple[slice, ...], bands: tuple[Band, ...],
                      sink, scale: float, *, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Several tiles at once (``plan.Step.groups``, a pack's documents; one band seen from each
        tile's bottom-right corner): tile i is rows ``rows[i]`` of ``q`` against rows ``cols[i]`` of
        ``k``, ``v`` with band ``bands[i]``; each writes its rows of ``o`` ``[b, h, n, d]`` and
        ``lse`` ``[b, h, n]`` (into ``out``, ``lse`` when given)."""

    def backward_group(self, q, k, v, o, grad_out, lse, rows: tuple[slice, ...], cols: tuple[slice, ...],
                       bands: tuple[Band, ...], sink, scale: float, *, dq=None) -> TileGrads:
        """The backward of ``forward_group``'s tiles: dq ``[b, h, n, d]`` valid on ``rows`` (written
        into ``dq`` when given, its other rows untouched), dK, dV ``[b, g, n_kv, d]`` valid on
        ``cols``, and the rows' sink gradient."""


@dataclass(frozen=True)
class BackwardState:
    """One rank's backward tensors (``[b, h, n, d]`` views; lse ``[b, h, n]``): the forward's final
    ``out`` and ``lse`` drive every tile."""

    q: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor         # final, sink-inclusive
    dq: torch.Tensor          # holds the rows' dq once ``RowsBackward.finish`` returns: in q's dtype (the
                              # rows backward accumulates apart and converts once) or the accumulator dtype


class RowsBackward(Protocol):
    concurrent: bool    # two tiles may run at once on two CUDA streams (dq rows they share added atomically)

    def tile(self, rows: slice, k, v, band: Band, sink, bias, *, first: bool, dkv=None) -> TileGrads:
        """One tile of rows ``rows`` against ``k``, ``v``: its dK, dV (and sink, bias) gradients;
        its dq goes to the rows' dq (``first``: the rows' first tile, nothing to add to yet), so
        the returned ``dq`` may be None. ``dkv``: ``(dk, dv)`` views the tile's dK/dV are to be
        written to (nothing else writes those rows); a kernel that writes them there itself
        returns ``dk = dv = None``."""

    def group(self, rows: tuple[slice, ...], k, v, cols: tuple[slice, ...], bands: tuple[Band, ...], sink, *,
              first: bool, dkv=None) -> TileGrads:
        """A group of tiles at once (``TileKernel.backward_group``): dK, dV valid on ``cols``, or
        written into ``dkv`` on ``cols`` (then None) as ``tile`` does."""

    def finish(self) -> None:
        """Every tile is in: ``state.dq`` holds the rows' dq."""


class TileRowsBackward:
    """A rank's rows tile after tile: each tile's dq written (first tile) or added into an
    accumulator (``state.dq`` itself when it has the accumulator dtype). With ``single`` (every
    row in one tile: the allgather schedule's one step) there is nothing to add: each tile's dq is
    written straight into ``state.dq``, a group's by the kernel itself."""

    concurrent = False   # two tiles' dq added into one accumulator: one after the other

    def __init__(self, kernel: TileKernel, state: BackwardState, scale: float, *, single: bool = False):
        self.kernel, self.state, self.scale, self.single = kernel, state, scale, single
        acc = accum_dtype(state.q.dtype)
        self.acc = state.dq if single or state.dq.dtype == acc else torch.empty_like(state.dq, dtype=acc)

    def tile(self, rows: slice, k, v, band: Band, sink, bias, *, first: bool, dkv=None) -> TileGrads:
        s = self.state
        grads = self.kernel.backward(s.q[:, :, rows], k, v, s.out[:, :, rows], s.grad_out[:, :, rows],
                                     s.lse[:, :, rows], band, sink, bias, self.scale)
        dq = self.acc[:, :, rows]
        if first:
            dq.copy_(grads.dq)
        else:
            dq += grads.dq
        return grads

    def group(self, rows, k, v, cols, bands, sink, *, first: bool, dkv=None) -> TileGrads:
        s = self.state
        if self.single:
            return self.kernel.backward_group(s.q, k, v, s.out, s.grad_out, s.lse, rows, cols, bands, sink, self.scale,
                                              dq=self.acc)
        grads = self.kernel.backward_group(s.q, k, v, s.out, s.grad_out, s.lse, rows, cols, bands, sink, self.scale)
        add_rows_(self.acc, grads.dq, rows, write=first)
        return grads

    def finish(self) -> None:
        if self.acc is not self.state.dq:
            self.state.dq.copy_(self.acc)


class TileByTile:
    """What a kernel that runs one tile per call does with a ring's rows and groups: each tile's
    dq added into the ring's accumulator, a group's tiles one after the other."""

    concurrent = False   # a backend whose calls share nothing says so

    def rows_backward(self, state: BackwardState, *, scale: float, tiles, biased: bool) -> TileRowsBackward:
        return TileRowsBackward(self, state, scale, single=one_tile_per_row(tiles))

    def forward_group(self, q, k, v, rows, cols, bands, sink, scale: float, *, out=None, lse=None):
        if out is None:
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=accum_dtype(q.dtype), device=q.device)
        for r, c, band in zip(rows, cols, bands):
            self.forward(q[:, :, r], k[:, :, c], v[:, :, c], band, sink, None, scale, out=out[:, :, r],
                         lse=lse[:, :, r])
        return out, lse

    def backward_group(self, q, k, v, o, grad_out, lse, rows, cols, bands, sink, scale: float, *, dq=None) -> TileGrads:
        acc = accum_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=acc, device=q.device) if dq is None else dq
        dk = torch.empty(k.shape, dtype=acc, device=k.device)
        dv = torch.empty(v.shape, dtype=acc, device=v.device)
        d_sink = None if sink is None else torch.zeros_like(sink)
        for r, c, band in zip(rows, cols, bands):
            part = self.backward(q[:, :, r], k[:, :, c], v[:, :, c], o[:, :, r], grad_out[:, :, r], lse[:, :, r],
                                 band, sink, None, scale)
            dq[:, :, r], dk[:, :, c], dv[:, :, c] = part.dq, part.dk, part.dv
            if sink is not None:
                d_sink += part.d_sink
        return TileGrads(dq, dk, dv, d_sink, None)


IO_DTYPES = (torch.bfloat16, torch.float16)   # what the GPU backends take; other dtypes run on torch


def one_tile_per_row(tiles) -> bool:
    """Every tile is its rows' first (``Tile.sink``): the first tiles cover each row once, so
    every row is in exactly one tile and its dq needs no accumulator."""
    return bool(tiles) and all(t.sink for t in tiles)


def add_rows_(dst: torch.Tensor, src: torch.Tensor, rows: tuple[slice, ...], *, write: bool = False) -> None:
    """``dst[:, :, r] += src[:, :, r]`` (``=`` with ``write``) for every range ``r`` of ``rows``
    (``[b, h, s, d]`` views; a group's tiles, a pack's documents): one fused pass on CUDA (a launch
    per document made a pack's backward pay ~10 us per document per step), a slice at a time
    elsewhere."""
    fused = fused_for(accum_dtype(dst.dtype), dst, src) if len(rows) > 1 else None   # (a bf16 dst: a part in K/V's dtype)
    if fused is not None:
        fused.add_rows_(dst, src, _row_index(tuple((r.start, r.stop) for r in rows), dst.device), write=write)
        return
    for r in rows:
        if write:
            dst[:, :, r].copy_(src[:, :, r])
        else:
            dst[:, :, r] += src[:, :, r]


INDEX_CACHE = 1024   # groups whose device index tensors a process keeps (the latest ones)


@functools.lru_cache(maxsize=INDEX_CACHE)
def _row_index(ranges: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """The sequence positions of ``ranges`` as an int32 tensor, made once (a warm ring stays
    graph-capturable). The cache keeps the ``INDEX_CACHE`` latest groups: a CUDA graph captured over a pack
    replays safely while fewer other groups than that run between its capture and its replays
    (packs that change every batch are not captured, and would otherwise grow the cache forever)."""
    return torch.cat([torch.arange(lo, hi, dtype=torch.int32) for lo, hi in ranges]).to(device)


def optional_module(name: str):
    """``(module, None)``, or ``(None, why)`` when the GPU extra that provides it is not importable."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # pragma: no cover - depends on the machine
        return None, f"{type(exc).__name__}: {exc}"


class BackendUnavailable(RuntimeError):
    """The requested tile backend cannot run here; the message says why."""


POOL_DRAWS = 64   # torch hands out streams from a pool of 32 a priority, in turn
_SIDE_STREAMS: dict = {}   # (device, a stream's handle, purpose) -> the streams handed out to run beside it
_HANDED: set = set()       # (device, handle) of every stream handed out here, or asked about
_SIDE_LOCK = threading.Lock()


def side_streams(stream: torch.cuda.Stream, count: int, purpose: str) -> list:
    """``count`` streams to run work beside ``stream`` (``purpose``: ``"beside"`` for a ring's step
    0, ``"pieces"`` for a tile's pieces), made once, at ``stream``'s priority, and none of them
    ``stream`` itself or a stream handed out here for anything else: torch makes streams by handing
    out those of a pool in turn, so a new one may be a stream already running other work (a ring's
    own, or a capture's), with which it would silently run in series; those are drawn past. Two
    threads capturing on streams of their own never share one."""
    dev = stream.device
    with _SIDE_LOCK:
        _HANDED.add((dev, stream.cuda_stream))
        have = _SIDE_STREAMS.setdefault((dev, stream.cuda_stream, purpose), [])
        have[:] = [s for s in have if s.cuda_stream != stream.cuda_stream]   # handed out once, the caller's now
        while len(have) < count:
            for _ in range(POOL_DRAWS):
                new = torch.cuda.Stream(dev, priority=stream.priority)
                if (dev, new.cuda_stream) not in _HANDED:
                    break
            _HANDED.add((dev, new.cuda_stream))
            have.append(new)
        return have[:count]


@functools.lru_cache(maxsize=4096)
def trim_band(band: Band, n_q: int, n_kv: int):
    """(q rows, kv rows, band) of the part of a tile that has anything visible, with
    ``lo <= 0 <= hi``; None if the tile sees nothing."""
    q0 = k0 = 0
    if band.hi is not None and band.hi < 0:           # the first -hi rows see no key
        q0 = -band.hi
        band = band.shifted(q0)
    if band.lo is not None and band.lo > 0:           # the first lo keys are seen by no row
        k0 = band.lo
        band = band.shifted(-band.lo)
    q1, k1 = n_q, n_kv
    if band.lo is not None:                           # rows past n_kv - lo see no key
        q1 = min(n_q, q0 + (n_kv - k0) - band.lo)
    if band.hi is not None:                           # keys past the last row + hi are unseen
        k1 = min(n_kv, k0 + (q1 - q0) + band.hi)
    if q1 <= q0 or k1 <= k0:
        return None
    lo = None if band.lo is None or band.lo <= -(q1 - q0 - 1) else band.lo
    hi = None if band.hi is None or band.hi >= k1 - k0 - 1 else band.hi
    return slice(q0, q1), slice(k0, k1), Band(lo, hi)


def empty_bshd(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A ``[b, h, rows, d]`` view with bshd strides (the layout the GPU kernels write fastest)."""
    b, h, _, d = x.shape
    return torch.empty(b, rows, h, d, dtype=x.dtype, device=x.device).permute(0, 2, 1, 3)


def deliver(o: torch.Tensor, lse: torch.Tensor, out: Optional[torch.Tensor],
            lse_out: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's result, in the caller's buffers when it gave them."""
    if out is not None and out is not o:
        out.copy_(o)
        o = out
    if lse_out is not None and lse_out is not lse:
        lse_out.copy_(lse)
        lse = lse_out
    return o, lse


def forward_trimmed(kernel, q, k, v, band, sink, bias, scale, trimmed):
    """A tile some of whose rows see no key: ``kernel`` runs the visible part (``trimmed``, from
    ``trim_band``); the other rows keep ``o = 0`` and ``lse = -inf``, or the sink when there is one."""
    b, h, n_q, _ = q.shape
    o = torch.zeros_like(empty_bshd(q, n_q))
    lse = torch.full((b, h, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    if trimmed is not None:
        rows, cols, sub = trimmed
        o_part, lse_part = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], sub, sink,
                                          None if bias is None else bias[:, :, rows][:, :, :, cols], scale)
        o[:, :, rows] = o_part
        lse[:, :, rows] = lse_part
    if sink is not None:  # a row with no key still has the sink: lse = a, o = 0
        empty = torch.isneginf(lse)
        lse = torch.where(empty, sink.reshape(1, -1, 1).to(lse.dtype).expand_as(lse), lse)
    return o, lse


def backward_trimmed(kernel, q, k, v, o, grad_out, lse, band, sink, bias, scale, trimmed) -> TileGrads:
    """Rows or keys that see nothing get zero gradients; the sink of an empty row gets
    ``-exp(a - lse') * D`` with ``D = rowsum(dO * o') = 0``, i.e. nothing."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    d_sink = torch.zeros_like(sink) if sink is not None else None
    d_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None else None
    if trimmed is not None:
        rows, cols, sub = trimmed
        part = kernel.backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], o[:, :, rows], grad_out[:, :, rows],
                               lse[:, :, rows], sub, sink,
                               None if bias is None else bias[:, :, rows][:, :, :, cols], scale)
        dq[:, :, rows] = part.dq.float()
        dk[:, :, cols] = part.dk.float()
        dv[:, :, cols] = part.dv.float()
        if sink is not None:
            d_sink = part.d_sink
        if bias is not None:
            d_bias[:, :, rows, cols] = part.d_bias.float()
    return TileGrads(dq, dk, dv, d_sink, d_bias)
