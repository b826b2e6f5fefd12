"""The torch tile kernel: explicit math in the accumulator dtype, any dtype, any device.

It is the CPU backend, the exact fp64 backend of the checks, and the fallback of the GPU backends
for tiles they cannot express.
"""
from __future__ import annotations

import torch

from ..options import Band, SinkStrategy, accum_dtype
from ..sink import sink_grad
from .base import TileByTile, TileGrads, deliver


class TorchTiles(TileByTile):
    """Explicit math in the accumulator dtype: any dtype, any device, exact in fp64."""

    name = "torch"
    sink_strategy = SinkStrategy.STEP0      # the faster one here (docs/benchmarks.md)

    @staticmethod
    def _scores(q, k, band: Band, bias, scale: float) -> torch.Tensor:
        """The tile's scaled, biased and masked scores: one tile-sized tensor, built in place."""
        acc = accum_dtype(q.dtype)
        g = k.shape[1]
        qg = q.to(acc).unflatten(1, (g, q.shape[1] // g))
        scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, k.to(acc)).flatten(1, 2).mul_(scale)
        if bias is not None:
            scores.add_(bias.to(acc))   # rounded to the accumulator first, as the reference does
        visible = band.mask(q.shape[2], k.shape[2], q.device)
        if visible is not None:
            scores.masked_fill_(~visible, float("-inf"))
        return scores

    @staticmethod
    def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The probabilities, in place of ``scores`` (so a tile holds one score-sized tensor, not two)."""
        finite = lse.masked_fill(lse == float("-inf"), 0.0)
        return scores.sub_(finite.unsqueeze(-1)).exp_()

    def forward(self, q, k, v, band, sink, bias, scale, *, out=None, lse=None):
        return deliver(*self._forward(q, k, v, band, sink, bias, scale), out, lse)

    def _forward(self, q, k, v, band, sink, bias, scale):
        scores = self._scores(q, k, band, bias, scale)
        lse = torch.logsumexp(scores, dim=-1)
        if sink is not None:
            lse = torch.logaddexp(lse, sink.reshape(1, -1, 1).to(lse.dtype))
        probs = self._probs(scores, lse)
        g = k.shape[1]
        o = torch.einsum("bgrqk,bgkd->bgrqd", probs.unflatten(1, (g, -1)), v.to(lse.dtype))
        return o.flatten(1, 2).to(q.dtype), lse

    def backward(self, q, k, v, o, grad_out, lse, band, sink, bias, scale):
        acc = lse.dtype
        g = k.shape[1]
        probs = self._probs(self._scores(q, k, band, bias, scale), lse)
        dout = grad_out.to(acc)
        d = (dout * o.to(acc)).sum(-1, keepdim=True)
        dp = torch.einsum("bgrqd,bgkd->bgrqk", dout.unflatten(1, (g, -1)), v.to(acc)).flatten(1, 2)
        ds = dp.sub_(d).mul_(probs)   # in place of dP: the backward holds two score-sized tensors
        ds_g, p_g = ds.unflatten(1, (g, -1)), probs.unflatten(1, (g, -1))
        dq = torch.einsum("bgrqk,bgkd->bgrqd", ds_g, k.to(acc)).flatten(1, 2) * scale
        dk = torch.einsum("bgrqk,bgrqd->bgkd", ds_g, q.to(acc).unflatten(1, (g, -1))) * scale
        dv = torch.einsum("bgrqk,bgrqd->bgkd", p_g, dout.unflatten(1, (g, -1)))
        d_bias = None
        if bias is not None:
            dims = [i for i in (0, 1) if bias.shape[i] == 1 and ds.shape[i] != 1]
            d_bias = ds.sum(dim=dims, keepdim=True) if dims else ds
        d_sink = sink_grad(o, grad_out, lse, sink) if sink is not None else None
        return TileGrads(dq, dk, dv, d_sink, d_bias)
