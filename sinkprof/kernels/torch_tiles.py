"""The torch tile kernel: explicit math in the accumulator dtype, any dtype, any device.

It is the CPU backend, the exact fp64 backend of the checks, and the fallback of the GPU backends
for tiles they cannot express.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..options import Band, SinkStrategy, accum_dtype
from ..sink import sink_grad
from .base import TileByTile, TileGrads, deliver


class TorchTiles(TileByTile):
    """Explicit math in the accumulator dtype: any dtype, any device, exact in fp64."""

    name = "torch"
    sink_strategy = SinkStrategy.STEP0      # the faster one here (docs/benchmarks.md)

    @staticmethod
    def _scores(q, k, band: Band, bias, scale: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        acc = accum_dtype(q.dtype)
        g = k.shape[1]
        qg = q.to(acc).unflatten(1, (g, q.shape[1] // g))
        scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, k.to(acc)).flatten(1, 2) * scale
        if bias is not None:
            scores = scores + bias.to(acc)
        visible = band.mask(q.shape[2], k.shape[2], q.device)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return scores, visible

    @staticmethod
    def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        finite = lse.masked_fill(lse == float("-inf"), 0.0)
        return torch.exp(scores - finite.unsqueeze(-1))

    def forward(self, q, k, v, band, sink, bias, scale, *, out=None, lse=None):
        return deliver(*self._forward(q, k, v, band, sink, bias, scale), out, lse)

    def _forward(self, q, k, v, band, sink, bias, scale):
        scores, _ = self._scores(q, k, band, bias, scale)
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
        scores, _ = self._scores(q, k, band, bias, scale)
        probs = self._probs(scores, lse)
        dout = grad_out.to(acc)
        d = (dout * o.to(acc)).sum(-1, keepdim=True)
        dp = torch.einsum("bgrqd,bgkd->bgrqk", dout.unflatten(1, (g, -1)), v.to(acc)).flatten(1, 2)
        ds = probs * (dp - d)
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
