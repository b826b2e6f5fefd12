"""The p2p ring: one rank's forward and backward over the ring plan (docs/design.md, section 3).

The loops here know nothing about communication: they ask a ``KVSource`` for the K/V of each
step and a ``DKVSink`` for where that step's dK/dV go. The distributed ring hands them the
messages of its communication schedule (``sinkprof.schedule``): double-buffered neighbour
exchanges of whole shards (``RingKV``, ``RingDKV``), the rows each step reads straight from
their owner (``DirectKV``, ``DirectDKV``), or the rows of every shard the rank's tiles read,
gathered for one step (``GatherKV``, ``GatherDKV``); the fp64 emulator hands them indexing into every
rank's shards that exposes only what the schedule sends (``LocalKV``, ``LocalDKV``). All of them
therefore execute literally the same plan.

Tensors in the loops are ``[b, h, s, d]`` views (``[b, h, s]`` for lse), accumulators in fp32
(fp64 for fp64 runs).
"""
from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from . import faults, profiling
from .dist import differentiable_once
from .kernels.base import BackwardState, add_rows_, side_streams
from .options import CPOptions, KVSchedule, SinkStrategy, accum_dtype
from .plan import RankPlan, Step, Tile, rows_in, spec_layout
from .schedule import CommSchedule, comm_schedule, row_bytes
from .sink import NEG_INF, fused_for, merge_parts_, sink_grad, sink_logits


class KVSource(Protocol):
    def get(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[b, g, 2c, d]`` views) of ``step.kv_rank``; may start the next exchange."""


class DKVSink(Protocol):
    def start(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Accumulators for dK and dV of ``step.kv_rank``, and whether the step's tiles write them
        (fresh, every row from one tile: ``Step.kv_cover``) rather than add into them."""

    def finish(self, step: Step) -> None:
        """This step's tiles are in; pass the accumulators on."""


class MissingRows(RuntimeError):
    """A tile read a K/V row that its owner did not send (the emulated direct schedule)."""


def _whole(step: Step, rows: int) -> bool:
    return step.held == (slice(0, rows),)


def _held_index(step: Step, device) -> torch.Tensor:
    """The owner's row behind each row of the step's K/V buffer."""
    return torch.cat([torch.arange(p.start, p.stop, device=device) for p in step.held]) if step.held else \
        torch.zeros(0, dtype=torch.int64, device=device)


def _arrived(held, sent) -> list[tuple[int, int, int]]:
    """(buffer row, owner row, rows) of every piece of the owner's rows in ``sent`` that lies in
    ``held`` (buffer order)."""
    out, at = [], 0
    for h in held:
        for part in sent:
            lo, hi = max(part.start, h.start), min(part.stop, h.stop)
            if lo < hi:
                out.append((at + lo - h.start, lo, hi - lo))
        at += h.stop - h.start
    return sorted(out)


def _uncovered(rows: slice, pieces) -> list[slice]:
    """The parts of ``rows`` (buffer rows) that no piece filled."""
    gaps, at = [], rows.start
    for start, _, n in pieces:
        if start > at and at < rows.stop:
            gaps.append(slice(at, min(start, rows.stop)))
        at = max(at, start + n)
    if at < rows.stop:
        gaps.append(slice(at, rows.stop))
    return gaps


class LocalKV:
    """Every rank's K/V in memory: "communication" is indexing (the emulator, simulations).

    A step holding its owner's whole shard reads it in place. Otherwise (the direct schedule) the
    step's buffer receives only the rows the owner sends (``schedule.kv_rows``, through
    ``faults.active.sent_rows``), every other row is NaN, and a tile that reads a row which did
    not arrive raises ``MissingRows``. The last step of a forward run (``Step.joins``) reads every
    step's buffer of the run side by side. A gathered step (``allgather``) reads the rows of the
    sequence it holds, every owner's put in place (``CommSchedule.gather_index``); both are put
    together once per ``LocalKV`` (the shards must not change while it is in use)."""

    def __init__(self, ks, vs, schedule: CommSchedule, reader: int, phase: str):
        self.ks, self.vs, self.schedule, self.reader, self.phase = ks, vs, schedule, reader, phase
        self.buffer = None
        self.runs: dict = {}   # a run's last step -> its buffers, put together once

    def get(self, step: Step):
        if step.gathered:
            if self.buffer is None:
                n = rows_in(step.held)
                out = []
                for xs in (self.ks, self.vs):
                    buf = xs[0].new_empty((*xs[0].shape[:2], n, xs[0].shape[3]))
                    for owner, x in enumerate(xs):
                        mine, at, _ = self.schedule.gather_index(self.reader, owner, x.device)
                        buf.index_copy_(2, at, x.index_select(2, mine))
                    out.append(buf)
                self.buffer = tuple(out)
            return self.buffer
        if not step.tiles:   # nothing reads it (a step of a run reads in the run's last step)
            return None, None
        if step.joins:   # a run of steps: their rows side by side, each step's as it holds them alone
            if step.index not in self.runs:
                steps = self.schedule.plans[self.reader].steps
                held = [self._held(steps[j]) for j in (*step.joins, step.index)]
                self.runs[step.index] = tuple(torch.cat([h[n] for h in held], dim=2) for n in (0, 1))
            return self.runs[step.index]
        return self._held(step)

    def _held(self, step: Step):
        """The step's buffer: the rows its owner sent, NaN elsewhere; ``MissingRows`` if a tile
        reads one that did not arrive."""
        k, v = self.ks[step.kv_rank], self.vs[step.kv_rank]
        shard = k.shape[2]
        sent = self.schedule.kv_rows(self.reader, step.index)
        if self.schedule.kind is KVSchedule.DIRECT and step.index > 0:
            sent = faults.active.sent_rows(self.phase, step.index, step.kv_rank, self.reader, sent)
        if _whole(step, shard) and sent == step.held:
            return k, v
        pieces = _arrived(step.held, sent)   # (buffer row, owner row, rows), worked out on the host
        for t, tile in enumerate(step.tiles):
            missing = _uncovered(tile.kv_rows, pieces)
            if missing:   # the error path alone lists rows one by one
                owner = [r for part in step.held for r in range(part.start, part.stop)]
                rows = [owner[r] if r < len(owner) else f"buffer row {r}" for gap in missing
                        for r in range(gap.start, gap.stop)]
                raise MissingRows(f"rank {self.reader} {self.phase} step {step.index} tile {t} reads K/V rows "
                                  f"{rows} of rank {step.kv_rank}'s shard, which were not sent "
                                  f"(sent {[(p.start, p.stop) for p in sent]})")
        out = []
        for x in (k, v):   # no host sync: a CUDA graph can capture this
            buf = torch.full((*x.shape[:2], step.held_rows, x.shape[3]), float("nan"), dtype=x.dtype, device=x.device)
            for at, src, n in pieces:
                buf[:, :, at:at + n] = x[:, :, src:src + n]
            out.append(buf)
        return out[0], out[1]


class LocalDKV:
    """dK/dV added into their owner's accumulators (one per rank): in place when
    the step holds the owner's whole shard and its part would travel in the accumulator dtype,
    else through the step's own rows (a gathered step's:
    every owner's rows it read), which its tiles write without zeroing them where they read every
    row once (``Step.kv_cover``), in the dtype ``DirectDKV`` sends them in (``kv_dtype`` where
    ``CommSchedule.partial_in_kv_dtype``; step 0's too where ``DirectDKV`` holds the home
    accumulator in it, ``CommSchedule.home_in_kv_dtype``)."""

    def __init__(self, dks, dvs, schedule: CommSchedule, *, reader: int, kv_dtype: torch.dtype):
        """``reader``: the rank whose steps run (``Step.held`` is what that rank holds)."""
        self.dks, self.dvs, self.schedule, self.reader, self.kv_dtype = dks, dvs, schedule, reader, kv_dtype
        self.part = None

    def _home(self, owner: int):
        return self.dks[owner], self.dvs[owner]

    def start(self, step: Step):
        self.part = None
        if not step.tiles:   # (a step of a run computes in the run's last step, ``Step.joins``)
            return None, None, True
        dk, dv = self._home(step.kv_rank)
        narrow = self.schedule.partial_in_kv_dtype(self.reader, step.index) or (
            step.index == 0 and self.kv_dtype.itemsize < dk.element_size()
            and self.schedule.home_in_kv_dtype(self.reader))
        if _whole(step, dk.shape[2]) and not step.gathered and not step.joins and not narrow:
            return dk, dv, False
        # a run's rows: every step's side by side, as ``LocalKV`` puts their K/V
        shape = (*dk.shape[:2], step.joined_rows + step.held_rows, dk.shape[3])
        dtype = self.kv_dtype if narrow else dk.dtype   # written where its tiles read every row once
        self.part = tuple((x.new_empty if step.kv_cover else x.new_zeros)(shape, dtype=dtype) for x in (dk, dv))
        return (*self.part, step.kv_cover)

    def finish(self, step: Step) -> None:
        """Rows held apart go home (a run's, each step's to its owner); the whole shard already is
        the owner's."""
        if self.part is None:
            return
        if step.joins:
            at = 0
            for j in (*step.joins, step.index):
                member = self.schedule.plans[self.reader].steps[j]
                index = _held_index(member, self.part[0].device)
                for home, part in zip(self._home(member.kv_rank), self.part):
                    home.index_add_(2, index, part.narrow(2, at, member.held_rows).to(home.dtype))
                at += member.held_rows
            return
        if step.gathered:
            for owner in range(self.schedule.cp):
                mine, at, n = self.schedule.gather_index(step.kv_rank, owner, self.part[0].device)
                if n:
                    for home, part in zip(self._home(owner), self.part):
                        home.index_add_(2, mine, part.index_select(2, at))
            return
        index = _held_index(step, self.part[0].device)
        for home, part in zip(self._home(step.kv_rank), self.part):
            home.index_add_(2, index, part.to(home.dtype))


class BiasTiles:
    """The slices of a full ``[1|b, 1|h, S, S]`` bias that each tile sees, and their gradient."""

    def __init__(self, bias: torch.Tensor, plan: RankPlan, q_pos: torch.Tensor, kv_pos: list[torch.Tensor],
                 grad_dtype: torch.dtype):
        self.bias = bias
        self.index = {}
        for step in plan.steps:
            for t, tile in enumerate(step.tiles):
                src = step.source_rows(tile.kv_rows)   # sequence rows of a gathered step's, else the owner's
                cols = (torch.arange(src.start, src.stop, device=q_pos.device) if step.gathered
                        else kv_pos[step.kv_rank][src])
                self.index[(step.index, t)] = (q_pos[tile.q_rows], cols)
        self.grad = torch.zeros(bias.shape, dtype=grad_dtype, device=bias.device)

    def tile(self, step: Step, t: int) -> torch.Tensor:
        rows, cols = self.index[(step.index, t)]
        return self.bias[:, :, rows[:, None], cols[None, :]]

    def add_grad(self, step: Step, t: int, grad: torch.Tensor) -> None:
        rows, cols = self.index[(step.index, t)]
        self.grad[:, :, rows[:, None], cols[None, :]] += grad


def beside_join(steps) -> Optional[int]:
    """The step beside which step 0 runs: the next step that is not a member of a run (members
    only receive messages; their run's last step computes them, ``Step.joins``), if it has tiles.
    None where step 0 has no tiles, or there is no such step: a step with no tiles of its own
    still moves dK/dV (``DirectDKV`` adds what arrived into the home accumulator step 0 writes),
    so it must not run while step 0 may."""
    if not steps or steps[0].index != 0 or not steps[0].tiles:
        return None
    members = {j for s in steps for j in s.joins}
    after = next((s for s in steps[1:] if s.index not in members), None)
    return after.index if after is not None and after.tiles else None


class Beside:
    """Step 0 beside the next step that computes (docs/design.md, section 7): step 0 reads only
    this rank's own K/V, so its tiles (and in the backward its dK/dV's ``start`` and ``finish``)
    are issued on a second CUDA stream that waits for everything before it, and the ring's stream
    waits for them once the next computing step's tiles are issued (``join``), before anything
    reads what step 0 wrote: a causal step 0 leaves SMs idle in its last waves, which the next
    step's call fills. Both steps' tiles write different buffers, and dq rows they share go
    through FA4's atomic adds (``RowsBackward.concurrent``); step 0's sink gradient is summed
    apart. On only with ``on`` (a kernel whose calls may run at once, ``TileKernel.concurrent``),
    on CUDA, and where the next step computes (``beside_join``); a CUDA graph captures both
    streams. Step 0's dK/dV messages (the ring schedule's) are posted from the second stream, so
    a wait for a message waits for its own work, not for the communication stream's tail
    (``dist.Pending``); over gloo, which stages messages through the host, posting them waits for
    step 0. A context manager: the ring's stream joins on the way out too, an error's included."""

    def __init__(self, steps, like: torch.Tensor, *, on: bool):
        self.at = beside_join(steps) if on and like.is_cuda else None
        self.on = self.at is not None
        self.main = self.side = None
        self.forked = False   # step 0 was issued on the second stream, which the ring's has not joined yet
        if self.on:
            self.main = torch.cuda.current_stream(like.device)
            self.side = side_streams(self.main, 1, "beside")[0]

    def __enter__(self) -> "Beside":
        return self

    def __exit__(self, *exc) -> None:
        if self.forked:   # (never before the fork: a capture must not wait on a stream it has not seen)
            self.main.wait_stream(self.side)
            self.forked = False

    def stream(self, step: Step, *reads):
        """The stream ``step`` is issued on: the second one for step 0 (which waits for the ring's
        stream first), else the ring's. ``reads``: tensors made on the ring's stream that step 0
        reads (its K/V), kept from reuse until the second stream is done with them."""
        if not self.on or step.index != 0:
            return contextlib.nullcontext()
        self.side.wait_stream(self.main)
        self.forked = True
        for x in reads:
            if x is not None:
                x.record_stream(self.side)
        return torch.cuda.stream(self.side)

    def join(self, step: Step) -> None:
        """After ``step``'s tiles: the ring's stream waits for step 0 if ``step`` is the one beside it."""
        if self.forked and step.index == self.at:
            self.main.wait_stream(self.side)
            self.forked = False


def tile_sink(tile: Tile, sink: Optional[torch.Tensor], strategy: SinkStrategy) -> Optional[torch.Tensor]:
    """The sink a tile gets: step 0's tiles under ``step0``, every tile under the ``every-tile`` bug."""
    if sink is None or strategy is SinkStrategy.POST_MERGE:
        return None
    return sink if (tile.sink or strategy is SinkStrategy.EVERY_TILE) else None


@dataclass(frozen=True)
class ForwardState:
    """One rank's forward tensors (``[b, h, n, d]`` views; lse ``[b, h, n]``; the parts one more
    leading dimension, a buffer each)."""

    q: torch.Tensor
    out: torch.Tensor         # q's dtype: the rows' first tiles' results, at the end the output
    lse: torch.Tensor         # the rows' merged log-sum-exp; sink-inclusive once ``run_forward`` returns
    parts_o: torch.Tensor     # [parts, ...] q's dtype: later tiles' results waiting for their merge
    parts_lse: torch.Tensor   # [parts, ...] accumulator dtype: -inf on the rows no tile of the buffer wrote
                              # (``run_forward`` clears it first, so a state serves any number of calls)
    o_acc: Optional[torch.Tensor]   # accumulator dtype; only when the later results merge more than once

    @classmethod
    def make(cls, plan: RankPlan, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             fill: Optional[float] = None) -> "ForwardState":
        """The buffers ``plan`` needs next to ``q``, ``out`` and ``lse`` (``[b, s, h, d]`` storage,
        the layout the GPU kernels write fastest). ``fill``: the parts' initial value (the emulator
        fills them with NaN, which proves the merge never reads a row no tile wrote)."""
        b, h, n, d = q.shape
        like = dict(device=q.device)
        parts_o = torch.empty(plan.parts, b, n, h, d, dtype=q.dtype, **like).permute(0, 1, 3, 2, 4)
        if fill is not None:
            parts_o.fill_(fill)
        parts_lse = torch.empty(plan.parts, b, h, n, dtype=lse.dtype, **like)   # run_forward clears it
        o_acc = torch.empty(b, n, h, d, dtype=lse.dtype, **like).transpose(1, 2) if plan.accumulates else None
        return cls(q, out, lse, parts_o, parts_lse, o_acc)


def run_forward(plan: RankPlan, kv: KVSource, *, state: ForwardState, sink: Optional[torch.Tensor],
                bias: Optional[BiasTiles], opts: CPOptions) -> None:
    """Every tile of every step: a row's first tile (step 0) writes the output buffer and the
    stats, later tiles their buffer of ``state.parts_o`` (``Tile.part``), and the buffers are
    merged into the rows' result where the plan says (``Step.merges``), the last merge writing
    the output and folding the sink in under post-merge. ``state.lse`` ends sink-inclusive."""
    strategy = faults.active.sink_strategy(opts.sink_strategy)
    fold = sink if strategy is SinkStrategy.POST_MERGE else None
    last = plan.steps[-1]
    merged = False    # the rows' result so far is in the accumulator, not the output buffer
    state.parts_lse.fill_(NEG_INF)   # no part covers a row until a tile writes it (the state may be reused)
    with Beside(plan.steps, state.q, on=opts.kernel.concurrent and bias is None) as beside:
        for step in plan.steps:
            k, v = kv.get(step)
            with beside.stream(step, k, v), profiling.active.compute("fwd", step.index):
                _forward_tiles(step, k=k, v=v, state=state, sink=sink, bias=bias, opts=opts, strategy=strategy)
                beside.join(step)   # (after the step's tiles: before anything reads step 0's results)
                final = step is last
                if step.merges or (final and fold is not None):
                    n = step.merges
                    src, dst = state.o_acc if merged else state.out, state.out if final else state.o_acc
                    folds = final and fold is not None
                    # in place and without the fold, the rows no later tile wrote are already final
                    rows = plan.merged_rows if src is dst and not folds else slice(None)
                    merge_parts_(src[:, :, rows], state.lse[:, :, rows], state.parts_o[:n, :, :, rows],
                                 state.parts_lse[:n, :, :, rows], into=dst[:, :, rows], sink=fold if folds else None)
                    if not final:
                        state.parts_lse[:n].fill_(NEG_INF)
                        merged = True


def _forward_tiles(step: Step, *, k, v, state: ForwardState, sink, bias, opts: CPOptions,
                   strategy: SinkStrategy) -> None:
    """One forward step: every tile (a group of tiles in one call where the step has them) written
    into its rows of the output (a first tile) or of its buffer of later results."""
    q = state.q
    for group in step.groups:
        first = step.tiles[group[0]]
        out, lse = (state.out, state.lse) if first.sink else (state.parts_o[first.part], state.parts_lse[first.part])
        if len(group) > 1 and bias is None:
            tiles = [step.tiles[t] for t in group]
            opts.kernel.forward_group(q, k, v, tuple(t.q_rows for t in tiles), tuple(t.kv_rows for t in tiles),
                                      tuple(t.band for t in tiles), tile_sink(first, sink, strategy), opts.scale,
                                      out=out, lse=lse)
            continue
        for t in group:
            tile = step.tiles[t]
            rows, cols = tile.q_rows, tile.kv_rows
            opts.kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], tile.band, tile_sink(tile, sink, strategy),
                                bias.tile(step, t) if bias else None, opts.scale, out=out[:, :, rows],
                                lse=lse[:, :, rows])


def run_backward(plan: RankPlan, kv: KVSource, dkv: DKVSink, *, state: BackwardState,
                 sink: Optional[torch.Tensor], bias: Optional[BiasTiles], opts: CPOptions) -> Optional[torch.Tensor]:
    """Recompute every tile with the final ``lse`` and ``out``; return this rank's rows' sink gradient.
    The kernel keeps the rows' dq (``TileKernel.rows_backward``): ``state.dq`` holds it at the end."""
    strategy = faults.active.sink_strategy(opts.sink_strategy)
    from_tiles = sink is not None and strategy is not SinkStrategy.POST_MERGE
    d_sink = torch.zeros_like(sink) if from_tiles else None
    rows = opts.kernel.rows_backward(state, scale=opts.scale,
                                     tiles=[t for step in plan.backward_steps for t in step.tiles],
                                     biased=bias is not None)
    with Beside(plan.backward_steps, state.q,
                on=opts.kernel.concurrent and rows.concurrent and bias is None) as beside:
        d_sink_0 = torch.zeros_like(sink) if from_tiles and beside.on else d_sink   # summed apart: no race
        for step in plan.backward_steps:
            k, v = kv.get(step)
            with beside.stream(step, k, v):
                dk, dv, write = dkv.start(step)
                with profiling.active.compute("bwd", step.index):
                    _backward_tiles(step, k=k, v=v, dk=dk, dv=dv, write=write, rows=rows, sink=sink, bias=bias,
                                    strategy=strategy, d_sink=d_sink_0 if step.index == 0 else d_sink)
                    beside.join(step)   # (before the step's dK/dV go on, which may add into step 0's)
                dkv.finish(step)
    rows.finish()
    if d_sink_0 is not d_sink:
        d_sink += d_sink_0
    if sink is not None and not from_tiles:
        d_sink = sink_grad(state.out, state.grad_out, state.lse, sink)
    return d_sink


def _backward_tiles(step: Step, *, k, v, dk, dv, write: bool, rows, sink, bias, strategy: SinkStrategy,
                    d_sink) -> None:
    """One backward step: every tile's gradients (a group's in one call) written (``write``: each
    row from one tile) or added to this step's dK/dV, and the sink's; the rows' dq is kept by
    ``rows``."""
    for group in step.groups:
        first = step.tiles[group[0]]
        if len(group) > 1 and bias is None:
            tiles = [step.tiles[t] for t in group]
            cols = tuple(t.kv_rows for t in tiles)
            grads = rows.group(tuple(t.q_rows for t in tiles), k, v, cols, tuple(t.band for t in tiles),
                               tile_sink(first, sink, strategy), first=first.sink, dkv=(dk, dv) if write else None)
            if grads.dk is not None:
                add_rows_(dk, grads.dk, cols, write=write)
                add_rows_(dv, grads.dv, cols, write=write)
            if grads.d_sink is not None:
                d_sink += grads.d_sink
            continue
        for t in group:
            tile = step.tiles[t]
            cols = tile.kv_rows
            grads = rows.tile(tile.q_rows, k[:, :, cols], v[:, :, cols], tile.band, tile_sink(tile, sink, strategy),
                              bias.tile(step, t) if bias else None, first=tile.sink,
                              dkv=(dk[:, :, cols], dv[:, :, cols]) if write else None)
            if grads.dk is not None:   # (None: the kernel wrote them into the step's dK/dV itself)
                if write:
                    dk[:, :, cols].copy_(grads.dk)
                    dv[:, :, cols].copy_(grads.dv)
                else:
                    dk[:, :, cols] += grads.dk
                    dv[:, :, cols] += grads.dv
            if grads.d_sink is not None:
                d_sink += grads.d_sink
            if grads.d_bias is not None:
                bias.add_grad(step, t, grads.d_bias)


def _fused(k: torch.Tensor, v: torch.Tensor, seq_dim: int) -> Optional[torch.Tensor]:
    """The contiguous buffer whose two halves ``k`` and ``v`` already are, a row's K beside its V
    (the pair dim right after ``seq_dim``: a fused K/V projection's ``[b, s, 2, g, d]`` output
    unbound, or the a2a's re-layout), else None."""
    pair = seq_dim + 1
    shape, strides = list(k.shape), list(k.stride())
    half = math.prod(shape[pair:])
    if (v.shape == k.shape and v.stride() == k.stride() and v.dtype == k.dtype and v.device == k.device
            and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and v.storage_offset() == k.storage_offset() + half):
        kv = k.as_strided(shape[:pair] + [2] + shape[pair:], strides[:pair] + [half] + strides[pair:])
        if kv.is_contiguous():
            return kv
    return None


def stacked(k: torch.Tensor, v: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """K and V in one buffer, a row's K beside its V (the pair dim right after ``seq_dim``), so a
    range of rows is one contiguous message whenever ``seq_dim`` is the outermost dim of a row
    range (sbhd, thd, bshd with b = 1): the buffer ``k`` and ``v`` are the halves of (``_fused``)
    without a copy, else a copy of both."""
    kv = _fused(k, v, seq_dim)
    return torch.stack([k, v], dim=seq_dim + 1) if kv is None else kv


def unstacked(kv: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[b, h, s, d]`` views of K and V in a ``stacked`` buffer."""
    return fmt.to_bhsd(kv.select(fmt.seq_dim + 1, 0)), fmt.to_bhsd(kv.select(fmt.seq_dim + 1, 1))


def kv_pieces(k: torch.Tensor, v: torch.Tensor, fmt, kind: KVSchedule) -> tuple[torch.Tensor, ...]:
    """This rank's K and V as its schedule moves them, each piece's rows along ``fmt.seq_dim``:
    ``(stacked,)`` (one message a range of rows) where the two are the halves of one buffer
    (``_fused``) or the schedule moves one tensor (ring, allgather); else, under direct, ``(k, v)``
    apart, each contiguous (two messages a range, sent from their own memory): stacking two
    separate tensors is a copy of both in the forward's stream, 35 us of a 1-3.5 ms forward at
    h16 d128 with 8k rows a rank (docs/benchmarks.md, eleventh GPU session)."""
    sd = fmt.seq_dim
    kv = _fused(k, v, sd)
    if kv is not None or kind is not KVSchedule.DIRECT:
        return (stacked(k, v, sd) if kv is None else kv,)
    return k.contiguous(), v.contiguous()


def kv_views(pieces: tuple[torch.Tensor, ...], fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[b, h, s, d]`` views of K and V in ``pieces`` (as ``kv_pieces`` gives them)."""
    return unstacked(pieces[0], fmt) if len(pieces) == 1 else (fmt.to_bhsd(pieces[0]), fmt.to_bhsd(pieces[1]))


class RingKV:
    """K/V of each step over the ring: step i+1's exchange is in flight while step i computes.
    Step 0 reads this rank's own ``kv`` (never written: the backward reads it again); step i > 0
    the buffer ``(i - 1) % 2`` (one buffer at cp = 2)."""

    def __init__(self, comm, kv: torch.Tensor, fmt, phase: str):
        """``kv``: this rank's K and V, ``stacked``."""
        self.comm, self.fmt, self.phase = comm, fmt, phase
        self.own = kv
        self.bufs = [torch.empty_like(kv) for _ in range(min(2, comm.size - 1))]
        self.pending = None

    def get(self, step: Step):
        i = step.index
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        faults.active.on_ring_step(self.comm.rank, self.phase, i)
        cur = self.own if i == 0 else self.bufs[(i - 1) % 2]
        if i + 1 < self.comm.size:
            self.pending = self.comm.exchange(cur, self.bufs[i % 2], "kv", self.phase, i)
        return unstacked(cur, self.fmt)


class RingDKV:
    """dK/dV travel one hop behind K/V: each step's tiles go into a part of their own (written when
    they read every row once, ``Step.kv_cover``, else zeroed and added to), the sum the previous
    rank sent is added once the step has computed, and the part is passed on; after the last step
    every shard's gradient has arrived home. The sum is waited for after the step's compute, not
    inside it: a wait there would hold the host (NCCL's timed wait) before the step's later kernels
    and count as compute in a profile."""

    def __init__(self, comm, shape, dtype: torch.dtype, device, fmt):
        self.comm, self.fmt = comm, fmt
        self.parts = [torch.empty((2, *shape), dtype=dtype, device=device) for _ in range(2)]
        self.incoming = [torch.empty_like(self.parts[0]) for _ in range(2)]
        self.pending = None
        self.last = 0

    def start(self, step: Step):
        part = self.parts[step.index % 2]
        if not step.kv_cover:
            part.zero_()
        return self.fmt.to_bhsd(part[0]), self.fmt.to_bhsd(part[1]), step.kv_cover

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


def _flat(like: torch.Tensor, seq_dim: int, rows: int, dtype=None, device=None) -> torch.Tensor:
    """Storage for ``rows`` rows of ``like`` along ``seq_dim`` (views of any fewer rows are
    contiguous), on ``like``'s device unless ``device`` is given."""
    return torch.empty(like.numel() // like.shape[seq_dim] * rows, dtype=dtype or like.dtype,
                       device=device or like.device)


def _rows(flat: torch.Tensor, like: torch.Tensor, seq_dim: int, rows: int) -> torch.Tensor:
    """A contiguous tensor shaped like ``like`` with ``rows`` rows along ``seq_dim``, in ``flat``."""
    shape = list(like.shape)
    shape[seq_dim] = rows
    return flat[:math.prod(shape)].view(shape)


def _pack(x: torch.Tensor, seq_dim: int, parts, out: torch.Tensor) -> torch.Tensor:
    """The rows ``parts`` of ``x``, one after another, into ``out``."""
    return torch.cat([x.narrow(seq_dim, p.start, p.stop - p.start) for p in parts], dim=seq_dim, out=out)


def _message(x: torch.Tensor, seq_dim: int, parts, buffer) -> torch.Tensor:
    """The rows ``parts`` of ``x`` as one contiguous message: ``x``'s own memory when they are one
    range that is contiguous there, else packed into ``buffer(rows)`` (asked for only then)."""
    if len(parts) == 1:
        rows = x.narrow(seq_dim, parts[0].start, parts[0].stop - parts[0].start)
        if rows.is_contiguous():
            return rows
    return _pack(x, seq_dim, parts, buffer(rows_in(parts)))


class DirectKV:
    """K/V of each step straight from its owner, only the rows its tiles read (``Step.held``).

    Step i's messages are this rank's rows that its reader ``rank + i`` reads, and the rows it
    reads of owner ``rank - i``. Each is posted as the reader's step that computes before step i's
    run starts (``RankPlan.posted_at``: step i - 1 where every step computes), by the reader and
    by the owner at its own step of that index, so both post every message at the same point of
    the schedule and it is in flight while the reader computes that step: where the forward joins
    a run of steps into its last one (``Step.joins``), the whole run's messages at once, landing
    side by side in one buffer. Buffers alternate between the steps that compute after step 0;
    step 0 reads the local shard. A step that reads nothing receives nothing. A message is one
    tensor a piece of ``kv_pieces`` (K and V stacked, or K and V apart), each piece's rows in
    buffers of their own.

    A run's messages are in flight at once, so they are sent from the owner's memory, never packed
    (``CommSchedule.joined_plans`` joins runs only where every message is one range of rows), and
    land in place: the buffer's rows must be contiguous per step, rows outermost (``runs_fit``)."""

    def __init__(self, comm, pieces: tuple[torch.Tensor, ...], fmt, phase: str, schedule: CommSchedule, plans):
        """``pieces``: this rank's K and V (``kv_pieces``); ``plans``: every rank's steps (the
        forward's runs joined, or not)."""
        self.comm, self.fmt, self.phase, self.schedule = comm, fmt, phase, schedule
        me, cp = comm.rank, comm.size
        self.plan = plan = plans[me]
        self.own = pieces
        self.sd = fmt.seq_dim
        self.bufs = [[_flat(p, self.sd, plan.buffer_rows) for p in pieces] for _ in range(2)]
        computing = [s.index for s in plan.steps[1:] if plan.computes(s.index)]
        self.parity = {i: n % 2 for n, i in enumerate(computing, start=1)}   # a computing step's buffer
        # at each step, the messages posted then: (step, send, receive), steps in order
        self.posts = {i: [(j, plans[(me + j) % cp].posted_at[j] == i, plan.posted_at[j] == i) for j in range(1, cp)
                          if i in (plans[(me + j) % cp].posted_at[j], plan.posted_at[j])] for i in range(cp)}
        self.out = [None] * len(pieces)   # a piece's send buffer, made the first time rows must be packed
        self.pending = []
        self.landing = []   # (buffer rows, message, [(buffer row, message row, rows)]) where they differ

    def get(self, step: Step):
        i = step.index
        member = not self.plan.computes(i)   # its rows are read in its run's last step
        if not member:
            for pending in self.pending:
                pending.wait()
            self.pending = []
            self._land()
        faults.active.on_ring_step(self.comm.rank, self.phase, i)
        for j, send, receive in self.posts[i]:
            self._post(j, send, receive)
        if member:
            return None, None
        pieces = self.own if i == 0 else self._buffers(self.parity[i], 0, sum(
            self.plan.steps[j].held_rows for j in (*step.joins, i)))
        return kv_views(pieces, self.fmt)

    def _buffers(self, parity: int, at: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``rows`` rows from row ``at`` of each piece's buffer ``parity``, contiguous."""
        return tuple(_rows(buf[at * (p.numel() // p.shape[self.sd]):], p, self.sd, rows)
                     for buf, p in zip(self.bufs[parity], self.own))

    def _post(self, i: int, send: bool, receive: bool) -> None:
        me, cp, sd = self.comm.rank, self.comm.size, self.sd
        owner, reader = (me - i) % cp, (me + i) % cp
        held = self.plan.steps[i].held
        leaving = faults.active.sent_rows(self.phase, i, me, reader, self.schedule.kv_rows(reader, i)) if send else ()
        arriving = faults.active.sent_rows(self.phase, i, owner, me, held) if receive else ()
        sends, recvs = [], []
        if leaving:
            sends = [(_message(p, sd, leaving, lambda n, k=k: self._send_buffer(k, n)), reader)
                     for k, p in enumerate(self.own)]
        if arriving:
            at, offset = self.plan.landing[i]
            for buf, p in zip(self._buffers(self.parity[at], offset, rows_in(held)), self.own):
                if arriving == held:
                    recvs.append((buf, owner))
                else:  # the message carries other rows than the buffer holds: place them, zero the rest
                    n = rows_in(arriving)
                    message = _rows(_flat(p, sd, n), p, sd, n)
                    self.landing.append((buf, message, _placement(held, arriving)))
                    recvs.append((message, owner))
        if sends or recvs:
            self.pending.append(self.comm.post(sends, recvs, "kv", self.phase, i - 1))

    def _send_buffer(self, piece: int, rows: int) -> torch.Tensor:
        own = self.own[piece]
        if self.out[piece] is None:
            self.out[piece] = _flat(own, self.sd, self.schedule.largest())
        return _rows(self.out[piece], own, self.sd, rows)

    def _land(self) -> None:
        for buf, message, placement in self.landing:
            buf.zero_()
            for at, src, n in placement:
                buf.narrow(self.sd, at, n).copy_(message.narrow(self.sd, src, n))
        self.landing = []


def _placement(held, arriving) -> list[tuple[int, int, int]]:
    """(buffer row, message row, rows) of each piece of ``arriving`` (message order) that lies in
    ``held`` (buffer order)."""
    out, src = [], 0
    for a in arriving:
        at = 0
        for h in held:
            lo, hi = max(a.start, h.start), min(a.stop, h.stop)
            if lo < hi:
                out.append((at + lo - h.start, src + lo - a.start, hi - lo))
            at += h.stop - h.start
        src += a.stop - a.start
    return out


class DirectDKV:
    """dK/dV of the rows a step read return to their owner, who sums them with its own in the
    accumulator dtype. Step 0's tiles go straight into the home accumulator. A step that computes
    (a run's last step, ``Step.joins``, or a step of its own) writes its part, the rows of every
    step of its run side by side as ``DirectKV`` holds their K/V, without zeroing it where its
    tiles write every row once (``Step.kv_cover``: causal and full masks), and once its tiles are
    in posts each step's rows to that step's owner: dK and dV, two tensors a message, each rows
    outermost (``runs_fit``) so that a step's rows are contiguous in either. This rank receives the
    part of its reader ``rank + j`` for step j at the same point of the schedule, its own step of
    the index at which the reader computes step j (``RankPlan.computed_at``). What was posted is waited
    for at the next step that computes, after its tiles: a part is in flight while the next run
    computes.

    A part written once per row is kept and sent in K/V's dtype (``CommSchedule.partial_in_kv_dtype``):
    half the bytes of an fp32 one for bf16/fp16. The ones that arrive that way each have a buffer
    of their own and are summed once, at the end, with the home accumulator straight into K/V's
    dtype (one pass, ``fused.sum_partials``, on CUDA; ~2 bytes an element a part where adding each
    into the accumulator as it lands moves ~10); what they cost is memory: up to cp - 1 shards of
    dK/dV in K/V's dtype until the backward ends. Parts in the accumulator dtype (all of them for
    fp32 and fp64 K/V: nothing to save) are added as they land. When every part that returns is
    kept and step 0 writes every row once (``CommSchedule.home_in_kv_dtype``), the home
    accumulator itself is in K/V's dtype: step 0's tiles write it as they write a part, and the
    sum goes into it in place."""

    def __init__(self, comm, shape, dtype: torch.dtype, device, fmt, schedule: CommSchedule, kv_dtype: torch.dtype,
                 plans):
        """``plans``: every rank's steps (runs joined, or not: ``joined_plans``), as ``DirectKV``."""
        self.comm, self.fmt, self.schedule, self.kv_dtype = comm, fmt, schedule, kv_dtype
        me, cp = comm.rank, comm.size
        self.plan = plan = plans[me]
        self.sd = fmt.seq_dim + 1
        like = torch.empty((2, *shape), dtype=dtype, device="meta")   # the accumulator's shape and dtype
        # kept only where K/V's dtype is narrower than the accumulator's (fp32/fp64 K/V: nothing to save)
        narrow = kv_dtype.itemsize < like.element_size()
        self.acc = torch.empty(like.shape, device=device,
                               dtype=kv_dtype if narrow and schedule.home_in_kv_dtype(me) else dtype)
        computing = [s.index for s in plan.steps[1:] if plan.computes(s.index)]
        self.parity = {i: n % 2 for n, i in enumerate(computing)}   # a computing step's part buffer
        rows = max(plan.buffer_rows, schedule.largest())
        self.parts = [_flat(like, self.sd, rows, device=device) for _ in range(2)]
        kept = schedule.kept_partials(me) if narrow else []
        self.kept_buffer = _flat(like, self.sd, sum(rows_in(rows) for _, rows in kept), kv_dtype, device)
        self.kept, at = {}, 0   # step -> (its part's buffer, the rows of this rank's shard it carries)
        for i, rows in kept:
            self.kept[i] = (_rows(self.kept_buffer[at:], like, self.sd, rows_in(rows)), rows)
            at += self.kept[i][0].numel()
        # at each step, the parts received then: (step j, the rows of this rank's shard it carries),
        # and where those added as they land go: a buffer per batch landed together (the ones
        # received from one computing step to the next), two batches alternating
        self.arrivals = {i: [] for i in range(cp)}
        for j in range(1, cp):
            reader = (me + j) % cp
            if self.schedule.kv_rows(reader, j):
                self.arrivals[plans[reader].computed_at[j]].append(j)
        self.batch = {i: sum(1 for c in computing if c <= i) for i in range(cp)}
        batch_rows = collections.Counter()
        for i, js in self.arrivals.items():
            batch_rows[self.batch[i]] += sum(rows_in(schedule.kv_rows((me + j) % cp, j)) for j in js if j not in self.kept)
        self.incoming = [_flat(like, self.sd, max(batch_rows.values(), default=0), device=device) for _ in range(2)]
        self.incoming_at = 0   # elements of the current batch's buffer taken
        self.like = like
        self.pending = []
        self.arrived = []   # (message, rows of this rank's shard it carries): added once it is in

    def start(self, step: Step):
        i = step.index
        if not self.plan.computes(i):   # computed in its run's last step
            return None, None, True
        part = self.acc if i == 0 else self._part(self.parts[self.parity[i]], self.comm.rank, i,
                                                  step.joined_rows + step.held_rows)
        if not step.kv_cover:
            # never step 0 of a home held in K/V's dtype (``home_in_kv_dtype``), but under a fault
            # that rewrites the plan (``Fault.DOC_LEAK``): its tiles then add in K/V's dtype
            part.zero_()
        return self.fmt.to_bhsd(part[0]), self.fmt.to_bhsd(part[1]), step.kv_cover

    def _part(self, flat: torch.Tensor, reader: int, i: int, rows: int) -> torch.Tensor:
        """``rows`` rows of ``reader``'s step-``i`` partial in ``flat``, in the dtype it travels in
        (``CommSchedule.partial_in_kv_dtype``; every step of a run the same: one full tile each)."""
        if self.schedule.partial_in_kv_dtype(reader, i):
            flat = flat.view(self.kv_dtype)   # fits: K/V's dtype is never wider than the accumulator's
        return _rows(flat, self.like, self.sd, rows)

    def finish(self, step: Step) -> None:
        """Once the step's tiles are in: where it computes, wait for what was posted before (adding
        the parts that arrived), then post each step j of its run, one post a step, its rows to
        their owner with the part this rank's reader ``rank + j`` returns for it, if that reader
        computes step j at this same index (both ends post a message at one point of the schedule,
        in step order, so every rank's posts meet their peers' in one order)."""
        i, me, cp = step.index, self.comm.rank, self.comm.size
        computes = self.plan.computes(i)
        if computes:
            self._land()
        run = (*step.joins, i) if i and computes else ()
        part = self._part(self.parts[self.parity[i]], me, i, step.joined_rows + step.held_rows) if run else None
        for j in sorted({*run, *self.arrivals[i]}):
            sends, recvs = [], []
            rows = self.plan.steps[j].held_rows if j in run else 0
            if rows:   # dK and dV apart: a step's rows are contiguous in each, not across the two
                at = self.plan.landing[j][1]
                sends = [(x.narrow(self.sd - 1, at, rows), (me - j) % cp) for x in part]
            if j in self.arrivals[i]:
                reader = (me + j) % cp
                if j in self.kept:
                    message = self.kept[j][0]
                else:
                    theirs = self.schedule.kv_rows(reader, j)
                    message = self._part(self.incoming[self.batch[i] % 2][self.incoming_at:], reader, j,
                                         rows_in(theirs))
                    self.incoming_at += message.numel()
                    self.arrived.append((message, theirs))
                recvs = [(x, reader) for x in message]
            if sends or recvs:
                self.pending.append(self.comm.post(sends, recvs, "dkv", "bwd", j))

    def _land(self) -> None:
        for pending in self.pending:
            pending.wait()
        self.pending = []
        for message, rows in self.arrived:
            self._add(message, rows)
        self.arrived = []
        self.incoming_at = 0

    def _add(self, message: torch.Tensor, rows, into: Optional[torch.Tensor] = None) -> None:
        into = self.acc if into is None else into
        at = 0
        for p in rows:
            n = p.stop - p.start
            into.narrow(self.sd, p.start, n).add_(message.narrow(self.sd, at, n))
            at += n

    def home(self) -> torch.Tensor:
        """``[2, *kv_shape]``: this rank's own dK and dV, summed over every rank's tiles (in K/V's
        dtype where parts were kept or the home accumulator is held in it, else the accumulator's)."""
        self._land()
        if not self.kept:
            return self.acc
        fused = fused_for(self.like.dtype, self.acc)
        if fused is None:   # each kept part added in the accumulator dtype
            total = self.acc.to(self.like.dtype)
            for message, rows in self.kept.values():
                self._add(message, rows, total)
            return total
        out = self.acc if self.acc.dtype == self.kv_dtype else torch.empty_like(self.acc, dtype=self.kv_dtype)
        table, sizes = self.schedule.partial_table(self.comm.rank, self.acc.shape[self.sd], self.acc.device)
        fused.sum_partials(out, self.acc, self.kept_buffer, table, sizes, self.sd)
        return out


class GatherKV:
    """Every rank's K/V for the one step of ``KVSchedule.ALLGATHER``: each rank sends every other
    the rows of its shard that rank's tiles read (``CommSchedule.gathered_rows``; its whole shard
    without a copy when they are all of it), as one batch, before the step computes; the rows that
    came in and this rank's own are then put at their rows of the step's buffer (``Step.held``).
    Nothing computes while they travel."""

    def __init__(self, comm, kv: torch.Tensor, fmt, phase: str, schedule: CommSchedule):
        """``kv``: this rank's K and V, ``stacked``."""
        self.comm, self.fmt, self.phase = comm, fmt, phase
        me, sd, dev = comm.rank, fmt.seq_dim, kv.device
        self.own, self.sd = kv, sd

        def rows_of(n: int) -> torch.Tensor:
            shape = list(kv.shape)
            shape[sd] = n
            return kv.new_empty(shape)
        self.buffer = rows_of(rows_in(schedule.plans[me].steps[0].held))
        # (own rows read, their rows of the buffer): every own row (a band holds its diagonal), in local
        # order as ``gathered_rows`` lists them, so the shard itself goes in without a copy
        rows, at, n = schedule.gather_index(me, me, dev)
        self.mine = (None if n == kv.shape[sd] else rows), at
        self.sends, self.recvs = [], []
        for peer in (r for r in range(comm.size) if r != me):
            rows, _, n = schedule.gather_index(peer, me, dev)        # the rows of this shard the peer reads
            if n:   # all of them: the shard itself (the rows in local order, as the reader places them)
                self.sends.append((rows, kv if n == kv.shape[sd] else rows_of(n), peer))
            _, at, n = schedule.gather_index(me, peer, dev)          # the peer's rows this rank reads
            if n:
                self.recvs.append((rows_of(n), peer, at))

    def get(self, step: Step):
        faults.active.on_ring_step(self.comm.rank, self.phase, step.index)
        for rows, buf, _ in self.sends:
            if buf is not self.own:
                torch.index_select(self.own, self.sd, rows, out=buf)
        if self.sends or self.recvs:
            self.comm.post([(buf, peer) for _, buf, peer in self.sends], [(buf, peer) for buf, peer, _ in self.recvs],
                           "kv", self.phase, step.index).wait()
        rows, at = self.mine
        self.buffer.index_copy_(self.sd, at, self.own if rows is None else self.own.index_select(self.sd, rows))
        for buf, _, at in self.recvs:
            self.buffer.index_copy_(self.sd, at, buf)
        return unstacked(self.buffer, self.fmt)


class GatherDKV:
    """dK/dV of the one gathered step: accumulated over the rows it read (written when its tiles read
    every key once, ``Step.kv_cover``), then each owner's rows go back to the owner, and this rank
    adds up its own rows from every rank that read them (a reduce-scatter, in the accumulator
    dtype)."""

    def __init__(self, comm, shape, dtype: torch.dtype, device, fmt, schedule: CommSchedule):
        self.comm, self.fmt = comm, fmt
        me = comm.rank
        self.sd = sd = fmt.seq_dim + 1

        def rows_of(n: int) -> torch.Tensor:
            whole = [2, *shape]
            whole[sd] = n
            return torch.empty(whole, dtype=dtype, device=device)
        self.buffer = rows_of(rows_in(schedule.plans[me].steps[0].held))
        self.own = rows_of(shape[sd - 1])
        self.mine = schedule.gather_index(me, me, device)[:2]       # (own rows read, their rows of the buffer)
        self.parts, self.incoming = [], []
        for peer in (r for r in range(comm.size) if r != me):
            _, at, n = schedule.gather_index(me, peer, device)          # the peer's rows this rank read: theirs
            if n:
                self.parts.append((at, rows_of(n), peer))
            rows, _, n = schedule.gather_index(peer, me, device)        # this shard's rows the peer read
            if n:
                self.incoming.append((rows, rows_of(n), peer))
        self.pending = None

    def start(self, step: Step):
        if not step.kv_cover:
            self.buffer.zero_()
        return self.fmt.to_bhsd(self.buffer[0]), self.fmt.to_bhsd(self.buffer[1]), step.kv_cover

    def finish(self, step: Step) -> None:
        for at, buf, _ in self.parts:
            torch.index_select(self.buffer, self.sd, at, out=buf)
        if self.parts or self.incoming:
            self.pending = self.comm.post([(buf, peer) for _, buf, peer in self.parts],
                                          [(buf, peer) for _, buf, peer in self.incoming], "dkv", "bwd", step.index)

    def home(self) -> torch.Tensor:
        """``[2, *kv_shape]``: this rank's own dK and dV, summed over every rank's tiles."""
        rows, at = self.mine
        if len(rows) != self.own.shape[self.sd]:
            self.own.zero_()
        self.own.index_copy_(self.sd, rows, self.buffer.index_select(self.sd, at))
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            for rows, buf, _ in self.incoming:
                self.own.index_add_(self.sd, rows, buf)
        return self.own


def runs_fit(x: torch.Tensor, fmt) -> bool:
    """Whether a run's messages can land side by side in one buffer in place (``DirectKV``): the
    rows are the outermost dim of ``x`` (K, V or ``stacked``, in ``fmt``: sbhd, thd, bshd with b = 1)."""
    return math.prod(x.shape[:fmt.seq_dim]) == 1


def joined_plans(schedule: CommSchedule, kv: torch.Tensor, fmt, biased: bool) -> tuple[RankPlan, ...]:
    """Every rank's steps, forward and backward: its runs of steps joined
    (``CommSchedule.joined_plans``) where the messages can land side by side (``runs_fit``) and no
    bias is sliced per step's owner (``BiasTiles``), else the plain plans (the same choice on every
    rank: the same shapes)."""
    return schedule.joined_plans if runs_fit(kv, fmt) and not biased else schedule.plans


def joined_plan(schedule: CommSchedule, rank: int, kv: torch.Tensor, fmt, biased: bool) -> RankPlan:
    """The plan ``rank`` runs, forward and backward (``joined_plans``, through
    ``faults.active.ring_plan``)."""
    return faults.active.ring_plan(joined_plans(schedule, kv, fmt, biased)[rank])


def kv_movers(schedule: CommSchedule, comm, pieces: tuple[torch.Tensor, ...], fmt, phase: str,
              plans: tuple[RankPlan, ...], acc=None):
    """The ``KVSource`` (and in the backward, with ``acc`` the accumulator dtype, the ``DKVSink``)
    that move a rank's K/V (``pieces``: ``kv_pieces``) and dK/dV under ``schedule``, for the steps
    of ``plans`` (every rank's: where the forward joins runs, a rank sends as its readers need)."""
    k = kv_views(pieces, fmt)[0]
    shape, dtype = fmt.from_bhsd(k).shape, k.dtype
    if schedule.kind is KVSchedule.DIRECT:
        source = DirectKV(comm, pieces, fmt, phase, schedule, plans)
        return source if acc is None else (source, DirectDKV(comm, shape, acc, k.device, fmt, schedule, dtype, plans))
    kv, = pieces   # ring and allgather move K and V stacked
    if schedule.kind is KVSchedule.ALLGATHER:
        source = GatherKV(comm, kv, fmt, phase, schedule)
        return source if acc is None else (source, GatherDKV(comm, shape, acc, kv.device, fmt, schedule))
    source = RingKV(comm, kv, fmt, phase)
    return source if acc is None else (source, RingDKV(comm, shape, acc, kv.device, fmt))


def schedule_for(opts: CPOptions, comm, k: torch.Tensor) -> CommSchedule:
    """The communication schedule of this call: ``opts.kv_schedule`` for a ring of ``comm.size``
    over this rank's shard ``k``, in the layout ``opts.spec`` names (``plan.spec_layout``)."""
    fmt = opts.spec.qkv_format
    kv_row, dkv_row = row_bytes(k.shape[1 - fmt.seq_dim], k.shape[2], k.shape[3], k.dtype)
    layout = spec_layout(opts.spec, k.shape[fmt.seq_dim] * comm.size, comm.size)
    return comm_schedule(opts.kv_schedule, comm.size, layout, opts.spec.band, kv_row, dkv_row)


class P2PAttention(torch.autograd.Function):
    """Ring attention over ``comm`` on this rank's load-balanced shard (user layout in and out)."""

    @staticmethod
    def forward(ctx, q, k, v, offset, bias, opts: CPOptions, comm):
        fmt = opts.spec.qkv_format
        schedule = schedule_for(opts, comm, k)
        pieces = kv_pieces(k, v, fmt, schedule.kind)   # kept for the backward, which moves them the same way
        plans = joined_plans(schedule, pieces[0], fmt, bias is not None)
        plan = faults.active.ring_plan(plans[comm.rank])
        acc = accum_dtype(q.dtype)
        h = q.shape[2]
        sink = faults.active.ring_sink(sink_logits(opts.spec.softmax_type, offset, h, q.device))
        bias_tiles = _bias_tiles(bias, plan, comm.size, acc)
        lse = torch.empty((q.shape[1 - fmt.seq_dim], h, q.shape[fmt.seq_dim]), dtype=acc, device=q.device)
        out = torch.empty_like(q)
        run_forward(plan, kv_movers(schedule, comm, pieces, fmt, "fwd", plans),
                    state=ForwardState.make(plan, fmt.to_bhsd(q), fmt.to_bhsd(out), lse),
                    sink=sink, bias=bias_tiles, opts=opts)
        ctx.save_for_backward(q, out, lse, offset, bias, *pieces)
        ctx.opts, ctx.comm, ctx.schedule, ctx.plans = opts, comm, schedule, plans
        ctx.sink_is_param = offset is not None
        return out

    @staticmethod
    @differentiable_once   # a double backward raises, naming cp_attention
    def backward(ctx, grad_out):
        q, out, lse, offset, bias, *pieces = ctx.saved_tensors
        pieces = tuple(pieces)
        opts, comm, schedule, plans = ctx.opts, ctx.comm, ctx.schedule, ctx.plans   # the forward's runs joined
        plan = faults.active.ring_plan(plans[comm.rank])
        fmt = opts.spec.qkv_format
        acc = accum_dtype(q.dtype)
        sink = faults.active.ring_sink(sink_logits(opts.spec.softmax_type, offset, q.shape[2], q.device))
        bias_tiles = _bias_tiles(bias, plan, comm.size, acc)
        dq = torch.empty_like(q)    # the rows backward writes it once, at the end
        source, dkv = kv_movers(schedule, comm, pieces, fmt, "bwd", plans, acc)
        d_sink = run_backward(plan, source, dkv,
                              state=BackwardState(fmt.to_bhsd(q), fmt.to_bhsd(out), fmt.to_bhsd(grad_out), lse,
                                                  fmt.to_bhsd(dq)),
                              sink=sink, bias=bias_tiles, opts=opts)
        dk, dv = dkv.home()
        d_offset = d_bias = None
        if ctx.sink_is_param:  # this rank's rows' part; the CP contract is applied by `replicated`
            d_offset = d_sink if d_sink is not None else torch.zeros_like(offset)
        if bias is not None:
            d_bias = bias_tiles.grad.to(bias.dtype)
        return dq, dk.to(pieces[0].dtype), dv.to(pieces[0].dtype), d_offset, d_bias, None, None


def _bias_tiles(bias, plan: RankPlan, cp: int, acc) -> Optional[BiasTiles]:
    if bias is None:
        return None
    device = bias.device
    positions = [plan.layout.rows(r, device) for r in range(cp)]
    return BiasTiles(bias, plan, positions[plan.rank], positions, acc)
