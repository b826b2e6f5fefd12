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

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from .options import AttnSpec, Band, KVSchedule, doc_lengths


PARTS = 8   # later tiles' results waiting for their merge at most: the forward's memory is PARTS x the rank's o


@dataclass(frozen=True)
class Tile:
    q_rows: slice     # rows of the local shard (0 .. 2c)
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
    gathered: bool = False          # the buffer is every rank's shard in sequence order (``held`` in sequence
                                    # rows; ``KVSchedule.ALLGATHER``), not one owner's rows

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
        """The tiles' K/V rows are disjoint and cover every held row: each row's dK/dV comes from
        exactly one tile, so a fresh accumulator is written by the tiles, not zeroed and added to."""
        at = 0
        for rows in sorted((t.kv_rows for t in self.tiles), key=lambda r: r.start):
            if rows.start != at:
                return False
            at = rows.stop
        return at == self.held_rows

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
    chunks: tuple[int, ...]    # rows per chunk of each document; the local shard has 2 * sum(chunks) rows
    steps: tuple[Step, ...]

    @property
    def parts(self) -> int:
        """How many buffers of later tiles' results the forward needs at once."""
        return max((t.part + 1 for step in self.steps for t in step.tiles), default=0)

    @property
    def accumulates(self) -> bool:
        """The later results are merged more than once: the merges between need an fp32 accumulator."""
        return any(step.merges for step in self.steps[:-1])

    @property
    def backward_steps(self) -> tuple[Step, ...]:
        """Backward visits the forward steps in ring order (dK/dV travel one hop behind K/V)."""
        return self.steps


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


def global_rows(cp: int, rank: int, chunk, device=None) -> torch.Tensor:
    """Global sequence position of each local row of ``rank``'s shard; ``chunk`` is the rows per
    chunk, or a tuple of them, one per document of a pack (each document is cut into ``2 cp``
    chunks and the local shard holds, document after document, its chunks r and 2cp-1-r)."""
    first, second = chunk_ids(cp, rank)
    parts, start = [], 0
    for c in as_chunks(chunk):
        base = torch.arange(c, device=device) + start
        parts += [base + first * c, base + second * c]
        start += 2 * cp * c
    return torch.cat(parts)


def _pack_spec(cu_seqlens, length: int, cp: int) -> tuple[int, ...]:
    """Chunk sizes of a pack (or of one sequence) split over ``cp`` ranks, validated."""
    docs = doc_lengths(cu_seqlens) if cu_seqlens is not None else ()
    if docs and sum(docs) != length:
        raise ValueError(f"cu_seqlens ends at {sum(docs)} but the tensor has {length} tokens along the sequence dim")
    return AttnSpec(docs=docs).chunks(length, cp)


def shard(x: torch.Tensor, cp_size: int, rank: int, seq_dim: int, cu_seqlens=None) -> torch.Tensor:
    """Rank ``rank``'s load-balanced shard of a full-sequence tensor: chunks r and 2cp-1-r (of
    every document of a thd pack, given ``cu_seqlens``, document after document)."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be in [0, cp_size={cp_size})")
    chunks = _pack_spec(cu_seqlens, x.shape[seq_dim], cp_size)
    if len(chunks) == 1:
        parts = x.chunk(2 * cp_size, dim=seq_dim)
        first, second = chunk_ids(cp_size, rank)
        return torch.cat([parts[first], parts[second]], dim=seq_dim)
    return x.index_select(seq_dim, global_rows(cp_size, rank, chunks, x.device))


def unshard(shards, seq_dim: int, cu_seqlens=None) -> torch.Tensor:
    """The full sequence (or thd pack, given ``cu_seqlens``) from the shards of ranks 0..cp-1:
    the inverse of ``shard``."""
    shards = list(shards)
    cp = len(shards)
    if cp == 0:
        raise ValueError("shards must hold one tensor per rank, got none")
    for rank, part in enumerate(shards):
        if part.shape[seq_dim] % 2:
            raise ValueError(f"shard of rank {rank} has odd length {part.shape[seq_dim]} along dim {seq_dim}")
    if cu_seqlens is None:
        halves: list[Optional[torch.Tensor]] = [None] * (2 * cp)
        for rank, part in enumerate(shards):
            first, second = chunk_ids(cp, rank)
            halves[first], halves[second] = part.chunk(2, dim=seq_dim)
        return torch.cat(halves, dim=seq_dim)
    chunks = _pack_spec(cu_seqlens, sum(p.shape[seq_dim] for p in shards), cp)
    joined = torch.cat(shards, dim=seq_dim)
    where = torch.cat([global_rows(cp, r, chunks, joined.device) for r in range(cp)])
    return joined.index_select(seq_dim, torch.argsort(where))


def pad_pack(x: torch.Tensor, cu_seqlens, multiple: int, seq_dim: int = 0, value: float = 0.0):
    """Pad every document of a thd pack at its end to a multiple of ``multiple`` tokens (``2 * cp``
    for a load-balanced CP layout). Returns ``(padded, cu_seqlens_padded, real)``: the padded pack,
    its document boundaries (an int32 tensor on x's device) and a bool mask over the padded tokens,
    True for the real ones (``padded[real]`` along ``seq_dim`` is ``x``).

    The pad tokens join the end of their document, after every real token: under a causal mask
    (with or without a left window) no real row sees them, so the real rows' output and the
    gradients of the real tokens are exact (give the pad rows a zero output gradient). Under
    ``no_mask`` or a right window real rows would attend to them: pad such packs in the model."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
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
    rows per chunk, or a tuple of them, one per document of a thd pack: documents see only
    themselves, so a pack's plan is every document's own plan, side by side in the local shard."""
    kv_schedule = KVSchedule.parse(kv_schedule, "kv_schedule")
    if kv_schedule is KVSchedule.AUTO:
        raise ValueError("ring_plan needs a resolved kv_schedule ('ring', 'direct' or 'allgather'); "
                         "sinkprof.schedule.comm_schedule resolves 'auto'")
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, cp={cp})")
    chunks = as_chunks(chunk)
    if not chunks or min(chunks) < 1:
        raise ValueError(f"chunk={chunk} rows must be >= 1")
    if kv_schedule is KVSchedule.ALLGATHER:
        return gather_plan(cp, rank, chunks, band)
    if len(chunks) > 1:
        return _pack_plan(cp, rank, chunks, band, kv_schedule)
    chunk = chunks[0]
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
    return RankPlan(cp, rank, chunks, _with_parts(steps))


def gather_plan(cp: int, rank: int, chunk, band: Band) -> RankPlan:
    """The plan of ``rank`` under ``KVSchedule.ALLGATHER``: one step whose K/V buffer is the whole
    sequence (every rank's shard, in sequence order), so each local chunk of each document meets
    every key it can see in one tile (a causal chunk at position p of its document: the document's
    first p + c keys). Each local row is in exactly one tile, which carries its sink: nothing is
    merged. A chunk's two tiles join into one when they read the same keys with one band (no
    mask); otherwise the first chunks of every document come first, then the second chunks, so a
    kernel with varlen calls takes each half as one call (``Step.groups``) where their corner bands
    agree (a one-row chunk, or a window trimming some chunks' keys, ends a run)."""
    chunks = as_chunks(chunk)
    per_doc, local, start = [], 0, 0
    for c in chunks:
        tiles: list[Tile] = []
        for a, q in enumerate(chunk_ids(cp, rank)):
            rows = slice(local + a * c, local + (a + 1) * c)
            kv_rows, tile_band = _visible_keys(slice(start, start + 2 * cp * c), c, band.shifted(q * c))
            last = tiles[-1] if tiles else None
            if last is not None and last.kv_rows == kv_rows and last.band == tile_band == Band():
                tiles[-1] = dataclasses.replace(last, q_rows=slice(last.q_rows.start, rows.stop))
            else:
                tiles.append(Tile(rows, kv_rows, tile_band, True))
        per_doc.append(tiles)
        local, start = local + 2 * c, start + 2 * cp * c
    tiles = tuple(t for a in range(2) for doc in per_doc for t in doc[a:a + 1])
    step = Step(0, rank, tiles, _union(t.kv_rows for t in tiles), (slice(0, start),), gathered=True)
    return RankPlan(cp, rank, chunks, _with_parts([step]))


def _shift(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _pack_plan(cp: int, rank: int, chunks: tuple[int, ...], band: Band, kv_schedule: KVSchedule) -> RankPlan:
    """Every document's plan (its rows at its offset in the local shard, the same offset in every
    rank's shard), joined step by step; a document a step cannot see adds no tile and no row."""
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
    return RankPlan(cp, rank, chunks, _with_parts(steps))


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
