"""sinkprof.attention against an explicit "extra softmax column" formulation, in fp64."""
import itertools
import re

import pytest
import torch

import sinkprof


def _inputs(fmt, h, g, s=12, b=2, d=8, seed=0, bias_heads=None):
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n: (b, s, n, d)) if fmt == "bshd" else (lambda n: (s, b, n, d))
    q = torch.randn(*shape(h), generator=gen, dtype=torch.float64)
    k = torch.randn(*shape(g), generator=gen, dtype=torch.float64)
    v = torch.randn(*shape(g), generator=gen, dtype=torch.float64)
    offset = torch.randn(1, h, 1, 1, generator=gen, dtype=torch.float64) * 5
    bias = torch.randn(1, bias_heads, s, s, generator=gen, dtype=torch.float64) if bias_heads else None
    dout = torch.randn(*shape(h), generator=gen, dtype=torch.float64)
    return q, k, v, offset, bias, dout


def extra_column(q, k, v, offset, bias, fmt, softmax_type, mask, window, scale):
    """Softmax over [scores, sink] with the sink column dropped: written without sinkprof's helpers."""
    if fmt == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        scores = scores + bias
    s = scores.shape[-1]
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    visible = torch.ones(s, s, dtype=torch.bool)
    if mask == "causal":
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    scores = scores.masked_fill(~visible, float("-inf"))
    if softmax_type != "vanilla":
        sink = offset if softmax_type == "learnable" else torch.zeros(1, h, 1, 1, dtype=scores.dtype)
        scores = torch.cat([scores, sink.expand(scores.shape[0], h, s, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if softmax_type != "vanilla":
        probs = probs[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.transpose(0, 1) if fmt == "sbhd" else out


CASES = list(itertools.product(
    ["vanilla", "off-by-one", "learnable"], ["causal", "no_mask"], [None, (3, 0), (2, 3)],
    [(4, 4), (4, 2), (4, 1)], ["bshd", "sbhd"], [None, 1, 4]))
CASES = [c for c in CASES if not (c[1] == "causal" and c[2] == (2, 3))]


@pytest.mark.parametrize("softmax_type,mask,window,heads,fmt,bias_heads", CASES)
def test_reference_matches_extra_column_formulation(softmax_type, mask, window, heads, fmt, bias_heads):
    h, g = heads
    q, k, v, offset, bias, dout = _inputs(fmt, h, g, bias_heads=bias_heads)
    learnable = softmax_type == "learnable"

    def leaves():
        return [x.clone().requires_grad_() if x is not None else None
                for x in (q, k, v, offset if learnable else None, bias)]

    mine, theirs = leaves(), leaves()
    out = sinkprof.attention(*mine[:4], softmax_type=softmax_type, mask=mask, window=window, bias=mine[4],
                             qkv_format=fmt)
    expected = extra_column(*theirs[:3], theirs[3], theirs[4], fmt, softmax_type, mask, window, 8 ** -0.5)
    assert torch.allclose(out, expected, atol=1e-13, rtol=0)
    out.backward(dout)
    expected.backward(dout)
    for a, b in zip(mine, theirs):
        if a is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)
    if learnable:
        assert mine[3].grad.abs().max() > 1e-6


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("mask,window", [("causal", None), ("no_mask", (3, 1))])
def test_sink_gradient_matches_finite_differences(softmax_type, mask, window):
    q, k, v, offset, _, dout = _inputs("bshd", 4, 2)

    def loss(off):
        a = off if softmax_type == "learnable" else None
        out = sinkprof.attention(q, k, v, a, softmax_type=softmax_type, mask=mask, window=window)
        return (out * dout).sum()

    if softmax_type == "off-by-one":
        # The off-by-one sink is the learnable one frozen at zero: its slope there is what learnable reports.
        softmax_type = "learnable"
        offset = torch.zeros_like(offset)
    off = offset.clone().requires_grad_()
    loss(off).backward()
    eps = 1e-6
    for head in range(4):
        plus, minus = offset.clone(), offset.clone()
        plus[0, head] += eps
        minus[0, head] -= eps
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(fd.item() - off.grad[0, head].item()) < 1e-7 * max(1.0, abs(fd.item()))


def test_lse_includes_the_sink_and_is_fp32_for_bf16():
    q, k, v, offset, _, _ = _inputs("bshd", 4, 2)
    _, lse = sinkprof.attention(q, k, v, offset, softmax_type="learnable", mask="causal", return_lse=True)
    _, lse_vanilla = sinkprof.attention(q, k, v, mask="causal", return_lse=True)
    assert lse.shape == (2, 4, 12)
    assert torch.allclose(lse, torch.logaddexp(lse_vanilla, offset.view(1, 4, 1)), atol=1e-14)
    _, lse16 = sinkprof.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), offset.float(),
                                  softmax_type="learnable", return_lse=True)
    assert lse16.dtype == torch.float32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_low_precision_inputs_follow_the_fp64_result(dtype, tol):
    q, k, v, offset, _, _ = _inputs("bshd", 4, 2)
    low = [x.to(dtype) for x in (q, k, v)]
    out = sinkprof.attention(*low, offset.float(), softmax_type="learnable", mask="causal")
    ref = sinkprof.attention(*(x.double() for x in low), offset.float().double(), softmax_type="learnable",
                             mask="causal")
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() < tol


def test_a_row_with_no_visible_key_is_zero_or_sink_only():
    q, k, v, offset, _, _ = _inputs("bshd", 4, 4, s=6)
    # top-left alignment with fewer keys than queries and a window: the last rows see nothing
    kk, vv = k[:, :2], v[:, :2]
    out, lse = sinkprof.attention(q, kk, vv, offset, softmax_type="learnable", window=(1, 0), return_lse=True)
    assert torch.equal(out[:, 3:], torch.zeros_like(out[:, 3:]))
    assert torch.allclose(lse[:, :, 3:], offset.view(1, 4, 1).expand(2, 4, 3))
    out_v = sinkprof.attention(q, kk, vv, window=(1, 0))
    assert torch.isfinite(out_v).all()


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_a_padding_row_of_the_bias_and_a_head_without_a_sink_give_the_blockwise_references_gradients(softmax_type):
    """A row whose bias is -inf on every key had logsumexp's NaN backward: NaN in its dq, in every
    element of dk, in its dbias; with a -inf offset (head 0 without a sink), NaN in d_offset too."""
    from sinkprof.options import make_spec
    from sinkprof.testing import Inputs, reference
    g = torch.Generator().manual_seed(7)
    b, s, h, d = 1, 8, 2, 4
    q, k, v, go = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(1, h, s, s, generator=g, dtype=torch.float64)
    bias[:, :, 3, :] = float("-inf")
    offset = (torch.randn(1, h, 1, 1, generator=g, dtype=torch.float64) * 5 if softmax_type == "learnable"
              else None)
    if offset is not None:
        offset[0, 0] = float("-inf")
    for window in (None, (1, 0)):
        xs = [x.clone().requires_grad_() for x in (q, k, v, bias)] + ([offset.clone().requires_grad_()] if
                                                                       offset is not None else [])
        out = sinkprof.attention(*xs[:3], xs[4] if offset is not None else None, softmax_type=softmax_type,
                                 window=window, bias=xs[3])
        out.backward(go)
        ref = reference(Inputs(q, k, v, offset, bias, go), make_spec(softmax_type, "no_mask", window, "bshd"))
        wants = [ref.out, ref.dq, ref.dk, ref.dv, ref.d_bias] + ([ref.d_offset] if offset is not None else [])
        for got, want in zip([out] + [x.grad for x in xs], wants):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))


BAD = [
    (dict(q=torch.zeros(2, 4, 8)), "q must be 4-D"),
    (dict(k=torch.zeros(2, 12, 3, 8, dtype=torch.float64), v=torch.zeros(2, 12, 3, 8, dtype=torch.float64)), "multiple of g"),
    (dict(k=torch.zeros(2, 12, 2, 8, dtype=torch.float32)), "share a dtype"),
    (dict(q=torch.zeros(2, 12, 4, 8, dtype=torch.int32)), "q.dtype"),
    (dict(softmax_type="learnable"), "needs softmax_offset"),
    (dict(softmax_type="learnable", softmax_offset=torch.zeros(4)), "softmax_offset must have shape"),
    (dict(softmax_type="vanilla", softmax_offset=torch.zeros(1, 4, 1, 1)), "softmax_offset must be None"),
    (dict(softmax_type="bogus"), "softmax_type='bogus'"),
    (dict(mask="padding"), "mask='padding'"),
    (dict(window=(3,)), "window="),
    (dict(window=(-2, 0)), "window left=-2"),
    (dict(mask="causal", window=(3, 2)), "contradicts mask='causal'"),
    (dict(bias=torch.zeros(1, 3, 12, 12, dtype=torch.float64)), "bias shape"),
    (dict(bias=torch.zeros(12, 12, dtype=torch.float64)), "bias must be a 4-D"),
    (dict(scale=-1.0), "scale=-1.0"),
    (dict(qkv_format="thd"), "qkv_format='thd'"),
]


@pytest.mark.parametrize("override,message", BAD)
def test_malformed_input_raises_value_error_naming_the_argument(override, message):
    q, k, v, _, _, _ = _inputs("bshd", 4, 2)
    args = dict(q=q, k=k, v=v, softmax_offset=None)
    args.update(override)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        sinkprof.attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("softmax_offset"), **args)


@pytest.mark.parametrize("fmt,softmax,mask,window,bias_heads,h,g", [
    ("bshd", "learnable", "causal", None, None, 4, 2),
    ("sbhd", "off-by-one", "no_mask", (3, 2), 4, 4, 1),
    ("bshd", "vanilla", "causal", (2, 0), 1, 2, 2),
    ("sbhd", "learnable", "no_mask", (0, 0), 1, 4, 4),
])
def test_the_blockwise_reference_equals_autograd_on_the_whole_sequence(fmt, softmax, mask, window, bias_heads, h, g):
    from sinkprof.options import make_spec
    from sinkprof.testing import Inputs, reference
    q, k, v, offset, bias, dout = _inputs(fmt, h, g, s=20, bias_heads=bias_heads)
    offset = offset if softmax == "learnable" else None
    spec = make_spec(softmax, mask, window, fmt)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (q, k, v, offset, bias)]
    out = sinkprof.attention(*leaves[:4], softmax_type=softmax, mask=mask, window=window, bias=leaves[4],
                             qkv_format=fmt)
    out.backward(dout)
    inputs = Inputs(q, k, v, offset, bias, dout)
    for block in (1, 3 * 2 * h * 20 * 8, 2 ** 30):          # one row, three rows, everything at once
        ref = reference(inputs, spec, block_bytes=block)
        grads = [None if t is None else t.grad for t in leaves]
        for got, want in ((ref.out, out), (ref.dq, grads[0]), (ref.dk, grads[1]), (ref.dv, grads[2]),
                          (ref.d_offset, grads[3]), (ref.d_bias, grads[4])):
            if want is None:
                assert got is None
                continue
            assert torch.allclose(got, want, atol=1e-12, rtol=1e-12)
    rows = torch.zeros(20, dtype=torch.bool)
    rows[::3] = True
    part, rest = reference(inputs, spec, rows=rows), reference(inputs, spec, rows=~rows)
    assert torch.allclose(part.dk + rest.dk, leaves[1].grad, atol=1e-12)
    assert torch.allclose(part.out + rest.out, out, atol=1e-12)


def test_the_reference_memory_grows_linearly_with_the_sequence():
    """At s=4096 a [b, h, s, s] fp64 score matrix is 256 MiB and autograd holds several (1.3 GiB
    measured before the blockwise reference); the blockwise reference never holds one."""
    import subprocess
    import sys
    code = """
import resource, torch
torch.set_num_threads(2)
from sinkprof.options import make_spec
from sinkprof.testing import Shape, make_inputs, reference
spec = make_spec("learnable", "causal", None, "bshd")
x = make_inputs(Shape(1, 4096, 2, 1, 8), spec, 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reference(x, spec)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.split()[-1]) < 400 * 2 ** 20


def _spec_inputs():
    from sinkprof.options import make_spec
    from sinkprof.testing import Inputs
    q, k, v, offset, _, dout = _inputs("bshd", 4, 2)
    return make_spec("learnable", "causal", (3, 0), "bshd"), Inputs(q, k, v, offset, None, dout)


@pytest.mark.parametrize("kw, kind, parts", [
    (dict(rows=torch.tensor([0, 3, 5])), ValueError, "rows must be a bool tensor of shape [12], a flag for each query row of "
                                         "the sequence; got torch.int64 of shape (3,)"),
    (dict(rows=torch.tensor([True, False])), ValueError, "rows must be a bool tensor of shape [12]"),
    (dict(heads=torch.tensor([1])), ValueError, "heads must be a bool tensor of shape [4], a flag for each query head; got "
                                    "torch.int64"),
    (dict(heads=[True] * 4), TypeError, "heads must be a bool tensor of shape [4], a flag for each query head; got "
                                        "list"),
])
def test_the_reference_refuses_rows_or_heads_that_are_not_one_flag_each(kw, kind, parts):
    """Before: integer rows were read as flags (rows [0, 3, 5] computed rows 1 and 2), a short bool
    vector computed its rows only, one integer head weighted every head."""
    from sinkprof.testing import reference
    spec, x = _spec_inputs()
    with pytest.raises(kind, match=re.escape(parts)):
        reference(x, spec, **kw)


def test_a_spec_built_by_hand_means_what_make_spec_builds():
    """Before: AttnSpec(mask="causal") ran without a mask, softmax_type="learnable" without the sink
    (the loops compare enums by identity), and a -1 window side saw nothing."""
    from sinkprof.options import AttnSpec
    from sinkprof.testing import reference
    spec, x = _spec_inputs()
    by_hand = reference(x, AttnSpec(softmax_type="learnable", mask="causal", window=(3, None)))
    made = reference(x, spec)
    for name, t in made.named().items():
        assert torch.equal(by_hand.named()[name], t), name
    for window in [(-1, 0), (1,), [1, 0], (True, 0), (1.0, 0)]:
        with pytest.raises(ValueError, match=re.escape(f"AttnSpec.window={window!r} must be a pair (left, right) "
                                                       f"of ints >= 0 or None for unbounded; make_spec takes -1")):
            AttnSpec(window=window)
    with pytest.raises(ValueError, match=re.escape("AttnSpec.mask='padding' is not supported")):
        AttnSpec(mask="padding")


def test_compare_counts_an_infinity_equal_to_itself_and_no_other_value():
    """Before: a tensor holding -inf (the lse of a row that sees no key) failed against itself."""
    from sinkprof.testing import Tolerance, compare
    tol = Tolerance(1e-6, 1e-6)
    t = torch.tensor([0.5, float("-inf")], dtype=torch.float64)
    assert compare(t, t.clone(), tol).passed
    for other in ([0.5, 0.0], [0.5, float("inf")], [0.5, float("nan")]):
        assert not compare(torch.tensor(other, dtype=torch.float64), t, tol).passed
        assert not compare(t, torch.tensor(other, dtype=torch.float64), tol).passed
    assert not compare(torch.tensor([0.6, float("-inf")], dtype=torch.float64), t, tol).passed
