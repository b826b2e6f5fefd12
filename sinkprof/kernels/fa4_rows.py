"""FlashAttention-4's backward over one rank's rows: dq kept in FA4's own fp32 accumulator across a
ring's tiles (docs/design.md, section 7).

FA4's ``_flash_attn_bwd`` runs three kernels per call: a preprocess (``D = rowsum(dO * o)``, the lse
in base 2, a zeroed fp32 dq accumulator), the main kernel (dK, dV, and each block's dq added into the
accumulator), and a postprocess (the accumulator scaled and converted to dq's dtype, and the sink
gradient). A ring calling it per tile re-reads the rows' ``o`` and ``dO`` and zeroes, converts and
then adds a dq-sized buffer into its own accumulator at every step: four passes over dq-sized
memory per tile.

Here the preprocess runs once over the rank's rows, every tile's main kernel adds into one
accumulator, and one postprocess converts it at the end. FA4's accumulator is laid out in blocks of
``m_block_size`` rows, so a tile whose rows start on a block boundary (and end on one, or at the last
row) owns a contiguous part of it, and of ``D`` and the base-2 lse. A tile whose rows start off the
blocks runs from its first block's first row, the rows before its own given an lse of +inf (a copy of
the lse's rows, made once per pass): their probabilities are 0, so they add nothing to dq, dK or dV,
and FA4 aligns a mask to the tile's bottom-right corner, so the rows' own mask is unchanged. The
sink gradient of a tile's rows, ``-sum exp(a - lse) * D``, comes from the same ``D``. The layout of
the accumulator depends on the kernel configuration, so every tile of a rank runs one configuration:
FA4's for unmasked tiles (``configuration(unmasked=True)``, what ``FA4Tiles`` runs; at head dim 128
it has 80-row blocks where the one for masked tiles has 64, docs/design.md, section 7), or FA4's for
masked tiles when any tile is masked.

A tile whose dK/dV the ring writes rather than adds (every key row from one tile: a direct step's
part, kept in q's dtype) has FA4 write them there itself, with no scratch and no copy.

A causal ``n x n`` tile (a zigzag rank's step 0) may run as pieces cut by keys, on streams of their
own, longest first (``causal_cuts``). FA4's sm90 backward runs a program per block of keys that loops
over the rows that see it; its grid dispatches them head after head, each head's longest first, so
the last heads' longest programs start late and end alone: with few heads a single call ends in a
tail of idle SMs. The pieces are issued in order, the first (the longest programs of every head) on
the tile's stream, the others on helper streams, so the later pieces' short programs fill the first
one's tail. Their dq goes into the one accumulator through FA4's atomic adds; their keys, and so
their dK/dV, are disjoint.

``FA4Tiles.rows_backward`` takes this path when every tile qualifies (``unqualified``: rows that end
on a block or at the last row, every row and key of the tile visible, no bias, bf16/fp16) and the per-tile path
otherwise. The main kernel is compiled here as FA4's interface compiles it for sm90 (no varlen, not
deterministic, no score or mask modifiers): those are FA4 internals, so this path runs only on Hopper
and on the FA4 versions in ``VERSIONS``.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Optional

import torch

from .base import BackwardState, TileGrads, side_streams, trim_band

VERSIONS = ("4.0.0b36",)    # the FA4 releases whose internals this module was written against


def unavailable_reason(fa4_version: Optional[str], device) -> Optional[str]:
    """None when the rows path can run with this FA4 on ``device``, else why not."""
    if fa4_version not in VERSIONS:
        return f"the rows backward is written against flash-attn-4 {', '.join(VERSIONS)}, not {fa4_version}"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"the rows backward drives FA4's sm90 kernels; this GPU is sm{cap[0]}{cap[1]}"
    return None


PROGRAM_COST = 2   # a program's fixed work (loading its keys, writing dK/dV), in blocks of rows
SPLIT_GAIN = 0.01  # more pieces are taken when the model gives them this much less time than fewer


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def predicted_time(n: int, cuts: tuple, programs: int, tile_n: int, tile_m: int, sms: int) -> float:
    """The time, in blocks of rows, of the backward of a causal ``n x n`` tile run as pieces cut by
    keys at ``cuts`` (module docstring), on ``sms`` SMs holding one program each: FA4's grid of
    ``programs`` (batch x heads) times blocks of ``tile_n`` keys is dispatched in order, piece after
    piece, each program to the SM that frees first; the program of key block ``j`` in a piece
    starting at key ``k0`` loops over its rows' blocks of ``tile_m`` from key ``j``'s row to the
    last."""
    free = [0.0] * sms
    end = 0.0
    bounds = (0, *cuts, n)
    for k0, k1 in zip(bounds, bounds[1:]):
        last = -(-(n - k0) // tile_m)
        lengths = [last - (j * tile_n - k0) // tile_m + PROGRAM_COST for j in range(k0 // tile_n, -(-k1 // tile_n))]
        for _ in range(programs):
            for length in lengths:
                t = heapq.heappop(free) + length
                end = max(end, t)
                heapq.heappush(free, t)
    return end


def candidate_cuts(n: int, tile_n: int, tile_m: int) -> list:
    """The cuts ``causal_cuts`` chooses from, fewest pieces first: none, at half, at a half and three
    quarters, each on blocks of both sizes (those that round to nothing left out)."""
    unit = math.lcm(tile_n, tile_m)
    out = [()]
    for cuts in ((n // 2,), (n // 2, 3 * n // 4)):
        cuts = tuple(c // unit * unit for c in cuts)
        if len(set(cuts)) != len(cuts) or not all(0 < c < n for c in cuts):
            break
        out.append(cuts)
    return out


@functools.lru_cache(maxsize=256)
def causal_cuts(n: int, programs: int, tile_n: int, tile_m: int, sms: int) -> tuple:
    """The keys at which a causal ``n x n`` tile's backward is cut into pieces (module docstring):
    of ``candidate_cuts``, whichever ``predicted_time`` gives the least, more pieces only for
    ``SPLIT_GAIN`` less time than fewer."""
    best, best_t = (), predicted_time(n, (), programs, tile_n, tile_m, sms)
    for cuts in candidate_cuts(n, tile_n, tile_m)[1:]:
        t = predicted_time(n, cuts, programs, tile_n, tile_m, sms)
        if t < best_t * (1 - SPLIT_GAIN):
            best, best_t = cuts, t
    return best


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _writable(dkv, dtype: torch.dtype) -> bool:
    """Whether FA4 can write a tile's dK/dV straight into ``dkv`` (``[b, g, n, d]`` views): q's
    dtype, each row's head dim contiguous, 16-byte aligned as FA4 assumes of its tensors."""
    return dkv is not None and all(x.dtype == dtype and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
                                   and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]) for x in dkv)


def configuration(interface, tiles, d: int, d_v: int, *, unmasked: bool = False):
    """FA4's sm90 backward configuration (``interface``: ``flash_attn.cute.interface``) for a rank
    whose backward runs ``tiles``: FA4's for masked tiles when any tile is masked, or with
    ``unmasked`` its configuration for unmasked tiles when no tile has a window's left bound (FA4
    runs its windowed kernels on the masked one only; causal tiles were measured and tested on both:
    module docstring)."""
    bands = [trim_band(t.band, t.q_rows.stop - t.q_rows.start, t.kv_rows.stop - t.kv_rows.start) for t in tiles]
    bands = [trimmed[2] for trimmed in bands if trimmed is not None]
    if unmasked and all(band.lo is None for band in bands):
        return interface._tile_size_bwd_sm90(d, d_v, False, False)
    masked = any(band.lo is not None or band.hi is not None for band in bands)
    return interface._tile_size_bwd_sm90(d, d_v, masked, False)


def unqualified(tiles, n: int, block: int) -> Optional[str]:
    """None when every tile can run on the rows path with ``block``-row blocks, else why not."""
    for tile in tiles:
        rows, cols = tile.q_rows, tile.kv_rows
        n_q, n_kv = rows.stop - rows.start, cols.stop - cols.start
        trimmed = trim_band(tile.band, n_q, n_kv)
        if trimmed is None or trimmed[:2] != (slice(0, n_q), slice(0, n_kv)):
            return f"a tile of rows {rows.start}..{rows.stop} sees only part of its rows or keys"
        if rows.stop % block and rows.stop != n:
            return f"a tile's rows {rows.start}..{rows.stop} do not end on a {block}-row block or the last row"
    return None


def choose_configuration(interface, tiles, n: int, d: int, d_v: int, *, unmasked: bool) -> tuple:
    """(configuration, None) for a rank of ``n`` rows whose every tile qualifies under it: the one
    ``unmasked`` asks for, else FA4's own (a thd pack's tiles end where its documents' chunks do,
    which may be on the blocks of one and not the other); else (None, why not)."""
    why = None
    for each in dict.fromkeys((unmasked, False)):
        cfg = configuration(interface, tiles, d, d_v, unmasked=each)
        why = unqualified(tiles, n, cfg.m_block_size)
        if why is None:
            return cfg, None
    return None, why


class FA4RowsBackward:
    """The rows path (module docstring): one preprocess, a main kernel per tile, one postprocess.
    Two tiles may run at once on two streams (``ring.Beside``): their dq goes into the accumulator
    through FA4's atomic adds, and each stream has dK/dV scratch of its own."""

    concurrent = True

    def __init__(self, interface, state: BackwardState, scale: float, cfg, *, tiles, window, quiet,
                 causal_pieces: bool = True):
        """``interface``: ``flash_attn.cute.interface``; ``tiles``: the rank's tiles (``plan.Tile``,
        every one that ``tile`` will be given); ``window``: a trimmed band as FA4's ``(causal, left,
        right)``; ``quiet``: the context that hides the command line from the CuTe DSL (``fa4.py``);
        ``causal_pieces``: whether a causal tile may run as pieces (``causal_cuts``)."""
        fa4 = self.fa4 = interface
        self.state, self.scale, self.cfg = state, scale, cfg
        self.kv_rows = max(t.kv_rows.stop - t.kv_rows.start for t in tiles)
        self._window, self._quiet = window, quiet
        q = state.q
        b, h, n, d = q.shape
        d_v = state.out.shape[-1]
        self.dtype = q.dtype
        self.block = cfg.m_block_size
        self.hdim_multiple_of = 64 if cfg.dKV_swapAB else 32
        self.d_rounded = _round_up(d, self.hdim_multiple_of)
        self.dv_rounded = _round_up(d_v, self.hdim_multiple_of)
        n_rounded = _round_up(n, self.block)
        f32 = dict(dtype=torch.float32, device=q.device)
        self.dq_accum = torch.empty(b, h, n_rounded * self.d_rounded, **f32)
        self.dpsum = torch.empty(b, h, n_rounded, **f32)
        self.lse_log2 = torch.empty(b, h, n_rounded, **f32)
        self.q = fa4.maybe_contiguous(_bshd(q))
        self.dout = fa4.maybe_contiguous(_bshd(state.grad_out))
        self.cute_dtype = fa4.torch2cute_dtype_map[q.dtype]
        self.arch = fa4._get_device_arch()
        self._kv_scratch: dict = {}   # a stream -> its dK/dV scratch
        self.causal_pieces = causal_pieces
        self.sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        with self._quiet():
            fa4._bwd_preprocess(fa4.maybe_contiguous(_bshd(state.out)), self.dout, self.dpsum,
                                fa4.maybe_contiguous(state.lse), self.lse_log2, self.dq_accum, None, None, None,
                                self.cute_dtype, d, d_v, self.block, hdim_multiple_of=self.hdim_multiple_of,
                                fake_mode=False)
        # a main kernel's rows start on a block: rows off one run from the block's first row, the rows
        # before theirs seeing nothing (an lse of +inf: every probability 0), from a copy of the lse
        self._lse_from: dict = {}   # a first row off the blocks -> that copy, from its block's first row
        for start in sorted({t.q_rows.start for t in tiles if t.q_rows.start % self.block}):
            self._lse_from[start] = self._lse_before(start)

    def _lse_before(self, start: int) -> torch.Tensor:
        """The base-2 lse of the rows from ``start``'s block's first row on, +inf before ``start``.
        The rows it blanks keep their q, dO and D, which are finite (every row of a rank is written by
        its step 0), so their zero probabilities add exactly nothing."""
        at = start // self.block * self.block
        lse = self.lse_log2[:, :, at:].clone()
        lse[:, :, :start - at] = math.inf
        return lse

    def _scratch(self, k: torch.Tensor, v: torch.Tensor, dkv):
        """dK/dV outputs (q's dtype, ``[b, n_kv, g, d]``: ``dkv``'s when given, else scratch) and,
        under GQA, FA4's zeroed fp32 accumulators for them: views of buffers made at the stream's
        first tile for the largest tile, one set a stream."""
        b, g, n_kv, d = k.shape
        stream = torch.cuda.current_stream(k.device).cuda_stream
        if stream not in self._kv_scratch:
            rows, dev = _round_up(self.kv_rows, self.cfg.n_block_size), k.device
            s = dict(dk=torch.empty(b, rows, g, d, dtype=self.dtype, device=dev),
                     dv=torch.empty(b, rows, g, v.shape[-1], dtype=self.dtype, device=dev))
            if self.state.q.shape[1] != g:
                s.update(dk_accum=torch.empty(b, g, rows * self.d_rounded, dtype=torch.float32, device=dev),
                         dv_accum=torch.empty(b, g, rows * self.dv_rounded, dtype=torch.float32, device=dev))
            self._kv_scratch[stream] = s
        s = self._kv_scratch[stream]
        if dkv is not None:
            dk, dv = _bshd(dkv[0]), _bshd(dkv[1])
        else:
            dk, dv = s["dk"][:, :n_kv], s["dv"][:, :n_kv]
        if "dk_accum" not in s:
            return dk, dv, None, None
        n_rounded = _round_up(n_kv, self.cfg.n_block_size)
        dk_accum = s["dk_accum"][:, :, :n_rounded * self.d_rounded]
        dv_accum = s["dv_accum"][:, :, :n_rounded * self.dv_rounded]
        dk_accum.zero_()
        dv_accum.zero_()
        return dk, dv, dk_accum, dv_accum

    def tile(self, rows: slice, k, v, band, sink, bias, *, first: bool, dkv=None) -> TileGrads:
        fa4, cfg = self.fa4, self.cfg
        direct = _writable(dkv, self.dtype)
        n_q, n_kv = rows.stop - rows.start, k.shape[2]
        band = trim_band(band, n_q, n_kv)[2]
        k, v = fa4.maybe_contiguous(_bshd(k)), fa4.maybe_contiguous(_bshd(v))
        dk, dv, dk_accum, dv_accum = self._scratch(_bshd(k), _bshd(v), dkv if direct else None)
        causal, _, _ = self._window(band, n_q, n_kv)
        cuts = ()
        if self.causal_pieces and causal and n_q == n_kv and rows.start % self.block == 0:   # pieces start on blocks
            b, h = self.q.shape[0], self.q.shape[2]
            cuts = causal_cuts(n_q, b * h, cfg.n_block_size, self.block, self.sms)
        bounds = (0, *cuts, n_kv)
        here = torch.cuda.current_stream(k.device)
        helpers = side_streams(here, len(cuts), "pieces") if cuts else []
        for helper in helpers:   # before the first piece is issued: the pieces run side by side
            helper.wait_stream(here)
        try:
            for stream, k0, k1 in zip((here, *helpers), bounds, bounds[1:]):
                # a piece: the keys [k0, k1) and the rows from k0 on (the first that see them when the tile is cut)
                accum = [None if x is None else x[:, :, k0 * width:_round_up(k1, cfg.n_block_size) * width]
                         for x, width in ((dk_accum, self.d_rounded), (dv_accum, self.dv_rounded))]
                with torch.cuda.stream(stream):
                    self._main(slice(rows.start + k0, rows.stop), k[:, k0:k1], v[:, k0:k1], band,
                               dk[:, k0:k1], dv[:, k0:k1], *accum)
        finally:   # an error's way out too: a capture must not end with work forked and not joined
            for helper in helpers:
                here.wait_stream(helper)
        if dk_accum is not None:
            post = dict(use_2cta_instrs=False, cluster_size=1, hdim_multiple_of=self.hdim_multiple_of,
                        accum_order=None, fake_mode=False)
            threads = cfg.num_wg * 128
            with self._quiet():
                fa4._bwd_postprocess_convert(dk_accum, dk, self.scale, None, None, self.arch, self.cute_dtype, k.shape[-1],
                                             cfg.n_block_size, threads, cfg.AtomLayoutNdKV, cfg.dKV_swapAB, **post)
                fa4._bwd_postprocess_convert(dv_accum, dv, 1.0, None, None, self.arch, self.cute_dtype, v.shape[-1],
                                             cfg.n_block_size, threads, cfg.AtomLayoutNdKV, cfg.dKV_swapAB, **post)
        d_sink = None
        if sink is not None:   # -sum over the rows of exp(a - lse) * D, per head
            lse = self.state.lse[:, :, rows]
            d_sink = -(torch.exp(sink.reshape(1, -1, 1).float() - lse) * self.dpsum[:, :, rows.start:rows.stop]).sum((0, 2))
            d_sink = d_sink.reshape(sink.shape).to(sink.dtype)
        if direct:
            return TileGrads(None, None, None, d_sink, None)
        return TileGrads(None, _bshd(dk), _bshd(dv), d_sink, None)

    def _main(self, rows: slice, k, v, band, dk, dv, dk_accum, dv_accum) -> None:
        """FA4's main kernel over ``rows`` of the rank's rows and the keys ``k``, ``v`` (``[b, n, g,
        d]``), adding dq into the accumulator and writing dK/dV (under GQA: adding into their fp32
        accumulators) on the current stream."""
        fa4, cfg = self.fa4, self.cfg
        n_q, n_kv = rows.stop - rows.start, k.shape[1]
        causal, left, right = self._window(trim_band(band, n_q, n_kv)[2], n_q, n_kv)
        causal, local, left, right = fa4._resolve_causal_local_window(causal, left, right)
        # rows off the blocks run from their block's first row, the rows before theirs seeing nothing
        # (__init__); FA4 aligns a mask to the bottom-right corner, so the rows' own are unchanged
        start, at = rows.start, rows.start // self.block * self.block
        rows, n_q = slice(at, rows.stop), rows.stop - at
        q_rounded = _round_up(n_q, self.block)
        if at != start and start not in self._lse_from:   # a tile __init__ was not given
            self._lse_from[start] = self._lse_before(start)
        lse_log2 = self._lse_from[start][:, :, :q_rounded] if at != start else self.lse_log2[:, :, at:at + q_rounded]
        dpsum = self.dpsum[:, :, at:at + q_rounded]
        dq_accum = self.dq_accum[:, :, at * self.d_rounded:(at + q_rounded) * self.d_rounded]
        q, dout = self.q[:, rows], self.dout[:, rows]
        gqa = dk_accum is not None
        args = [q, k, v, dout, lse_log2, dpsum, dq_accum, dk_accum if gqa else dk, dv_accum if gqa else dv]
        key = ("rows_bwd", str(self.dtype), q.shape[-1], v.shape[-1], q.shape[2] // k.shape[2], causal, local,
               left is not None, right is not None, dataclasses.astuple(cfg),
               q_rounded // self.block == 1, _round_up(n_kv, cfg.n_block_size) // cfg.n_block_size == 1)
        compiled = _compiled_kernels(fa4)
        if key not in compiled:
            with self._quiet():
                compiled[key] = self._compile(args, causal, local, left, right)
        compiled[key](*[t.detach() for t in args[:4]], *args[4:], self.scale, None, None, None, None, left, right,
                      None, None, None, fa4.AuxData(None, None), None, None)

    def group(self, rows, k, v, cols, bands, sink, *, first: bool, dkv=None) -> TileGrads:
        """Tile after tile; each tile's dK/dV written into ``dkv`` (when in q's dtype) or into fp32
        buffers of the group's keys."""
        direct = _writable(dkv, self.dtype)
        if direct:
            dk, dv = dkv
        else:
            dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        d_sink = None
        for r, c, band in zip(rows, cols, bands):
            part = self.tile(r, k[:, :, c], v[:, :, c], band, sink, None, first=first,
                             dkv=(dk[:, :, c], dv[:, :, c]) if direct else None)
            if part.dk is not None:   # not written in place (a view FA4 cannot write to)
                dk[:, :, c], dv[:, :, c] = part.dk, part.dv
            d_sink = part.d_sink if d_sink is None else d_sink + part.d_sink
        return TileGrads(None, None if direct else dk, None if direct else dv, d_sink, None)

    def _compile(self, args, causal: bool, local: bool, left, right):
        fa4, cfg = self.fa4, self.cfg
        q, k, v = args[:3]
        kernel = fa4.FlashAttentionBackwardSm90(
            self.cute_dtype, q.shape[-1], v.shape[-1], q.shape[2] // k.shape[2], causal, is_local=local,
            deterministic=False, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q,
            dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB,
            dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
            AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128,
            V_in_regs=False, score_mod=None, score_mod_bwd=None, mask_mod=None, has_aux_tensors=False,
            q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg)
        tensors = [fa4.to_cute_tensor(t) for t in args]
        stream = fa4.cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return fa4.cute.compile(kernel, *tensors, self.scale, None, None, None, None, left, right, None, None, None,
                                fa4.AuxData(None, None), None, None, stream, options="--enable-tvm-ffi")

    def finish(self) -> None:
        """FA4's postprocess converts the accumulator straight into ``state.dq`` when that is a
        contiguous ``[b, n, h, d]`` tensor of q's dtype (the ring's dq in the bshd layout), else
        into a buffer copied there."""
        fa4, cfg = self.fa4, self.cfg
        want = _bshd(self.state.dq)
        dq = want if want.dtype == self.dtype and want.is_contiguous() else torch.empty_like(self.q)
        threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
        with self._quiet():
            fa4._bwd_postprocess_convert(self.dq_accum, dq, self.scale, None, None, self.arch, self.cute_dtype,
                                         self.q.shape[-1], self.block, threads, cfg.AtomLayoutMdQ, cfg.dQ_swapAB,
                                         use_2cta_instrs=False, cluster_size=1, hdim_multiple_of=self.hdim_multiple_of,
                                         accum_order=None, fake_mode=False)
        if dq is not want:
            want.copy_(dq)


_kernels = None


def _compiled_kernels(interface):
    """The compiled main kernels, kept on disk across processes as FA4 keeps its own
    (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``)."""
    global _kernels
    if _kernels is None:
        _kernels = interface.get_jit_cache("sinkprof_rows_bwd")
    return _kernels
