"""The sink math, in one place (docs/design.md, section 2).

Layout here: ``o`` is ``[b, h, s, d]`` (any strides), ``lse`` is ``[b, h, s]`` in natural log,
the sink ``a`` is ``[1, h, 1, 1]``. All arithmetic runs in the accumulators' dtype (fp32, or fp64
for fp64 runs). A row that sees no key has ``lse = -inf`` and ``o = 0``; every function here keeps
that state finite (no ``-inf - -inf``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .options import SoftmaxType

NEG_INF = float("-inf")


def sink_logits(softmax_type: SoftmaxType, offset: Optional[torch.Tensor], heads: int,
                device) -> Optional[torch.Tensor]:
    """The sink logit per query head as ``[1, h, 1, 1]``: the offset, zeros, or None for vanilla."""
    if softmax_type is SoftmaxType.LEARNABLE:
        return offset
    if softmax_type is SoftmaxType.OFF_BY_ONE:
        return torch.zeros(1, heads, 1, 1, dtype=torch.float32, device=device)
    return None


def _as_rows(sink: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, h, 1, 1]`` -> ``[1, h, 1]``, broadcastable against ``lse``."""
    return sink.reshape(1, -1, 1).to(dtype)


def _fused(acc_dtype: torch.dtype, *tensors: torch.Tensor):
    """The one-pass CUDA kernels of ``fused.py`` when they can take these tensors, else None."""
    if not tensors[0].is_cuda:
        return None
    from . import fused
    return fused if fused.usable(acc_dtype, *tensors) else None


def merge_(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *,
           into: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None) -> None:
    """Add a partial result over a disjoint key set to the merged result so far.

    The new part's weight is ``exp(lse - lse') = sigmoid(lse - lse_acc)``; ``lse_acc`` is updated
    in place. The merged ``o`` goes to ``into`` (any dtype: the output buffer when this is the
    rows' last part), else back into ``o_acc``; ``o_acc`` itself may be in any dtype (the rows'
    first part, still in the output buffer). With ``sink``, the sink is folded in as well (the
    rows' last part under post-merge), so the output is written once. On CUDA this is one fused
    kernel; the torch form below is the reference and the CPU path.
    """
    fused = _fused(lse_acc.dtype, o_acc, o, into if into is not None else o_acc)
    if fused is not None:
        fused.merge_(o_acc, lse_acc, o, lse, into=into, sink=sink)
        return
    diff = lse.to(lse_acc.dtype) - lse_acc
    diff.nan_to_num_(nan=NEG_INF)                 # both rows empty: keep the accumulator as it is
    weight = torch.sigmoid(diff).unsqueeze(-1)
    torch.logaddexp(lse_acc, lse.to(lse_acc.dtype), out=lse_acc)
    if into is None and sink is None and o_acc.dtype == lse_acc.dtype:
        o_acc.lerp_(o.to(o_acc.dtype), weight)    # (1 - w) o_acc + w o, exact at w = 0 and w = 1
        return
    merged = torch.lerp(o_acc.to(lse_acc.dtype), o.to(lse_acc.dtype), weight)
    if sink is not None:
        a = _as_rows(sink, lse_acc.dtype)
        merged.mul_(torch.sigmoid(lse_acc - a).unsqueeze(-1))
        lse_acc.copy_(torch.logaddexp(lse_acc, a))
    (o_acc if into is None else into).copy_(merged)


def fold_(out: torch.Tensor, o_acc: torch.Tensor, lse_acc: torch.Tensor, sink: Optional[torch.Tensor]) -> None:
    """Write the merged result into ``out`` (the output dtype), folding the sink in once if given.

    ``lse' = logaddexp(lse, a)`` and ``o' = o * sigmoid(lse - a)`` (0 for an empty row); the
    product is written straight into ``out``, so folding costs no extra pass over ``o``.
    """
    if sink is None:
        out.copy_(o_acc)
        return
    fused = _fused(lse_acc.dtype, o_acc, out)
    if fused is not None:
        fused.fold_(out, o_acc, lse_acc, sink)
        return
    a = _as_rows(sink, lse_acc.dtype)
    out.copy_(o_acc.to(lse_acc.dtype) * torch.sigmoid(lse_acc - a).unsqueeze(-1))
    lse_acc.copy_(torch.logaddexp(lse_acc, a))


def delta(o: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FlashAttention's ``D = rowsum(dO * o)`` as ``[b, h, s]``, summed in ``dtype``.

    The product stays in the inputs' dtype (one pass, no fp32 copies of o and dO: this is most of
    the post-merge backward's extra cost); the sum accumulates in ``dtype``.
    """
    return (grad_out * o.to(grad_out.dtype)).sum(-1, dtype=dtype)


def sink_grad(o: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """``d a_h = -sum_rows exp(a_h - lse') * D`` over the rows given, as ``[1, h, 1, 1]`` fp32/fp64.

    ``o`` and ``lse`` must be the final, sink-inclusive results of those rows. A row's heads are
    query heads, so under GQA each sink still sums only its own head's rows.
    """
    dtype = lse.dtype
    fused = _fused(dtype, o, grad_out)
    if fused is not None:  # one pass for the row terms, one sum
        return fused.sink_grad_rows(o, grad_out, lse, sink).sum(dim=(0, 2)).reshape(1, -1, 1, 1).to(sink.dtype)
    weight = torch.exp(_as_rows(sink, dtype) - lse)
    grad = -(weight * delta(o, grad_out, dtype)).sum(dim=(0, 2))
    return grad.reshape(1, -1, 1, 1).to(sink.dtype)
