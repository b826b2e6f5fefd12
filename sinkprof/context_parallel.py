"""``sinkprof.cp_attention``: context-parallel attention with a sink, on a load-balanced shard.

Validates the public arguments once, builds a ``CPOptions`` and hands the tensors to the module
of the chosen communication scheme.
"""
from __future__ import annotations

from typing import Optional

import torch

from .dist import DEFAULT_TIMEOUT_S, Comm
from .kernels import get_kernel
from .options import (Comm as CommType, CPOptions, Fault, SinkGrad, SinkStrategy, check_bias, check_offset,
                      check_qkv, check_scale, make_spec)

_comms: dict = {}


def comm_for(group=None, timeout: float = DEFAULT_TIMEOUT_S) -> Comm:
    """One ``Comm`` per (group, timeout), so message counts and ring neighbours are computed once."""
    key = (id(group), timeout)
    if key not in _comms:
        _comms[key] = Comm(group, timeout)
    return _comms[key]


def cp_attention(q, k, v, softmax_offset=None, *, group=None, comm="p2p", softmax_type="vanilla",
                 mask="no_mask", window=None, bias=None, scale=None, qkv_format="bshd", backend="auto",
                 sink_strategy="step0", sink_grad="full", timeout: float = DEFAULT_TIMEOUT_S):
    """Attention over a sequence split across the ranks of ``group`` (default: the world).

    q, k, v are this rank's load-balanced shards (``sinkprof.shard``: chunks r and 2cp-1-r);
    the output is in the same layout. ``softmax_offset`` (learnable) and ``bias`` (full sequence,
    ``[1|b, 1|h, S, S]``) are replicated on every rank. ``sink_strategy``: ``step0`` (the sink
    enters the step-0 tile) or ``post-merge`` (vanilla tiles, the sink folded once).
    ``sink_grad``: ``full`` (every rank returns the whole-sequence gradient of the sink and bias)
    or ``partial`` (each rank returns its own rows' part; sum over the CP group yourself).
    """
    return _cp_attention(q, k, v, softmax_offset, group=group, comm=comm, softmax_type=softmax_type, mask=mask,
                         window=window, bias=bias, scale=scale, qkv_format=qkv_format, backend=backend,
                         sink_strategy=sink_strategy, sink_grad=sink_grad, timeout=timeout)


def _cp_attention(q, k, v, softmax_offset=None, *, group=None, comm="p2p", softmax_type="vanilla",
                  mask="no_mask", window=None, bias=None, scale=None, qkv_format="bshd", backend="auto",
                  sink_strategy="step0", sink_grad="full", timeout: float = DEFAULT_TIMEOUT_S,
                  fault: Optional[Fault] = None):
    """``cp_attention`` plus the faults ``sinkprof check`` injects."""
    spec = make_spec(softmax_type, mask, window, qkv_format)
    comm_type = CommType.parse(comm, "comm")
    strategy = SinkStrategy.parse(sink_strategy, "sink_strategy")
    if strategy is SinkStrategy.EVERY_TILE:
        raise ValueError("sink_strategy='every-tile' is the known bug (the sink counted once per tile); "
                         "use 'step0' or 'post-merge'")
    grad_contract = SinkGrad.parse(sink_grad, "sink_grad")
    dims = check_qkv(q, k, v, spec.qkv_format)
    if dims.s_q != dims.s_kv:
        raise ValueError(f"q has {dims.s_q} local rows and k has {dims.s_kv}: CP self-attention needs equal shards")
    if dims.s_q % 2:
        raise ValueError(f"the local shard has {dims.s_q} rows; a load-balanced shard has an even number "
                         f"(two chunks, see sinkprof.shard)")
    check_offset(softmax_offset, spec.softmax_type, dims.h, q.device)
    ring = comm_for(group, timeout)
    full = dims.s_q * ring.size
    check_bias(bias, dims.b, dims.h, full, full, q.device)
    opts = CPOptions(spec, check_scale(scale, dims.d), get_kernel(backend, q.device), strategy, grad_contract, fault)
    if comm_type is CommType.P2P:
        from .ring import P2PAttention
        return P2PAttention.apply(q, k, v, softmax_offset, bias, opts, ring)
    raise ValueError(f"comm={comm_type.value!r} is not available in this version; use comm='p2p'")
