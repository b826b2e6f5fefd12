"""The p2p ring: one rank's forward and backward over the ring plan (DESIGN.md section 3).

The loops here know nothing about communication: they ask a ``KVSource`` for the K/V of each
step and a ``DKVSink`` for where that step's dK/dV go. The distributed ring (``cp_p2p``) hands
them double-buffered isend/irecv exchanges; the fp64 emulator hands them plain indexing into
every rank's shards. Both therefore execute literally the same schedule.

Tensors in the loops are ``[b, h, s, d]`` views (``[b, h, s]`` for lse), accumulators in fp32
(fp64 for fp64 runs).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from .options import CPOptions, Fault, SinkStrategy
from .plan import RankPlan, Step, Tile
from .sink import fold_sink_, merge_, sink_grad


class KVSource(Protocol):
    def get(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[b, g, 2c, d]`` views) of ``step.kv_rank``; may start the next exchange."""


class DKVSink(Protocol):
    def start(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulators for dK and dV of ``step.kv_rank``, to add this step's tiles into."""

    def finish(self, step: Step) -> None:
        """This step's tiles are in; pass the accumulators on."""


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


def effective_strategy(opts: CPOptions) -> SinkStrategy:
    return SinkStrategy.EVERY_TILE if opts.fault is Fault.SINK_EVERY_TILE else opts.sink_strategy


def run_forward(plan: RankPlan, q: torch.Tensor, kv: KVSource, sink: Optional[torch.Tensor],
                bias: Optional[BiasTiles], opts: CPOptions, o_acc: torch.Tensor, lse_acc: torch.Tensor) -> None:
    """Merge every tile of every step into ``o_acc`` (zeros) and ``lse_acc`` (-inf), then fold the
    sink once under ``post-merge``."""
    strategy = effective_strategy(opts)
    for step in plan.steps:
        k, v = kv.get(step)
        for t, tile in enumerate(step.tiles):
            o, lse = opts.kernel.forward(q[:, :, tile.q_rows], k[:, :, tile.kv_rows], v[:, :, tile.kv_rows],
                                         tile.band, tile_sink(tile, sink, strategy),
                                         bias.tile(step, t) if bias else None, opts.scale)
            merge_(o_acc[:, :, tile.q_rows], lse_acc[:, :, tile.q_rows], o, lse)
    if sink is not None and strategy is SinkStrategy.POST_MERGE:
        fold_sink_(o_acc, lse_acc, sink)


def run_backward(plan: RankPlan, q: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                 kv: KVSource, dkv: DKVSink, sink: Optional[torch.Tensor], bias: Optional[BiasTiles],
                 opts: CPOptions, dq_acc: torch.Tensor) -> Optional[torch.Tensor]:
    """Recompute every tile with the final ``lse`` and ``out``; return this rank's rows' sink gradient."""
    strategy = effective_strategy(opts)
    d_sink = torch.zeros_like(sink) if sink is not None else None
    for step in plan.backward_steps:
        k, v = kv.get(step)
        dk, dv = dkv.start(step)
        for t, tile in enumerate(step.tiles):
            rows, cols = tile.q_rows, tile.kv_rows
            grads = opts.kernel.backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                                         grad_out[:, :, rows], lse[:, :, rows], tile.band,
                                         tile_sink(tile, sink, strategy),
                                         bias.tile(step, t) if bias else None, opts.scale)
            dq_acc[:, :, rows] += grads.dq
            dk[:, :, cols] += grads.dk
            dv[:, :, cols] += grads.dv
            if grads.d_sink is not None:
                d_sink += grads.d_sink
            if grads.d_bias is not None:
                bias.add_grad(step, t, grads.d_bias)
        dkv.finish(step)
    if sink is not None and strategy is SinkStrategy.POST_MERGE:
        d_sink = sink_grad(out, grad_out, lse, sink)
    return d_sink
