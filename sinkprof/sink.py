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


def fused_for(acc_dtype: torch.dtype, *tensors: torch.Tensor):
    """The one-pass CUDA kernels of ``fused.py`` when they can take these tensors, else None."""
    if not tensors[0].is_cuda:
        return None
    from . import fused
    return fused if fused.usable(acc_dtype, *tensors) else None


def merge_parts_(o: torch.Tensor, lse: torch.Tensor, parts_o: torch.Tensor, parts_lse: torch.Tensor, *,
                 into: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None) -> None:
    """Merge partial results over disjoint key sets into the rows' result so far, in one pass.

    ``o``, ``lse``: the rows' result so far (``o`` in any dtype; ``lse`` in the accumulators' and
    updated in place); ``parts_o`` ``[n, b, h, s, d]``, ``parts_lse`` ``[n, b, h, s]``: n more
    partial results (n may be 0), ``-inf`` on rows a part does not cover, whose ``o`` is never
    read. With ``m = max`` of the lse's and weights ``w_i = exp(lse_i - m)``, the merged result is
    ``o' = sum w_i o_i / sum w_i`` and ``lse' = m + log sum w_i``; a row no part covers keeps
    ``o`` (0) and ``-inf``. ``o'`` goes to ``into`` (any dtype), else back into ``o``. With
    ``sink`` the sink is folded in as well, ``lse'' = logaddexp(lse', a)`` and
    ``o'' = o' * sigmoid(lse' - a)`` (0 for an empty row), so the output is written once. On CUDA
    this is one fused kernel; the torch form below is the reference and the CPU path.
    """
    dst = o if into is None else into
    fused = fused_for(lse.dtype, o, dst, *([parts_o] if len(parts_o) else []))
    if fused is not None:
        fused.merge_parts_(o, lse, parts_o, parts_lse, into=into, sink=sink)
        return
    acc = lse.dtype
    lses = torch.cat([lse.unsqueeze(0), parts_lse.to(acc)])
    top = lses.amax(0)
    ref = torch.where(torch.isneginf(top), 0.0, top)
    weights = torch.exp(lses - ref).unsqueeze(-1)              # 0 where a part does not cover the row
    merged = weights[0] * o.to(acc)
    for w, part in zip(weights[1:], parts_o):
        merged += torch.where(w > 0, w * part.to(acc), 0.0)   # a row a part does not cover is never read
    total = weights.sum(0)
    merged = torch.where(total > 0, merged / total, o.to(acc))
    merged_lse = torch.where(total.squeeze(-1) > 0, ref + torch.log(total.squeeze(-1)), NEG_INF)
    if sink is not None:   # a head whose sink is -inf has none: its rows keep o' and lse' (an empty row too)
        a = _as_rows(sink, acc)
        merged.mul_(torch.where(torch.isneginf(a), 1.0, torch.sigmoid(merged_lse - a)).unsqueeze(-1))
        merged_lse = torch.logaddexp(merged_lse, a)
    lse.copy_(merged_lse)
    dst.copy_(merged)


def delta(o: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FlashAttention's ``D = rowsum(dO * o)`` as ``[b, h, s]``, summed in ``dtype``.

    The product stays in the inputs' dtype where it cannot overflow (one pass, no fp32 copies of o
    and dO: this is most of the post-merge backward's extra cost; bf16 has fp32's range); fp16's,
    whose largest value is 65504 (``o`` and a loss-scaled ``dO`` of a few hundred each), is formed in
    ``dtype``. The sum accumulates in ``dtype``.
    """
    if grad_out.dtype == torch.float16:
        return (grad_out.to(dtype) * o.to(dtype)).sum(-1)
    return (grad_out * o.to(grad_out.dtype)).sum(-1, dtype=dtype)


def sink_grad(o: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """``d a_h = -sum_rows exp(a_h - lse') * D`` over the rows given, as ``[1, h, 1, 1]`` fp32/fp64.

    ``o`` and ``lse`` must be the final, sink-inclusive results of those rows. A row's heads are
    query heads, so under GQA each sink still sums only its own head's rows.
    """
    dtype = lse.dtype
    fused = fused_for(dtype, o, grad_out)
    if fused is not None:  # one pass for the row terms, one sum
        return fused.sink_grad_rows(o, grad_out, lse, sink).sum(dim=(0, 2)).reshape(1, -1, 1, 1).to(sink.dtype)
    weight = torch.where(torch.isneginf(lse), 0.0, torch.exp(_as_rows(sink, dtype) - lse))   # lse' >= a: -inf only
    grad = -(weight * delta(o, grad_out, dtype)).sum(dim=(0, 2))
    return grad.reshape(1, -1, 1, 1).to(sink.dtype)
