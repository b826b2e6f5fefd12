"""The p2p ring: one rank's forward and backward over the ring plan (docs/design.md, section 3).

The loops here know nothing about communication: they ask a ``KVSource`` for the K/V of each
step and a ``DKVSink`` for where that step's dK/dV go. The distributed ring (``cp_p2p``) hands
them double-buffered isend/irecv exchanges; the fp64 emulator hands them plain indexing into
every rank's shards. Both therefore execute literally the same schedule.

Tensors in the loops are ``[b, h, s, d]`` views (``[b, h, s]`` for lse), accumulators in fp32
(fp64 for fp64 runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from . import faults, profiling
from .options import CPOptions, SinkStrategy, accum_dtype
from .plan import RankPlan, Step, Tile, global_rows, ring_plan
from .sink import fold_, merge_, sink_grad, sink_logits


class KVSource(Protocol):
    def get(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[b, g, 2c, d]`` views) of ``step.kv_rank``; may start the next exchange."""


class DKVSink(Protocol):
    def start(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulators for dK and dV of ``step.kv_rank``, to add this step's tiles into."""

    def finish(self, step: Step) -> None:
        """This step's tiles are in; pass the accumulators on."""


class LocalKV:
    """Every rank's K/V in memory: "communication" is indexing (the emulator, simulations)."""

    def __init__(self, ks, vs):
        self.ks, self.vs = ks, vs

    def get(self, step: Step):
        return self.ks[step.kv_rank], self.vs[step.kv_rank]


class LocalDKV:
    """dK/dV added straight into their owner's accumulators (one per rank, or one shared)."""

    def __init__(self, dks, dvs):
        self.dks, self.dvs = dks, dvs

    def start(self, step: Step):
        if isinstance(self.dks, torch.Tensor):
            return self.dks, self.dvs
        return self.dks[step.kv_rank], self.dvs[step.kv_rank]

    def finish(self, step: Step) -> None:
        """Nothing travels: the accumulators already are the owners'."""


class BiasTiles:
    """The slices of a full ``[1|b, 1|h, S, S]`` bias that each tile sees, and their gradient."""

    def __init__(self, bias: torch.Tensor, plan: RankPlan, q_pos: torch.Tensor, kv_pos: list[torch.Tensor],
                 grad_dtype: torch.dtype):
        self.bias = bias
        self.index = {}
        for step in plan.steps:
            for t, tile in enumerate(step.tiles):
                self.index[(step.index, t)] = (q_pos[tile.q_rows], kv_pos[step.kv_rank][tile.kv_rows])
        self.grad = torch.zeros(bias.shape, dtype=grad_dtype, device=bias.device)

    def tile(self, step: Step, t: int) -> torch.Tensor:
        rows, cols = self.index[(step.index, t)]
        return self.bias[:, :, rows[:, None], cols[None, :]]

    def add_grad(self, step: Step, t: int, grad: torch.Tensor) -> None:
        rows, cols = self.index[(step.index, t)]
        self.grad[:, :, rows[:, None], cols[None, :]] += grad


def tile_sink(tile: Tile, sink: Optional[torch.Tensor], strategy: SinkStrategy) -> Optional[torch.Tensor]:
    """The sink a tile gets: step 0's tiles under ``step0``, every tile under the ``every-tile`` bug."""
    if sink is None or strategy is SinkStrategy.POST_MERGE:
        return None
    return sink if (tile.sink or strategy is SinkStrategy.EVERY_TILE) else None


@dataclass(frozen=True)
class ForwardState:
    """One rank's forward tensors (``[b, h, 2c, d]`` views; lse ``[b, h, 2c]``)."""

    q: torch.Tensor
    o_acc: Optional[torch.Tensor]   # merged output so far (accumulator dtype); None if the plan never needs it
    lse_acc: torch.Tensor     # merged log-sum-exp so far; sink-inclusive once ``run_forward`` returns
    out: torch.Tensor         # the output, in q's dtype; also holds each row's first partial result


@dataclass(frozen=True)
class BackwardState:
    """One rank's backward tensors: the forward's final ``out`` and ``lse`` drive every tile."""

    q: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor         # final, sink-inclusive
    dq_acc: torch.Tensor      # accumulator dtype; written (not added to) by each row's first tile


def run_forward(plan: RankPlan, kv: KVSource, *, state: ForwardState, sink: Optional[torch.Tensor],
                bias: Optional[BiasTiles], opts: CPOptions) -> None:
    """Every tile of every step, joined to its rows as the plan says (``Tile.merges``): a row's
    first tile (step 0) writes the output buffer and the stats, later tiles merge into the
    accumulator, and a row's last tile merges into the output, folding the sink in under
    post-merge. ``lse_acc`` ends sink-inclusive."""
    strategy = faults.active.sink_strategy(opts.sink_strategy)
    fold = sink if strategy is SinkStrategy.POST_MERGE else None
    for step in plan.steps:
        k, v = kv.get(step)
        with profiling.active.compute("fwd", step.index):
            _forward_tiles(step, k=k, v=v, state=state, sink=sink, fold=fold, bias=bias, opts=opts,
                           strategy=strategy)
    if fold is not None:
        for rows in plan.alone:  # rows only their first tile sees: their output is that tile's
            out = state.out[:, :, rows]
            fold_(out, out, state.lse_acc[:, :, rows], fold)


def _forward_tiles(step: Step, *, k, v, state: ForwardState, sink, fold, bias, opts: CPOptions,
                   strategy: SinkStrategy) -> None:
    """One forward step: every tile, written or merged where its rows' result belongs."""
    q, out, o_acc, lse_acc = state.q, state.out, state.o_acc, state.lse_acc
    for t, tile in enumerate(step.tiles):
        rows = tile.q_rows
        args = (q[:, :, rows], k[:, :, tile.kv_rows], v[:, :, tile.kv_rows], tile.band,
                tile_sink(tile, sink, strategy), bias.tile(step, t) if bias else None, opts.scale)
        if tile.sink:  # the first tile of these rows: straight into the output buffer and the stats
            opts.kernel.forward(*args, out=out[:, :, rows], lse=lse_acc[:, :, rows])
            continue
        o, lse = opts.kernel.forward(*args)
        for m in tile.merges:
            part = slice(m.rows.start - rows.start, m.rows.stop - rows.start)
            merged = (out if m.second else o_acc)[:, :, m.rows]
            if m.last:
                into = out[:, :, m.rows]
            elif m.second:
                into = o_acc[:, :, m.rows]
            else:
                into = None                  # in place, in the accumulator
            merge_(merged, lse_acc[:, :, m.rows], o[:, :, part], lse[:, :, part], into=into,
                   sink=fold if m.last else None)


def run_backward(plan: RankPlan, kv: KVSource, dkv: DKVSink, *, state: BackwardState,
                 sink: Optional[torch.Tensor], bias: Optional[BiasTiles], opts: CPOptions) -> Optional[torch.Tensor]:
    """Recompute every tile with the final ``lse`` and ``out``; return this rank's rows' sink gradient."""
    strategy = faults.active.sink_strategy(opts.sink_strategy)
    from_tiles = sink is not None and strategy is not SinkStrategy.POST_MERGE
    d_sink = torch.zeros_like(sink) if from_tiles else None
    for step in plan.backward_steps:
        k, v = kv.get(step)
        dk, dv = dkv.start(step)
        with profiling.active.compute("bwd", step.index):
            _backward_tiles(step, k=k, v=v, dk=dk, dv=dv, state=state, sink=sink, bias=bias, opts=opts,
                            strategy=strategy, d_sink=d_sink)
        dkv.finish(step)
    if sink is not None and not from_tiles:
        d_sink = sink_grad(state.out, state.grad_out, state.lse, sink)
    return d_sink


def _backward_tiles(step: Step, *, k, v, dk, dv, state: BackwardState, sink, bias, opts: CPOptions,
                    strategy: SinkStrategy, d_sink) -> None:
    """One backward step: every tile's gradients added to dq, this step's dK/dV and the sink's."""
    q, out, grad_out, lse, dq_acc = state.q, state.out, state.grad_out, state.lse, state.dq_acc
    for t, tile in enumerate(step.tiles):
        rows, cols = tile.q_rows, tile.kv_rows
        grads = opts.kernel.backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                                     grad_out[:, :, rows], lse[:, :, rows], tile.band,
                                     tile_sink(tile, sink, strategy),
                                     bias.tile(step, t) if bias else None, opts.scale)
        if tile.sink:  # the rows' first tile (step 0 comes first): no zeroed accumulator to add to
            dq_acc[:, :, rows].copy_(grads.dq)
        else:
            dq_acc[:, :, rows] += grads.dq
        dk[:, :, cols] += grads.dk
        dv[:, :, cols] += grads.dv
        if grads.d_sink is not None:
            d_sink += grads.d_sink
        if grads.d_bias is not None:
            bias.add_grad(step, t, grads.d_bias)


class RingKV:
    """K/V of each step over the ring: step i+1's exchange is in flight while step i computes."""

    def __init__(self, comm, k: torch.Tensor, v: torch.Tensor, fmt, phase: str):
        self.comm, self.fmt, self.phase = comm, fmt, phase
        self.bufs = [torch.stack([k, v])]
        self.bufs.append(torch.empty_like(self.bufs[0]))
        self.pending = None

    def get(self, step: Step):
        i = step.index
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        faults.active.on_ring_step(self.comm.rank, self.phase, i)
        cur = self.bufs[i % 2]
        if i + 1 < self.comm.size:
            self.pending = self.comm.exchange(cur, self.bufs[(i + 1) % 2], "kv", self.phase, i)
        return self.fmt.to_bhsd(cur[0]), self.fmt.to_bhsd(cur[1])


class RingDKV:
    """dK/dV travel one hop behind K/V: each step adds its tiles to what the previous rank sent
    and passes the sum on; after the last step every shard's gradient has arrived home."""

    def __init__(self, comm, shape, dtype: torch.dtype, device, fmt):
        self.comm, self.fmt = comm, fmt
        self.parts = [torch.empty((2, *shape), dtype=dtype, device=device) for _ in range(2)]
        self.incoming = [torch.empty_like(self.parts[0]) for _ in range(2)]
        self.pending = None
        self.last = 0

    def start(self, step: Step):
        part = self.parts[step.index % 2].zero_()
        return self.fmt.to_bhsd(part[0]), self.fmt.to_bhsd(part[1])

    def finish(self, step: Step) -> None:
        i = step.index
        part = self.parts[i % 2]
        if self.pending is not None:
            self.pending.wait()
            part += self.incoming[(i - 1) % 2]
        if self.comm.size > 1:
            self.pending = self.comm.exchange(part, self.incoming[i % 2], "dkv", "bwd", i)
        self.last = i

    def home(self) -> torch.Tensor:
        """``[2, *kv_shape]``: this rank's own dK and dV, summed over every rank's tiles."""
        if self.comm.size == 1:
            return self.parts[0]
        self.pending.wait()
        return self.incoming[self.last % 2]


class P2PAttention(torch.autograd.Function):
    """Ring attention over ``comm`` on this rank's load-balanced shard (user layout in and out)."""

    @staticmethod
    def forward(ctx, q, k, v, offset, bias, opts: CPOptions, comm):
        fmt = opts.spec.qkv_format
        chunk = q.shape[fmt.seq_dim] // 2
        plan = ring_plan(comm.size, comm.rank, chunk, opts.spec.band)
        acc = accum_dtype(q.dtype)
        h = q.shape[2]
        sink = faults.active.ring_sink(sink_logits(opts.spec.softmax_type, offset, h, q.device))
        bias_tiles = _bias_tiles(bias, plan, comm.size, chunk, acc)
        o_acc = torch.empty(q.shape, dtype=acc, device=q.device) if plan.accumulates else None
        lse = torch.empty((q.shape[1 - fmt.seq_dim], h, 2 * chunk), dtype=acc, device=q.device)
        out = torch.empty_like(q)
        run_forward(plan, RingKV(comm, k, v, fmt, "fwd"),
                    state=ForwardState(fmt.to_bhsd(q), None if o_acc is None else fmt.to_bhsd(o_acc), lse,
                                       fmt.to_bhsd(out)),
                    sink=sink, bias=bias_tiles, opts=opts)
        ctx.save_for_backward(q, k, v, out, lse, offset, bias)
        ctx.opts, ctx.comm, ctx.plan, ctx.sink_is_param = opts, comm, plan, offset is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, offset, bias = ctx.saved_tensors
        opts, comm, plan = ctx.opts, ctx.comm, ctx.plan
        fmt = opts.spec.qkv_format
        acc = accum_dtype(q.dtype)
        sink = faults.active.ring_sink(sink_logits(opts.spec.softmax_type, offset, q.shape[2], q.device))
        bias_tiles = _bias_tiles(bias, plan, comm.size, plan.chunk, acc)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)    # step 0 writes every row first
        dkv = RingDKV(comm, k.shape, acc, q.device, fmt)
        d_sink = run_backward(plan, RingKV(comm, k, v, fmt, "bwd"), dkv,
                              state=BackwardState(fmt.to_bhsd(q), fmt.to_bhsd(out), fmt.to_bhsd(grad_out), lse,
                                                  fmt.to_bhsd(dq)),
                              sink=sink, bias=bias_tiles, opts=opts)
        dk, dv = dkv.home()
        d_offset = d_bias = None
        if ctx.sink_is_param:  # this rank's rows' part; the CP contract is applied by `replicated`
            d_offset = d_sink if d_sink is not None else torch.zeros_like(offset)
        if bias is not None:
            d_bias = bias_tiles.grad.to(bias.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_offset, d_bias, None, None


def _bias_tiles(bias, plan: RankPlan, cp: int, chunk: int, acc) -> Optional[BiasTiles]:
    if bias is None:
        return None
    device = bias.device
    positions = [global_rows(cp, r, chunk, device) for r in range(cp)]
    return BiasTiles(bias, plan, positions[plan.rank], positions, acc)
