"""The sink math: merge, fold and the sink gradient, against direct formulas in fp64."""
import torch

from sinkprof.sink import fold_, merge_, sink_grad

NEG_INF = float("-inf")


def _attn(scores, v):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v, lse


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    full_o, full_lse = _attn(scores, v)
    o_acc = torch.zeros(2, 3, 5, 4, dtype=torch.float64)
    lse_acc = torch.full((2, 3, 5), NEG_INF, dtype=torch.float64)
    for part in (slice(0, 3), slice(3, 8)):
        o, lse = _attn(scores[..., part], v[:, :, part])
        merge_(o_acc, lse_acc, o, lse)
    assert torch.allclose(o_acc, full_o, atol=1e-14, rtol=0)
    assert torch.allclose(lse_acc, full_lse, atol=1e-14, rtol=0)


def test_merge_keeps_empty_rows_finite():
    o_acc = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    lse_acc = torch.full((1, 1, 2), NEG_INF, dtype=torch.float64)
    merge_(o_acc, lse_acc, torch.zeros(1, 1, 2, 3, dtype=torch.float64), torch.full((1, 1, 2), NEG_INF, dtype=torch.float64))
    assert torch.equal(o_acc, torch.zeros_like(o_acc))
    assert torch.isneginf(lse_acc).all()
    o = torch.ones(1, 1, 2, 3, dtype=torch.float64)
    merge_(o_acc, lse_acc, o, torch.tensor([[[0.5, NEG_INF]]], dtype=torch.float64))
    assert torch.equal(o_acc[0, 0, 0], torch.ones(3, dtype=torch.float64))
    assert torch.equal(o_acc[0, 0, 1], torch.zeros(3, dtype=torch.float64))


def test_fold_equals_an_extra_softmax_column_with_zero_value():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    a = torch.randn(1, 3, 1, 1, generator=g, dtype=torch.float64) * 5
    with_col = torch.cat([scores, a.expand(2, 3, 5, 1)], -1)
    expected = torch.softmax(with_col, -1)[..., :-1] @ v
    o, lse = _attn(scores, v)
    out = torch.empty_like(o)
    fold_(out, o, lse, a)
    assert torch.allclose(out, expected, atol=1e-14, rtol=0)
    assert torch.allclose(lse, torch.logsumexp(with_col, -1), atol=1e-14, rtol=0)


def test_fold_on_an_empty_row_gives_zero_output_and_lse_equal_to_the_sink():
    o = torch.zeros(1, 2, 1, 3, dtype=torch.float64)
    lse = torch.full((1, 2, 1), NEG_INF, dtype=torch.float64)
    a = torch.tensor([1.5, -7.0], dtype=torch.float64).view(1, 2, 1, 1)
    out = torch.full_like(o, 7.0)
    fold_(out, o, lse, a)
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
