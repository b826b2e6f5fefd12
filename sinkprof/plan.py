"""The load-balanced ring plan, as pure data (docs/design.md, section 3).

The sequence is cut into ``2 * cp`` chunks of ``c`` rows; rank r holds chunks r and 2cp-1-r
(its *local shard*, 2c rows, chunk r first). At ring step i rank r computes against the K/V shard
of rank ``(r - i) mod cp``. Each step is a list of tiles: a slice of the local query rows, a slice
of the K/V rows held, and a ``Band`` in the tile's own coordinates. Tiles a mask or window cannot
see are left out; a step's chunk pairs are coalesced into one tile whenever one band describes
them all (the standard causal ring is then exactly: step 0 one causal tile over all local rows,
steps 1..r all rows against the first K/V chunk, later steps the second query chunk against all).

The backward runs the same steps in the same ring order: each step's tiles are recomputed with
the final merged statistics, and the tiles that carry the sink (step 0's) return the sink gradient.
Both the distributed ring and the fp64 emulator execute this plan.

The plan also says how each tile's result joins its rows (``Tile.merges``), so the forward makes
as few passes over ``o`` as the rows allow: the first tile of a row (step 0's) writes straight into
the output buffer, the second merges from there into the fp32 accumulator, and the last writes
the merged result (the sink folded in, under post-merge) straight into the output; a row seen by
two tiles only is never copied into the accumulator at all.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from .options import Band


@dataclass(frozen=True)
class RowMerge:
    """How a later tile's partial result joins some of its rows (a chunk, or both)."""

    rows: slice       # rows of the local shard
    second: bool      # the rows' merged result so far is the first tile's, still in the output buffer
    last: bool        # no later tile sees these rows: the merge writes the output (and folds the sink)


@dataclass(frozen=True)
class Tile:
    q_rows: slice     # rows of the local shard (0 .. 2c)
    kv_rows: slice    # rows of the K/V shard held at this step (0 .. 2c)
    band: Band        # visibility in the tile's own coordinates
    sink: bool        # the first tile of its rows: carries their sink (step 0, each local row exactly once)
    merges: tuple[RowMerge, ...] = ()   # how a later tile joins its rows (empty for the first tiles)


@dataclass(frozen=True)
class Step:
    index: int
    kv_rank: int               # whose K/V this step computes against
    tiles: tuple[Tile, ...]


@dataclass(frozen=True)
class RankPlan:
    cp: int
    rank: int
    chunk: int                 # rows per chunk; the local shard has 2 * chunk rows
    steps: tuple[Step, ...]
    alone: tuple[slice, ...] = ()   # rows that only their first tile sees: the output is that tile's

    @property
    def accumulates(self) -> bool:
        """Some rows see three tiles or more: their middle merges need the fp32 accumulator."""
        return any(not m.last for step in self.steps for tile in step.tiles for m in tile.merges)

    @property
    def backward_steps(self) -> tuple[Step, ...]:
        """Backward visits the forward steps in ring order (dK/dV travel one hop behind K/V)."""
        return self.steps


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunks a rank holds, in local order."""
    return rank, 2 * cp - 1 - rank


def global_rows(cp: int, rank: int, chunk: int, device=None) -> torch.Tensor:
    """Global sequence position of each local row of ``rank``'s shard."""
    first, second = chunk_ids(cp, rank)
    base = torch.arange(chunk, device=device)
    return torch.cat([base + first * chunk, base + second * chunk])


def _check_split(length: int, cp: int, what: str) -> None:
    if cp < 1:
        raise ValueError(f"cp_size={cp} must be >= 1")
    if length % (2 * cp):
        raise ValueError(f"{what} length {length} must be divisible by 2 * cp = {2 * cp} for the "
                         f"load-balanced layout; pad the sequence or choose another cp")


def shard(x: torch.Tensor, cp_size: int, rank: int, seq_dim: int) -> torch.Tensor:
    """Rank ``rank``'s load-balanced shard of a full-sequence tensor: chunks r and 2cp-1-r."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be in [0, cp_size={cp_size})")
    _check_split(x.shape[seq_dim], cp_size, "sequence")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = chunk_ids(cp_size, rank)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def unshard(shards, seq_dim: int) -> torch.Tensor:
    """The full sequence from the shards of ranks 0..cp-1 (the inverse of ``shard``)."""
    shards = list(shards)
    cp = len(shards)
    if cp == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    halves: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(shards):
        if part.shape[seq_dim] % 2:
            raise ValueError(f"shard of rank {rank} has odd length {part.shape[seq_dim]} along dim {seq_dim}")
        first, second = chunk_ids(cp, rank)
        halves[first], halves[second] = part.chunk(2, dim=seq_dim)
    return torch.cat(halves, dim=seq_dim)


def _normalized(band: Band, n_q: int, n_kv: int) -> Band:
    """Drop bounds that the tile's edges already imply, so a full tile reads as ``Band()``."""
    lo = None if band.lo is None or band.lo <= -(n_q - 1) else band.lo
    hi = None if band.hi is None or band.hi >= n_kv - 1 else band.hi
    return Band(lo, hi)


def _one_band(pairs: dict[tuple[int, int], Band], rows: list[int], cols: list[int], c: int) -> Optional[Band]:
    """A single band, in the coordinates of the tile rows x cols, that reproduces every chunk pair.

    ``pairs`` maps (q chunk, kv chunk) -> band in that pair's coordinates (absent = invisible).
    """
    def merged(a: int, b: int, band: Band) -> Band:
        return band.shifted((cols.index(b) - rows.index(a)) * c)

    seen = [merged(a, b, band) for (a, b), band in pairs.items() if a in rows and b in cols]
    for lo, hi in itertools.product([None, *{s.lo for s in seen if s.lo is not None}],
                                    [None, *{s.hi for s in seen if s.hi is not None}]):
        cand = Band(lo, hi)
        if all(cand.shifted(-(cols.index(b) - rows.index(a)) * c).clipped(c, c)
               == (pairs[(a, b)].clipped(c, c) if (a, b) in pairs else None)
               for a in rows for b in cols):
            return _normalized(cand, len(rows) * c, len(cols) * c)
    return None


def _step_tiles(pairs: dict[tuple[int, int], Band], c: int) -> list[tuple[list[int], list[int], Band]]:
    """Coalesce the visible chunk pairs of one step into as few tiles as one band each allows."""
    rows = sorted({a for a, _ in pairs})
    cols = sorted({b for _, b in pairs})
    if not rows:
        return []
    whole = _one_band(pairs, rows, cols, c)
    if whole is not None:
        return [(rows, cols, whole)]
    tiles = []
    for a in rows:
        cols_a = sorted(b for (x, b) in pairs if x == a)
        band = _one_band(pairs, [a], cols_a, c)
        if band is not None:
            tiles.append(([a], cols_a, band))
        else:
            tiles.extend(([a], [b], _normalized(pairs[(a, b)], c, c)) for b in cols_a)
    return tiles


def ring_plan(cp: int, rank: int, chunk: int, band: Band) -> RankPlan:
    """The forward tiles of every ring step of ``rank`` for a global visibility ``band``."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, cp={cp})")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} rows must be >= 1")
    q_chunks = chunk_ids(cp, rank)
    steps = []
    sink_rows: set[int] = set()
    for i in range(cp):
        src = (rank - i) % cp
        kv_chunks = chunk_ids(cp, src)
        pairs = {}
        for a, b in itertools.product((0, 1), (0, 1)):
            pair = band.shifted((q_chunks[a] - kv_chunks[b]) * chunk)
            if pair.clipped(chunk, chunk) is not None:
                pairs[(a, b)] = pair
        tiles = []
        for rows, cols, tile_band in _step_tiles(pairs, chunk):
            carries = i == 0 and not sink_rows.intersection(rows)
            if carries:
                sink_rows.update(rows)
            tiles.append(Tile(slice(rows[0] * chunk, (rows[-1] + 1) * chunk),
                              slice(cols[0] * chunk, (cols[-1] + 1) * chunk), tile_band, carries))
        steps.append(Step(i, src, tuple(tiles)))
    if sink_rows != {0, 1}:  # the diagonal is always visible, so step 0 covers every local row
        raise AssertionError(f"step 0 of rank {rank} does not cover every local row: {sink_rows}")
    steps, alone = _with_merges(steps, chunk)
    return RankPlan(cp, rank, chunk, steps, alone)


def _with_merges(steps: list[Step], c: int) -> tuple[tuple[Step, ...], tuple[slice, ...]]:
    """Each later tile's ``RowMerge``s, from the order in which tiles visit each local chunk; and
    the chunks only their first tile visits."""
    visits: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for step in steps:
        for t, tile in enumerate(step.tiles):
            for chunk in range(tile.q_rows.start // c, tile.q_rows.stop // c):
                visits[chunk].append((step.index, t))
    role = {}  # (step, tile, chunk) -> (second, last) for every visit after the first
    for chunk, seen in visits.items():
        for n, (i, t) in enumerate(seen[1:], start=1):
            role[(i, t, chunk)] = (n == 1, n == len(seen) - 1)
    out = []
    for step in steps:
        tiles = []
        for t, tile in enumerate(step.tiles):
            parts = [(chunk, role[(step.index, t, chunk)])
                     for chunk in range(tile.q_rows.start // c, tile.q_rows.stop // c) if (step.index, t, chunk) in role]
            merges = []
            for chunk, (second, last) in parts:  # one merge per run of chunks that join alike
                if merges and (merges[-1].second, merges[-1].last) == (second, last):
                    merges[-1] = RowMerge(slice(merges[-1].rows.start, (chunk + 1) * c), second, last)
                else:
                    merges.append(RowMerge(slice(chunk * c, (chunk + 1) * c), second, last))
            tiles.append(dataclasses.replace(tile, merges=tuple(merges)))
        out.append(Step(step.index, step.kv_rank, tuple(tiles)))
    alone = tuple(slice(chunk * c, (chunk + 1) * c) for chunk, seen in visits.items() if len(seen) == 1)
    return tuple(out), alone


@dataclass(frozen=True)
class CommCount:
    """Messages one rank sends (and receives) in one phase and step of the ring."""

    phase: str    # "fwd" or "bwd"
    step: int
    kind: str     # "kv" or "dkv"
    messages: int


def expected_comm(cp: int) -> list[CommCount]:
    """The comm-count contract (docs/design.md, section 5): K/V forward for steps 0..cp-2 in both
    phases, dK/dV after every backward step (the last one carries each shard's gradient home)."""
    if cp == 1:
        return []
    counts = [CommCount("fwd", i, "kv", 1) for i in range(cp - 1)]
    counts += [CommCount("bwd", i, "kv", 1) for i in range(cp - 1)]
    counts += [CommCount("bwd", i, "dkv", 1) for i in range(cp)]
    return sorted(counts, key=lambda c: (c.phase, c.step, c.kind))
