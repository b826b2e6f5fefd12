"""Every bug ``sinkprof check`` and ``sinkprof bench`` can inject, in one place.

A check that cannot fail proves nothing, so the tool injects known bugs and expects the check to
catch them. The library never branches on a fault: at the few places where such a bug would live
it asks ``faults.active``, a ``NoFault`` whose hooks hand back what they were given. ``injected``
swaps in an ``Injected`` fault for the duration of a block (the same pattern as
``profiling.installed``), so the ring, a2a and ``cp_attention`` read as the algorithm
(docs/design.md, section 9).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Optional

from .dist import where
from .options import SinkStrategy, _Choice
from .plan import RankPlan


class Fault(_Choice):
    """Bugs ``sinkprof check`` can inject to prove that it fails when they are present."""

    SINK_EVERY_TILE = "sink-every-tile"      # the sink enters every ring tile (counted per tile)
    NO_SINK_REDUCE = "no-sink-reduce"        # the full contract skips its all-reduce
    ALIASED_REFERENCE = "aliased-reference"  # the reference shares storage with the CP gradients
    VANILLA_FALLBACK = "vanilla-fallback"    # the tiles drop the softmax type (TE's p2p bug)
    SKIP_SINK_SLICE = "skip-sink-slice"      # a2a gives every rank the first heads' sinks
    DROP_HALO = "drop-halo"                  # the direct schedule leaves one halo row out of a K/V message
    DOC_LEAK = "doc-leak"                    # a thd tile also sees the keys of the document before its own
    STALL = "stall"                          # rank 1 stops answering in the forward ring
    CRASH = "crash"                          # rank 1 dies in the forward ring


RANK_FAILURES = (Fault.STALL, Fault.CRASH)
CRASH_EXIT_CODE = 17


class NoFault:
    """No fault: every hook is the identity (or does nothing)."""

    fault: Optional[Fault] = None

    def sink_strategy(self, strategy: SinkStrategy) -> SinkStrategy:
        """Where the ring puts the sink."""
        return strategy

    def ring_sink(self, sink):
        """The sink logits the ring's tiles and fold see (None for vanilla)."""
        return sink

    def sink_heads(self, mine: slice, per: int) -> slice:
        """The query heads whose sinks an a2a member takes (its own, ``mine``, of ``per`` heads)."""
        return mine

    def reduces_replicated_grads(self) -> bool:
        """Whether the ``full`` contract all-reduces the sink and bias gradients."""
        return True

    def ring_plan(self, plan: RankPlan) -> RankPlan:
        """The plan a rank's ring runs (forward and backward)."""
        return plan

    def on_ring_step(self, rank: int, phase: str, step: int) -> None:
        """Called as a ring step's K/V is taken, before the next exchange is posted."""

    def sent_rows(self, phase: str, step: int, owner: int, reader: int, rows: tuple) -> tuple:
        """The rows of ``owner``'s K/V shard its message to ``reader`` carries for ``step`` under
        the direct schedule (both ends ask, so they agree on the message's size)."""
        return rows

    def alias_reference(self, offset, ref) -> None:
        """Called by ``check`` between the CP forward and backward with the learnable offset and
        the reference result."""


class Injected(NoFault):
    """One fault, in the hooks where it lives."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def sink_strategy(self, strategy: SinkStrategy) -> SinkStrategy:
        return SinkStrategy.EVERY_TILE if self.fault is Fault.SINK_EVERY_TILE else strategy

    def ring_sink(self, sink):
        return None if self.fault is Fault.VANILLA_FALLBACK else sink

    def sink_heads(self, mine: slice, per: int) -> slice:
        return slice(0, per) if self.fault is Fault.SKIP_SINK_SLICE else mine

    def reduces_replicated_grads(self) -> bool:
        return self.fault is not Fault.NO_SINK_REDUCE

    def ring_plan(self, plan: RankPlan) -> RankPlan:
        # The packing bug: step 0's tile of the rank's second document also reads the keys before
        # it (its K/V rows start at the buffer's first row, the band shifted to match): the first
        # document's under zigzag, every earlier document of the pack under allgather.
        if self.fault is not Fault.DOC_LEAK:
            return plan
        pieces = list(plan.layout.local_pieces(plan.rank))
        start = next((at for at, piece in pieces if piece.doc != pieces[0][1].doc), None)
        if start is None:                    # the rank holds one document
            return plan
        step = plan.steps[0]                 # start: the second document's first local row
        tiles = list(step.tiles)
        n, tile = next((n, t) for n, t in enumerate(tiles) if t.q_rows.start == start)
        tiles[n] = dataclasses.replace(tile, kv_rows=slice(0, tile.kv_rows.stop),
                                       band=tile.band.shifted(tile.kv_rows.start))
        steps = (dataclasses.replace(step, tiles=tuple(tiles)),) + plan.steps[1:]
        return dataclasses.replace(plan, steps=steps)

    def on_ring_step(self, rank: int, phase: str, step: int) -> None:
        if self.fault not in RANK_FAILURES or (rank, phase, step) != (1, "fwd", 0):
            return
        where.phase, where.step, where.op = phase, step, f"the injected {self.fault.value}"   # what a report names
        if self.fault is Fault.CRASH:
            os._exit(CRASH_EXIT_CODE)
        while True:  # stall: stop answering; the peers' timeouts must catch it
            time.sleep(60)

    def sent_rows(self, phase: str, step: int, owner: int, reader: int, rows: tuple) -> tuple:
        # The halo bug: the forward message from rank 0 to rank 1 (their shared chunk boundary)
        # misses its last row, the key nearest rank 1's first queries.
        if self.fault is not Fault.DROP_HALO or (phase, owner, reader) != ("fwd", 0, 1) or not rows:
            return rows
        last = rows[-1]
        return rows[:-1] + ((slice(last.start, last.stop - 1),) if last.stop - last.start > 1 else ())

    def alias_reference(self, offset, ref) -> None:
        # The seed bug: the "reference" gradient is the very tensor the CP backward accumulates into.
        if self.fault is Fault.ALIASED_REFERENCE and offset is not None:
            offset.grad = ref.d_offset.to(offset.dtype)
            ref.d_offset = offset.grad


active: NoFault = NoFault()


@contextlib.contextmanager
def injected(fault: Optional[Fault]):
    """Make ``fault`` (None: no fault) the active one for the duration of the block."""
    global active
    previous, active = active, (NoFault() if fault is None else Injected(fault))
    try:
        yield active
    finally:
        active = previous
