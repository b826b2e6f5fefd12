"""GPU tests (marked ``gpu``; skipped without CUDA): cuDNN tiles against the torch tiles and the
reference, the ring schedule on cuDNN with both sink strategies, and the graph cache."""
import pytest
import torch

from sinkprof.emulate import emulate_ring
from sinkprof.kernels import TorchTiles, get_kernel
from sinkprof.options import Band, SinkStrategy, make_spec
from sinkprof.testing import Shape, compare, make_inputs, reference, tolerance_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def cudnn_kernel():
    from sinkprof.kernels import cudnn_unavailable_reason
    reason = cudnn_unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    return get_kernel("cudnn", "cuda")


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
def test_cudnn_tile_matches_the_torch_tile(cudnn_kernel, band, with_sink, dtype, layout, n_q, n_kv):
    q, k, v, do, sink = _tile_inputs(layout, dtype, n_q, n_kv)
    sink = sink if with_sink else None
    scale = 64 ** -0.5
    ref = TorchTiles()
    o_ref, lse_ref = ref.forward(*(x.double() for x in (q, k, v)), band, None if sink is None else sink.double(), None, scale)
    o, lse = cudnn_kernel.forward(q, k, v, band, sink, None, scale)
    tol = tolerance_for(dtype, gqa=True)
    assert compare(o, o_ref, tol).passed
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse_ref[finite]).abs().max() < 1e-2
    # backward driven with the given (here: the tile's own) stats, as a ring drives it with merged ones
    g_ref = ref.backward(*(x.double() for x in (q, k, v)), o_ref, do.double(), lse_ref, band,
                         None if sink is None else sink.double(), None, scale)
    g = cudnn_kernel.backward(q, k, v, o, do, lse, band, sink, None, scale)
    for name in ("dq", "dk", "dv", "d_sink"):
        got, want = getattr(g, name), getattr(g_ref, name)
        if want is None:
            assert got is None
            continue
        err = compare(got, want, tol)
        assert err.passed, (name, err)


def test_cudnn_tile_with_bias_matches_the_torch_tile(cudnn_kernel):
    q, k, v, do, sink = _tile_inputs("bshd", torch.bfloat16, 128, 128, h=4, g=4)
    bias = torch.randn(1, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
    ref = TorchTiles()
    o_ref, lse_ref = ref.forward(q.double(), k.double(), v.double(), Band(None, 0), sink.double(), bias.double(), 0.125)
    o, lse = cudnn_kernel.forward(q, k, v, Band(None, 0), sink, bias, 0.125)
    g = cudnn_kernel.backward(q, k, v, o, do, lse, Band(None, 0), sink, bias, 0.125)
    g_ref = ref.backward(q.double(), k.double(), v.double(), o_ref, do.double(), lse_ref, Band(None, 0),
                         sink.double(), bias.double(), 0.125)
    tol = tolerance_for(torch.bfloat16)
    assert compare(o, o_ref, tol).passed
    for name in ("dq", "dk", "dv", "d_sink", "d_bias"):
        assert compare(getattr(g, name), getattr(g_ref, name), tol).passed, name


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", None), ("causal", (128, 0))])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_ring_schedule_on_cudnn_matches_the_reference_with_both_strategies(cudnn_kernel, cp, mask, window,
                                                                        softmax_type):
    spec = make_spec(softmax_type, mask, window, "bshd")
    shape = Shape(b=2, s=1024, h=8, g=2, d=64)
    host = make_inputs(shape, spec, seed=cp)
    ref = reference(host.to("cuda", torch.bfloat16).to("cuda", torch.float64), spec)
    x = host.to("cuda", torch.bfloat16)
    tol = tolerance_for(torch.bfloat16, gqa=True)
    results = {}
    for strategy in (SinkStrategy.STEP0, SinkStrategy.POST_MERGE):
        got = emulate_ring(x, spec, cp, strategy, kernel=cudnn_kernel).result
        for name, want in ref.named().items():
            err = compare(got.named()[name], want, tol)
            assert err.passed, (strategy, name, err)
        results[strategy] = got
    for name, a in results[SinkStrategy.STEP0].named().items():
        assert compare(a, results[SinkStrategy.POST_MERGE].named()[name], tol).passed, name


def test_a_warm_ring_builds_no_graph_and_standard_masks_are_never_refused(cudnn_kernel):
    spec = make_spec("learnable", "causal", None, "bshd")
    x = make_inputs(Shape(b=1, s=2048, h=8, g=8, d=128), spec, seed=1).to("cuda", torch.bfloat16)
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    built = cudnn_kernel.builds
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    emulate_ring(x, spec, 4, SinkStrategy.STEP0, kernel=cudnn_kernel)
    assert cudnn_kernel.builds == built
    assert not {k: v for k, v in cudnn_kernel.refused().items() if k[-4] in (Band(), Band(None, 0))}
