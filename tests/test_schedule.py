"""The communication schedule: exact bytes per (phase, step, kind, peer) from the plan, against an
oracle that reads the mask directly; the emulator's strictness; the gpt-oss and causal targets."""
import tomllib
from pathlib import Path

import pytest
import torch

import sinkprof
from sinkprof import faults
from sinkprof.emulate import emulate_ring
from sinkprof.faults import Fault
from sinkprof.options import Band, KVSchedule, make_spec
from sinkprof.plan import global_rows, ring_plan
from sinkprof.ring import LocalKV, MissingRows
from sinkprof.schedule import CommSchedule, comm_schedule
from sinkprof.testing import Shape, make_inputs, reference

C = 4  # rows per chunk in the exact tests
# (name, band): causal, no mask, windows narrower than, as wide as and wider than a chunk, two-sided.
BANDS = [("causal", Band(None, 0)), ("no_mask", Band()), ("w<c", Band(-2, 0)), ("w=c", Band(-C, 0)),
         ("w>c", Band(-(C + 3), 0)), ("w>2c", Band(-(2 * C + 1), 0)), ("two-sided", Band(-3, 2)),
         ("two-sided-wide", Band(-(C + 1), C + 2))]
CPS = [2, 3, 4, 8]


def read_rows(cp: int, band: Band, reader: int, owner: int) -> int:
    """Rows of ``owner``'s shard that some query row of ``reader`` sees: straight from the mask."""
    s = 2 * cp * C
    mask = band.mask(s, s)
    mask = torch.ones(s, s, dtype=torch.bool) if mask is None else mask
    seen = mask[global_rows(cp, reader, C)][:, global_rows(cp, owner, C)]
    return int(seen.any(0).sum())


def expected_direct(cp, band, rank, kv_row, dkv_row, cover):
    """(phase, step, kind, peer) -> (messages sent, bytes sent, messages received, bytes received);
    ``cover(reader, i)``: the reader's step-i dK/dV partial was written once per row, so it travels
    in K/V's dtype (``kv_row`` bytes a row)."""
    out = {}

    def add(key, sent, received):
        m_s, b_s, m_r, b_r = out.get(key, (0, 0, 0, 0))
        out[key] = (m_s + (sent > 0), b_s + sent, m_r + (received > 0), b_r + received)

    for i in range(1, cp):
        owner, reader = (rank - i) % cp, (rank + i) % cp
        mine, theirs = read_rows(cp, band, rank, owner), read_rows(cp, band, reader, rank)
        for phase in ("fwd", "bwd"):
            if theirs:
                add((phase, i - 1, "kv", reader), theirs * kv_row, 0)
            if mine:
                add((phase, i - 1, "kv", owner), 0, mine * kv_row)
        if mine:
            add(("bwd", i, "dkv", owner), mine * (kv_row if cover(rank, i) else dkv_row), 0)
        if theirs:
            add(("bwd", i, "dkv", reader), 0, theirs * (kv_row if cover(reader, i) else dkv_row))
    return out


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("name,band", BANDS, ids=[n for n, _ in BANDS])
def test_direct_bytes_per_step_and_peer_are_the_rows_the_mask_reads(cp, name, band):
    kv_row, dkv_row = 2 * 3 * 8 * 2, 2 * 3 * 8 * 4     # bf16 K/V rows, fp32 dK/dV rows (b=1, g=3, d=8)
    schedule = CommSchedule(KVSchedule.DIRECT, cp, C, band)
    for rank in range(cp):
        got = {t.key: t.counts for t in schedule.transfers(rank, kv_row, dkv_row)}
        cover = lambda reader, i: schedule.plans[reader].steps[i].kv_cover   # noqa: E731
        assert got == expected_direct(cp, band, rank, kv_row, dkv_row, cover), (name, rank)


@pytest.mark.parametrize("kind", [KVSchedule.DIRECT, KVSchedule.RING, KVSchedule.ALLGATHER])
@pytest.mark.parametrize("name,band", BANDS, ids=[n for n, _ in BANDS])
def test_partials_travel_in_kv_dtype_only_when_one_tile_per_row_wrote_them_under_direct(kind, name, band):
    """Direct steps after step 0 whose tiles write each K/V row once send dK/dV in K/V's dtype;
    every other partial (and every ring or allgather one, which is summed on the way) in the
    accumulator dtype."""
    cp = 4
    schedule = CommSchedule(kind, cp, C, band)
    for r in range(cp):
        for step in schedule.plans[r].steps:
            want = kind is KVSchedule.DIRECT and step.index > 0 and step.kv_cover
            assert schedule.partial_in_kv_dtype(r, step.index) is want, (name, r, step.index)
    if kind is KVSchedule.DIRECT and name in ("causal", "no_mask"):   # these steps read each row once
        assert all(schedule.partial_in_kv_dtype(r, i) for r in range(cp) for i in range(1, cp)
                   if schedule.plans[r].steps[i].held)


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("name,band", BANDS, ids=[n for n, _ in BANDS])
def test_ring_moves_whole_shards_every_step(cp, name, band):
    shard = 2 * C
    for rank in range(cp):
        got = {t.key: t.counts for t in CommSchedule(KVSchedule.RING, cp, C, band).transfers(rank, 10, 20)}
        want = {}
        nxt, prev = (rank + 1) % cp, (rank - 1) % cp
        for key, row in [(("fwd", i, "kv"), 10) for i in range(cp - 1)] + [(("bwd", i, "kv"), 10) for i in range(cp - 1)] \
                + [(("bwd", i, "dkv"), 20) for i in range(cp)]:
            if nxt == prev:
                want[(*key, nxt)] = (1, shard * row, 1, shard * row)
            else:
                want[(*key, nxt)] = (1, shard * row, 0, 0)
                want[(*key, prev)] = (0, 0, 1, shard * row)
        assert got == want


@pytest.mark.parametrize("cp", CPS)
def test_closed_forms_causal_and_a_narrow_window(cp):
    """Causal: steps 1..r read the first K/V chunk, later steps both; a window W < c: one halo of W
    rows from each ring neighbour (r-1 for the first chunk, r+1 for the second)."""
    causal = CommSchedule(KVSchedule.DIRECT, cp, C, Band(None, 0))
    window = CommSchedule(KVSchedule.DIRECT, cp, C, Band(-2, 0))
    for r in range(cp):
        assert [sum(p.stop - p.start for p in causal.kv_rows(r, i)) for i in range(1, cp)] == \
            [C if i <= r else 2 * C for i in range(1, cp)]
        received = {t.peer: t.received for t in window.transfers(r, 1, 1) if t.phase == "fwd" and t.received}
        expected = {}
        if r > 0:
            expected[r - 1] = 2
        if r < cp - 1:
            expected[r + 1] = expected.get(r + 1, 0) + 2
        assert received == expected


def test_comm_bytes_is_the_schedule_in_cp_ranks_and_auto_takes_the_fewer_bytes():
    args = dict(s=64, b=2, h=4, g=2, d=8, dtype=torch.bfloat16, cp=4, mask="causal", window=(3, 0))
    direct = sinkprof.comm_bytes(**args, kv_schedule="direct")
    ring = sinkprof.comm_bytes(**args, kv_schedule="ring")
    auto = sinkprof.comm_bytes(**args)
    assert auto == direct and sum(t.sent for t in direct) < sum(t.sent for t in ring)
    kv_row = 2 * 2 * 2 * 8 * 2
    assert sum(t.sent for t in direct if t.rank == 1 and t.phase == "fwd") == 2 * 3 * kv_row   # two halos of 3 rows
    assert sum(t.sent for t in direct) == sum(t.received for t in direct)
    # a2a+p2p: the ring over groups of 2 on half the K/V heads, the a2a inside each group
    hier = sinkprof.comm_bytes(**{**args, "dtype": torch.float64}, comm="a2a+p2p", a2a_size=2, kv_schedule="direct")
    a2a = [t for t in hier if t.kind == "a2a"]
    assert {(t.rank, t.peer) for t in a2a} == {(0, 1), (1, 0), (2, 3), (3, 2)}
    q_piece, kv_piece = 2 * 16 * 2 * 8 * 8, 2 * 2 * 16 * 1 * 8 * 8
    assert all(t.sent == 2 * q_piece + kv_piece and t.messages_sent == 3 for t in a2a)
    ring_peers = {(t.rank, t.peer) for t in hier if t.kind != "a2a"}
    assert ring_peers == {(0, 2), (2, 0), (1, 3), (3, 1)}
    # no ring, no ring messages; a resolved schedule for cp 1 is the ring
    assert all(t.kind == "a2a" for t in sinkprof.comm_bytes(**{**args, "h": 4, "g": 4}, comm="a2a"))
    assert comm_schedule("auto", 1, 8, Band(None, 0), 1, 1).kind is KVSchedule.RING


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
@pytest.mark.parametrize("name,band", BANDS[:3] + BANDS[6:7])
def test_allgather_sends_each_rank_the_rows_of_its_span_once_per_phase(cp, name, band):
    """Each rank sends every other rank the rows of its shard that rank's rows can see, in the
    forward and again in the backward, and gets back the dK/dV of the rows it sent, all labelled
    step 0: whole shards without a mask (the ring's bytes less one dK/dV shard per rank), fewer
    under a causal mask or a window; ``auto`` never takes it."""
    kv_row, dkv_row = 10, 20
    shard, s = 2 * C, 2 * C * cp
    gather = CommSchedule(KVSchedule.ALLGATHER, cp, C, band)
    ring = CommSchedule(KVSchedule.RING, cp, C, band)
    seen = band.mask(s, s)
    seen = torch.ones(s, s, dtype=torch.bool) if seen is None else seen
    read = [seen[global_rows(cp, rank, C)].any(0) for rank in range(cp)]   # the keys each rank's rows see

    def rows(reader, owner):
        return int(read[reader][global_rows(cp, owner, C)].sum())
    for rank in range(cp):
        moves = gather.transfers(rank, kv_row, dkv_row)
        assert {t.step for t in moves} <= {0}
        want = {}
        for peer in (p for p in range(cp) if p != rank):
            mine, theirs = rows(peer, rank), rows(rank, peer)
            for phase, kind, out, back, row in (("fwd", "kv", mine, theirs, kv_row), ("bwd", "kv", mine, theirs, kv_row),
                                                ("bwd", "dkv", theirs, mine, dkv_row)):
                if out or back:
                    want[(phase, kind, peer)] = (int(out > 0), out * row, int(back > 0), back * row)
        assert {(t.phase, t.kind, t.peer): t.counts for t in moves} == want
    if cp > 1:
        whole = ring.total_bytes(kv_row, dkv_row) - cp * shard * dkv_row
        if name == "no_mask":
            assert gather.total_bytes(kv_row, dkv_row) == whole
        else:
            assert 0 < gather.total_bytes(kv_row, dkv_row) < whole
    assert comm_schedule("auto", cp, C, band, kv_row, dkv_row).kind is not KVSchedule.ALLGATHER


def test_kv_schedule_errors_name_the_argument():
    with pytest.raises(ValueError, match="kv_schedule='sideways'"):
        sinkprof.comm_bytes(s=64, b=1, h=2, g=2, d=8, dtype=torch.float32, cp=2, kv_schedule="sideways")
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match="kv_schedule='sideways'"):
        sinkprof.cp_attention(q, q, q, kv_schedule="sideways")


def test_direct_plan_tiles_index_the_packed_rows_they_read():
    band = Band(-3, 0)
    for rank in range(4):
        ring, direct = ring_plan(4, rank, C, band, "ring"), ring_plan(4, rank, C, band, "direct")
        for a, b in zip(ring.steps, direct.steps):
            assert a.reads == b.reads and a.held == (slice(0, 2 * C),)
            assert b.held == (a.held if b.index == 0 else a.reads)
            for ta, tb in zip(a.tiles, b.tiles):
                assert b.source_rows(tb.kv_rows) == ta.kv_rows and ta.band == tb.band
            if not b.tiles:
                assert b.held == ()


SHAPE = Shape(b=1, s=32, h=2, g=1, d=8)


def test_the_emulator_fails_loudly_when_a_tile_reads_a_row_that_was_not_sent():
    spec = make_spec("learnable", "causal", (3, 0), "bshd")
    inputs = make_inputs(SHAPE, spec, seed=0)
    with faults.injected(Fault.DROP_HALO):
        with pytest.raises(MissingRows, match=r"rank 1 fwd step 1 tile 0 reads K/V rows \[7\] of rank 0's shard"):
            emulate_ring(inputs, spec, 2, "step0", kv_schedule="direct")
    # and a schedule that sends fewer rows than a step holds is caught the same way
    schedule = CommSchedule(KVSchedule.DIRECT, 2, 8, spec.band)

    class Short(CommSchedule):
        def __init__(self):
            self.__dict__.update(schedule.__dict__)

        def kv_rows(self, reader, step):
            rows = schedule.kv_rows(reader, step)
            return (slice(rows[0].start + 1, rows[0].stop),) + rows[1:] if step else rows

    k = [torch.randn(1, 1, 16, 8) for _ in range(2)]
    step = schedule.plans[1].steps[1]
    with pytest.raises(MissingRows, match="were not sent"):
        LocalKV(k, k, Short(), 1, "fwd").get(step)
    got_k, _ = LocalKV(k, k, schedule, 1, "fwd").get(step)    # the honest schedule: exactly the rows read
    assert torch.equal(got_k, k[0][:, :, step.source_rows(slice(0, step.held_rows))])


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [None, (3, 0), (5, 0), (9, 0), (4, 3)])
def test_every_schedule_replays_exactly_in_the_emulator(cp, window):
    mask = "no_mask" if window == (4, 3) else "causal"
    spec = make_spec("learnable", mask, window, "bshd")
    inputs = make_inputs(Shape(b=1, s=48, h=2, g=1, d=8), spec, seed=cp, with_bias=True)
    ref = reference(inputs, spec)
    for kv in ("ring", "direct", "allgather"):
        for strategy in ("step0", "post-merge"):
            run = emulate_ring(inputs, spec, cp, strategy, kv_schedule=kv)
            assert run.kv_schedule.value == kv
            err = max((run.result.named()[k] - v).abs().max().item() for k, v in ref.named().items())
            assert err <= 1e-12, (kv, strategy)


def _profile(name):
    return tomllib.loads((Path(__file__).resolve().parents[1] / "sinkprof" / "profiles" / f"{name}.toml").read_text())


def test_gpt_oss_window_is_128_keys_and_its_layer_moves_50x_fewer_bytes_at_cp8_64k():
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        windows = [tuple(c["window"]) for c in _profile(name)["cases"]]
        assert windows == [(-1, 0), (127, 0)], name
    p = _profile("gpt-oss-120b")
    args = dict(s=65536, b=p["batch"], h=p["heads"], g=p["kv_heads"], d=p["head_dim"], dtype=torch.bfloat16, cp=8,
                mask="causal")
    for window in [(127, 0), None]:
        ring = sinkprof.comm_bytes(**args, window=window, kv_schedule="ring")
        direct = sinkprof.comm_bytes(**args, window=window, kv_schedule="direct")
        assert sinkprof.comm_bytes(**args, window=window) == direct    # auto
        for rank in range(8):
            def total(ts, kinds=("kv", "dkv")):
                return sum(t.sent + t.received for t in ts if t.rank == rank and t.kind in kinds)
            if window is not None:
                assert total(ring, ("kv",)) >= 50 * total(direct, ("kv",)), rank
                assert total(ring) >= 50 * total(direct), rank
            else:
                assert total(direct) < total(ring)
                assert sum(t.sent for t in direct if t.rank == rank) <= sum(t.sent for t in ring if t.rank == rank)
    # no message for a step that computes nothing: a K/V message posted in step i feeds step i+1
    schedule = CommSchedule(KVSchedule.DIRECT, 8, 65536 // 16, make_spec("vanilla", "causal", (127, 0), "bshd").band)
    for rank in range(8):
        plan = schedule.plans[rank]
        fed = {t.step + 1 for t in schedule.transfers(rank, 1, 1) if t.kind == "kv" and t.received}
        returned = {t.step for t in schedule.transfers(rank, 1, 1) if t.kind == "dkv" and t.sent}
        computing = {s.index for s in plan.steps[1:] if s.tiles}
        assert fed == computing == returned
        assert len(computing) <= 2


@pytest.mark.parametrize("fmt,shape", [("bshd", (1, 12, 3, 4)), ("bshd", (2, 12, 3, 4)), ("sbhd", (12, 2, 3, 4)),
                                       ("thd", (12, 3, 4))])
def test_a_range_of_stacked_rows_goes_out_from_the_shard_itself_when_it_is_contiguous(fmt, shape):
    """A row's K sits beside its V, so one range of rows is one contiguous message (sent from the
    shard, no copy) wherever the sequence dim is outermost for it; otherwise it is packed."""
    from sinkprof.options import QKVFormat
    from sinkprof.ring import _message, stacked, unstacked
    f = QKVFormat.parse(fmt, "qkv_format")
    k, v = torch.randn(shape), torch.randn(shape)
    kv = stacked(k, v, f.seq_dim)
    got_k, got_v = unstacked(kv, f)
    assert torch.equal(got_k, f.to_bhsd(k)) and torch.equal(got_v, f.to_bhsd(v))
    outs = [torch.empty(_rows_shape(kv, f.seq_dim, 5)) for _ in range(2)]
    one = _message(kv, f.seq_dim, (slice(2, 7),), lambda n: outs[0])
    two = _message(kv, f.seq_dim, (slice(0, 2), slice(9, 12)), lambda n: outs[1])
    assert torch.equal(one, kv.narrow(f.seq_dim, 2, 5))
    assert torch.equal(two, torch.cat([kv.narrow(f.seq_dim, 0, 2), kv.narrow(f.seq_dim, 9, 3)], f.seq_dim))
    from_shard = one.data_ptr() == kv.narrow(f.seq_dim, 2, 5).data_ptr()
    assert from_shard == (fmt != "bshd" or shape[0] == 1)
    assert two.data_ptr() == outs[1].data_ptr() and one.is_contiguous()


@pytest.mark.parametrize("fmt,shape", [("bshd", (1, 12, 3, 4)), ("sbhd", (12, 2, 3, 4)), ("thd", (12, 3, 4))])
def test_direct_moves_separate_k_and_v_apart_and_every_schedule_moves_a_fused_buffer_as_one(fmt, shape):
    """``kv_pieces``: under direct, separate k and v are the pieces themselves (no copy; a
    non-contiguous one made contiguous once); ring and allgather stack them; the halves of one
    fused buffer are that buffer under every schedule. The views read back K and V."""
    from sinkprof.options import QKVFormat
    from sinkprof.ring import kv_pieces, kv_views
    f = QKVFormat.parse(fmt, "qkv_format")
    k, v = torch.randn(shape), torch.randn(shape)
    apart = kv_pieces(k, v, f, KVSchedule.DIRECT)
    assert [p.data_ptr() for p in apart] == [k.data_ptr(), v.data_ptr()]
    strided = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]   # not contiguous
    copied = kv_pieces(strided, v, f, KVSchedule.DIRECT)
    assert copied[0].is_contiguous() and torch.equal(copied[0], strided) and copied[1] is v
    fused = torch.stack([k, v], dim=f.seq_dim + 1)
    for kind in KVSchedule:
        if kind is KVSchedule.AUTO:
            continue
        one = kv_pieces(*fused.unbind(f.seq_dim + 1), f, kind)
        assert len(one) == 1 and one[0].data_ptr() == fused.data_ptr()
        pieces = kv_pieces(k, v, f, kind)
        assert len(pieces) == (2 if kind is KVSchedule.DIRECT else 1)
        for got, want in zip(kv_views(pieces, f), (k, v)):
            assert torch.equal(got, f.to_bhsd(want))


def _rows_shape(x: torch.Tensor, dim: int, rows: int) -> list:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("name,band", BANDS, ids=[n for n, _ in BANDS])
def test_the_kept_partials_table_places_each_shard_row_in_every_partial_that_carries_it(cp, name, band):
    """``DirectDKV`` sums the partials that come back in K/V's dtype at the end: the table says
    where each row of the owner's shard sits in each of them (message order), -1 where it is not."""
    schedule = CommSchedule(KVSchedule.DIRECT, cp, C, band)
    for owner in range(cp):
        kept = schedule.kept_partials(owner)
        readers = {i: (owner + i) % cp for i in range(1, cp)}
        assert [i for i, _ in kept] == [i for i in range(1, cp) if schedule.partial_in_kv_dtype(readers[i], i)
                                        and schedule.kv_rows(readers[i], i)]
        table, sizes = schedule.partial_table(owner, 2 * C, "cpu")
        assert table.shape == (2 * C, len(kept)) and table.dtype == torch.int32
        for j, (i, rows) in enumerate(kept):
            assert rows == schedule.kv_rows(readers[i], i)
            carried = [r for p in rows for r in range(p.start, p.stop)]    # the shard's rows, in message order
            want = torch.full((2 * C,), -1, dtype=torch.int32)
            want[carried] = torch.arange(len(carried), dtype=torch.int32)
            assert sizes[j] == len(carried) and torch.equal(table[:, j], want), (owner, i)


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("name,band", BANDS, ids=[n for n, _ in BANDS])
def test_the_home_dkv_is_held_in_kv_dtype_only_when_nothing_is_ever_added_into_it(cp, name, band):
    """``DirectDKV`` holds an owner's own dK/dV in K/V's dtype when its step 0 writes every row
    once and every partial that returns to it is kept in K/V's dtype; never under ring or
    allgather, which add into it."""
    direct = CommSchedule(KVSchedule.DIRECT, cp, C, band)
    for owner in range(cp):
        returning = [i for i in range(1, cp) if direct.kv_rows((owner + i) % cp, i)]
        kept = [i for i, _ in direct.kept_partials(owner)]
        want = direct.plans[owner].steps[0].kv_cover and kept == returning
        assert direct.home_in_kv_dtype(owner) is want, (name, owner)
        for kind in (KVSchedule.RING, KVSchedule.ALLGATHER):
            assert not CommSchedule(kind, cp, C, band).home_in_kv_dtype(owner)
    if name in ("causal", "no_mask"):
        assert all(direct.home_in_kv_dtype(owner) for owner in range(cp))
    if name == "two-sided-wide":   # a step after 0 reads some rows twice: that partial comes in fp32
        assert not all(direct.home_in_kv_dtype(owner) for owner in range(cp))
