"""The fp64 replay of the ring schedule: exact with the sink once per row, wrong on every tile."""
import itertools

import pytest
import torch

from sinkprof.emulate import emulate_ring
from sinkprof.kernels import TorchTiles
from sinkprof.options import CPOptions, SinkStrategy, make_spec
from sinkprof.plan import PARTS, shard
from sinkprof.ring import ForwardState, LocalKV, run_forward
from sinkprof.schedule import comm_schedule
from sinkprof.testing import Shape, make_inputs, reference
from sinkprof.tool.emulate import emulate

SHAPE = Shape(b=2, s=48, h=4, g=2, d=8)


def _max_err(got, ref):
    return max((got.named()[k] - v).abs().max().item() for k, v in ref.named().items())


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_step0_and_post_merge_match_the_reference_and_each_other(cp, mask, softmax_type):
    spec = make_spec(softmax_type, mask, None, "bshd")
    inputs = make_inputs(SHAPE, spec, seed=cp)
    ref = reference(inputs, spec)
    step0 = emulate_ring(inputs, spec, cp, SinkStrategy.STEP0).result
    post = emulate_ring(inputs, spec, cp, SinkStrategy.POST_MERGE).result
    assert _max_err(step0, ref) <= 1e-12
    assert _max_err(post, ref) <= 1e-12
    assert _max_err(step0, post) <= 1e-12


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("mask,window,fmt,bias", [
    ("causal", (5, 0), "bshd", False), ("no_mask", (4, 3), "sbhd", True), ("causal", None, "sbhd", True),
    ("no_mask", (0, 0), "bshd", False)])
def test_windows_bias_and_sbhd_through_the_plan(cp, mask, window, fmt, bias):
    spec = make_spec("learnable", mask, window, fmt)
    inputs = make_inputs(SHAPE, spec, seed=7, with_bias=bias)
    ref = reference(inputs, spec)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        assert _max_err(emulate_ring(inputs, spec, cp, strategy).result, ref) <= 1e-12



@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("strategy", [SinkStrategy.STEP0, SinkStrategy.POST_MERGE])
def test_a_head_without_a_sink_and_a_padding_row_of_the_bias_match_the_reference(cp, strategy):
    """A -inf offset (the head's sink switched off) on a row a -inf bias empties: the fold's
    sigmoid(-inf - -inf) put NaN in the post-merge output and every gradient, and exp(-inf - -inf)
    in the sink's gradient under step0."""
    spec = make_spec("learnable", "causal", None, "bshd")
    inputs = make_inputs(SHAPE, spec, seed=11, with_bias=True)
    inputs.offset[0, 1] = float("-inf")
    inputs.bias[:, :, 30, :] = float("-inf")   # a padding row, on rank 0 or 1's second chunk
    ref = reference(inputs, spec)
    got = emulate_ring(inputs, spec, cp, strategy).result
    assert all(torch.isfinite(t).all() for t in got.named().values())
    assert _max_err(got, ref) <= 1e-12
    assert ref.d_offset[0, 1].item() == 0.0 and ref.d_offset.abs().max() > 1e-3

def test_partial_sink_gradients_cover_each_ranks_rows_and_sum_to_the_reference():
    cp = 3
    spec = make_spec("learnable", "causal", None, "bshd")
    inputs = make_inputs(SHAPE, spec, seed=1)
    run = emulate_ring(inputs, spec, cp, SinkStrategy.STEP0)
    chunk = SHAPE.s // (2 * cp)
    for rank, part in enumerate(run.d_sink_parts):
        rows = torch.zeros(SHAPE.s, dtype=torch.bool)
        for c in (rank, 2 * cp - 1 - rank):
            rows[c * chunk:(c + 1) * chunk] = True
        expected = reference(inputs, spec, rows=rows).d_offset
        assert torch.allclose(part, expected, atol=1e-12, rtol=0)
    assert torch.allclose(sum(run.d_sink_parts), reference(inputs, spec).d_offset, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_every_tile_sink_is_detectably_wrong(cp, mask):
    rows = emulate([cp], [mask], [SinkStrategy.EVERY_TILE], SHAPE, seed=0)
    (row,) = rows
    assert not row.passed and row.ok
    assert row.dsink_max_abs_err > 1e-3
    # the per-head ratio of the CP-summed sink gradient to the reference leaves 1 by a wide margin
    assert max(abs(row.dsink_ratio_min - 1), abs(row.dsink_ratio_max - 1)) > 0.2


def test_emulate_rows_for_correct_strategies_are_ok():
    rows = emulate([2, 3], ["causal"], [SinkStrategy.STEP0, SinkStrategy.POST_MERGE], SHAPE, seed=0)
    assert all(r.passed and r.ok for r in rows)
    assert all(abs(r.dsink_ratio_min - 1) < 1e-9 and abs(r.dsink_ratio_max - 1) < 1e-9 for r in rows)


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_a_pack_with_more_later_tiles_than_buffers_is_exact(mask):
    """cp = PARTS + 2 on a thd pack: every step's documents share a buffer, and the buffers merge
    through the accumulator before the last pass."""
    cp = PARTS + 2
    docs = (2 * cp, 6 * cp, 4 * cp)
    spec = make_spec("learnable", mask, None, "thd", cu_seqlens=[0, *itertools.accumulate(docs)])
    inputs = make_inputs(Shape(b=1, s=sum(docs), h=2, g=1, d=8), spec, seed=3)
    ref = reference(inputs, spec)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        assert _max_err(emulate_ring(inputs, spec, cp, strategy).result, ref) <= 1e-12


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_more_later_tiles_than_buffers_merge_in_batches_and_a_forward_state_serves_twice(mask):
    """cp = PARTS + 3: the later results fill their buffers more than once and merge through the
    fp32 accumulator; the result is exact, and a ``ForwardState`` used again (as benchmarks and
    graph replays use it) gives the same output, whatever its buffers hold from before."""
    cp = PARTS + 3
    spec = make_spec("learnable", mask, None, "bshd")
    inputs = make_inputs(Shape(b=1, s=4 * cp, h=2, g=1, d=8), spec, seed=cp)
    ref = reference(inputs, spec)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        assert _max_err(emulate_ring(inputs, spec, cp, strategy).result, ref) <= 1e-12

    schedule = comm_schedule("ring", cp, 2, spec.band, 1, 1)
    ks, vs = ([spec.qkv_format.to_bhsd(shard(x, cp, r, 1)) for r in range(cp)] for x in (inputs.k, inputs.v))
    opts = CPOptions(spec, 8 ** -0.5, TorchTiles(), SinkStrategy.POST_MERGE)
    for rank in (0, cp - 1):
        plan = schedule.plans[rank]
        assert plan.accumulates
        q = spec.qkv_format.to_bhsd(shard(inputs.q, cp, rank, 1))
        out = torch.empty_like(q)
        state = ForwardState.make(plan, q, out, torch.empty(q.shape[:3], dtype=torch.float64), fill=float("nan"))
        outs = []
        for _ in range(2):
            run_forward(plan, LocalKV(ks, vs, schedule, rank, "fwd"), state=state, sink=inputs.offset, bias=None,
                        opts=opts)
            outs.append(out.clone())
            state.parts_lse.fill_(0.0)    # whatever the last call (or anything else) left there
            state.parts_o.fill_(1.0)
        want = spec.qkv_format.to_bhsd(shard(ref.out, cp, rank, 1))
        assert (outs[0] - want).abs().max() <= 1e-12
        assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("strategy", [SinkStrategy.STEP0, SinkStrategy.POST_MERGE])
def test_a_merge_in_place_touches_only_the_rows_later_tiles_wrote(strategy, monkeypatch):
    """Under zigzag causal, rank 0's later steps see only its second chunk: without the fold its
    one merge (in place, into the output) reads and writes those rows alone, and the rows of its
    first chunk keep step 0's result; the post-merge fold touches every row. Rank cp - 1's later
    tiles cover all its rows. Either way the output is exact."""
    import sinkprof.ring as ring
    cp, c = 4, 3
    spec = make_spec("learnable", "causal", None, "bshd")
    inputs = make_inputs(Shape(b=1, s=2 * c * cp, h=2, g=1, d=8), spec, seed=5)
    ref = reference(inputs, spec)
    schedule = comm_schedule("ring", cp, c, spec.band, 1, 1)
    ks, vs = ([spec.qkv_format.to_bhsd(shard(x, cp, r, 1)) for r in range(cp)] for x in (inputs.k, inputs.v))
    opts = CPOptions(spec, 8 ** -0.5, TorchTiles(), strategy)
    merged = []
    real = ring.merge_parts_
    monkeypatch.setattr(ring, "merge_parts_", lambda o, *a, **kw: (merged.append(o.shape[2]), real(o, *a, **kw)))
    for rank, later in ((0, slice(c, 2 * c)), (cp - 1, slice(0, 2 * c))):
        plan = schedule.plans[rank]
        assert plan.merged_rows == later and not plan.accumulates
        q = spec.qkv_format.to_bhsd(shard(inputs.q, cp, rank, 1))
        out = torch.empty_like(q)
        state = ForwardState.make(plan, q, out, torch.empty(q.shape[:3], dtype=torch.float64), fill=float("nan"))
        merged.clear()
        run_forward(plan, LocalKV(ks, vs, schedule, rank, "fwd"), state=state, sink=inputs.offset, bias=None,
                    opts=opts)
        folds = strategy is SinkStrategy.POST_MERGE
        assert merged == [2 * c if folds else later.stop - later.start]
        assert (out - spec.qkv_format.to_bhsd(shard(ref.out, cp, rank, 1))).abs().max() <= 1e-12
