"""Packed sequences (thd): the reference against per-document attention, the pack's plan, shards,
padding, the byte contract, the fp64 replay of every schedule and the public entry points.

Multi-rank runs go through ``sinkprof check --qkv-format thd`` (the check tests)."""
import itertools
import re

import pytest
import torch

import sinkprof
from sinkprof import faults
from sinkprof.a2a import join_outer, split_outer
from sinkprof.emulate import emulate_hierarchical, emulate_ring
from sinkprof.options import Band, KVSchedule, SinkStrategy, make_spec
from sinkprof.plan import global_rows, ring_plan, zigzag_layout
from sinkprof.reference import doc_ids
from sinkprof.schedule import CommSchedule, comm_bytes
from sinkprof.testing import Shape, make_inputs, reference

from conftest import assert_pack_plan_exact

SOFTMAX = ["vanilla", "off-by-one", "learnable"]
# (mask, window) pairs, windows narrower and wider than the documents' chunks, and two-sided
MASKS = [("causal", None), ("no_mask", None), ("causal", (3, 0)), ("causal", (20, 0)), ("no_mask", (2, 3))]


def cu(docs):
    return [0, *itertools.accumulate(docs)]


def pack_inputs(docs, softmax="learnable", mask="causal", window=None, seed=0, h=4, g=2, d=8):
    spec = make_spec(softmax, mask, window, "thd", cu(docs))
    return spec, make_inputs(Shape(1, sum(docs), h, g, d), spec, seed)


@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("mask,window", MASKS)
def test_the_thd_reference_is_per_document_attention(softmax, mask, window):
    docs = [8, 24, 4, 12]
    spec, x = pack_inputs(docs, softmax, mask, window)
    ref = reference(x, spec)
    out, dq, dk, dv = [], [], [], []
    d_off = torch.zeros(1, 4, 1, 1, dtype=torch.float64)
    for a, b in zip(cu(docs), cu(docs)[1:]):
        q, k, v = (t[a:b].unsqueeze(0).clone().requires_grad_() for t in (x.q, x.k, x.v))
        off = x.offset.clone().requires_grad_() if x.offset is not None else None
        o = sinkprof.attention(q, k, v, off, softmax_type=softmax, mask=mask, window=window)
        o.backward(x.grad_out[a:b].unsqueeze(0))
        out.append(o.detach()[0]), dq.append(q.grad[0]), dk.append(k.grad[0]), dv.append(v.grad[0])
        if off is not None:
            d_off += off.grad
    for name, got, want in (("out", ref.out, out), ("dq", ref.dq, dq), ("dk", ref.dk, dk), ("dv", ref.dv, dv)):
        assert (got - torch.cat(want)).abs().max() < 1e-12, name
    if softmax == "learnable":
        assert (ref.d_offset - d_off).abs().max() < 1e-12
    else:
        assert ref.d_offset is None


def test_the_thd_sink_gradient_matches_finite_differences():
    docs = [6, 10, 16]
    spec, x = pack_inputs(docs, "learnable", "causal", (4, 0), seed=3)
    ref = reference(x, spec)

    def loss(offset):
        out = sinkprof.attention(x.q, x.k, x.v, offset, softmax_type="learnable", mask="causal", window=(4, 0),
                                 qkv_format="thd", cu_seqlens=cu(docs))
        return float((out * x.grad_out).sum())

    eps = 1e-6
    for head in range(4):
        bump = torch.zeros_like(x.offset)
        bump[0, head] = eps
        numeric = (loss(x.offset + bump) - loss(x.offset - bump)) / (2 * eps)
        assert abs(numeric - float(ref.d_offset[0, head])) < 1e-6 * max(1.0, abs(numeric))


def test_a_pack_of_one_document_is_that_sequence():
    spec, x = pack_inputs([32], "learnable", "causal", (5, 0))
    bshd = make_spec("learnable", "causal", (5, 0), "bshd")
    one = reference(x, spec)
    seq = reference(x.batched(), bshd)
    assert torch.equal(one.out, seq.out[0]) and torch.equal(one.dk, seq.dk[0])
    assert torch.equal(one.d_offset, seq.d_offset)


def test_no_query_sees_a_key_of_another_document():
    docs = [4, 8, 12]
    spec, x = pack_inputs(docs, "vanilla", "no_mask")
    ref = reference(x, spec)
    # keys of document 1 changed: documents 0 and 2 keep every output and gradient row
    y = make_inputs(Shape(1, 24, 4, 2, 8), spec, 0)
    y.k[4:12] += 1.0
    other = reference(y, spec)
    keep = doc_ids(spec) != 1
    assert torch.equal(ref.out[keep], other.out[keep]) and not torch.equal(ref.out[~keep], other.out[~keep])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip_per_document(cp):
    docs = [2 * cp * n for n in (1, 3, 2)]
    x = torch.arange(sum(docs))
    shards = [sinkprof.shard(x, cp, r, 0, cu(docs)) for r in range(cp)]
    assert torch.equal(sinkprof.unshard(shards, 0, cu(docs)), x)
    for r, part in enumerate(shards):   # chunks r and 2cp-1-r of every document, document after document
        want = []
        for a, n in zip(cu(docs), docs):
            c = n // (2 * cp)
            want += [torch.arange(a + r * c, a + (r + 1) * c), torch.arange(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c)]
        assert torch.equal(part, torch.cat(want))
        assert torch.equal(part, global_rows(cp, r, tuple(n // (2 * cp) for n in docs)))


def test_a_document_not_a_multiple_of_2cp_is_refused_saying_how_to_pad():
    with pytest.raises(ValueError, match=re.escape("document 1 has 10 tokens") + ".*pad_pack"):
        sinkprof.shard(torch.zeros(26), 2, 0, 0, [0, 16, 26])


@pytest.mark.parametrize("bad,message", [
    ([1, 8], "must start at 0"), ([0], "one end per document"), ([0, 8, 8], "increase strictly"),
    ([0, 4.5], "sequence of ints"), (torch.tensor([0.0, 8.0]), "integer tensor"),
    (torch.tensor([[0, 8]]), "1-D integer tensor"),
])
def test_bad_cu_seqlens_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec("vanilla", "causal", None, "thd", bad)


def test_pad_pack_pads_each_document_and_keeps_the_real_rows_exact_under_a_causal_mask():
    docs = [5, 8, 3]
    spec, x = pack_inputs(docs, "learnable", "causal", (4, 0), seed=5)
    padded = [sinkprof.pad_pack(t, cu(docs), 4) for t in (x.q, x.k, x.v, x.grad_out)]
    (q, ends, real), (k, _, _), (v, _, _), (do, _, _) = padded
    assert ends.tolist() == [0, 8, 16, 20] and ends.dtype == torch.int32
    assert real.tolist() == [True] * 5 + [False] * 3 + [True] * 8 + [True] * 3 + [False]
    assert torch.equal(q[real], x.q)
    spec_p = make_spec("learnable", "causal", (4, 0), "thd", ends)
    do = do * real.view(-1, 1, 1)
    got = reference(type(x)(q, k, v, x.offset, None, do), spec_p)
    want = reference(x, spec)
    for name in ("out", "dq", "dk", "dv"):
        assert (getattr(got, name)[real] - getattr(want, name)).abs().max() < 1e-12, name
    assert (got.d_offset - want.d_offset).abs().max() < 1e-12


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("band", [Band(None, 0), Band(), Band(-3, 0), Band(-9, 0), Band(-2, 3)], ids=str)
@pytest.mark.parametrize("kind", [KVSchedule.RING, KVSchedule.DIRECT])
def test_every_visible_pair_of_a_pack_is_computed_exactly_once(cp, band, kind):
    docs = [2 * cp * n for n in (1, 4, 2, 1)]
    assert_pack_plan_exact(cp, zigzag_layout(cp, tuple(n // (2 * cp) for n in docs)), band, kind)


def test_documents_a_step_cannot_see_cost_no_tile_and_no_bytes():
    # window 3: from step 1 on only the halos of each document's chunk boundaries are read
    cp, docs = 4, [8, 64, 8]
    chunks = tuple(n // (2 * cp) for n in docs)
    plan = ring_plan(cp, 1, chunks, Band(-3, 0), KVSchedule.DIRECT)
    for step in plan.steps[1:]:
        for tile in step.tiles:
            assert tile.kv_rows.stop - tile.kv_rows.start <= 3
        assert step.held_rows <= 3 * len(docs)
    ring = sum(t.sent for t in comm_bytes(s=80, b=1, h=4, g=2, d=8, dtype=torch.float32, cp=cp, mask="causal",
                                           window=(3, 0), kv_schedule="ring", cu_seqlens=cu(docs)))
    direct = sum(t.sent for t in comm_bytes(s=80, b=1, h=4, g=2, d=8, dtype=torch.float32, cp=cp, mask="causal",
                                             window=(3, 0), kv_schedule="direct", cu_seqlens=cu(docs)))
    assert direct * 5 < ring


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_direct_bytes_of_a_pack_are_the_rows_its_documents_read(cp):
    docs = [2 * cp * n for n in (3, 1, 2)]
    chunks = tuple(n // (2 * cp) for n in docs)
    t = sum(docs)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    mask = Band(None, 0).mask(t, t) & (doc[:, None] == doc[None, :])
    schedule = CommSchedule(KVSchedule.DIRECT, cp, chunks, Band(None, 0))
    for rank in range(cp):
        for i in range(1, cp):
            owner = (rank - i) % cp
            seen = mask[global_rows(cp, rank, chunks)][:, global_rows(cp, owner, chunks)].any(0)
            assert schedule.plans[rank].steps[i].held_rows == int(seen.sum())


@pytest.mark.parametrize("cp,docs", [(2, [8, 24, 16]), (3, [12, 36, 6, 24]), (4, [64]), (4, [8] * 6),
                                     (2, [4, 60]), (3, [6, 18])])
@pytest.mark.parametrize("softmax", SOFTMAX)
@pytest.mark.parametrize("mask,window", MASKS)
def test_the_replayed_ring_of_a_pack_equals_the_reference(cp, docs, softmax, mask, window):
    spec, x = pack_inputs(docs, softmax, mask, window, seed=cp)
    ref = reference(x, spec)
    for strategy, kind in itertools.product((SinkStrategy.STEP0, SinkStrategy.POST_MERGE), ("ring", "direct", "allgather")):
        got = emulate_ring(x, spec, cp, strategy, kv_schedule=kind).result
        for name, want in ref.named().items():
            assert (got.named()[name] - want).abs().max() < 1e-11, (strategy, kind, name)


@pytest.mark.parametrize("world,members", [(2, 2), (4, 2), (4, 4)])
def test_the_a2a_relayout_of_a_pack_lands_each_group_on_its_outer_shard(world, members):
    docs = [2 * world * n for n in (1, 3, 2)]
    chunks = tuple(n // (2 * world) for n in docs)
    x = torch.arange(sum(docs))
    outer = world // members
    for o in range(outer):
        pieces = [sinkprof.shard(x, world, o * members + m, 0, cu(docs)) for m in range(members)]
        joined = join_outer(pieces, 0, chunks)
        assert torch.equal(joined, sinkprof.shard(x, outer, o, 0, cu(docs)))
        assert all(torch.equal(a, b) for a, b in zip(split_outer(joined, members, 0, chunks), pieces))


@pytest.mark.parametrize("world,members", [(2, 2), (4, 2)])
def test_the_replayed_a2a_p2p_of_a_pack_equals_the_reference(world, members):
    spec, x = pack_inputs([8, 16, 40], "learnable", "causal", (6, 0), seed=world, h=4, g=4)
    ref = reference(x, spec)
    got = emulate_hierarchical(x, spec, world, members, SinkStrategy.POST_MERGE, kv_schedule="direct").result
    for name, want in ref.named().items():
        assert (got.named()[name] - want).abs().max() < 1e-11, name


@pytest.mark.parametrize("window", [None, (3, 0)])
@pytest.mark.parametrize("kind", ["direct", "allgather"])
def test_the_doc_leak_fault_breaks_the_replay(window, kind):
    spec, x = pack_inputs([16, 32], "learnable", "causal", window)
    ref = reference(x, spec)
    with faults.injected(faults.Fault.DOC_LEAK):
        got = emulate_ring(x, spec, 2, SinkStrategy.STEP0, kv_schedule=kind).result
    assert (got.out - ref.out).abs().max() > 1e-3
    clean = emulate_ring(x, spec, 2, SinkStrategy.STEP0, kv_schedule=kind).result
    assert (clean.out - ref.out).abs().max() < 1e-12


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("strategy", ["step0", "post-merge"])
def test_one_rank_cp_attention_of_a_pack_equals_the_reference(world, comm, strategy):
    docs = [6, 10, 16]
    spec, x = pack_inputs(docs, "learnable", "causal", (5, 0))
    mine = [t.clone().requires_grad_() for t in (x.q, x.k, x.v, x.offset)]
    out = sinkprof.cp_attention(*mine, comm=comm, softmax_type="learnable", mask="causal", window=(5, 0),
                                qkv_format="thd", cu_seqlens=torch.tensor(cu(docs), dtype=torch.int32),
                                sink_strategy=strategy)
    out.backward(x.grad_out)
    ref = reference(x, spec)
    assert out.shape == x.q.shape
    for got, want in zip([out] + [t.grad for t in mine], (ref.out, ref.dq, ref.dk, ref.dv, ref.d_offset)):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("kwargs,message", [
    (dict(qkv_format="thd"), "needs cu_seqlens"),
    (dict(cu_seqlens=[0, 32]), "use qkv_format='thd'"),
    (dict(qkv_format="thd", cu_seqlens=[0, 16]), "cu_seqlens ends at 16 but the pack has 32 tokens"),
    (dict(qkv_format="thd", cu_seqlens=[0, 16, 32], bias=torch.zeros(1, 4, 32, 32, dtype=torch.float64)),
     "bias is not supported with qkv_format='thd'"),
    (dict(qkv_format="thd", cu_seqlens=[0, 15, 32]), "document 0 has 15 tokens"),
])
def test_bad_thd_arguments_are_refused_by_name(world, kwargs, message):
    spec, x = pack_inputs([32], "vanilla", "causal")
    q, k, v = x.q, x.k, x.v
    if "qkv_format" not in kwargs:
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    with pytest.raises(ValueError, match=re.escape(message)):
        sinkprof.cp_attention(q, k, v, **kwargs)


def test_thd_tensors_must_be_three_dimensional(world):
    q = torch.zeros(1, 32, 4, 8)
    with pytest.raises(ValueError, match=re.escape("q must be 3-D [t, h, d] for qkv_format='thd'")):
        sinkprof.attention(q, q, q, qkv_format="thd", cu_seqlens=[0, 32])
