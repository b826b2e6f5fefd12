"""The public `sinkprof.cp_attention` in-process, on a one-rank gloo group: it equals the reference
and refuses bad arguments by name (multi-rank runs are in test_check.py and test_a2a.py)."""
import re

import pytest
import torch

import sinkprof


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 16, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 16, 2, 8, generator=g, dtype=torch.float64)
    a = torch.randn(1, 4, 1, 1, generator=g, dtype=torch.float64) * 5
    return q, k, v, a


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("strategy", ["step0", "post-merge", None])
def test_one_rank_cp_attention_equals_the_reference(world, comm, strategy):
    q, k, v, a = _inputs()
    mine = [x.clone().requires_grad_() for x in (q, k, v, a)]
    ref = [x.clone().requires_grad_() for x in (q, k, v, a)]
    out = sinkprof.cp_attention(*mine, comm=comm, softmax_type="learnable", mask="causal", window=(5, 0),
                                sink_strategy=strategy)
    expected = sinkprof.attention(*ref, softmax_type="learnable", mask="causal", window=(5, 0))
    assert torch.allclose(out, expected, atol=1e-13)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout)
    for a_, b_ in zip(mine, ref):
        assert torch.allclose(a_.grad, b_.grad, atol=1e-12)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sink_strategy="every-tile"), "every-tile"),
    (dict(comm="ring"), "comm='ring'"),
    (dict(sink_grad="sum"), "sink_grad='sum'"),
    (dict(comm="a2a+p2p"), "needs a2a_size"),
    (dict(a2a_size=2), "only applies to comm='a2a+p2p'"),
    (dict(bias=torch.zeros(1, 4, 8, 8, dtype=torch.float64)), "bias shape"),
])
def test_bad_arguments_are_refused_by_name(world, kwargs, message):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=re.escape(message)):
        sinkprof.cp_attention(q, k, v, **kwargs)


def test_an_odd_local_shard_is_refused(world):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="even number"):
        sinkprof.cp_attention(q[:, :15], k[:, :15], v[:, :15])


def test_the_default_sink_strategy_is_the_backends_faster_one():
    from sinkprof.kernels import get_kernel
    from sinkprof.kernels.cudnn import CudnnTiles
    from sinkprof.kernels.fa4 import FA4Tiles
    from sinkprof.options import SinkStrategy
    assert get_kernel("torch", "cpu").sink_strategy is SinkStrategy.STEP0
    assert CudnnTiles.sink_strategy is SinkStrategy.POST_MERGE    # its native sink is slow backward
    assert FA4Tiles.sink_strategy is SinkStrategy.STEP0           # its native sink costs nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_offset_is_used_in_fp32_and_gets_its_gradient_in_its_dtype(world, dtype):
    q, k, v, a = (x.float() for x in _inputs())
    half = a.to(dtype)
    for fn in (sinkprof.attention, sinkprof.cp_attention):
        mine = [x.clone().requires_grad_() for x in (q, k, v, half)]
        ref = [x.clone().requires_grad_() for x in (q, k, v, half.float())]
        out = fn(*mine, softmax_type="learnable", mask="causal")
        expected = fn(*ref, softmax_type="learnable", mask="causal")
        assert torch.allclose(out, expected, atol=1e-6)
        out.sum().backward()
        expected.sum().backward()
        assert mine[3].grad.dtype == dtype
        assert torch.allclose(mine[3].grad.float(), ref[3].grad.to(dtype).float())


@pytest.mark.parametrize("kv_schedule", ["ring", "direct", "allgather"])
def test_k_and_v_unbound_from_a_fused_kv_buffer_are_used_in_place_and_give_the_same_gradients(world, monkeypatch,
                                                                                               kv_schedule):
    """A fused K/V projection's ``[b, s, 2, g, d]`` output, unbound: the ring keeps that buffer
    (no stacking copy, ``ring.kv_pieces``) under every schedule, and the result and every gradient
    equal those of separate k and v tensors; the gradient reaches the fused buffer. Separate
    tensors are stacked (a copy) where the schedule moves one tensor (ring, allgather) and moved as
    they are under direct."""
    from sinkprof import ring
    q, k, v, a = _inputs(seed=3)
    fused = torch.stack([k, v], dim=2).requires_grad_()
    seen = []
    real = ring.kv_pieces
    monkeypatch.setattr(ring, "kv_pieces", lambda *args: seen.append(real(*args)) or seen[-1])
    qf, af = q.clone().requires_grad_(), a.clone().requires_grad_()
    out = sinkprof.cp_attention(qf, *fused.unbind(2), af, softmax_type="learnable", mask="causal",
                                kv_schedule=kv_schedule)
    assert len(seen[0]) == 1 and seen[0][0].data_ptr() == fused.data_ptr()   # the fused buffer itself, not a copy
    sep = [x.clone().requires_grad_() for x in (q, k, v, a)]
    expected = sinkprof.cp_attention(*sep, softmax_type="learnable", mask="causal", kv_schedule=kv_schedule)
    if kv_schedule == "direct":   # K and V apart, their own memory
        assert [p.data_ptr() for p in seen[1]] == [sep[1].data_ptr(), sep[2].data_ptr()]
    else:                         # stacked: a copy of both
        assert len(seen[1]) == 1 and seen[1][0].data_ptr() not in (sep[1].data_ptr(), sep[2].data_ptr())
    assert torch.equal(out, expected)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout)
    assert torch.equal(fused.grad, torch.stack([sep[1].grad, sep[2].grad], dim=2))
    assert torch.equal(qf.grad, sep[0].grad) and torch.equal(af.grad, sep[3].grad)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(timeout=-5), ValueError, "timeout -5: give a number of seconds from 1 to"),
    (dict(timeout=0), ValueError, "timeout 0: give a number of seconds from 1 to"),
    (dict(timeout=float("inf")), ValueError, "timeout inf: give a number of seconds from 1 to"),
    (dict(timeout=float("nan")), ValueError, "timeout nan: give a number of seconds from 1 to"),
    (dict(timeout=None), TypeError, "timeout=None must be a number of seconds, got NoneType"),
    (dict(timeout="30"), TypeError, "timeout='30' must be a number of seconds, got str"),
    (dict(timeout=True), TypeError, "timeout=True must be a number of seconds, got bool"),
    (dict(window=(1.9, 0)), TypeError, "window=(1.9, 0): left must be an int (-1 for unbounded), got float"),
    (dict(window=("2", "0")), TypeError, "window=('2', '0'): left must be an int"),
    (dict(window=(True, 0)), TypeError, "window=(True, 0): left must be an int (-1 for unbounded), got bool"),
    (dict(window=(4, 0.0)), TypeError, "window=(4, 0.0): right must be an int"),
    (dict(window="4,0"), TypeError, "window='4,0' must be a pair (left, right) of ints"),
    (dict(scale="0.3"), TypeError, "scale='0.3' must be a real number"),
    (dict(scale=True), TypeError, "scale=True must be a real number"),
    (dict(scale=torch.tensor(0.3)), TypeError, "must be a real number (None: d ** -0.5), got Tensor"),
    (dict(comm="a2a+p2p", a2a_size=1.0), TypeError, "a2a_size=1.0 must be an int"),
    (dict(group="world"), ValueError, "group='world' must be a torch.distributed ProcessGroup (None: the world)"),
    (dict(group=(None, None)), ValueError, "group=(a2a_group, p2p_group) is the form of comm='a2a+p2p', not "
                                           "comm='p2p'"),
    (dict(group=-100), ValueError, "rank 0 is not a member of group: torch.distributed.new_group gave this rank "
                                   "GroupMember.NON_GROUP_MEMBER"),
    (dict(comm="a2a+p2p", group=(None, None, None)), ValueError,
     "group=(a2a_group, p2p_group) takes exactly two process groups, got 3"),
    (dict(comm="a2a+p2p", group=()), ValueError, "takes exactly two process groups, got 0"),
    (dict(softmax_type="learnable", softmax_offset=[0.0] * 4), TypeError,
     "softmax_offset must be a [1, 4, 1, 1] torch.Tensor, got list; torch.as_tensor makes one"),
    (dict(bias=[[0.0]]), TypeError, "bias must be a 4-D torch.Tensor [1|2, 1|4, 16, 16], got list"),
])
def test_mistyped_arguments_and_groups_are_refused_by_name(world, kwargs, error, message):
    """Before: a float window side truncated, strings and bools taken for numbers, a negative
    timeout a CommError at every call, 0 the default, inf an OverflowError, None a TypeError
    from timedelta; a tuple or string group torch's 'Group ... is not registered'."""
    q, k, v, _ = _inputs()
    with pytest.raises(error) as err:
        sinkprof.cp_attention(q, k, v, **kwargs)
    assert message in str(err.value)


def test_a_group_of_one_compares_nothing_and_sends_nothing(world, monkeypatch):
    import torch.distributed as dist
    calls = []
    real = dist.all_gather
    monkeypatch.setattr(dist, "all_gather", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, a = _inputs()
    for offset in (a, a + 1):
        sinkprof.cp_attention(q, k, v, offset, softmax_type="learnable", window=(7, 0))
    assert calls == []


def test_an_offset_edited_in_place_between_forward_and_backward_is_named(world):
    """Before: torch's "Output 0 of ReplicatedGrad is a view ... clone the output of the custom Function"."""
    q, k, v, a = _inputs()
    q.requires_grad_()
    a.requires_grad_()
    out = sinkprof.cp_attention(q, k, v, a, softmax_type="learnable", mask="causal")
    with torch.no_grad():
        a.mul_(2)
    with pytest.raises(RuntimeError, match=re.escape("softmax_offset was modified in place after cp_attention's "
                                                     "forward and before its backward (its version went from 0 to 1)")):
        out.sum().backward()


@pytest.mark.parametrize("bias_grad", [True, False])
def test_a_bias_edited_in_place_between_forward_and_backward_is_named(world, bias_grad):
    """Before: torch's "Output 0 of ReplicatedGrad is a view ..." (a private class) for a bias that
    takes a gradient; the tiles recompute their scores from the forward's bias."""
    q, k, v, _ = _inputs()
    q.requires_grad_()
    bias = torch.randn(1, q.shape[2], q.shape[1], q.shape[1], dtype=q.dtype).requires_grad_(bias_grad)
    out = sinkprof.cp_attention(q, k, v, softmax_type="off-by-one", mask="causal", bias=bias)
    with torch.no_grad():
        bias.add_(1.0)
    with pytest.raises(RuntimeError, match=re.escape("bias was modified in place after cp_attention's forward and "
                                                     "before its backward (its version went from 0 to 1)")):
        out.sum().backward()


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_a_double_backward_raises_naming_cp_attention_and_the_first_order_is_unchanged(world, comm):
    """Before: wrong second-order gradients, or a crash inside the ring ("cat(): functions with out=...")."""
    q, k, v, a = (x.clone().requires_grad_() for x in _inputs())
    call = dict(comm=comm, softmax_type="learnable", mask="causal")
    graphed = torch.autograd.grad(sinkprof.cp_attention(q, k, v, a, **call).sum(), (q, k, v, a), create_graph=True)
    plain = torch.autograd.grad(sinkprof.cp_attention(q, k, v, a, **call).sum(), (q, k, v, a))
    assert all(torch.equal(x, y) for x, y in zip(graphed, plain))
    for grad, wrt in zip(graphed, (q, k, v, a)):
        assert grad.requires_grad
        with pytest.raises(NotImplementedError, match="cp_attention has no double backward"):
            torch.autograd.grad(grad.pow(2).sum(), wrt)
    with pytest.raises(NotImplementedError, match="cp_attention has no double backward"):
        sum(g.sum() for g in graphed).backward()


def test_tensors_made_under_inference_mode_are_taken_as_the_single_device_attention_takes_them(world):
    """Before: autograd's 'Inference tensors cannot be saved for backward', from inside the ring."""
    q, k, v, _ = _inputs()
    with torch.inference_mode():
        a = torch.randn(1, 4, 1, 1, dtype=torch.float64) * 5
        bias = torch.randn(1, 4, 16, 16, dtype=torch.float64)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sinkprof.cp_attention(*mine, a, softmax_type="learnable", mask="causal", bias=bias)
    expected = sinkprof.attention(*ref, a, softmax_type="learnable", mask="causal", bias=bias)
    assert torch.allclose(out, expected, atol=1e-13)
    out.sum().backward()
    expected.sum().backward()
    for x, y in zip(mine, ref):
        assert torch.allclose(x.grad, y.grad, atol=1e-12)


@pytest.mark.parametrize("call", ["cp_attention", "attention"])
def test_no_heads_and_a_numpy_q_are_refused_like_any_other_empty_or_foreign_input(world, call):
    """Before: zero heads ran and returned an empty output (zero b, s or d were refused); a numpy q
    was a ValueError where shard and unshard raise TypeError."""
    q, k, v, _ = _inputs()
    fn = getattr(sinkprof, call)
    with pytest.raises(ValueError, match=re.escape("q, k, v must not be empty, got q (2, 16, 0, 8)")):
        fn(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match="must not be empty"):
        fn(q[:, :, :0], k[:, :, :0], v[:, :, :0])
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got numpy.ndarray; torch.as_tensor makes one"):
        fn(q.numpy(), k, v)
