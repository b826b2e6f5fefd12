"""The load-balanced ring plan, as pure data (docs/design.md, section 3).

The sequence is cut into ``2 * cp`` chunks of ``c`` rows; rank r holds chunks r and 2cp-1-r
(its *local shard*, 2c rows, chunk r first). Which rows each rank holds is a ``Layout``: this
zigzag one, or for a thd pack the balanced one (``balanced_layout``: each document in a few long
pieces, planned under ``allgather`` only). At ring step i rank r computes against the K/V shard
of rank ``(r - i) mod cp``. Each step is a list of tiles: a slice of the local query rows, a slice
of the K/V rows held, and a ``Band`` in the tile's own coordinates. Tiles a mask or window cannot
see are left out; a step's chunk pairs are coalesced into one tile whenever one band describes
them all (the standard causal ring is then exactly: step 0 one causal tile over all local rows,
steps 1..r all rows against the first K/V chunk, later steps the second query chunk against all).

The backward runs the same steps in the same ring order: each step's tiles are recomputed with
the final merged statistics, and the tiles that carry the sink (step 0's) return the sink gradient.
Both the distributed ring and the fp64 emulator execute this plan.

The plan also says which K/V rows each step reads (``Step.reads``: row ranges of the owner's
shard, the union of its tiles' ``kv_rows``, each tile trimmed to the keys its band can see) and
which rows the step's K/V buffer holds (``Step.held``, in buffer order; a tile's ``kv_rows``
index that buffer). Under the ``ring`` schedule every step holds its owner's whole shard; under
``direct`` a step after step 0 holds exactly the rows it reads, packed, and its tiles are
remapped into them (docs/design.md, section 5: the communication schedule).

The plan also says where each tile's result goes (``Tile.part``) and when the results are merged
(``Step.merges``), so the forward makes as few passes over ``o`` as it can: the first tile of a row
(step 0's) writes straight into the output buffer and the statistics; every later tile writes its
own rows of one of ``RankPlan.parts`` buffers (the tiles of one buffer see disjoint rows); after
the last step (or, with more later tiles than ``PARTS`` buffers hold, every time they fill up) one
pass merges the buffers into the rows' result, folding the sink in under post-merge.
"""
from __future__ import annotations

import bisect
import collections.abc
import dataclasses
import functools
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from .options import (BALANCED_RUNS, AttnSpec, Band, KVSchedule, PackLayout, check_int, check_tensor, doc_lengths,
                      type_name)


PARTS = 8   # later tiles' results waiting for their merge at most: the forward's memory is PARTS x the rank's o
RUN_ROWS = 16384   # K/V rows of a run of forward steps joined into one call (``join_runs``) at most
BALANCE = 1e-3   # the balanced layout's work per rank: within this fraction of the mean where it can be
# The orders the light end of a two-ended fill takes documents in (lower first): by the first row
# left (the lightest rows), and two mixes of that and the rows left (whole short documents first).
LIGHT_ORDERS = (1.0, 0.75, 0.5)
KEYS_SLACK = 1 / 16   # two-ended fills run where a rank of the symmetric one reads more keys than its rows by more


@dataclass(frozen=True)
class Tile:
    q_rows: slice     # rows of the local shard
    kv_rows: slice    # rows of the K/V buffer held at this step (``Step.held``), the keys its band can see
    band: Band        # visibility in the tile's own coordinates
    sink: bool        # the first tile of its rows: carries their sink (step 0, each local row exactly once)
    part: int = -1    # the buffer of later results this tile writes its rows into; -1: a first tile (the output)

    @property
    def corner_band(self) -> Band:
        """The band seen from the tile's bottom-right corner (``j - i`` counted so that the last
        row's last key is 0): tiles of different sizes with one corner band are one varlen mask."""
        return self.band.shifted(-(self.kv_rows.stop - self.kv_rows.start - (self.q_rows.stop - self.q_rows.start)))


@dataclass(frozen=True)
class Step:
    index: int
    kv_rank: int               # whose K/V this step computes against
    tiles: tuple[Tile, ...]
    reads: tuple[slice, ...] = ()   # rows of the owner's shard the tiles read (sorted, disjoint)
    held: tuple[slice, ...] = ()    # rows of the owner's shard in this step's K/V buffer, in buffer order
    merges: int = 0                 # once this step's tiles are in: merge buffers 0..merges-1 into the rows' result
    gathered: bool = False          # the buffer holds rows of the sequence from every rank (``held`` and ``reads``
                                    # in sequence rows; ``KVSchedule.ALLGATHER``), not one owner's rows
    joins: tuple[int, ...] = ()     # the forward's run of steps computed as one (``join_runs``): the earlier steps
                                    # whose held rows come before this step's own in its K/V buffer (they have no
                                    # tiles; their messages land in this step's buffer)
    joined_rows: int = 0            # the held rows of those earlier steps, before this step's own in its buffer

    @property
    def held_rows(self) -> int:
        return rows_in(self.held)

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The step's tiles as runs of neighbours that one kernel call can take at once: one band
        seen from the tiles' bottom-right corners (``Tile.corner_band``; varlen kernels align their
        masks there), one sink flag, rows and keys each after the last's (a pack's documents at this
        step). A kernel with varlen calls (FA4) runs a run of several tiles as one call."""
        runs: list[list[int]] = []
        for t, tile in enumerate(self.tiles):
            if runs:
                last = self.tiles[runs[-1][-1]]
                if (tile.corner_band == last.corner_band and tile.sink == last.sink
                        and tile.q_rows.start >= last.q_rows.stop and tile.kv_rows.start >= last.kv_rows.stop):
                    runs[-1].append(t)
                    continue
            runs.append([t])
        return tuple(tuple(run) for run in runs)

    @functools.cached_property
    def kv_cover(self) -> bool:
        """The tiles' K/V rows are disjoint and cover every row of the step's buffer (a run's: its
        joined steps' rows too): each row's dK/dV comes from exactly one tile, so a fresh
        accumulator is written by the tiles, not zeroed and added to."""
        at = 0
        for rows in sorted((t.kv_rows for t in self.tiles), key=lambda r: r.start):
            if rows.start != at:
                return False
            at = rows.stop
        return at == self.joined_rows + self.held_rows

    def source_rows(self, rows: slice) -> slice:
        """The rows of the owner's shard behind ``rows`` of this step's K/V buffer (a tile's
        ``kv_rows`` lies inside one held range)."""
        at = 0
        for part in self.held:
            n = part.stop - part.start
            if at <= rows.start and rows.stop <= at + n:
                return slice(part.start + rows.start - at, part.start + rows.stop - at)
            at += n
        raise ValueError(f"rows {rows.start}..{rows.stop} of step {self.index}'s K/V buffer are not one held range "
                         f"of {self.held}")


@dataclass(frozen=True)
class RankPlan:
    cp: int
    rank: int
    layout: "Layout"           # which rows of the sequence (pack) each rank holds
    steps: tuple[Step, ...]

    @property
    def parts(self) -> int:
        """How many buffers of later tiles' results the forward needs at once."""
        return max((t.part + 1 for step in self.steps for t in step.tiles), default=0)

    @property
    def accumulates(self) -> bool:
        """The later results are merged more than once: the merges between need an fp32 accumulator."""
        return any(step.merges for step in self.steps[:-1])

    @functools.cached_property
    def merged_rows(self) -> slice:
        """The span of the rows later tiles write (empty without them): a merge that reads and writes
        the same buffer leaves the rows outside it as they are (under zigzag, a rank whose later steps
        see only its second chunk merges half its rows)."""
        rows = [t.q_rows for step in self.steps for t in step.tiles if not t.sink]
        return slice(min(r.start for r in rows), max(r.stop for r in rows)) if rows else slice(0, 0)

    @property
    def backward_steps(self) -> tuple[Step, ...]:
        """Backward visits the forward steps in ring order (dK/dV travel one hop behind K/V)."""
        return self.steps

    @functools.cached_property
    def landing(self) -> dict[int, tuple[int, int]]:
        """Each step's (after step 0) K/V rows: ``(the step whose buffer holds them, their first row
        there)``: its own buffer, or that of the step its run is computed at (``Step.joins``)."""
        out = {}
        for step in self.steps[1:]:
            at = 0
            for j in (*step.joins, step.index):
                out[j] = (step.index, at)
                at += self.steps[j].held_rows
        return out

    @functools.cached_property
    def computed_at(self) -> dict[int, int]:
        """Each step after step 0 -> the step whose call computes its tiles: its run's last step
        (``Step.joins``), or itself. A backward sends its dK/dV from there."""
        return {j: at for j, (at, _) in self.landing.items()}

    def computes(self, i: int) -> bool:
        """Whether step ``i``'s call is its own (step 0, a step not joined, a run's last step), not
        its run's last step's."""
        return self.computed_at.get(i, i) == i

    @functools.cached_property
    def posted_at(self) -> dict[int, int]:
        """Under ``direct``, the step at whose start each later step's K/V messages are posted: the
        step that computes before its run (``landing``), so that they are in flight while it
        computes; every step's predecessor where every step computes."""
        out, last = {}, 0
        for step in self.steps[1:]:
            if self.computes(step.index):
                for j in (*step.joins, step.index):
                    out[j] = last
                last = step.index
        return out

    @functools.cached_property
    def buffer_rows(self) -> int:
        """The most K/V rows one step's buffer holds after step 0 (a run's: every step of it)."""
        return max((sum(self.steps[j].held_rows for j in (*s.joins, s.index)) for s in self.steps[1:]
                    if self.computes(s.index)), default=0)


def rows_in(parts) -> int:
    """How many rows a tuple of row ranges covers."""
    return sum(p.stop - p.start for p in parts)


def _union(parts) -> tuple[slice, ...]:
    """Sorted, merged row ranges (touching ranges join)."""
    out: list[slice] = []
    for p in sorted(parts, key=lambda p: p.start):
        if out and p.start <= out[-1].stop:
            out[-1] = slice(out[-1].start, max(out[-1].stop, p.stop))
        else:
            out.append(p)
    return tuple(out)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunks a rank holds, in local order."""
    return rank, 2 * cp - 1 - rank


def as_chunks(chunk) -> tuple[int, ...]:
    """Rows per chunk of each document: an int is one sequence (one document)."""
    return (chunk,) if isinstance(chunk, int) else tuple(chunk)


@dataclass(frozen=True)
class Piece:
    doc: int      # the document it belongs to
    start: int    # its first row, in the sequence's (pack's) rows
    stop: int


@dataclass(frozen=True)
class Layout:
    """Which rows of a sequence or a pack each rank holds, in local order: every rank holds as
    many rows, each document's rows on a rank come as one or two pieces (in the zigzag layout its
    two chunks), and the documents follow in pack order."""

    kind: PackLayout
    docs: tuple[int, ...]                      # document lengths (a sequence is one document)
    ranks: tuple[tuple[Piece, ...], ...]       # per rank, its pieces in local order
    chunks: tuple[int, ...] = ()               # zigzag: rows per chunk of each document

    def __hash__(self) -> int:   # what determines a layout: cheap where it keys a cache (comm_schedule)
        return hash((self.kind, self.docs, len(self.ranks)))

    @property
    def cp(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Each document's first row in the sequence."""
        return tuple(itertools.accumulate(self.docs, initial=0))[:-1]

    @property
    def shard_rows(self) -> int:
        """Rows every rank holds."""
        return sum(p.stop - p.start for p in self.ranks[0])

    def rows(self, rank: int, device=None) -> torch.Tensor:
        """The sequence row of each local row of ``rank``'s shard."""
        return torch.cat([torch.arange(p.start, p.stop, device=device) for p in self.ranks[rank]])

    def local_pieces(self, rank: int):
        """(first local row, piece) of each piece of ``rank``'s shard."""
        at = 0
        for piece in self.ranks[rank]:
            yield at, piece
            at += piece.stop - piece.start


@functools.lru_cache(maxsize=64)
def zigzag_layout(cp: int, chunks: tuple[int, ...]) -> Layout:
    """Each document cut into ``2 cp`` chunks of ``chunks[d]`` rows; rank r holds chunks r and
    2cp-1-r of every document, document after document."""
    docs = tuple(2 * cp * c for c in chunks)
    starts = tuple(itertools.accumulate(docs, initial=0))
    ranks = tuple(tuple(Piece(d, starts[d] + q * c, starts[d] + (q + 1) * c)
                        for d, c in enumerate(chunks) for q in chunk_ids(cp, r)) for r in range(cp))
    return Layout(PackLayout.ZIGZAG, docs, ranks, tuple(chunks))


def _pairs(start: int, stop: int) -> int:
    """Causal (query, key) pairs of a document's rows ``[start, stop)``."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


Ranges = list[tuple[int, int, int]]   # (document, first row, end row), rows counted in the document


def _symmetric_fill(cp: int, docs: tuple[int, ...]) -> list[Ranges]:
    """Ranks filled in turn from both ends of every document at once: a take of ``2x`` rows from a
    document of length L of which ``2u`` rows are gone is its rows ``[u, u + x)`` and ``[L - u - x,
    L - u)``, which cost ``x (L + 1)`` causal pairs wherever they sit. Each rank takes rows from the
    longest documents left and the shortest left in the proportion that gives it its share of the
    work left (a bisection over the rows from the long end). Per rank, its ranges."""
    per = sum(docs) // cp
    order = sorted(range(len(docs)), key=lambda d: (-docs[d], d))
    left = list(docs)
    work_left = sum(_pairs(0, n) for n in docs)
    ranks = []
    for r in range(cp):
        live = [d for d in order if left[d]]   # longest first

        def take(used: dict, from_long: bool, n: int) -> int:
            """The work of ``n`` rows from one end of ``live``; ``used``: rows taken per document."""
            work = 0
            for d in (live if from_long else reversed(live)):
                if not n:
                    break
                t = min(n, left[d] - used.get(d, 0))
                if t:
                    used[d] = used.get(d, 0) + t
                    n -= t
                    work += t * (docs[d] + 1) // 2
            return work

        def work_of(a: int) -> int:
            used: dict = {}
            return take(used, True, a) + take(used, False, per - a)

        share = work_left / (cp - r)
        lo, hi = 0, per // 2             # rows from the long end, in pairs: the work grows with them
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if work_of(2 * mid) <= share:
                lo = mid
            else:
                hi = mid - 1
        a = 2 * lo
        if a < per and abs(work_of(a + 2) - share) < abs(work_of(a) - share):
            a += 2
        used: dict = {}
        work_left -= take(used, True, a) + take(used, False, per - a)
        pieces = []
        for d, t in used.items():   # a document taken from both ends is one stretch of its takes
            n, u, x = docs[d], (docs[d] - left[d]) // 2, t // 2
            pieces += [(d, u, u + x), (d, n - u - x, n - u)]
            left[d] -= t
        ranks.append(pieces)
    return ranks


def _two_ended_fill(cp: int, docs: tuple[int, ...], light: float) -> list[Ranges]:
    """Ranks filled in turn, each document's rows left one range ``[low, high)``: the heavy end
    takes the top rows of the documents with the highest rows left (a top piece reads the keys up
    to ``high`` whatever its length), the light end the bottom rows of the documents first in the
    order ``light`` weighs (``light`` x the first row left + (1 - light) x the rows left), in the
    proportion that gives the rank its share of the causal work left (a bisection over the rows
    of the heavy end). Per rank, its ranges."""
    per, n = sum(docs) // cp, len(docs)
    low, high = [0] * n, list(docs)
    work_left = sum(_pairs(0, length) for length in docs)
    ranks = []
    for r in range(cp):
        live = [d for d in range(n) if low[d] < high[d]]
        heavy_order = sorted(live, key=lambda d: (-high[d], d))
        light_order = sorted(live, key=lambda d: (light * low[d] + (1 - light) * (high[d] - low[d]), d))
        at = {d: i for i, d in enumerate(light_order)}
        # running totals along the light order: rows, and their work taken whole
        rows = list(itertools.accumulate((high[d] - low[d] for d in light_order), initial=0))
        whole = list(itertools.accumulate((_pairs(low[d], high[d]) for d in light_order), initial=0))

        def take(heavy: int, taken: Optional[Ranges] = None) -> int:
            """The work of ``heavy`` rows from the heavy end and the rest from the light end (in
            ``taken``, the ranges: the light end's first)."""
            work, need, tops = 0, per - heavy, {}
            for d in heavy_order:
                if not heavy:
                    break
                t = min(heavy, high[d] - low[d])
                work += _pairs(high[d] - t, high[d])
                tops[d] = high[d] - t
                heavy -= t
            # the light end: whole documents along its order, then part of one; the documents
            # the heavy end cut short (few) split the order into runs taken by their totals
            i = 0
            for p, d in sorted((at[d], d) for d in tops) + [(len(light_order), None)]:
                if rows[p] - rows[i] >= need:   # the light end ends in this run
                    j = bisect.bisect_right(rows, rows[i] + need, i, p + 1) - 1
                    work += whole[j] - whole[i]
                    need -= rows[j] - rows[i]
                    cut = [(light_order[j], low[light_order[j]], low[light_order[j]] + need)] if need else []
                    work += _pairs(low[light_order[j]], low[light_order[j]] + need) if need else 0
                    if taken is not None:
                        taken += [(e, low[e], high[e]) for e in light_order[i:j]] + cut
                    need = 0
                    break
                work += whole[p] - whole[i]
                need -= rows[p] - rows[i]
                t = min(need, tops[d] - low[d])
                work += _pairs(low[d], low[d] + t)
                need -= t
                if taken is not None:
                    taken += [(e, low[e], high[e]) for e in light_order[i:p]] + ([(d, low[d], low[d] + t)] if t else [])
                i = p + 1
                if not need:
                    break
            if taken is not None:
                taken += [(d, top, high[d]) for d, top in tops.items()]
            return work

        share = work_left / (cp - r)
        lo, hi = 0, per
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if take(mid) <= share:
                lo = mid
            else:
                hi = mid - 1
        if lo < per and abs(take(lo + 1) - share) < abs(take(lo) - share):
            lo += 1
        taken: Ranges = []
        work_left -= take(lo, taken)
        for d, x, y in taken:   # the light end's ranges come first: where the two ends meet, the
            if x == low[d]:     # heavy one's range starts at the light one's end, and the document is done
                low[d] = y
            else:
                high[d] = x
        ranks.append(taken)
    return ranks


@dataclass(frozen=True)
class _Fill:
    """A candidate balanced layout: per rank its ranges (merged, in pack order), how far its
    busiest rank's work is over the mean (a fraction), and the most keys a rank reads."""
    ranks: tuple
    excess: float
    keys: int

    @staticmethod
    def of(ranks: list[Ranges], mean: float) -> "_Fill":
        ranks = tuple(tuple(_merged(r)) for r in ranks)
        work = max(sum(_pairs(x, y) for _, x, y in r) for r in ranks)
        return _Fill(ranks, work / mean - 1 if mean else 0.0, max(sum(y for _, _, y in r) for r in ranks))


@functools.lru_cache(maxsize=64)
def balanced_layout(cp: int, docs: tuple[int, ...]) -> Layout:
    """Documents in few long pieces, ``t / cp`` rows and the same causal work on every rank, and
    few keys read (docs/design.md, section 3).

    Under a causal mask a piece ``[x, y)`` of a document reads its first ``y`` keys, and the
    backward costs a fixed part per key read besides the work. ``_symmetric_fill``'s work per rank
    is always close to the share; where its ranks read more keys than they hold rows by over
    ``KEYS_SLACK`` (long documents), ``_two_ended_fill`` runs too, in each of ``LIGHT_ORDERS``, and
    the fill kept reads the fewest keys on the rank that reads the most, among those whose busiest
    rank's work is within ``BALANCE`` of the mean (or as close as the symmetric fill's). Every
    document needs an even length and every rank an even share (the symmetric takes are pairs)."""
    if cp < 1:
        raise ValueError(f"cp_size={cp} must be >= 1")
    if sum(docs) % (2 * cp):
        raise ValueError(f"the pack has {sum(docs)} tokens: the balanced layout gives every rank an even share, so "
                         f"the pack needs a multiple of 2 * cp = {2 * cp} tokens (add a padding document)")
    odd = [(n, length) for n, length in enumerate(docs) if length % 2]
    if odd:
        n, length = odd[0]
        raise ValueError(f"document {n} has {length} tokens ({len(odd)} of {len(docs)} documents are odd): the "
                         f"balanced layout takes documents from both ends at once, so every document needs an even "
                         f"length; pad with sinkprof.pad_pack(x, cu_seqlens, 2)")
    mean, per = sum(_pairs(0, n) for n in docs) / cp, sum(docs) // cp
    symmetric = _Fill.of(_symmetric_fill(cp, docs), mean)
    fills = [symmetric]
    if symmetric.keys > per * (1 + KEYS_SLACK):   # else what the other fills could save is small
        fills += [_Fill.of(_two_ended_fill(cp, docs, light=w), mean) for w in LIGHT_ORDERS]
    enough = max(BALANCE, symmetric.excess)
    best = min((f for f in fills if f.excess <= enough), key=lambda f: (f.keys, f.excess))
    starts = tuple(itertools.accumulate(docs, initial=0))
    ranks = tuple(tuple(Piece(d, starts[d] + x, starts[d] + y) for d, x, y in r) for r in best.ranks)
    return Layout(PackLayout.BALANCED, tuple(docs), ranks)


def _merged(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(document, first row, end row) ranges in pack order, empty ones dropped, touching ones joined."""
    out: list[tuple[int, int, int]] = []
    for d, x, y in sorted(r for r in ranges if r[1] < r[2]):
        if out and out[-1][0] == d and out[-1][2] == x:
            out[-1] = (d, out[-1][1], y)
        else:
            out.append((d, x, y))
    return out


def as_layout(cp: int, chunk) -> Layout:
    """A ``Layout``, or the zigzag layout of ``chunk`` rows per chunk (a tuple: one per document)."""
    if isinstance(chunk, Layout):
        if chunk.cp != cp:
            raise ValueError(f"the layout is for {chunk.cp} ranks, not cp={cp}")
        return chunk
    return zigzag_layout(cp, as_chunks(chunk))


def spec_layout(spec: AttnSpec, s: int, cp: int) -> Layout:
    """The layout of a sequence (a pack, with ``spec.docs``) of ``s`` rows over ``cp`` ranks, validated."""
    if not (spec.docs and spec.pack_layout is PackLayout.BALANCED):
        return zigzag_layout(cp, spec.chunks(s, cp))
    if sum(spec.docs) != s:
        raise ValueError(f"cu_seqlens ends at {sum(spec.docs)} but the pack has {s} tokens")
    return balanced_layout(cp, spec.docs)


def global_rows(cp: int, rank: int, chunk, device=None) -> torch.Tensor:
    """Global sequence position of each local row of ``rank``'s shard; ``chunk`` is a ``Layout``,
    or the rows per chunk (a tuple of them, one per document of a pack: each document is cut into
    ``2 cp`` chunks and the local shard holds, document after document, its chunks r and 2cp-1-r)."""
    return as_layout(cp, chunk).rows(rank, device)


def _pack_layout(cu_seqlens, length: int, cp: int, pack_layout) -> Layout:
    """The layout of a pack (or of one sequence) split over ``cp`` ranks, validated."""
    docs = doc_lengths(cu_seqlens) if cu_seqlens is not None else ()
    if docs and sum(docs) != length:
        raise ValueError(f"cu_seqlens ends at {sum(docs)} but the tensor has {length} tokens along the sequence dim")
    layout = PackLayout.parse(pack_layout, "pack_layout")
    if layout is not PackLayout.ZIGZAG and not docs:
        raise ValueError(f"pack_layout={layout.value!r} lays out the documents of a pack: give cu_seqlens")
    return spec_layout(AttnSpec(docs=docs, pack_layout=layout), length, cp)


def _shards_layout(cu_seqlens, rows: int, cp: int, pack_layout, seq_dim: int) -> Layout:
    """The layout ``unshard``'s ``cp`` shards of ``rows`` rows each were cut in. A layout that
    cannot hold the pack means the shards were cut in another one (or from another pack), not that
    the pack needs padding: the error says which layout holds it, if one does."""
    asked = PackLayout.parse(pack_layout, "pack_layout")
    if cu_seqlens is None:
        return _pack_layout(None, cp * rows, cp, asked)
    docs = doc_lengths(cu_seqlens)
    ends = [0, *itertools.accumulate(docs)]
    if ends[-1] != cp * rows:
        raise ValueError(f"cu_seqlens ends at {ends[-1]} but the {cp} shards hold {cp} x {rows} = {cp * rows} rows "
                         f"along dim {seq_dim}; pass the cu_seqlens used to shard them, one shard per rank")
    for layout in (asked, *(other for other in PackLayout if other is not asked)):
        try:
            found = _pack_layout(cu_seqlens, cp * rows, cp, layout)
        except ValueError:
            continue
        if layout is asked:
            return found
        raise ValueError(f"pack_layout={asked.value!r} cannot lay out the pack cu_seqlens={ends} over {cp} ranks, so "
                         f"these shards were not cut in it; pass the pack_layout used to shard them: "
                         f"pack_layout={layout.value!r}")
    raise ValueError(f"no pack_layout lays out the pack cu_seqlens={ends} over {cp} ranks, so these {cp} shards were "
                     f"not cut from it; pass the cu_seqlens and pack_layout used to shard them, one shard per rank")


def _check_dim(dim, x: torch.Tensor, arg: str, name: str) -> int:
    """``dim`` as an int, a dim of ``x`` (negative ones count from the end, as in torch)."""
    dim = check_int(dim, arg, what=" (the sequence dim)")
    n = x.dim()
    if n == 0:
        raise ValueError(f"{arg}={dim}: {name} is 0-d (a scalar), with no sequence dim; pass the tensor of the "
                         f"sequence")
    if not -n <= dim < n:
        raise ValueError(f"{arg}={dim} is out of range for {name} of shape {tuple(x.shape)}: use a dim from "
                         f"{-n} to {n - 1}")
    return dim


def _check_pad_value(value, dtype: torch.dtype) -> None:
    """A pad value that ``dtype`` holds: a floating dtype rounds it (but does not overflow), an
    integer or bool one must hold it exactly (``new_full`` would truncate 0.5 or refuse nan)."""
    v = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if not isinstance(v, numbers.Number):
        raise TypeError(f"value={value!r} must be a number (the pad tokens' value), not {type(value).__name__}")
    if dtype.is_complex:
        return
    if not isinstance(v, numbers.Real):
        want = "a real number"
    elif dtype.is_floating_point:
        top = torch.finfo(dtype).max
        if not ((isinstance(v, numbers.Integral) or math.isfinite(v)) and abs(v) > top):
            return
        want = f"a number within +-{top:g} (or +-inf, nan)"
    elif dtype == torch.bool:
        if v in (0, 1):
            return
        want = "0 or 1 (False or True)"
    else:
        info = torch.iinfo(dtype)
        whole = isinstance(v, numbers.Integral) or math.isfinite(v) and float(v).is_integer()
        if whole and info.min <= v <= info.max:
            return
        want = f"a whole number from {info.min} to {info.max}"
    raise ValueError(f"value={value!r} is not representable in x's dtype {dtype} (the pad tokens take it): "
                     f"give {want}")


def shard(x: torch.Tensor, cp_size: int, rank: int, seq_dim: int, cu_seqlens=None,
          pack_layout="zigzag") -> torch.Tensor:
    """Rank ``rank``'s load-balanced shard of a full-sequence tensor: chunks r and 2cp-1-r (of
    every document of a thd pack, given ``cu_seqlens``, document after document); with
    ``pack_layout="balanced"`` the pack's rows of ``balanced_layout``."""
    check_tensor(x, "x")
    cp_size = check_int(cp_size, "cp_size", 1, " (ranks in the CP group)")
    rank = check_int(rank, "rank", what=" (a rank of the CP group)")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be in [0, cp_size={cp_size})")
    seq_dim = _check_dim(seq_dim, x, "seq_dim", "x")
    layout = _pack_layout(cu_seqlens, x.shape[seq_dim], cp_size, pack_layout)
    if len(layout.docs) == 1:
        parts = x.chunk(2 * cp_size, dim=seq_dim)
        first, second = chunk_ids(cp_size, rank)
        return torch.cat([parts[first], parts[second]], dim=seq_dim)
    return x.index_select(seq_dim, layout.rows(rank, x.device))


def _check_shards(shards: list, seq_dim) -> int:
    """One shard per rank of one tensor: tensors of one shape, dtype and device; ``seq_dim`` as an int."""
    for rank, part in enumerate(shards):
        check_tensor(part, f"shards[{rank}] (the shard of rank {rank})")
    first = shards[0]
    seq_dim = _check_dim(seq_dim, first, "seq_dim", "the shard of rank 0")
    for rank, part in enumerate(shards[1:], 1):
        if part.dim() != first.dim():
            raise ValueError(f"shard of rank {rank} has {part.dim()} dims (shape {tuple(part.shape)}) but rank 0's "
                             f"has {first.dim()} ({tuple(first.shape)}); pass the shards of one tensor, one per rank")
        if part.shape[seq_dim] != first.shape[seq_dim]:
            raise ValueError(f"shard of rank {rank} has {part.shape[seq_dim]} rows along dim {seq_dim} but rank 0's "
                             f"has {first.shape[seq_dim]}; every rank holds as many rows (pass the shards of one "
                             f"tensor, one per rank, as sinkprof.shard cut them)")
        for d, (n, m) in enumerate(zip(part.shape, first.shape)):
            if n != m:
                raise ValueError(f"shard of rank {rank} has size {n} along dim {d} but rank 0's has {m}; the shards "
                                 f"of one tensor differ only in their rows (along seq_dim={seq_dim})")
        if part.dtype != first.dtype:
            raise ValueError(f"shard of rank {rank} is {part.dtype} but rank 0's is {first.dtype}; the shards of one "
                             f"tensor share a dtype (convert them to one with .to(dtype) first)")
        if part.device != first.device:
            raise ValueError(f"shard of rank {rank} is on {part.device} but rank 0's is on {first.device}; move the "
                             f"shards to one device first")
    return seq_dim


def unshard(shards, seq_dim: int, cu_seqlens=None, pack_layout="zigzag") -> torch.Tensor:
    """The full sequence (or thd pack, given ``cu_seqlens``) from the shards of ranks 0..cp-1:
    the inverse of ``shard``, given the ``cu_seqlens`` and ``pack_layout`` it was given."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, collections.abc.Iterable):
        raise TypeError(f"shards must be a list of one tensor per rank (rank 0's first), got "
                        f"{type_name(shards)}; a stacked tensor's shards are list(x.unbind(0))")
    shards = list(shards)
    cp = len(shards)
    if cp == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    seq_dim = _check_shards(shards, seq_dim)
    rows = shards[0].shape[seq_dim]
    if rows % 2:
        raise ValueError(f"shard of rank 0 has odd length {rows} along dim {seq_dim}")
    layout = _shards_layout(cu_seqlens, rows, cp, pack_layout, seq_dim)
    if cu_seqlens is None:
        halves: list[Optional[torch.Tensor]] = [None] * (2 * cp)
        for rank, part in enumerate(shards):
            first, second = chunk_ids(cp, rank)
            halves[first], halves[second] = part.chunk(2, dim=seq_dim)
        return torch.cat(halves, dim=seq_dim)
    joined = torch.cat(shards, dim=seq_dim)
    where = torch.cat([layout.rows(r, joined.device) for r in range(cp)])
    return joined.index_select(seq_dim, torch.argsort(where))


def pad_pack(x: torch.Tensor, cu_seqlens, multiple: int, seq_dim: int = 0, value: float = 0.0):
    """Pad every document of a thd pack at its end to a multiple of ``multiple`` tokens (``2 * cp``
    for a load-balanced CP layout). Returns ``(padded, cu_seqlens_padded, real)``: the padded pack,
    its document boundaries (an int32 tensor on x's device) and a bool mask over the padded tokens,
    True for the real ones (``padded[real]`` along ``seq_dim`` is ``x``). ``value`` fills the pad
    tokens: a number x's dtype holds (exactly, for an integer dtype).

    The pad tokens join the end of their document, after every real token: under a causal mask
    (with or without a left window) no real row sees them, so the real rows' output and the
    gradients of the real tokens are exact (give the pad rows a zero output gradient). Under
    ``no_mask`` or a right window real rows would attend to them: pad such packs in the model."""
    check_tensor(x, "x")
    multiple = check_int(multiple, "multiple", 1, " (2 * cp for a CP layout)")
    seq_dim = _check_dim(seq_dim, x, "seq_dim", "x")
    _check_pad_value(value, x.dtype)
    docs = doc_lengths(cu_seqlens)
    if sum(docs) != x.shape[seq_dim]:
        raise ValueError(f"cu_seqlens ends at {sum(docs)} but x has {x.shape[seq_dim]} tokens along dim {seq_dim}")
    padded_docs = [-(-n // multiple) * multiple for n in docs]
    real = torch.zeros(sum(padded_docs), dtype=torch.bool, device=x.device)
    parts, start, at = [], 0, 0
    for n, m in zip(docs, padded_docs):
        parts.append(x.narrow(seq_dim, start, n))
        if m > n:
            shape = list(x.shape)
            shape[seq_dim] = m - n
            parts.append(x.new_full(shape, value))
        real[at:at + n] = True
        start, at = start + n, at + m
    ends = torch.tensor([0, *itertools.accumulate(padded_docs)], dtype=torch.int32, device=x.device)
    return torch.cat(parts, dim=seq_dim), ends, real


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


def _visible_keys(kv_rows: slice, n_q: int, band: Band) -> tuple[slice, Band]:
    """A tile's K/V rows trimmed to the keys its band lets some row see, and the band in the
    trimmed tile's coordinates (key j is seen by a row iff ``lo <= j <= n_q - 1 + hi``)."""
    n_kv = kv_rows.stop - kv_rows.start
    lo, hi = band.clipped(n_q, n_kv)
    first, last = max(0, lo), min(n_kv - 1, n_q - 1 + hi)
    trimmed = slice(kv_rows.start + first, kv_rows.start + last + 1)
    return trimmed, _normalized(band.shifted(-first), n_q, last - first + 1)


def ring_plan(cp: int, rank: int, chunk, band: Band, kv_schedule=KVSchedule.RING) -> RankPlan:
    """The forward tiles of every ring step of ``rank`` for a global visibility ``band``; under the
    ``direct`` K/V schedule every step after step 0 holds only the rows it reads, and under
    ``allgather`` there is one step over the whole sequence (``gather_plan``). ``chunk`` is the
    rows per chunk, or a tuple of them, one per document of a thd pack (documents see only
    themselves, so a pack's plan is every document's own plan, side by side in the local shard),
    or a ``Layout``; the balanced layout runs under ``allgather`` only."""
    kv_schedule = KVSchedule.parse(kv_schedule, "kv_schedule")
    if kv_schedule is KVSchedule.AUTO:
        raise ValueError("ring_plan needs a resolved kv_schedule ('ring', 'direct' or 'allgather'); "
                         "sinkprof.schedule.comm_schedule resolves 'auto'")
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, cp={cp})")
    if not isinstance(chunk, Layout):
        chunks = as_chunks(chunk)
        if not chunks or min(chunks) < 1:
            raise ValueError(f"chunk={chunk} rows must be >= 1")
    layout = as_layout(cp, chunk)
    if kv_schedule is KVSchedule.ALLGATHER:
        return gather_plan(cp, rank, layout, band)
    if layout.kind is not PackLayout.ZIGZAG:
        raise ValueError(BALANCED_RUNS)
    if len(layout.chunks) > 1:
        return _pack_plan(cp, rank, layout, band, kv_schedule)
    chunk = layout.chunks[0]
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
            q_rows = slice(rows[0] * chunk, (rows[-1] + 1) * chunk)
            kv_rows, tile_band = _visible_keys(slice(cols[0] * chunk, (cols[-1] + 1) * chunk),
                                               q_rows.stop - q_rows.start, tile_band)
            tiles.append(Tile(q_rows, kv_rows, tile_band, carries))
        reads = _union(t.kv_rows for t in tiles)
        step = Step(i, src, tuple(tiles), reads, (slice(0, 2 * chunk),))
        steps.append(_packed(step) if kv_schedule is KVSchedule.DIRECT and i > 0 else step)
    if sink_rows != {0, 1}:  # the diagonal is always visible, so step 0 covers every local row
        raise AssertionError(f"step 0 of rank {rank} does not cover every local row: {sink_rows}")
    return RankPlan(cp, rank, layout, _with_parts(steps))


def gather_plan(cp: int, rank: int, chunk, band: Band) -> RankPlan:
    """The plan of ``rank`` under ``KVSchedule.ALLGATHER``: one step whose K/V buffer holds the rows
    of the sequence its tiles read (``Step.held``: ranges of sequence rows, packed in order; every
    rank sends each the rows of its shard in them), so each local piece of each document (a chunk,
    in the zigzag layout) meets every key it can see in one tile (under a causal mask, the
    document's keys up to the piece's last row). Each local row is in exactly one tile, which
    carries its sink: nothing is merged. A document's two pieces join into one tile when they read
    the same keys with one band (no mask); otherwise the first pieces of every document come first,
    then the second pieces, so a kernel with varlen calls takes each half as one call
    (``Step.groups``) where their corner bands agree (a one-row piece, or a window trimming some
    pieces' keys, ends a run)."""
    layout = as_layout(cp, chunk)
    halves: tuple[list[Tile], list[Tile]] = ([], [])
    last_doc = None
    for at, piece in layout.local_pieces(rank):
        n, start = piece.stop - piece.start, layout.starts[piece.doc]
        rows = slice(at, at + n)
        kv_rows, tile_band = _visible_keys(slice(start, start + layout.docs[piece.doc]), n,
                                           band.shifted(piece.start - start))
        second = piece.doc == last_doc
        last = halves[0][-1] if second else None
        if last is not None and last.kv_rows == kv_rows and last.band == tile_band == Band():
            halves[0][-1] = dataclasses.replace(last, q_rows=slice(last.q_rows.start, rows.stop))
        else:
            halves[second].append(Tile(rows, kv_rows, tile_band, True))
        last_doc = piece.doc
    tiles = tuple(halves[0] + halves[1])
    step = Step(0, rank, tiles, _union(t.kv_rows for t in tiles), (slice(0, sum(layout.docs)),), gathered=True)
    return RankPlan(cp, rank, layout, _with_parts([_packed(step)]))


def _shift(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _pack_plan(cp: int, rank: int, layout: Layout, band: Band, kv_schedule: KVSchedule) -> RankPlan:
    """Every document's plan (its rows at its offset in the local shard, the same offset in every
    rank's shard), joined step by step; a document a step cannot see adds no tile and no row."""
    chunks = layout.chunks
    docs = [ring_plan(cp, rank, c, band) for c in chunks]
    offsets = [0, *itertools.accumulate(2 * c for c in chunks)]
    steps = []
    for i in range(cp):
        tiles, reads = [], []
        for plan, at in zip(docs, offsets):
            step = plan.steps[i]
            reads += [_shift(part, at) for part in step.reads]
            tiles += [dataclasses.replace(t, q_rows=_shift(t.q_rows, at), kv_rows=_shift(t.kv_rows, at))
                      for t in step.tiles]
        step = Step(i, (rank - i) % cp, tuple(tiles), _union(reads), (slice(0, offsets[-1]),))
        steps.append(_packed(step) if kv_schedule is KVSchedule.DIRECT and i > 0 else step)
    return RankPlan(cp, rank, layout, _with_parts(steps))


def _packed(step: Step) -> Step:
    """The step holding only the rows it reads, packed in order, its tiles remapped into them."""
    starts, at = [], 0
    for part in step.reads:
        starts.append(at)
        at += part.stop - part.start
    tiles = []
    for tile in step.tiles:
        n, part = next((n, p) for n, p in enumerate(step.reads)
                       if p.start <= tile.kv_rows.start and tile.kv_rows.stop <= p.stop)
        start = starts[n] + tile.kv_rows.start - part.start
        tiles.append(dataclasses.replace(tile, kv_rows=slice(start, start + tile.kv_rows.stop - tile.kv_rows.start)))
    return dataclasses.replace(step, tiles=tuple(tiles), held=step.reads)


def join_runs(plan: RankPlan, max_rows: int = RUN_ROWS) -> RankPlan:
    """``plan`` with each run of later steps that one kernel call can take computed as one (in the
    forward and in the backward): consecutive steps after step 0 with one tile each, over the same query rows, under a
    full band, reading every row the step holds (under ``direct``: a causal rank's steps 1..r, its
    steps r+1..cp-1, a full mask's later steps), their held rows together at most ``max_rows``.
    The run's last step computes one tile over its K/V buffer, which holds the rows of every step
    of the run side by side (``Step.joins``, ``Step.joined_rows``); the earlier ones have no tiles.
    Messages, their rows and their bytes stay per step; only where they land and when they are
    computed change (in the backward, each step's dK/dV leave once the run's call is done). FA4's
    rate grows with a call's key loop (docs/design.md, section 7): one 8192 x 16384 call runs at
    664 TFLOP/s on the H200 where four 8192 x 4096 ones run at 616."""
    def joinable(step: Step) -> bool:
        return (step.index > 0 and not step.gathered and len(step.tiles) == 1 and len(step.held) == 1
                and step.tiles[0].band == Band() and not step.tiles[0].sink
                and step.tiles[0].kv_rows == slice(0, step.held_rows))

    out: list[Step] = [plan.steps[0]]
    run: list[Step] = []

    def flush() -> None:
        if len(run) > 1:
            rows = sum(s.held_rows for s in run)
            out.extend(dataclasses.replace(s, tiles=(), merges=0) for s in run[:-1])
            tile = dataclasses.replace(run[-1].tiles[0], kv_rows=slice(0, rows))
            out.append(dataclasses.replace(run[-1], tiles=(tile,), joins=tuple(s.index for s in run[:-1]),
                                           joined_rows=rows - run[-1].held_rows))
        else:
            out.extend(run)
        run.clear()

    for step in plan.steps[1:]:
        if run and not (joinable(step) and step.tiles[0].q_rows == run[0].tiles[0].q_rows
                        and sum(s.held_rows for s in run) + step.held_rows <= max_rows):
            flush()
        if joinable(step):
            run.append(step)
        else:
            out.append(step)
    flush()
    if all(not s.joins for s in out):
        return plan
    return dataclasses.replace(plan, steps=_with_parts(out))


def _overlaps(rows: list[slice], taken: list[slice]) -> bool:
    return any(r.start < t.stop and t.start < r.stop for r in rows for t in taken)


def _with_parts(steps: list[Step], parts: int = PARTS) -> tuple[Step, ...]:
    """Each later tile's buffer (``Tile.part``) and each step's merges (``Step.merges``).

    A step's later tiles fill new buffers, a group of tiles (``Step.groups``, one kernel call) one
    buffer, and a group goes into the step's first new buffer whose rows it does not touch. When a
    step would need more buffers than are left, the buffers filled so far are merged after the
    step before it; after the last step every filled buffer is merged."""
    out: list[Step] = []
    used = 0   # buffers filled since the last merge
    for step in steps:
        rows: list[list[slice]] = []   # rows taken in each of this step's new buffers
        where: dict[int, int] = {}
        for group in step.groups:
            if step.tiles[group[0]].sink:
                continue
            group_rows = [step.tiles[t].q_rows for t in group]
            n = next((n for n, taken in enumerate(rows) if not _overlaps(group_rows, taken)), len(rows))
            if n == len(rows):
                rows.append([])
            rows[n] += group_rows
            for t in group:
                where[t] = n
        if used + len(rows) > parts and out:
            out[-1] = dataclasses.replace(out[-1], merges=used)
            used = 0
        if len(rows) > parts:
            raise ValueError(f"step {step.index} needs {len(rows)} buffers of results, more than {parts}")
        tiles = tuple(dataclasses.replace(t, part=used + where[n]) if n in where else t
                      for n, t in enumerate(step.tiles))
        used += len(rows)
        out.append(dataclasses.replace(step, tiles=tiles, merges=0))
    out[-1] = dataclasses.replace(out[-1], merges=used)
    return tuple(out)
