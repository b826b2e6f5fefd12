"""Single-device attention with an optional sink: the reference every CP result is checked against.

Plain torch ops, so autograd gives every gradient (q, k, v, the offset, the bias) without any
hand-written backward; accumulation runs in fp32 for bf16/fp16 and in fp64 for fp64 inputs.
Positions of queries and keys both start at 0 (top-left alignment when ``s_q != s_kv``).
"""
from __future__ import annotations

import torch

from .options import (AttnSpec, QKVFormat, accum_dtype, check_bias, check_docs, check_offset, check_qkv, check_scale,
                      make_spec)
from .sink import sink_logits


def doc_ids(spec: AttnSpec, device=None):
    """The document of each token of a thd pack (``[t]``); None when the spec has no documents."""
    if not spec.docs:
        return None
    return torch.repeat_interleave(torch.arange(len(spec.docs), device=device), torch.tensor(spec.docs, device=device))


def attention(q, k, v, softmax_offset=None, *, softmax_type="vanilla", mask="no_mask", window=None,
              bias=None, scale=None, qkv_format="bshd", cu_seqlens=None, return_lse=False):
    """Attention over the whole sequence on one device.

    q is ``[b, s, h, d]`` (bshd) or ``[s, b, h, d]`` (sbhd); k and v have ``g`` heads, ``h % g == 0``.
    ``softmax_type``: ``vanilla`` (no sink), ``off-by-one`` (sink logit fixed at 0) or ``learnable``
    (``softmax_offset`` of shape ``[1, h, 1, 1]``, any float dtype: a bf16/fp16 offset is used in
    the accumulation dtype and its gradient comes back in bf16/fp16). ``window=(left, right)``: key j is visible to
    query i when ``i - left <= j <= i + right``, -1 unbounded. ``bias`` is added after scaling.
    Returns ``out`` in q's layout and dtype, and with ``return_lse`` also ``lse`` ``[b, h, s_q]``
    (fp32, or fp64 for fp64 inputs; sink included).
    ``qkv_format="thd"``: q, k, v are one pack ``[t, h, d]`` of documents whose boundaries
    ``cu_seqlens`` gives (``[0, end_0, ..., t]``); each document attends only to itself, the mask
    and window apply within it, and ``lse`` is ``[1, h, t]``.
    """
    spec = make_spec(softmax_type, mask, window, qkv_format, cu_seqlens)
    dims = check_qkv(q, k, v, spec.qkv_format)
    check_docs(spec, dims.s_q, dims.s_kv)
    thd = spec.qkv_format is QKVFormat.THD
    if thd:
        if bias is not None:
            raise ValueError("bias is not supported with qkv_format='thd'; use bshd or sbhd")
        q, k, v = (x.unsqueeze(0) for x in (q, k, v))
        spec = spec.batched()
    check_offset(softmax_offset, spec.softmax_type, dims.h, q.device)
    check_bias(bias, dims.b, dims.h, dims.s_q, dims.s_kv, q.device)
    scale = check_scale(scale, dims.d)

    fmt, acc = spec.qkv_format, accum_dtype(q.dtype)
    qh = fmt.to_bhsd(q).to(acc).unflatten(1, (dims.g, dims.h // dims.g))  # [b, g, r, s_q, d]
    kh, vh = fmt.to_bhsd(k).to(acc), fmt.to_bhsd(v).to(acc)                # [b, g, s_kv, d]
    scores = torch.einsum("bgrqd,bgkd->bgrqk", qh, kh).flatten(1, 2) * scale
    if bias is not None:
        scores = scores + bias.to(acc)

    visible = spec.band.mask(dims.s_q, dims.s_kv, q.device)
    doc = doc_ids(spec, q.device)
    if doc is not None:
        same_doc = doc[:, None] == doc[None, :]
        visible = same_doc if visible is None else visible & same_doc
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    # A row no key reaches (masked whole, or a bias of -inf on every key: a padding row) gets harmless
    # finite scores and lse -inf; its probabilities are zeroed below. Left at -inf, logsumexp's
    # backward would put NaN in its gradients (-inf - -inf) and, through dk, in every row's.
    # (Only a mask or a bias can empty a row: without either, no pass over the scores for it.)
    empty = None if visible is None and bias is None else torch.isneginf(scores).all(-1, keepdim=True)
    if empty is not None:                                                   # [b, h, s_q, 1]
        scores = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, dim=-1)                                   # [b, h, s_q]
    if empty is not None:
        lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    sink = sink_logits(spec.softmax_type, softmax_offset, dims.h, q.device)   # bf16/fp16: used in fp32 or fp64
    if sink is not None:   # a head whose sink is -inf has none (logaddexp(-inf, -inf)'s backward is NaN)
        a = sink.reshape(1, -1, 1).to(acc)
        off = torch.isneginf(a)
        lse = torch.where(off, lse, torch.logaddexp(lse, a.masked_fill(off, 0.0)))
    lse_finite = lse.masked_fill(lse == float("-inf"), 0.0)
    probs = torch.exp(scores - lse_finite.unsqueeze(-1))
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs.unflatten(1, (dims.g, dims.h // dims.g)), vh)
    out = fmt.from_bhsd(out.flatten(1, 2)).to(q.dtype)
    if thd:
        out = out.squeeze(0)
    return (out, lse) if return_lse else out
