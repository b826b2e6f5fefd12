"""Tile kernels behind one interface (DESIGN.md section 5).

A tile is one rectangle of the attention matrix: ``q`` ``[b, h, n_q, d]`` against ``k``, ``v``
``[b, g, n_kv, d]`` (strided views are fine), with visibility given by a ``Band``. The forward
returns ``(o, lse)``; the backward takes the *given* ``lse`` and ``o`` (the final merged ones in a
ring) so it can be driven exactly like a fused kernel driven with merged stats. A tile given a
sink adds it to its softmax (forward) and returns its rows' sink gradient (backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from .options import Backend, Band, accum_dtype
from .sink import sink_grad


@dataclass
class TileGrads:
    dq: torch.Tensor                  # [b, h, n_q, d], accumulator dtype
    dk: torch.Tensor                  # [b, g, n_kv, d]
    dv: torch.Tensor                  # [b, g, n_kv, d]
    d_sink: Optional[torch.Tensor]    # [1, h, 1, 1] when the tile carries the sink
    d_bias: Optional[torch.Tensor]    # the bias tile's own shape when a bias is given


class TileKernel(Protocol):
    name: str

    def forward(self, q, k, v, band: Band, sink, bias, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (o ``[b, h, n_q, d]`` in q's dtype, lse ``[b, h, n_q]`` fp32/fp64, sink included)."""

    def backward(self, q, k, v, o, grad_out, lse, band: Band, sink, bias, scale: float) -> TileGrads:
        """Gradients of the tile's rows, recomputed with the given ``lse`` and ``o``."""


class TorchTiles:
    """Explicit math in the accumulator dtype: any dtype, any device, exact in fp64."""

    name = "torch"

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

    def forward(self, q, k, v, band, sink, bias, scale):
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


class BackendUnavailable(RuntimeError):
    """The requested tile backend cannot run here; the message says why."""


_cudnn_kernels: dict = {}


def cudnn_unavailable_reason(device) -> Optional[str]:
    """None when the cuDNN tiles can run on ``device``, else a sentence saying why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"cuDNN tiles need a CUDA device, got {device}"
    from .cudnn_tiles import unavailable_reason
    return unavailable_reason()


def get_kernel(backend: Backend, device) -> TileKernel:
    """The tile kernel for ``backend`` on ``device``: ``auto`` is cudnn on CUDA when it can run
    there, else torch. Explicit ``cudnn`` that cannot run raises with the reason."""
    backend = Backend.parse(backend, "backend")
    if backend is Backend.TORCH:
        return TorchTiles()
    device = torch.device(device)
    reason = cudnn_unavailable_reason(device)
    if reason is not None:
        if backend is Backend.CUDNN:
            raise BackendUnavailable(f"backend='cudnn' cannot run: {reason}; use backend='torch'")
        return TorchTiles()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cudnn_kernels:
        from .cudnn_tiles import CudnnTiles
        _cudnn_kernels[index] = CudnnTiles(index)
    return _cudnn_kernels[index]
