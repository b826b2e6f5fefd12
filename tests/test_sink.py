"""The sink math: merges, the fold and the sink gradient, against direct formulas in fp64."""
import pytest
import torch

from sinkprof.sink import merge_parts_, sink_grad

NEG_INF = float("-inf")


def _attn(scores, v):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v, lse


def _no_parts(o, lse):
    return o.unsqueeze(0)[:0], lse.unsqueeze(0)[:0]


@pytest.mark.parametrize("cuts", [(0, 3, 8), (0, 1, 4, 6, 8), (0, 2, 3, 4, 5, 6, 7, 8)], ids=["2", "4", "7"])
def test_merging_key_blocks_in_one_pass_equals_attention_over_all_keys(cuts):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    full_o, full_lse = _attn(scores, v)
    blocks = [_attn(scores[..., lo:hi], v[:, :, lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
    o, lse = blocks[0]
    lse = lse.clone()
    parts_o, parts_lse = torch.stack([b[0] for b in blocks[1:]]), torch.stack([b[1] for b in blocks[1:]])
    merge_parts_(o, lse, parts_o, parts_lse)
    assert torch.allclose(o, full_o, atol=1e-14, rtol=0)
    assert torch.allclose(lse, full_lse, atol=1e-14, rtol=0)


def test_parts_that_do_not_cover_a_row_are_never_read_and_empty_rows_stay_finite():
    """Row 0: the result so far only; row 1: one part only; row 2: nothing at all (o 0, lse -inf).
    The parts hold NaN where they do not cover a row: a merge that read them would show it."""
    o = torch.tensor([[[[1.0, 2.0], [5.0, 5.0], [0.0, 0.0]]]], dtype=torch.float64)
    lse = torch.tensor([[[0.3, NEG_INF, NEG_INF]]], dtype=torch.float64)
    parts_o = torch.full((2, 1, 1, 3, 2), float("nan"), dtype=torch.float64)
    parts_lse = torch.full((2, 1, 1, 3), NEG_INF, dtype=torch.float64)
    parts_o[1, 0, 0, 1] = torch.tensor([3.0, 4.0])
    parts_lse[1, 0, 0, 1] = -2.0
    merge_parts_(o, lse, parts_o, parts_lse)
    assert torch.equal(o[0, 0], torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]], dtype=torch.float64))
    assert torch.equal(lse[0, 0], torch.tensor([0.3, -2.0, NEG_INF], dtype=torch.float64))


def test_fold_equals_an_extra_softmax_column_with_zero_value():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    a = torch.randn(1, 3, 1, 1, generator=g, dtype=torch.float64) * 5
    with_col = torch.cat([scores, a.expand(2, 3, 5, 1)], -1)
    expected = torch.softmax(with_col, -1)[..., :-1] @ v
    o, lse = _attn(scores, v)
    out = torch.empty_like(o)
    merge_parts_(o, lse, *_no_parts(o, lse), into=out, sink=a)      # no parts: the fold alone
    assert torch.allclose(out, expected, atol=1e-14, rtol=0)
    assert torch.allclose(lse, torch.logsumexp(with_col, -1), atol=1e-14, rtol=0)


def test_fold_on_an_empty_row_gives_zero_output_and_lse_equal_to_the_sink():
    o = torch.zeros(1, 2, 1, 3, dtype=torch.float64)
    lse = torch.full((1, 2, 1), NEG_INF, dtype=torch.float64)
    a = torch.tensor([1.5, -7.0], dtype=torch.float64).view(1, 2, 1, 1)
    out = torch.full_like(o, 7.0)
    merge_parts_(o, lse, *_no_parts(o, lse), into=out, sink=a)
    assert torch.equal(out, torch.zeros_like(o))
    assert torch.equal(lse.flatten(), a.flatten())


def test_sink_grad_matches_autograd_through_the_extra_column():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 2
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    a = (torch.randn(1, 3, 1, 1, generator=g, dtype=torch.float64) * 5).requires_grad_()
    probs = torch.softmax(torch.cat([scores, a.expand(2, 3, 5, 1)], -1), -1)[..., :-1]
    out = probs @ v
    out.backward(dout)
    lse = torch.logsumexp(torch.cat([scores, a.detach().expand(2, 3, 5, 1)], -1), -1)
    got = sink_grad(out.detach(), dout, lse, a.detach())
    assert got.shape == (1, 3, 1, 1)
    assert torch.allclose(got, a.grad, atol=1e-13, rtol=0)
    assert a.grad.abs().max() > 1e-3  # the check is not vacuous


def test_merge_into_the_output_with_the_sink_equals_merge_then_fold():
    """The last merge of a ring writes the output and folds the sink in one pass; the rows' result
    so far may be read from the output buffer (a lower dtype) rather than the accumulator."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    a = torch.randn(1, 3, 1, 1, generator=g, dtype=torch.float64) * 5
    o1, lse1 = _attn(scores[..., :3], v[:, :, :3])
    o2, lse2 = _attn(scores[..., 3:], v[:, :, 3:])
    want_o, want_lse = o1.clone(), lse1.clone()
    merge_parts_(want_o, want_lse, o2.unsqueeze(0), lse2.unsqueeze(0))
    want = torch.empty_like(want_o)
    merge_parts_(want_o, want_lse, *_no_parts(want_o, want_lse), into=want, sink=a)
    for first_dtype in (torch.float64, torch.float32):
        first = o1.to(first_dtype)                     # the first part, as the output buffer holds it
        lse = lse1.clone()
        out = torch.full_like(o1, 7.0)
        merge_parts_(first, lse, o2.unsqueeze(0), lse2.unsqueeze(0), into=out, sink=a)
        tol = 1e-14 if first_dtype == torch.float64 else 1e-6
        assert torch.allclose(out, want, atol=tol, rtol=0)
        assert torch.allclose(lse, want_lse, atol=1e-14, rtol=0)
        assert torch.equal(first, o1.to(first_dtype))  # the source is read, not written


def test_a_head_whose_sink_is_minus_inf_keeps_its_rows_and_its_empty_rows_stay_zero():
    """A -inf sink switches a head's sink off. The fold computed sigmoid(-inf - -inf) on that head's
    empty rows (a padding row a bias masks whole) and multiplied the NaN into the output."""
    o = torch.tensor([[[[1.0, 2.0], [0.0, 0.0]], [[3.0, 4.0], [0.0, 0.0]]]], dtype=torch.float64)
    lse = torch.tensor([[[0.5, NEG_INF], [0.5, NEG_INF]]], dtype=torch.float64)
    a = torch.tensor([NEG_INF, 1.5], dtype=torch.float64).view(1, 2, 1, 1)
    out = torch.full_like(o, 7.0)
    merge_parts_(o, lse, *_no_parts(o, lse), into=out, sink=a)
    assert torch.equal(out[0, 0], o[0, 0])                                   # no sink: unchanged
    assert torch.equal(out[0, 1, 1], torch.zeros(2, dtype=torch.float64))   # empty row, finite sink: 0
    assert torch.allclose(out[0, 1, 0], o[0, 1, 0] * torch.sigmoid(torch.tensor(-1.0, dtype=torch.float64)))
    assert torch.equal(lse[0, 0], torch.tensor([0.5, NEG_INF], dtype=torch.float64))
    assert lse[0, 1, 1] == 1.5
    d_o = torch.ones_like(out)
    grad = sink_grad(out, d_o, lse, a)
    assert grad[0, 0, 0, 0] == 0.0                                           # was NaN: exp(-inf - -inf)
    assert torch.allclose(grad[0, 1, 0, 0], -torch.exp(1.5 - lse[0, 1, 0]) * out[0, 1, 0].sum())


def test_the_sink_gradient_of_fp16_rows_whose_products_pass_65504_is_finite():
    """``D = rowsum(dO * o)`` was formed in fp16 before the fp32 sum: o and a loss-scaled dO of a
    few hundred each overflowed to inf, and the sink's gradient with it."""
    g = torch.Generator().manual_seed(4)
    o = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) + 300
    d_o = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) + 300
    lse = torch.randn(1, 2, 6, generator=g, dtype=torch.float64) + 3
    a = torch.randn(1, 2, 1, 1, generator=g, dtype=torch.float64)
    want = sink_grad(o, d_o, lse, a)
    got = sink_grad(o.half(), d_o.half(), lse.float(), a.float())
    assert torch.isfinite(got).all(), got
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=0)
