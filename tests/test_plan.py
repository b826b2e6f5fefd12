"""The ring plan as data: layout, exact coverage of the attention matrix, sink placement."""

import dataclasses

import pytest
import torch

import sinkprof
from sinkprof.options import Band
from sinkprof.plan import PARTS, _with_parts, chunk_ids, global_rows, ring_plan
from sinkprof.schedule import CommSchedule
from sinkprof.options import KVSchedule


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_shard_unshard_round_trip_and_layout(cp, seq_dim):
    s = 2 * cp * 3
    x = torch.arange(s).view(-1, 1).expand(s, 2) if seq_dim == 0 else torch.arange(s).view(1, -1).expand(2, s)
    shards = [sinkprof.shard(x, cp, r, seq_dim) for r in range(cp)]
    assert torch.equal(sinkprof.unshard(shards, seq_dim), x)
    for r, part in enumerate(shards):
        rows = part[:, 0] if seq_dim == 0 else part[0]
        assert torch.equal(rows, global_rows(cp, r, 3))
        first, second = chunk_ids(cp, r)
        assert rows[0].item() == 3 * first and rows[3].item() == 3 * second


def test_shard_rejects_a_sequence_that_does_not_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 6"):
        sinkprof.shard(torch.zeros(2, 10), 3, 0, 1)
    with pytest.raises(ValueError, match="rank=3"):
        sinkprof.shard(torch.zeros(2, 12), 3, 3, 1)


BANDS = [Band(None, 0), Band(), Band(-5, 0), Band(-3, 2), Band(0, 0), Band(None, 4), Band(-1, None), Band(-40, 0)]


@pytest.mark.parametrize("cp,chunk", [(1, 4), (2, 3), (3, 4), (4, 2), (5, 3)])
@pytest.mark.parametrize("band", BANDS, ids=str)
def test_every_visible_pair_is_computed_exactly_once_and_every_row_gets_the_sink_once(cp, chunk, band):
    s = 2 * cp * chunk
    truth = band.mask(s, s)
    truth = torch.ones(s, s, dtype=torch.bool) if truth is None else truth
    for rank in range(cp):
        plan = ring_plan(cp, rank, chunk, band)
        q_pos = global_rows(cp, rank, chunk)
        covered = torch.zeros(2 * chunk, s, dtype=torch.int64)
        sink_rows = torch.zeros(2 * chunk, dtype=torch.int64)
        for step in plan.steps:
            assert step.kv_rank == (rank - step.index) % cp
            kv_pos = global_rows(cp, step.kv_rank, chunk)
            for tile in step.tiles:
                nq = tile.q_rows.stop - tile.q_rows.start
                nk = tile.kv_rows.stop - tile.kv_rows.start
                vis = tile.band.mask(nq, nk)
                vis = torch.ones(nq, nk, dtype=torch.bool) if vis is None else vis
                rows = torch.arange(tile.q_rows.start, tile.q_rows.stop)
                cols = kv_pos[tile.kv_rows]
                covered[rows[:, None], cols[None, :]] += vis.long()
                if tile.sink:
                    assert step.index == 0
                    sink_rows[rows] += 1
        assert torch.equal(covered, truth[q_pos].long()), f"rank {rank}"
        assert torch.equal(sink_rows, torch.ones_like(sink_rows))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_ring_has_the_load_balanced_shape_of_the_design(cp):
    c = 5
    for rank in range(cp):
        steps = ring_plan(cp, rank, c, Band(None, 0)).steps
        assert [(t.q_rows, t.kv_rows, t.band, t.sink) for t in steps[0].tiles] == \
            [(slice(0, 2 * c), slice(0, 2 * c), Band(None, 0), True)]
        for step in steps[1:]:
            (tile,) = step.tiles
            assert tile.band.is_full and not tile.sink
            if step.index <= rank:
                assert (tile.q_rows, tile.kv_rows) == (slice(0, 2 * c), slice(0, c))
            else:
                assert (tile.q_rows, tile.kv_rows) == (slice(c, 2 * c), slice(0, 2 * c))


def test_equal_work_per_rank_under_the_causal_mask():
    cp, c = 4, 8
    work = []
    for rank in range(cp):
        total = 0
        for step in ring_plan(cp, rank, c, Band(None, 0)).steps:
            for t in step.tiles:
                m = t.band.mask(t.q_rows.stop - t.q_rows.start, t.kv_rows.stop - t.kv_rows.start)
                total += int(m.sum()) if m is not None else (t.q_rows.stop - t.q_rows.start) * (t.kv_rows.stop - t.kv_rows.start)
        work.append(total)
    assert len(set(work)) == 1


def _sent_messages(cp, rank):
    """(phase, step, kind) -> messages ``rank`` sends under the ring schedule."""
    out = {}
    for t in CommSchedule(KVSchedule.RING, cp, 2, Band(None, 0)).transfers(rank, 1, 1):
        out[(t.phase, t.step, t.kind)] = out.get((t.phase, t.step, t.kind), 0) + t.messages_sent
    return out


def test_ring_schedule_message_counts():
    assert _sent_messages(1, 0) == {}
    counts = _sent_messages(3, 1)
    assert counts.get(("fwd", 0, "kv")) == 1 and ("fwd", 2, "kv") not in counts
    assert sum(n for (_, _, kind), n in counts.items() if kind == "dkv") == 3
    assert sum(n for (_, _, kind), n in counts.items() if kind == "kv") == 4


@pytest.mark.parametrize("cp,chunk", [(1, 4), (2, 3), (3, 4), (4, 2), (5, 3), (11, 2), (20, 1)])
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("parts", [2, 3, PARTS])   # a step needs at most 2 (a chunk sees 2 K/V chunks)
def test_parts_hold_every_later_tile_until_its_merge(cp, chunk, band, parts):
    """Step 0's first tiles write the output; every later tile writes a buffer whose rows no other
    tile of that buffer touches before it is merged; the merges empty the buffers they filled, at
    most ``parts`` of them at a time, and the last step merges whatever is left."""
    for rank in range(cp):
        plan = ring_plan(cp, rank, chunk, band)
        if parts != PARTS:
            plan = dataclasses.replace(plan, steps=_with_parts(list(plan.steps), parts))
        assert plan.parts <= parts
        covered_first: list[int] = []
        pending: dict[int, set] = {}       # buffer -> rows written since its last merge
        merges = 0
        for step in plan.steps:
            for group in step.groups:
                assert len({step.tiles[t].part for t in group}) == 1    # a group is one kernel call: one buffer
            for tile in step.tiles:
                rows = set(range(tile.q_rows.start, tile.q_rows.stop))
                if tile.sink:
                    assert step.index == 0 and tile.part == -1
                    covered_first += rows
                    continue
                assert 0 <= tile.part < parts
                assert not rows & pending.setdefault(tile.part, set())
                pending[tile.part] |= rows
            if step.merges:
                assert set(pending) == set(range(step.merges))
                pending, merges = {}, merges + 1
        assert not pending                                        # the last step merged them all
        assert sorted(covered_first) == list(range(2 * chunk))    # every row's first tile writes the output
        assert plan.accumulates == (merges > 1)


@pytest.mark.parametrize("kind", [KVSchedule.RING, KVSchedule.DIRECT, KVSchedule.ALLGATHER])
@pytest.mark.parametrize("band", [Band(None, 0), Band(), Band(-5, 0), Band(-9, 0), Band(-3, 2)],
                         ids=["causal", "no_mask", "w5", "w9", "two-sided"])
def test_kv_cover_says_every_held_row_is_read_by_exactly_one_tile(kind, band):
    """``Step.kv_cover`` lets the direct schedule write a step's dK/dV without zeroing them first:
    it must hold exactly when each row of the step's K/V buffer is in one tile's ``kv_rows``."""
    seen = set()
    for rank in range(4):
        for step in ring_plan(4, rank, 4, band, kind).steps:
            counts = [0] * step.held_rows
            for tile in step.tiles:
                for r in range(tile.kv_rows.start, tile.kv_rows.stop):
                    counts[r] += 1
            assert step.kv_cover == all(c == 1 for c in counts), (rank, step.index)
            seen.add(step.kv_cover)
    if kind is KVSchedule.RING and band != Band():
        assert seen == {True, False}   # both answers occur, so the oracle is tested both ways


def _pack_truth(docs, band: Band) -> torch.Tensor:
    """[t, t] visibility of a pack: ``band`` inside each document, nothing across."""
    t = sum(docs)
    truth = torch.zeros(t, t, dtype=torch.bool)
    at = 0
    for n in docs:
        m = band.mask(n, n)
        truth[at:at + n, at:at + n] = True if m is None else m
        at += n
    return truth


@pytest.mark.parametrize("cp,docs", [(1, [4]), (2, [12]), (3, [6, 18, 12]), (4, [8, 24, 16, 8]), (5, [30, 10])])
@pytest.mark.parametrize("band", BANDS, ids=str)
def test_the_allgather_plan_meets_every_visible_pair_once_in_one_tile_per_row(cp, docs, band):
    """``allgather``: one step over the rows of the sequence the rank's tiles read (its own among
    them); every (row, key) pair a document's band lets through is in exactly one tile, every
    local row is in exactly one tile (which carries its sink: nothing to merge), and a chunk's keys
    are one range of the sequence."""
    chunks = tuple(n // (2 * cp) for n in docs)
    truth = _pack_truth(docs, band)
    for rank in range(cp):
        plan = ring_plan(cp, rank, chunks, band, KVSchedule.ALLGATHER)
        (step,) = plan.steps
        assert step.gathered and step.held == step.reads and step.merges == 0 and plan.parts == 0
        q_pos = global_rows(cp, rank, chunks)
        held = torch.cat([torch.arange(p.start, p.stop) for p in step.held])
        assert torch.isin(q_pos, held).all()            # a rank reads its own rows' keys
        covered = torch.zeros(len(q_pos), sum(docs), dtype=torch.int64)
        rows_seen = torch.zeros(len(q_pos), dtype=torch.int64)
        for tile in step.tiles:
            assert tile.sink and tile.part == -1
            nq, nk = tile.q_rows.stop - tile.q_rows.start, tile.kv_rows.stop - tile.kv_rows.start
            vis = tile.band.mask(nq, nk)
            vis = torch.ones(nq, nk, dtype=torch.bool) if vis is None else vis
            rows = torch.arange(tile.q_rows.start, tile.q_rows.stop)
            src = step.source_rows(tile.kv_rows)
            keys = torch.arange(src.start, src.stop)
            covered[rows[:, None], keys[None, :]] += vis.long()
            rows_seen[rows] += 1
        assert torch.equal(covered, truth[q_pos].long()), f"rank {rank}"
        assert torch.equal(rows_seen, torch.ones_like(rows_seen))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_an_allgather_pack_is_two_varlen_calls_under_causal_and_one_without_a_mask(cp):
    """The tiles of every document's first chunks share one band from their bottom-right corners
    (each chunk sees its document's keys up to its own last row), so they are one group; then the
    second chunks. Without a mask a document's two chunks are one tile and the pack one group. (A
    one-row chunk is a full tile, which ends a run: its document's tiles would be a call apart.)"""
    chunks = (3, 7, 2, 5)
    for rank in range(cp):
        causal = ring_plan(cp, rank, chunks, Band(None, 0), KVSchedule.ALLGATHER).steps[0]
        assert [len(g) for g in causal.groups] == [4, 4]
        assert {t.corner_band for t in causal.tiles} == {Band(None, 0)}
        assert len({t.band for t in causal.tiles}) > 1 or rank == 0    # the bands themselves differ
        full = ring_plan(cp, rank, chunks, Band(), KVSchedule.ALLGATHER).steps[0]
        assert [len(g) for g in full.groups] == [4] and full.kv_cover
        assert [t.q_rows.stop - t.q_rows.start for t in full.tiles] == [2 * c for c in chunks]
