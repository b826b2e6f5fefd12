"""The balanced layout of a thd pack: every row on one rank, equal rows and equal causal work per
rank, few pieces; its allgather plan, shards, fp64 replay, byte contract, faults and refusals."""
import itertools
import random
import re

import pytest
import torch

import sinkprof
from sinkprof import faults, plan
from sinkprof.emulate import emulate_hierarchical, emulate_ring
from sinkprof.options import Band, KVSchedule, PackLayout, SinkStrategy, make_spec
from sinkprof.plan import balanced_layout, ring_plan, spec_layout, zigzag_layout
from sinkprof.schedule import comm_bytes, resolved_kv_schedule
from sinkprof.testing import Shape, make_inputs, reference

from conftest import assert_pack_plan_exact

SOFTMAX = ["vanilla", "off-by-one", "learnable"]
MASKS = [("causal", None), ("no_mask", None), ("causal", (3, 0)), ("causal", (20, 0)), ("no_mask", (2, 3))]


def cu(docs):
    return [0, *itertools.accumulate(docs)]


def work(layout, rank):
    """Causal (query, key) pairs of a rank's rows."""
    return sum(row - layout.starts[p.doc] + 1 for p in layout.ranks[rank] for row in range(p.start, p.stop))


def random_pack(rng, cp):
    docs = [2 * rng.randint(1, 60) for _ in range(rng.randint(1, 10))]
    extra = -sum(docs) % (2 * cp)
    return tuple(docs + [extra] if extra else docs)


def test_every_row_is_on_one_rank_in_at_most_two_pieces_of_a_document():
    """Every rank holds as many rows; a document's rows on a rank are one or two pieces, documents
    in pack order."""
    rng = random.Random(0)
    for _ in range(300):
        cp = rng.randint(1, 8)
        docs = random_pack(rng, cp)
        layout = balanced_layout(cp, docs)
        rows = torch.cat([layout.rows(r) for r in range(cp)])
        assert torch.equal(rows.sort().values, torch.arange(sum(docs))), (cp, docs)
        assert {len(layout.rows(r)) for r in range(cp)} == {sum(docs) // cp}
        for r in range(cp):
            pieces = layout.ranks[r]
            assert [(p.doc, p.start) for p in pieces] == sorted((p.doc, p.start) for p in pieces)
            for doc, mine in itertools.groupby(pieces, key=lambda p: p.doc):
                mine = list(mine)
                assert len(mine) <= 2 and all(p.start < p.stop for p in mine), (docs, r, mine)
                assert layout.starts[doc] <= mine[0].start and mine[-1].stop <= layout.starts[doc] + docs[doc]
                if len(mine) == 2:
                    assert mine[0].stop < mine[1].start, (docs, r, mine)   # touching pieces are one


def keys_read(layout, rank):
    """Under a causal mask a piece reads its document's keys up to its last row."""
    return sum(p.stop - layout.starts[p.doc] for p in layout.ranks[rank])


def test_the_busiest_rank_reads_fewer_keys_than_with_symmetric_takes():
    """The benchmark's 64k pack at cp 8: taking each document from both ends at once (the first
    balanced layout) had its busiest rank read 35.6k keys; the two-ended fills read at most 23.4k,
    at the same work per rank."""
    docs = (15872, 15216, 8352, 8928, 2704, 14464)
    layout = balanced_layout(8, docs)
    symmetric = [plan._merged(r) for r in plan._symmetric_fill(8, docs)]
    assert max(sum(y for _, _, y in r) for r in symmetric) == 35600
    assert max(keys_read(layout, r) for r in range(8)) <= 23400
    works = [work(layout, r) for r in range(8)]
    assert max(works) / (sum(works) / 8) < 1 + plan.BALANCE, works
    # and never more than the symmetric fill's, on any pack
    rng = random.Random(1)
    for _ in range(200):
        cp = rng.randint(1, 8)
        docs = random_pack(rng, cp)
        layout = balanced_layout(cp, docs)
        symmetric = [plan._merged(r) for r in plan._symmetric_fill(cp, docs)]
        assert max(keys_read(layout, r) for r in range(cp)) <= max(sum(y for _, _, y in r) for r in symmetric)


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_the_causal_work_is_the_same_on_every_rank_of_long_packs(cp):
    rng = random.Random(cp)
    for _ in range(10):
        docs = []
        while sum(docs) < 65536 - 16384:
            docs.append(2 * rng.randint(1024, 8192))
        docs.append(65536 - sum(docs))
        layout = balanced_layout(cp, tuple(docs))
        works = [work(layout, r) for r in range(cp)]
        assert max(works) / (sum(works) / cp) < 1.001, (docs, works)
        # few pieces: a rank's documents change where the long and the short end run out
        assert sum(len(p) for p in layout.ranks) <= 2 * (2 * cp + len(docs)), layout.ranks


def test_the_two_ended_fills_run_only_where_the_symmetric_one_reads_many_more_keys_than_rows(monkeypatch):
    """Short documents: no rank of the symmetric fill reads more keys than its rows by over
    KEYS_SLACK, so the two-ended fills (host time per document) are not tried; long ones: they are."""
    tried = []
    real = plan._two_ended_fill
    monkeypatch.setattr(plan, "_two_ended_fill", lambda *a, **kw: tried.append(kw["light"]) or real(*a, **kw))
    balanced_layout.cache_clear()
    short = (4,) * 2048
    layout = balanced_layout(8, short)
    assert tried == []
    assert max(keys_read(layout, r) for r in range(8)) <= 1024 * (1 + plan.KEYS_SLACK)
    balanced_layout(8, (15872, 15216, 8352, 8928, 2704, 14464))
    assert tried == list(plan.LIGHT_ORDERS)
    balanced_layout.cache_clear()


def test_one_document_is_the_zigzag_layout():
    for cp in (1, 2, 3, 8):
        for r in range(cp):
            assert torch.equal(balanced_layout(cp, (4 * cp,)).rows(r), zigzag_layout(cp, (2,)).rows(r))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp):
    docs = [2 * cp * n for n in (1, 5, 2)] + [6, 2 * cp - 6 % (2 * cp)]
    x = torch.arange(sum(docs))
    shards = [sinkprof.shard(x, cp, r, 0, cu(docs), pack_layout="balanced") for r in range(cp)]
    assert torch.equal(sinkprof.unshard(shards, 0, cu(docs), pack_layout="balanced"), x)
    layout = balanced_layout(cp, tuple(docs))
    for r, part in enumerate(shards):
        assert torch.equal(part, layout.rows(r))


def test_unshard_refuses_shards_of_the_wrong_size():
    docs = [8, 24]
    shards = [sinkprof.shard(torch.arange(32), 2, r, 0, cu(docs), pack_layout="balanced") for r in range(2)]
    with pytest.raises(ValueError, match=re.escape("shard of rank 1 has 18 rows along dim 0 but rank 0's has 14; "
                                                   "every rank holds as many rows")):
        sinkprof.unshard([shards[0][:14], torch.cat([shards[1], shards[0][14:]])], 0, cu(docs), pack_layout="balanced")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("band", [Band(None, 0), Band(), Band(-3, 0), Band(-9, 0), Band(-2, 3)], ids=str)
def test_every_visible_pair_is_computed_exactly_once(cp, band):
    docs = (2 * cp * 4, 6, 2 * cp * 2 + 2)
    docs += (-sum(docs) % (2 * cp) or 2 * cp,)
    assert_pack_plan_exact(cp, balanced_layout(cp, docs), band, KVSchedule.ALLGATHER)


def test_a_causal_rank_runs_its_pieces_as_two_kernel_calls():
    # each document's first piece on the rank in one varlen call, the second pieces in the other:
    # one corner band, rows and keys increasing
    docs = (15872, 15216, 8352, 8928, 2704, 14464)
    layout = balanced_layout(8, docs)
    calls = []
    for rank in range(8):
        step, = ring_plan(8, rank, layout, Band(None, 0), KVSchedule.ALLGATHER).steps
        pieces = layout.ranks[rank]
        calls.append(len(step.groups))
        assert len(step.groups) == (2 if len({p.doc for p in pieces}) < len(pieces) else 1), pieces
    assert 1 in calls and 2 in calls, calls


@pytest.mark.parametrize("cp,docs", [(2, [8, 24, 16]), (3, [12, 36, 6, 24]), (4, [64]), (4, [8] * 6),
                                     (2, [4, 60]), (3, [6, 18, 2, 10]), (4, [2, 2, 50, 10])])
@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("mask,window", MASKS)
def test_the_replayed_ring_equals_the_reference(cp, docs, softmax, mask, window):
    spec = make_spec(softmax, mask, window, "thd", cu(docs), "balanced")
    x = make_inputs(Shape(1, sum(docs), 4, 2, 8), spec, cp)
    ref = reference(x, spec)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        run = emulate_ring(x, spec, cp, strategy)
        assert run.kv_schedule is KVSchedule.ALLGATHER   # auto takes the one schedule the layout runs under
        for name, want in ref.named().items():
            assert (run.result.named()[name] - want).abs().max() < 1e-11, (strategy, name)


def test_the_doc_leak_fault_breaks_the_replay():
    spec = make_spec("learnable", "causal", None, "thd", cu([16, 32, 12]), "balanced")
    x = make_inputs(Shape(1, 60, 4, 2, 8), spec, 0)
    ref = reference(x, spec)
    with faults.injected(faults.Fault.DOC_LEAK):
        got = emulate_ring(x, spec, 2, SinkStrategy.STEP0).result
    assert (got.out - ref.out).abs().max() > 1e-3
    clean = emulate_ring(x, spec, 2, SinkStrategy.STEP0).result
    assert (clean.out - ref.out).abs().max() < 1e-12


def test_each_rank_gets_the_rows_of_its_span_of_the_pack():
    """Under allgather a rank receives, of every other shard, the rows its own rows see (its
    documents' keys up to its pieces' last rows), and returns their dK/dV: in the balanced layout a
    rank holding a few documents gets nothing of the others."""
    docs, cp, g, d = [40, 12, 20, 8], 4, 2, 8
    layout = balanced_layout(cp, tuple(docs))
    kw = dict(s=80, b=1, h=4, g=g, d=d, dtype=torch.float32, cp=cp, mask="causal", cu_seqlens=cu(docs))
    assert resolved_kv_schedule(**kw, pack_layout="balanced") is KVSchedule.ALLGATHER
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    seen = Band(None, 0).mask(80, 80) & (doc[:, None] == doc[None, :])
    read = [seen[layout.rows(r)].any(0) for r in range(cp)]   # the keys each rank's rows see

    def rows(reader, owner):
        return int(read[reader][layout.rows(owner)].sum())
    kv_row, dkv_row = 2 * g * d * 4, 2 * g * d * 4   # K and V (dK and dV) rows of b=1, fp32
    got = {(t.rank, t.phase, t.kind, t.peer): (t.sent, t.received) for t in comm_bytes(**kw, pack_layout="balanced")}
    want = {}
    for r in range(cp):
        for p in (p for p in range(cp) if p != r):
            mine, theirs = rows(p, r), rows(r, p)
            for phase, kind, out, back in (("fwd", "kv", mine, theirs), ("bwd", "kv", mine, theirs),
                                           ("bwd", "dkv", theirs, mine)):
                if out or back:
                    want[(r, phase, kind, p)] = (out * kv_row, back * dkv_row)
    assert got == want
    assert sum(out for out, _ in got.values()) < 3 * cp * (cp - 1) * 20 * kv_row   # less than whole shards


@pytest.mark.parametrize("call,message", [
    (lambda: ring_plan(2, 0, balanced_layout(2, (8, 8)), Band(None, 0), KVSchedule.RING), "kv_schedule='allgather'"),
    (lambda: make_spec("vanilla", "causal", None, "bshd", None, "balanced"), "lays out the documents of a thd pack"),
    (lambda: make_spec("vanilla", "causal", None, "thd", [0, 8], "diagonal"), "pack_layout='diagonal'"),
    (lambda: sinkprof.shard(torch.zeros(16), 2, 0, 0, [0, 7, 16], pack_layout="balanced"), "document 0 has 7 tokens"),
    (lambda: sinkprof.shard(torch.zeros(18), 2, 0, 0, [0, 8, 18], pack_layout="balanced"),
     "a multiple of 2 * cp = 4 tokens"),
    (lambda: sinkprof.shard(torch.zeros(16), 2, 0, 0, pack_layout="balanced"), "give cu_seqlens"),
    (lambda: comm_bytes(s=16, b=1, h=4, g=2, d=8, dtype=torch.float32, cp=2, comm="a2a", cu_seqlens=[0, 8, 16],
                        pack_layout="balanced"), "comm='p2p'"),
])
def test_what_the_layout_cannot_run_is_refused_by_name(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_the_a2a_replay_refuses_the_layout():
    spec = make_spec("learnable", "causal", None, "thd", cu([8, 8]), "balanced")
    x = make_inputs(Shape(1, 16, 4, 4, 8), spec, 0)
    with pytest.raises(ValueError, match=re.escape("comm='p2p'")):
        emulate_hierarchical(x, spec, 4, 2, SinkStrategy.STEP0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(comm="a2a"), "comm='a2a', kv_schedule='auto'"),
    (dict(kv_schedule="ring"), "comm='p2p', kv_schedule='ring'"),
])
def test_cp_attention_refuses_what_the_layout_cannot_run(world, kwargs, message):
    spec = make_spec("vanilla", "causal", None, "thd", cu([16, 16]), "balanced")
    x = make_inputs(Shape(1, 32, 4, 2, 8), spec, 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        sinkprof.cp_attention(x.q, x.k, x.v, qkv_format="thd", cu_seqlens=cu([16, 16]), pack_layout="balanced",
                              **kwargs)


@pytest.mark.parametrize("strategy", ["step0", "post-merge"])
def test_one_rank_cp_attention_equals_the_reference(world, strategy):
    docs = [6, 10, 16]
    spec = make_spec("learnable", "causal", (5, 0), "thd", cu(docs), "balanced")
    x = make_inputs(Shape(1, 32, 4, 2, 8), spec, 0)
    mine = [t.clone().requires_grad_() for t in (x.q, x.k, x.v, x.offset)]
    out = sinkprof.cp_attention(*mine, softmax_type="learnable", mask="causal", window=(5, 0), qkv_format="thd",
                                cu_seqlens=cu(docs), sink_strategy=strategy, pack_layout="balanced")
    out.backward(x.grad_out)
    ref = reference(x, spec)
    for got, want in zip([out] + [t.grad for t in mine], (ref.out, ref.dq, ref.dk, ref.dv, ref.d_offset)):
        assert (got - want).abs().max() < 1e-12


def test_spec_layout_is_the_layout_the_spec_names():
    spec = make_spec("vanilla", "causal", None, "thd", cu([8, 24]), "balanced")
    assert spec_layout(spec, 32, 2).kind is PackLayout.BALANCED
    assert spec_layout(make_spec("vanilla", "causal", None, "thd", cu([8, 24])), 32, 2) == zigzag_layout(2, (2, 6))
