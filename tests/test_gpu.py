"""GPU tests (marked ``gpu``; skipped without CUDA): the cuDNN and FA4 tiles against the torch tiles
and the reference, the ring schedule on both with both sink strategies, CUDA-graph capture, and the
cuDNN graph cache."""
import pytest
import torch

from sinkprof.emulate import emulate_ring
from sinkprof.kernels import TorchTiles, get_kernel
from sinkprof.options import Band, KVSchedule, SinkStrategy, make_spec
from sinkprof.plan import ring_plan, spec_layout
from sinkprof.testing import Shape, compare, make_inputs, reference, tolerance_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _kernel_or_skip(backend: str):
    from sinkprof.kernels import unavailable_reason
    reason = unavailable_reason(backend, "cuda")
    if reason:
        pytest.skip(reason)
    return get_kernel(backend, "cuda")


@pytest.fixture(scope="module")
def cudnn_kernel():
    return _kernel_or_skip("cudnn")


@pytest.fixture(scope="module", params=["cudnn", "fa4"])
def gpu_kernel(request):
    """Each GPU tile backend in turn."""
    return _kernel_or_skip(request.param)


def _tile_inputs(layout, dtype, n_q, n_kv, h=8, g=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def make(n, heads):
        shape = (2, n, heads, d) if layout == "bshd" else (n, 2, heads, d)
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to("cuda", dtype).permute(0, 2, 1, 3) if layout == "bshd" else x.to("cuda", dtype).permute(1, 2, 0, 3)
    sink = torch.randn(1, h, 1, 1, generator=gen) * 5
    return make(n_q, h), make(n_kv, g), make(n_kv, g), make(n_q, h), sink.cuda()


BANDS = [Band(), Band(None, 0), Band(-64, 0), Band(-32, 16), Band(None, -8), Band(16, None), Band(-300, -200)]


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("n_q,n_kv", [(256, 256), (256, 128)])
def test_gpu_tile_matches_the_torch_tile(gpu_kernel, band, with_sink, dtype, layout, n_q, n_kv):
    q, k, v, do, sink = _tile_inputs(layout, dtype, n_q, n_kv)
    sink = sink if with_sink else None
    scale = 64 ** -0.5
    ref = TorchTiles()
    o_ref, lse_ref = ref.forward(*(x.double() for x in (q, k, v)), band, None if sink is None else sink.double(), None, scale)
    o, lse = gpu_kernel.forward(q, k, v, band, sink, None, scale)
    tol = tolerance_for(dtype, gqa=True)
    assert compare(o, o_ref, tol).passed
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse_ref[finite]).abs().max() < 1e-2
    # backward driven with the given (here: the tile's own) stats, as a ring drives it with merged ones
    g_ref = ref.backward(*(x.double() for x in (q, k, v)), o_ref, do.double(), lse_ref, band,
                         None if sink is None else sink.double(), None, scale)
    g = gpu_kernel.backward(q, k, v, o, do, lse, band, sink, None, scale)
    for name in ("dq", "dk", "dv", "d_sink"):
        got, want = getattr(g, name), getattr(g_ref, name)
        if want is None:
            assert got is None
            continue
        err = compare(got, want, tol)
        assert err.passed, (name, err)


def test_gpu_tile_with_bias_matches_the_torch_tile(gpu_kernel):
    q, k, v, do, sink = _tile_inputs("bshd", torch.bfloat16, 128, 128, h=4, g=4)
    bias = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
    ref = TorchTiles()
    o_ref, lse_ref = ref.forward(q.double(), k.double(), v.double(), Band(None, 0), sink.double(), bias.double(), 0.125)
    o, lse = gpu_kernel.forward(q, k, v, Band(None, 0), sink, bias, 0.125)
    g = gpu_kernel.backward(q, k, v, o, do, lse, Band(None, 0), sink, bias, 0.125)
    g_ref = ref.backward(q.double(), k.double(), v.double(), o_ref, do.double(), lse_ref, Band(None, 0),
                         sink.double(), bias.double(), 0.125)
    tol = tolerance_for(torch.bfloat16)
    assert compare(o, o_ref, tol).passed
    for name in ("dq", "dk", "dv", "d_sink", "d_bias"):
        assert compare(getattr(g, name), getattr(g_ref, name), tol).passed, name
    if gpu_kernel.name == "fa4":  # FA4 has no bias input: the tile ran elsewhere, and says so
        assert any("no bias input" in why for why in gpu_kernel.refused().values())


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (128, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_ring_schedule_on_gpu_tiles_matches_the_reference_with_both_strategies(gpu_kernel, cp, mask, window,
                                                                            softmax_type):
    spec = make_spec(softmax_type, mask, window, "bshd")
    shape = Shape(b=2, s=1024, h=8, g=2, d=64)
    host = make_inputs(shape, spec, seed=cp)
    ref = reference(host.to("cuda", torch.bfloat16).to("cuda", torch.float64), spec)
    x = host.to("cuda", torch.bfloat16)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    results = {}
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        got = emulate_ring(x, spec, cp, strategy, kernel=gpu_kernel).result
        for name, want in ref.named().items():
            err = compare(got.named()[name], want, tol)
            assert err.passed, (strategy, name, err)
        results[strategy] = got
    for name, a in results[SinkStrategy.STEP0].named().items():
        assert compare(a, results[SinkStrategy.POST_MERGE].named()[name], tol).passed, name


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (128, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_the_allgather_schedule_on_gpu_tiles_matches_the_reference(gpu_kernel, cp, mask, window, softmax_type):
    """One step over the gathered sequence: each chunk against all its keys in one tile (a causal
    chunk's tile is wider than tall, its mask aligned to the bottom-right corner)."""
    spec = make_spec(softmax_type, mask, window, "bshd")
    x = make_inputs(Shape(b=2, s=1024, h=8, g=2, d=64), spec, seed=cp).to("cuda", torch.bfloat16)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        run = emulate_ring(x, spec, cp, strategy, kernel=gpu_kernel, kv_schedule="allgather")
        assert run.kv_schedule.value == "allgather"
        for name, want in ref.named().items():
            assert compare(run.result.named()[name], want, tol).passed, (strategy, name)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("fmt,b", [("bshd", 1), ("sbhd", 2)])
def test_joined_runs_on_gpu_tiles_match_the_reference_forward_and_backward(gpu_kernel, cp, mask, fmt, b):
    """Under direct, with the rows outermost, the ring joins its runs of steps into one call over
    their K/V side by side (``plan.join_runs``), in the forward and in the backward (one call's dK/dV
    for every step of the run); learnable sink, both strategies."""
    from sinkprof.schedule import CommSchedule
    spec = make_spec("learnable", mask, None, fmt)
    s = 256 * cp
    schedule = CommSchedule(KVSchedule.DIRECT, cp, s // (2 * cp), spec.band)
    assert any(st.joins for p in schedule.joined_plans for st in p.steps) == (cp > 2)   # cp 2: one later step
    x = make_inputs(Shape(b=b, s=s, h=8, g=2, d=64), spec, seed=cp).to("cuda", torch.bfloat16)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        run = emulate_ring(x, spec, cp, strategy, kernel=gpu_kernel, kv_schedule="direct")
        for name, want in ref.named().items():
            assert compare(run.result.named()[name], want, tol).passed, (strategy, name)


def test_a_warm_ring_builds_no_graph_and_standard_masks_are_never_refused(cudnn_kernel):
    spec = make_spec("learnable", "causal", None, "bshd")
    x = make_inputs(Shape(b=1, s=2048, h=8, g=8, d=128), spec, seed=1).to("cuda", torch.bfloat16)
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    built = cudnn_kernel.builds
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    assert cudnn_kernel.builds == built
    assert not {k: v for k, v in cudnn_kernel.refused().items() if k[-4] in (Band(), Band(None, 0))}


# -- CUDA graphs: a warm ring has no host work a graph cannot hold ------------------------------

def _copy_inputs_(dst, src) -> None:
    for name in ("q", "k", "v", "offset", "grad_out"):
        getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("strategy", [SinkStrategy.STEP0, SinkStrategy.POST_MERGE])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("kind", ["auto", "allgather"])
def test_a_warm_ring_replays_from_a_cuda_graph_on_new_inputs(gpu_kernel, strategy, mask, kind):
    """Capture every rank's forward and backward schedule once (under the K/V schedule ``kind``),
    replay it on other inputs copied into the captured buffers: the replay must match the
    reference of the new inputs."""
    spec = make_spec("learnable", mask, None, "bshd")
    shape = Shape(b=1, s=1024, h=8, g=2, d=64)
    first, second = (make_inputs(shape, spec, seed=s) for s in (11, 12))
    static = first.to("cuda", torch.bfloat16)
    emulate_ring(static, spec, 4, strategy, kernel=gpu_kernel, kv_schedule=kind)          # warm-up builds/compiles the kernels
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        emulate_ring(static, spec, 4, strategy, kernel=gpu_kernel, kv_schedule=kind)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = emulate_ring(static, spec, 4, strategy, kernel=gpu_kernel, kv_schedule=kind).result
    _copy_inputs_(static, second.to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    tol = tolerance_for(torch.bfloat16, gqa=True)
    want = reference(second.to("cuda", torch.bfloat16).to("cuda", torch.float64), spec)
    stale = reference(first.to("cuda", torch.bfloat16).to("cuda", torch.float64), spec)
    for name, expected in want.named().items():
        assert compare(captured.named()[name], expected, tol).passed, name
        assert not compare(captured.named()[name], stale.named()[name], tol).passed, name


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["step0", "post-merge"])
def test_cp_attention_forward_and_backward_replay_from_a_cuda_graph(gpu_kernel, world_of_one, strategy):
    """The public function, forward and backward (``torch.autograd.grad``), captured once and
    replayed on new inputs copied into the captured buffers: the output and every gradient (the
    sink's included) match an eager call on those inputs, and differ from the captured ones."""
    import sinkprof
    spec = make_spec("learnable", "causal", None, "bshd")
    shape = Shape(b=2, s=512, h=8, g=2, d=64)
    first, second = (make_inputs(shape, spec, seed=s).to("cuda", torch.bfloat16) for s in (5, 6))
    static = [first.q.clone(), first.k.clone(), first.v.clone(), first.offset.clone()]
    static_grad_out = first.grad_out.clone()

    def step(tensors, grad_out):
        # leaves made inside the step, so autograd's accumulators live on the capturing stream
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = sinkprof.cp_attention(*leaves, softmax_type="learnable", mask="causal", backend=gpu_kernel.name,
                                    sink_strategy=strategy)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static, static_grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static, static_grad_out)
    stale = [t.clone() for t in step(static, static_grad_out)]
    for dst, src in zip(static + [static_grad_out], [second.q, second.k, second.v, second.offset, second.grad_out]):
        dst.copy_(src)
    graph.replay()
    eager = step([second.q, second.k, second.v, second.offset], second.grad_out)
    torch.cuda.synchronize()
    tol = tolerance_for(torch.bfloat16, gqa=True)
    for name, got, want, old in zip(("out", "dq", "dk", "dv", "d_offset"), captured, eager, stale):
        assert compare(got, want, tol).passed, name
        assert not compare(got, old, tol).passed, name
    assert eager[4].abs().max() > 1e-3  # the sink gradient is really there


def test_the_argument_check_gathers_its_rows_over_nccl_on_the_gpu():
    """cp_attention's argument check under NCCL: its row of ints goes up as a CUDA tensor and
    comes back as Python ints, every rank's (one here: NCCL refuses two ranks on one GPU); and
    cp_attention on that group of one matches the reference."""
    import torch.distributed as dist
    import sinkprof
    from sinkprof.dist import gather_rows
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        row = [0, 2**62, -(2**62), 7]
        assert gather_rows(dist.group.WORLD, row, 30.0, "the test's rows") == [row]
        q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
        out = sinkprof.cp_attention(q, q, q, mask="causal")
        want = sinkprof.attention(q.double(), q.double(), q.double(), mask="causal")
        assert (out.double() - want).abs().max() < 2e-2
    finally:
        dist.destroy_process_group()


def test_a_graph_build_during_capture_names_the_missing_warm_up():
    from sinkprof.kernels.cudnn import CudnnTiles
    from sinkprof.kernels import unavailable_reason
    if unavailable_reason("cudnn", "cuda"):
        pytest.skip(unavailable_reason("cudnn", "cuda"))
    cold = CudnnTiles(torch.cuda.current_device())     # its own, empty graph cache
    q, k, v, _, sink = _tile_inputs("bshd", torch.bfloat16, 128, 128)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            cold.forward(q, k, v, Band(None, 0), sink, None, 0.125)
    assert cold.builds == 0


# -- the fused (Triton) sink kernels against the torch formulas ----------------------------------

@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_fused_sink_kernels_match_the_torch_formulas_in_fp64(d, layout, n):
    """The merge of n later parts (rows some part does not cover hold NaN, never to be read), the
    fold, and the sink gradient's row terms, against the torch formulas in fp64."""
    from sinkprof import fused
    from sinkprof import sink as sk
    if fused.disabled_reason():
        pytest.skip(fused.disabled_reason())
    gen = torch.Generator().manual_seed(d + n)
    b, h, s = 2, 4, 300

    def rows(dtype, *lead):  # a [.., b, h, s, d] view of a bshd or sbhd buffer
        x = torch.randn(*lead, b, s, h, d, generator=gen) if layout == "bshd" else \
            torch.randn(*lead, s, b, h, d, generator=gen)
        x = x.to("cuda", dtype)
        k = len(lead)
        dims = (*range(k), k, k + 2, k + 1, k + 3) if layout == "bshd" else (*range(k), k + 1, k + 2, k, k + 3)
        return x.permute(*dims)
    o_acc, parts_o = rows(torch.float32), rows(torch.bfloat16, n)
    lse_acc = (torch.randn(b, h, s, generator=gen) * 3).cuda()
    parts_lse = (torch.randn(n, b, h, s, generator=gen) * 3).cuda()
    lse_acc[..., :10] = float("-inf")            # rows 0-4: the parts only; 5-9: nothing at all
    o_acc[..., :10, :] = 0
    parts_lse[..., 5:15] = float("-inf")         # rows 10-14: the result so far only
    parts_o[..., 5:15, :] = float("nan")
    for i in range(n):                           # and each part misses a span of its own
        parts_lse[i, ..., 20 + 40 * i:50 + 40 * i] = float("-inf")
        parts_o[i, ..., 20 + 40 * i:50 + 40 * i, :] = float("nan")
    sink = (torch.randn(1, h, 1, 1, generator=gen) * 5).cuda()
    assert sk.fused_for(torch.float32, o_acc, parts_o) is not None   # this test runs the fused kernels

    def cpu64(x):
        return x.detach().to("cpu", torch.float64)
    ref_acc, ref_lse = cpu64(o_acc), cpu64(lse_acc)
    sk.merge_parts_(ref_acc, ref_lse, cpu64(parts_o), cpu64(parts_lse))
    sk.merge_parts_(o_acc, lse_acc, parts_o, parts_lse)
    torch.testing.assert_close(cpu64(o_acc), ref_acc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu64(lse_acc), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse_acc[..., 5:10]).all() and not o_acc.isnan().any()

    none_o, none_lse = parts_o[:0], parts_lse[:0]
    plain = rows(torch.bfloat16)
    sk.merge_parts_(o_acc, lse_acc, none_o, none_lse, into=plain)       # no parts, no sink: a cast
    assert torch.equal(plain, o_acc.to(torch.bfloat16))
    torch.testing.assert_close(cpu64(lse_acc), ref_lse, atol=1e-5, rtol=1e-5)

    out, ref_out = rows(torch.bfloat16), torch.empty_like(ref_acc)
    sk.merge_parts_(ref_acc, ref_lse, cpu64(none_o), cpu64(none_lse), into=ref_out, sink=cpu64(sink))
    sk.merge_parts_(o_acc, lse_acc, none_o, none_lse, into=out, sink=sink)   # the fold alone
    torch.testing.assert_close(cpu64(out), ref_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(cpu64(lse_acc), ref_lse, atol=1e-5, rtol=1e-5)   # empty rows end at a

    # the sink gradient of the rows, from o', dO and lse' (a part plays dO here)
    d_out = rows(torch.bfloat16)
    ref_grad = sk.sink_grad(cpu64(out), cpu64(d_out), cpu64(lse_acc), cpu64(sink))
    got = sk.sink_grad(out, d_out, lse_acc, sink)
    assert got.shape == (1, h, 1, 1) and got.dtype == torch.float32
    torch.testing.assert_close(cpu64(got), ref_grad, atol=1e-3, rtol=1e-4)
    assert ref_grad.abs().max() > 1.0


@pytest.mark.parametrize("first_dtype", [torch.float32, torch.bfloat16], ids=["from-acc", "from-output"])
@pytest.mark.parametrize("into_dtype", [None, torch.float32, torch.bfloat16], ids=["in-place", "into-fp32", "into-bf16"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["", "fold"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_fused_merge_into_another_buffer_and_with_the_fold_matches_fp64(first_dtype, into_dtype, with_sink, layout):
    """The ring's merges: from the accumulator or the output buffer, into either, with the sink
    folded in on the last merge; against the torch formulas in fp64."""
    from sinkprof import fused
    from sinkprof import sink as sk
    if fused.disabled_reason():
        pytest.skip(fused.disabled_reason())
    if into_dtype is None and first_dtype != torch.float32:
        pytest.skip("an in-place merge keeps the accumulator in fp32")
    gen = torch.Generator().manual_seed(7)
    b, h, s, d, n = 2, 4, 300, 128, 2

    def rows(dtype, *lead):
        x = torch.randn(*lead, b, s, h, d, generator=gen) if layout == "bshd" else \
            torch.randn(*lead, s, b, h, d, generator=gen)
        x = x.to("cuda", dtype)
        k = len(lead)
        dims = (*range(k), k, k + 2, k + 1, k + 3) if layout == "bshd" else (*range(k), k + 1, k + 2, k, k + 3)
        return x.permute(*dims)
    first, parts_o = rows(first_dtype), rows(torch.bfloat16, n)
    lse_first = (torch.randn(b, h, s, generator=gen) * 3).cuda()
    parts_lse = (torch.randn(n, b, h, s, generator=gen) * 3).cuda()
    lse_first[..., :10] = float("-inf")
    first[..., :10, :] = 0
    parts_lse[..., 5:15] = float("-inf")
    parts_o[..., 5:15, :] = float("nan")
    sink = (torch.randn(1, h, 1, 1, generator=gen) * 5).cuda() if with_sink else None
    into = None if into_dtype is None else rows(into_dtype)

    def cpu64(x):
        return x.detach().to("cpu", torch.float64)
    want, want_lse = cpu64(first), cpu64(lse_first)
    sk.merge_parts_(want, want_lse, cpu64(parts_o), cpu64(parts_lse), sink=None if sink is None else cpu64(sink))
    assert sk.fused_for(torch.float32, first, parts_o) is not None
    sk.merge_parts_(first, lse_first, parts_o, parts_lse, into=into, sink=sink)
    got = first if into is None else into
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(cpu64(got), want, atol=tol, rtol=tol)
    torch.testing.assert_close(cpu64(lse_first), want_lse, atol=1e-5, rtol=1e-5)


# -- FA4's rows backward: dq kept in FA4's accumulator across a rank's tiles ---------------------

@pytest.fixture
def fa4_kernel():
    kernel = _kernel_or_skip("fa4")
    yield kernel
    kernel.rows_path = True


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("h,g,d", [(8, 8, 128), (8, 2, 64)], ids=["mha-d128", "gqa-d64"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("chunk", [320, 512])
def test_fa4_rows_backward_matches_the_per_tile_backward_and_the_reference(fa4_kernel, cp, mask, h, g, d, layout,
                                                                           chunk):
    """Chunks of 320 rows are on FA4's 64- and 80-row blocks (d128) and off its 128-row ones (d64);
    of 512, on 64 and 128 and off 80: the second chunk's rows then run from the block before them."""
    from sinkprof.kernels import fa4_rows
    from sinkprof.kernels.base import BackwardState
    from sinkprof.plan import ring_plan
    spec = make_spec("learnable", mask, None, layout)
    shape = Shape(b=2, s=2 * chunk * cp, h=h, g=g, d=d)
    host = make_inputs(shape, spec, seed=cp)
    x = host.to("cuda", torch.bfloat16)
    n = shape.s // cp
    plan = ring_plan(cp, cp - 1, shape.s // (2 * cp), spec.band)
    tiles = [t for st in plan.backward_steps for t in st.tiles]
    state = BackwardState(*(torch.zeros(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)),
                          torch.zeros(1, h, n, device="cuda"), torch.zeros(1, h, n, d, device="cuda"))
    taken = fa4_kernel.rows_backward(state, scale=d ** -0.5, tiles=tiles, biased=False)
    assert isinstance(taken, fa4_rows.FA4RowsBackward), f"{type(taken).__name__}: not the rows path (see the debug log)"
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=g < h)
    got = {}
    for rows_path in (True, False):
        fa4_kernel.rows_path = rows_path
        got[rows_path] = emulate_ring(x, spec, cp, SinkStrategy.STEP0, kernel=fa4_kernel).result.named()
    for name, want in ref.named().items():
        assert compare(got[True][name], want, tol).passed, name
        assert compare(got[True][name], got[False][name], tol).passed, name


def _fa4_ring_off_and_on(fa4_kernel, monkeypatch, setting: str, spec, shape: Shape, cp: int, seed: int, kind: str,
                         after):
    """The ring on fa4 with the kernel's ``setting`` off, then on, ``after(on)`` checking (and
    clearing) what its spies saw each time: both match the reference, and each other."""
    x = make_inputs(shape, spec, seed=seed).to("cuda", torch.bfloat16)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=shape.g < shape.h)
    got = {}
    for on in (False, True):
        monkeypatch.setattr(fa4_kernel, setting, on)
        got[on] = emulate_ring(x, spec, cp, SinkStrategy.STEP0, kernel=fa4_kernel, kv_schedule=kind).result.named()
        after(on)
    for name, want in ref.named().items():
        assert compare(got[True][name], want, tol).passed, name
        assert compare(got[True][name], got[False][name], tol).passed, name


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (127, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("h,g,d", [(8, 8, 128), (8, 2, 64)], ids=["mha-d128", "gqa-d64"])
@pytest.mark.parametrize("kind", ["ring", "direct"])
def test_step_0_beside_the_next_step_matches_one_stream_and_the_reference(fa4_kernel, monkeypatch, cp, mask, window,
                                                                         softmax_type, h, g, d, kind):
    """On fa4 every rank's step 0 runs on a second stream beside its next step (``ring.Beside``),
    forward and backward: the result matches the reference and the one-stream ring's, and the
    ring's stream did join the second one at that step. A windowed tile sees only part of its
    rows, so that backward runs tile by tile (``TileRowsBackward``, whose dq adds are one after
    the other): there only the forward's step 0 runs beside, where step 1 has tiles."""
    from sinkprof import ring
    joined, armed = [], []
    join, init = ring.Beside.join, ring.Beside.__init__

    def spy_join(self, step):
        if self.forked and step.index == self.at:
            joined.append(step.index)
        join(self, step)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        armed.append(self.on)
    monkeypatch.setattr(ring.Beside, "join", spy_join)
    monkeypatch.setattr(ring.Beside, "__init__", spy_init)

    def after(concurrent):
        assert len(joined) == sum(armed), (joined, armed)   # every ring that put step 0 beside joined it
        if window is None:   # every rank's forward and backward
            assert sum(armed) == (2 * cp if concurrent else 0), armed
        else:   # forwards only, where step 1 has tiles (all ranks but rank 0 at cp 4)
            assert sum(armed) == ((cp if cp == 2 else cp - 1) if concurrent else 0), armed
        joined.clear()
        armed.clear()
    _fa4_ring_off_and_on(fa4_kernel, monkeypatch, "concurrent", make_spec(softmax_type, mask, window, "bshd"),
                         Shape(b=1, s=1024 * cp, h=h, g=g, d=d), cp, cp, kind, after)


@pytest.mark.parametrize("h,g,d", [(8, 8, 128), (8, 2, 64)], ids=["mha-d128", "gqa-d64"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_fa4_rows_backward_writes_a_tiles_dkv_into_the_views_given_and_nowhere_else(fa4_kernel, h, g, d, layout):
    """A tile given ``dkv`` (bf16 views of a larger part, as a direct step's) has FA4 write its dK/dV
    there: the same values as through the scratch, the part's other rows untouched."""
    from sinkprof.kernels import fa4_rows
    from sinkprof.kernels.base import BackwardState
    from sinkprof.options import QKVFormat
    b, n, n_kv, around = 2, 512, 384, 64
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    q, out, do = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    lse = torch.randn(b, h, n, generator=gen, device="cuda") + 8
    state = BackwardState(q, out, do, lse, torch.empty_like(q))
    k, v = rand(b, g, n_kv, d), rand(b, g, n_kv, d)
    fmt = QKVFormat.parse(layout, "layout")
    rows = 2 * around + n_kv   # the part: n_kv rows between sentinel rows
    shape = (b, rows, g, d) if layout == "bshd" else (rows, b, g, d)
    storage = [torch.full(shape, 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dkv = tuple(fmt.to_bhsd(x)[:, :, around:around + n_kv] for x in storage)
    plan_tiles = ring_plan(2, 1, 256, Band()).backward_steps[1].tiles
    rows_bwd = fa4_kernel.rows_backward(state, scale=d ** -0.5, tiles=plan_tiles, biased=False)
    assert isinstance(rows_bwd, fa4_rows.FA4RowsBackward)
    want = rows_bwd.tile(slice(0, n), k, v, Band(), None, None, first=True)
    want = (want.dk.clone(), want.dv.clone())    # views of the scratch
    got = rows_bwd.tile(slice(0, n), k, v, Band(), None, None, first=False, dkv=dkv)
    assert got.dk is None and got.dv is None
    exact = dict(rtol=0, atol=0) if g == h else {}   # under GQA FA4 sums dK/dV with atomics, in any order
    for x, y in zip(dkv, want):
        torch.testing.assert_close(x, y, **exact)
    for x in storage:
        x = fmt.to_bhsd(x)
        assert (x[:, :, :around] == 7).all() and (x[:, :, around + n_kv:] == 7).all()


@pytest.mark.parametrize("h,g,d", [(8, 8, 128), (8, 2, 64)], ids=["mha-d128", "gqa-d64"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("into_views", [False, True], ids=["scratch", "views"])
def test_a_causal_tile_cut_into_pieces_matches_the_whole_tile(fa4_kernel, monkeypatch, h, g, d, layout, into_views):
    """The rows backward runs a causal 2048 x 2048 tile of 2 x 8 heads as three pieces cut by keys on
    three streams (``fa4_rows.causal_cuts``): dq, dK, dV and the sink gradient match the tile run
    whole, into scratch and into views given (``dkv``) alike."""
    from sinkprof.kernels import fa4_rows
    from sinkprof.kernels.base import BackwardState
    from sinkprof.options import QKVFormat
    b, n = 2, 2048
    gen = torch.Generator(device="cuda").manual_seed(1)
    fmt = QKVFormat.parse(layout, "layout")

    def rand(heads):
        shape = (b, n, heads, d) if layout == "bshd" else (n, b, heads, d)
        return fmt.to_bhsd(torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16))
    q, out, do, k, v = rand(h), rand(h), rand(h), rand(g), rand(g)
    lse = torch.randn(b, h, n, generator=gen, device="cuda") + 8
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    tiles = ring_plan(2, 0, n // 2, Band(None, 0)).backward_steps[0].tiles
    assert len(tiles) == 1 and tiles[0].q_rows == slice(0, n) and tiles[0].kv_rows == slice(0, n)
    cuts, model = [], fa4_rows.causal_cuts
    monkeypatch.setattr(fa4_rows, "causal_cuts", lambda *a: cuts.append(model(*a)) or cuts[-1])
    got = {}
    for split in (False, True):
        monkeypatch.setattr(fa4_kernel, "causal_pieces", split)
        state = BackwardState(q, out, do, lse, rand(h))
        rows_bwd = fa4_kernel.rows_backward(state, scale=d ** -0.5, tiles=tiles, biased=False)
        assert isinstance(rows_bwd, fa4_rows.FA4RowsBackward)
        dkv = (rand(g), rand(g)) if into_views else None
        part = rows_bwd.tile(slice(0, n), k, v, Band(None, 0), sink, None, first=True, dkv=dkv)
        rows_bwd.finish()
        dk, dv = dkv if into_views else (part.dk, part.dv)
        got[split] = [state.dq.clone(), dk.clone(), dv.clone(), part.d_sink.clone()]
    assert len(cuts) == 1 and cuts[0], cuts   # the model cut the tile (on 114 or 132 SMs; not asked when split is off)
    exact = dict(rtol=0, atol=0) if g == h else {}   # dq (and dK/dV under GQA) sum with atomics, in any order
    torch.testing.assert_close(got[True][0], got[False][0])
    for x, y in zip(got[True][1:3], got[False][1:3]):
        torch.testing.assert_close(x, y, **exact)
    torch.testing.assert_close(got[True][3], got[False][3], rtol=0, atol=0)
    assert got[True][1].abs().sum() > 0 and got[True][0].abs().sum() > 0


@pytest.mark.parametrize("kind", ["ring", "direct"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("h,g,d", [(16, 16, 128), (16, 4, 64)], ids=["mha-d128", "gqa-d64"])
def test_a_ring_whose_step_0_runs_in_pieces_matches_the_reference(fa4_kernel, monkeypatch, kind, softmax_type,
                                                                   h, g, d):
    """At cp 2 with 2048 rows a rank and 16 heads every rank's step 0 backward runs in pieces
    (beside step 1), each piece after the first on a stream of its own: the ring matches the
    reference and the ring with its causal tiles whole."""
    from sinkprof.kernels import fa4_rows
    seen, asked = [], []
    model, streams = fa4_rows.causal_cuts, fa4_rows.side_streams
    monkeypatch.setattr(fa4_rows, "causal_cuts", lambda *a: seen.append(model(*a)) or seen[-1])
    monkeypatch.setattr(fa4_rows, "side_streams",
                        lambda stream, count, purpose: asked.append(count) or streams(stream, count, purpose))
    cp = 2

    def after(split):
        if split:   # every rank's step 0 (the one square causal tile) cut, its later pieces on helper streams
            assert len(seen) == cp and all(seen) and asked == [len(c) for c in seen], (seen, asked)
        else:
            assert seen == [] and asked == []
        seen.clear()
        asked.clear()
    _fa4_ring_off_and_on(fa4_kernel, monkeypatch, "causal_pieces", make_spec(softmax_type, "causal", None, "bshd"),
                         Shape(b=1, s=2048 * cp, h=h, g=g, d=d), cp, 3, kind, after)


@pytest.mark.parametrize("home", [torch.float32, torch.bfloat16], ids=["fp32-home", "bf16-home-in-place"])
@pytest.mark.parametrize("layout,b,g,d", [("bshd", 2, 3, 40), ("sbhd", 2, 3, 40), ("sbhd", 4, 8, 160)],
                         ids=["bshd", "sbhd", "sbhd-two-column-blocks"])
def test_the_fused_sum_of_kept_partials_matches_adding_them_one_after_another(layout, b, g, d, home):
    """``fused.sum_partials`` (``DirectDKV.home``): the home accumulator plus each bf16 partial on
    the rows it carries, in one pass, equals adding them one by one in fp32, to the bit; a bf16
    home (``CommSchedule.home_in_kv_dtype``) is summed into in place."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sinkprof import fused
    if fused.disabled_reason() is not None:
        pytest.skip(fused.disabled_reason())
    S = 96
    sd = 2 if layout == "bshd" else 1
    gen = torch.Generator(device="cuda").manual_seed(1)

    def like(rows, dtype):
        shape = [2, b, rows, g, d] if layout == "bshd" else [2, rows, b, g, d]
        return (torch.randn(*shape, generator=gen, device="cuda") * 3).to(dtype)
    acc = like(S, home)
    carried = [[slice(0, 40), slice(50, 96)], [slice(10, 30)], [slice(0, 96)], [slice(95, 96), slice(0, 1)]]
    parts = [like(sum(p.stop - p.start for p in rows), torch.bfloat16) for rows in carried]
    buf = torch.cat([p.reshape(-1) for p in parts])
    table = torch.full((S, len(parts)), -1, dtype=torch.int32)
    for j, rows in enumerate(carried):
        at = 0
        for p in rows:
            table[p, j] = torch.arange(at, at + p.stop - p.start, dtype=torch.int32)
            at += p.stop - p.start
    sizes = torch.tensor([p.shape[sd] for p in parts], dtype=torch.int64)
    want = acc.float().clone()   # a copy also when acc is fp32
    for part, rows in zip(parts, carried):
        at = 0
        for p in rows:
            want.narrow(sd, p.start, p.stop - p.start).add_(part.narrow(sd, at, p.stop - p.start))
            at += p.stop - p.start
    out = acc if home is torch.bfloat16 else torch.empty_like(acc, dtype=torch.bfloat16)
    fused.sum_partials(out, acc, buf, table.cuda(), sizes.cuda(), sd)
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("layout,extra", [("bshd", ["--batch", "2", "--seq-len", "2048"]),
                                          ("sbhd", ["--batch", "2", "--seq-len", "2048"]),
                                          ("thd", ["--seqlens", "1024,512,1536"])])
def test_a_direct_backward_on_fa4_sums_the_parts_it_kept_in_every_layout(fa4_kernel, tmp_path, layout, extra):
    """4 ranks sharing the GPU under direct: each owner sums the bf16 dK/dV parts its readers
    return in one pass at the end (``DirectDKV.home``, ``fused.sum_partials``) over the buffers
    and table the schedule lays out, for a sequence in both layouts and for a pack."""
    import json
    import subprocess
    import sys
    out = tmp_path / "check.json"
    res = subprocess.run([sys.executable, "-m", "sinkprof", "check", "--device", "cuda", "--backend", "fa4",
                          "--ranks", "4", "--comm", "p2p", "--kv-schedule", "direct", "--qkv-format", layout, *extra,
                          "--softmax", "vanilla,learnable", "--mask", "causal,no_mask", "--dtype", "bf16",
                          "--sink-strategy", "step0", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
                          "--format", "json", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["cases"]) == 4
    assert all(c["kv_schedule"] == "direct" and c["backend"] == "fa4" for c in report["cases"])


# -- thd packs on FA4: a step's documents as one varlen call ---------------------------------------

@pytest.mark.parametrize("cp,docs", [(2, [512, 1536, 2048]), (4, [256, 2048, 768, 1024])])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (127, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_a_pack_on_fa4_runs_each_step_as_one_varlen_call_and_matches_the_reference(fa4_kernel, cp, docs, mask,
                                                                                    window, softmax_type):
    spec = make_spec(softmax_type, mask, window, "thd", [0, *torch.tensor(docs).cumsum(0).tolist()])
    host = make_inputs(Shape(1, sum(docs), 8, 2, 64), spec, seed=cp)
    x = host.to("cuda", torch.bfloat16)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    fa4_kernel._varlen.clear()
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        got = emulate_ring(x, spec, cp, strategy, kernel=fa4_kernel).result
        for name, want in ref.named().items():
            assert compare(got.named()[name], want, tol).passed, (strategy, name)
    if window is None:   # whole tiles: every group of documents went to FA4 as one call
        assert fa4_kernel._varlen


@pytest.mark.parametrize("cp,docs", [(2, [512, 1536, 2048]), (4, [256, 2048, 768, 1024])])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (127, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_a_pack_under_allgather_on_fa4_is_two_varlen_calls_and_matches_the_reference(fa4_kernel, cp, docs, mask,
                                                                                     window, softmax_type):
    """Every document's first chunks against their keys as one varlen call, then the second
    chunks (one call in all without a mask), each tile's mask aligned to its bottom-right corner."""
    spec = make_spec(softmax_type, mask, window, "thd", [0, *torch.tensor(docs).cumsum(0).tolist()])
    x = make_inputs(Shape(1, sum(docs), 8, 2, 64), spec, seed=cp).to("cuda", torch.bfloat16)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    fa4_kernel._varlen.clear()
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        got = emulate_ring(x, spec, cp, strategy, kernel=fa4_kernel, kv_schedule="allgather").result
        for name, want in ref.named().items():
            assert compare(got.named()[name], want, tol).passed, (strategy, name)
    if window is None:   # each rank's groups (two under causal, one without a mask) went to FA4 as one varlen
        # call each: the forward's index of a group is its tiles' rows against the rows the rank holds (the
        # keys it reads); the backward's span the keys the group reads
        forward = set()
        for rank in range(cp):
            step, = ring_plan(cp, rank, spec_layout(spec, sum(docs), cp), spec.band, KVSchedule.ALLGATHER).steps
            assert len(step.groups) == (2 if mask == "causal" else 1)
            for group in step.groups:
                tiles = [step.tiles[t] for t in group]
                forward.add((tuple((t.q_rows.start, t.q_rows.stop) for t in tiles),
                             tuple((t.kv_rows.start, t.kv_rows.stop) for t in tiles), sum(docs) // cp, step.held_rows))
        assert forward <= set(fa4_kernel._varlen)
        assert len(fa4_kernel._varlen) <= 2 * len(forward)


@pytest.mark.parametrize("cp,docs", [(2, [512, 1536, 2048]), (4, [256, 2048, 768, 1018, 6]), (8, [4096, 1024, 2048, 640])])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (127, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_pack_in_the_balanced_layout_on_fa4_matches_the_reference(fa4_kernel, cp, docs, mask, window,
                                                                    softmax_type, dtype):
    """Each rank's pieces (each document's first on the rank, then the second ones) against their documents' keys as FA4
    varlen calls under allgather, the shards cut by ``shard(..., pack_layout="balanced")``."""
    spec = make_spec(softmax_type, mask, window, "thd", [0, *torch.tensor(docs).cumsum(0).tolist()], "balanced")
    x = make_inputs(Shape(1, sum(docs), 8, 2, 64), spec, seed=cp).to("cuda", dtype)
    ref = reference(x.to("cuda", torch.float64), spec)
    tol = tolerance_for(dtype, gqa=True)
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        run = emulate_ring(x, spec, cp, strategy, kernel=fa4_kernel)
        assert run.kv_schedule.value == "allgather"
        for name, want in ref.named().items():
            assert compare(run.result.named()[name], want, tol).passed, (strategy, name)
