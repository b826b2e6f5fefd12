"""The ring plan as data: layout, exact coverage of the attention matrix, sink placement."""

import contextlib
import dataclasses

import pytest
import torch

import sinkprof
from sinkprof.options import Band
from sinkprof.plan import PARTS, _with_parts, chunk_ids, global_rows, join_runs, ring_plan
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


def _held_positions(cp, rank, chunk, step):
    """Sequence positions of the rows of a (plain) step's K/V buffer."""
    kv_pos = global_rows(cp, step.kv_rank, chunk)
    return torch.cat([kv_pos[p] for p in step.held]) if step.held else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("cp,chunk", [(2, 3), (3, 4), (4, 2), (5, 3), (8, 2)])
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("max_rows", [4, 6, 1000])
def test_joined_runs_meet_every_visible_pair_once_over_the_runs_rows_side_by_side(cp, chunk, band, max_rows):
    """The forward with its runs joined (``join_runs``): a run's last step reads the rows of
    every step of the run side by side (``landing``), its one tile meets exactly the pairs the
    run's tiles met, the steps it absorbed have no tiles, at most ``max_rows`` rows a run; the
    messages stay per step, each posted at the step that computes before its run; the parts and
    merges still hold every later tile until its merge."""
    s = 2 * cp * chunk
    truth = band.mask(s, s)
    truth = torch.ones(s, s, dtype=torch.bool) if truth is None else truth
    joined_any = False
    for rank in range(cp):
        plain = ring_plan(cp, rank, chunk, band, KVSchedule.DIRECT)
        plan = join_runs(plain, max_rows)
        joined_any |= plan is not plain
        assert [(s_.index, s_.kv_rank, s_.held) for s_ in plan.steps] == [(s_.index, s_.kv_rank, s_.held)
                                                                            for s_ in plain.steps]
        q_pos = global_rows(cp, rank, chunk)
        covered = torch.zeros(2 * chunk, s, dtype=torch.int64)
        computed_at = 0
        for step in plan.steps:
            members = (*step.joins, step.index)
            if step.joins:
                assert not any(plan.steps[j].tiles for j in step.joins)
                assert [plan.landing[j][0] for j in members] == [step.index] * len(members)
                rows = sum(plain.steps[j].held_rows for j in members)
                assert rows <= max_rows and len(step.tiles) == 1
                assert step.tiles[0].kv_rows == slice(0, rows) and step.tiles[0].band == Band()
            if step.index:
                assert all(plan.posted_at[j] == computed_at for j in members if plan.landing[j][0] == step.index)
            if step.index == 0 or plan.landing[step.index][0] == step.index:
                computed_at = step.index
            kv_pos = (torch.cat([_held_positions(cp, rank, chunk, plain.steps[j]) for j in members])
                      if step.index else global_rows(cp, rank, chunk))
            for tile in step.tiles:
                nq, nk = tile.q_rows.stop - tile.q_rows.start, tile.kv_rows.stop - tile.kv_rows.start
                vis = tile.band.mask(nq, nk)
                vis = torch.ones(nq, nk, dtype=torch.bool) if vis is None else vis
                rows_ = torch.arange(tile.q_rows.start, tile.q_rows.stop)
                covered[rows_[:, None], kv_pos[tile.kv_rows][None, :]] += vis.long()
        assert torch.equal(covered, truth[q_pos].long()), f"rank {rank}"
        assert plan.buffer_rows <= max(max_rows, max((s_.held_rows for s_ in plain.steps[1:]), default=0))
        pending: dict[int, set] = {}
        for step in plan.steps:
            for tile in step.tiles:
                if not tile.sink:
                    r = set(range(tile.q_rows.start, tile.q_rows.stop))
                    assert not r & pending.setdefault(tile.part, set())
                    pending[tile.part] |= r
            if step.merges:
                assert set(pending) == set(range(step.merges))
                pending = {}
        assert not pending
    if cp > 2 and band in (Band(None, 0), Band()) and max_rows >= 2 * 2 * chunk:
        assert joined_any


def test_a_causal_rank_joins_its_steps_over_all_its_rows_and_over_its_second_chunk():
    """At cp 8 (chunks of c rows), rank 4's steps 1..4 (all its rows against each earlier rank's
    first chunk) are one call over 4c keys and its steps 5..7 (its second chunk against whole
    shards) two runs at 16k keys a run; no mask: runs of two shards. The backward, and the ring
    and allgather schedules, are not joined; nor are packs (several tiles a step)."""
    c = 4096
    causal = CommSchedule(KVSchedule.DIRECT, 8, c, Band(None, 0))
    plan = causal.joined_plans[4]
    assert [s.joins for s in plan.steps] == [(), (), (), (), (1, 2, 3), (), (5,), ()]
    assert [[(t.q_rows, t.kv_rows) for t in s.tiles] for s in plan.steps if s.tiles][1:] == [
        [(slice(0, 2 * c), slice(0, 4 * c))], [(slice(c, 2 * c), slice(0, 4 * c))],
        [(slice(c, 2 * c), slice(0, 2 * c))]]
    assert plan.posted_at == {1: 0, 2: 0, 3: 0, 4: 0, 5: 4, 6: 4, 7: 6}
    assert plan.landing == {1: (4, 0), 2: (4, c), 3: (4, 2 * c), 4: (4, 3 * c), 5: (6, 0), 6: (6, 2 * c),
                            7: (7, 0)}
    assert causal.plans[4].steps[4].joins == () and causal.plans[4].posted_at == {i: i - 1 for i in range(1, 8)}
    full = CommSchedule(KVSchedule.DIRECT, 8, c, Band()).joined_plans[0]
    assert [s.joins for s in full.steps] == [(), (), (1,), (), (3,), (), (5,), ()]
    for kind in (KVSchedule.RING, KVSchedule.ALLGATHER):
        other = CommSchedule(kind, 8, c, Band(None, 0))
        assert other.joined_plans is other.plans
    pack = CommSchedule(KVSchedule.DIRECT, 4, (8, 4), Band(None, 0))
    assert pack.joined_plans is pack.plans


def test_step_0_runs_beside_the_next_step_that_computes_and_only_on_cuda():
    """``ring.Beside`` puts step 0 beside the next step that is not a run's member (the run's last
    step where the forward joins steps 1..4) if it has tiles, never beside nothing (one step, cp =
    1, or a next step with no tiles), and stays off on the CPU."""
    from sinkprof.ring import Beside, beside_join
    c = 4096
    causal = CommSchedule(KVSchedule.DIRECT, 8, c, Band(None, 0))
    assert beside_join(causal.plans[4].steps) == 1
    assert beside_join(causal.joined_plans[4].steps) == 4            # steps 1..3 are the run's members
    assert beside_join(CommSchedule(KVSchedule.DIRECT, 1, c, Band(None, 0)).plans[0].steps) is None
    assert beside_join(CommSchedule(KVSchedule.ALLGATHER, 8, c, Band(None, 0)).plans[4].steps) is None
    window = CommSchedule(KVSchedule.RING, 4, 512, Band(-127, 0)).plans
    assert not window[0].steps[1].tiles and beside_join(window[0].steps) is None   # step 1 still moves dK/dV
    assert window[1].steps[1].tiles and beside_join(window[1].steps) == 1
    cpu = Beside(causal.plans[4].steps, torch.zeros(1), on=True)
    assert not cpu.on and isinstance(cpu.stream(causal.plans[4].steps[0]), contextlib.nullcontext)
