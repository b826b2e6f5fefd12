"""``sinkprof.cp_attention``: context-parallel attention with a sink, on a load-balanced shard.

Validates the public arguments once, builds a ``CPOptions`` and hands the tensors to the module
of the chosen communication scheme. The sink-gradient contract (``ReplicatedGrad``) is in
docs/design.md, section 5.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import faults
from .dist import DEFAULT_TIMEOUT_S, Communicator, SoloCommunicator
from .hierarchical import CPGroups, hierarchical_attention, split_groups
from .kernels import get_kernel
from .options import (BALANCED_RUNS, CommType, CPOptions, KVSchedule, PackLayout, QKVFormat, SinkGrad, check_bias,
                      check_docs, check_heads, check_offset, check_qkv, check_scale, check_sink_strategy, make_spec)
from .plan import spec_layout

_comms: dict = {}


def comm_for(group=None, timeout: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """One ``Communicator`` per (group, timeout), so message counts and ring neighbours are computed once.
    The key is the group object itself (the world's current one for None), so a re-initialised
    process group never meets a stale ``Communicator``."""
    key = (group if group is not None else dist.group.WORLD, timeout)
    if key not in _comms:
        _comms[key] = Communicator(group, timeout)
    return _comms[key]


def cp_attention(q, k, v, softmax_offset=None, *, group=None, comm="p2p", softmax_type="vanilla",
                 mask="no_mask", window=None, bias=None, scale=None, qkv_format="bshd", backend="auto",
                 sink_strategy=None, sink_grad="full", a2a_size: Optional[int] = None,
                 kv_schedule="auto", cu_seqlens=None, pack_layout="zigzag", timeout: float = DEFAULT_TIMEOUT_S):
    """Attention over a sequence split across the ranks of ``group`` (default: the world).

    q, k, v are this rank's load-balanced shards (``sinkprof.shard``: chunks r and 2cp-1-r);
    the output is in the same layout. ``softmax_offset`` (learnable) and ``bias`` (full sequence,
    ``[1|b, 1|h, S, S]``) are replicated on every rank. ``sink_strategy``: ``step0`` (the sink
    enters the step-0 tile) or ``post-merge`` (vanilla tiles, the sink folded once); None (the
    default) takes the backend's faster one, as measured on the H200 (docs/benchmarks.md): step0
    on fa4 (its sink costs nothing) and torch, post-merge on cudnn (its native sink costs 6-16% in
    the backward, 3x on windowed tiles).
    ``sink_grad``: ``full`` (every rank returns the whole-sequence gradient of the sink and bias)
    or ``partial`` (each rank returns its own part: its rows under p2p, its heads under a2a, both
    under a2a+p2p; sum over the CP group yourself).

    ``comm``: ``p2p`` (ring), ``a2a`` (Ulysses: needs h and g divisible by the group size) or
    ``a2a+p2p`` (a2a inside groups of ``a2a_size`` consecutive ranks, a ring across them; or pass
    ``group=(a2a_group, p2p_group)``).

    ``kv_schedule``: how the ring moves K/V and dK/dV (docs/design.md, section 5): ``ring``
    (every step forwards whole shards to the next rank), ``direct`` (each owner sends each rank
    exactly the rows its tiles read at the step that reads them, and the rows' dK/dV return to
    the owner; a sliding window moves halos only), ``allgather`` (each rank gets the rows of every
    shard its tiles read, then runs one step over them: each chunk meets all its keys in one kernel
    call, the fastest compute for short pieces such as a pack's documents, but nothing hides the
    transfer and each rank holds the K/V of every row it reads) or ``auto`` (whichever of ring and direct moves fewer
    bytes for this mask, window and cp; ``sinkprof.comm_bytes`` gives the bytes of each). It
    applies to the ring of p2p and a2a+p2p; plain a2a has none.

    Packed documents: ``qkv_format="thd"`` with q, k, v ``[t, h, d]`` (this rank's shard of the
    pack, ``sinkprof.shard(x, cp, rank, 0, cu_seqlens)``: chunks r and 2cp-1-r of every document)
    and ``cu_seqlens``, the boundaries ``[0, end_0, ..., T]`` of the whole pack (the same on every
    rank). Each document attends only to itself (mask and window per document, the sink once per
    row); every document's length must be a multiple of ``2 * cp`` (``sinkprof.pad_pack``).
    ``pack_layout="balanced"``: the shards are ``sinkprof.shard(x, cp, rank, 0, cu_seqlens,
    pack_layout="balanced")`` instead, each document in a few long pieces on a few ranks with the
    same tokens and causal work on every rank (docs/design.md, section 3), so every kernel call
    covers long stretches of its document; it runs under ``comm="p2p"`` with the ``allgather``
    K/V schedule (``auto`` takes it), and needs even document lengths and a pack of a multiple of
    ``2 * cp`` tokens.
    """
    spec = make_spec(softmax_type, mask, window, qkv_format, cu_seqlens, pack_layout)
    comm_type = CommType.parse(comm, "comm")
    strategy = None if sink_strategy is None else check_sink_strategy(sink_strategy)
    grad_contract = SinkGrad.parse(sink_grad, "sink_grad")
    schedule = KVSchedule.parse(kv_schedule, "kv_schedule")
    if spec.pack_layout is PackLayout.BALANCED and (
            comm_type is not CommType.P2P or schedule not in (KVSchedule.AUTO, KVSchedule.ALLGATHER)):
        raise ValueError(f"comm={comm_type.value!r}, kv_schedule={schedule.value!r}: {BALANCED_RUNS}")
    dims = check_qkv(q, k, v, spec.qkv_format)
    thd = spec.qkv_format is QKVFormat.THD
    if thd:   # a pack is one sequence of documents: b = 1, the same loops as bshd
        if bias is not None:
            raise ValueError("bias is not supported with qkv_format='thd' (a [1, h, T, T] bias over a pack defeats "
                             "packing); use bshd or sbhd")
        q, k, v = (x.unsqueeze(0) for x in (q, k, v))
        spec = spec.batched()
    if dims.s_q != dims.s_kv:
        raise ValueError(f"q has {dims.s_q} local rows and k has {dims.s_kv}: CP self-attention needs equal shards")
    if dims.s_q % 2:
        raise ValueError(f"the local shard has {dims.s_q} rows; a load-balanced shard has an even number "
                         f"(two chunks, see sinkprof.shard)")
    check_offset(softmax_offset, spec.softmax_type, dims.h, q.device)
    groups = cp_groups(comm_type, group, a2a_size, timeout)
    world = groups.inner.size * groups.outer.size
    check_docs(spec, dims.s_q, dims.s_kv, world)
    spec_layout(spec, dims.s_q * world, world)   # the layout exists (zigzag: every document in 2 * cp chunks)
    full = dims.s_q * world
    check_bias(bias, dims.b, dims.h, full, full, q.device)
    check_heads(dims.h, dims.g, groups.inner.size)
    kernel = get_kernel(backend, q.device)
    opts = CPOptions(spec, check_scale(scale, dims.d), kernel, strategy or kernel.sink_strategy, grad_contract,
                     schedule)
    if softmax_offset is not None:
        softmax_offset = ReplicatedGrad.apply(_at_least_fp32(softmax_offset), groups, opts, "sink gradient all-reduce")
    if bias is not None:
        bias = ReplicatedGrad.apply(bias, groups, opts, "bias gradient all-reduce")
    out = hierarchical_attention(q, k, v, softmax_offset, bias, opts, groups)
    return out.squeeze(0) if thd else out


def _at_least_fp32(offset: torch.Tensor) -> torch.Tensor:
    """A bf16/fp16 offset (gpt-oss stores its sinks in bf16) as fp32: the sink math runs in fp32,
    and autograd returns the gradient in the offset's own dtype."""
    return offset.float() if offset.dtype in (torch.bfloat16, torch.float16) else offset


def cp_groups(comm_type: CommType, group, a2a_size: Optional[int], timeout: float) -> CPGroups:
    """The (inner a2a, outer ring) groups a comm type runs on; p2p and a2a are the degenerate splits."""
    if comm_type is CommType.P2P:
        if a2a_size not in (None, 1):
            raise ValueError(f"a2a_size={a2a_size} only applies to comm='a2a+p2p'")
        return CPGroups(SoloCommunicator(), comm_for(group, timeout))
    if comm_type is CommType.A2A:
        if a2a_size is not None and a2a_size != comm_for(group, timeout).size:
            raise ValueError(f"a2a_size={a2a_size}: comm='a2a' uses the whole group; use comm='a2a+p2p'")
        return CPGroups(comm_for(group, timeout), SoloCommunicator())
    if isinstance(group, tuple):
        if len(group) != 2 or a2a_size is not None:
            raise ValueError("comm='a2a+p2p' takes group=(a2a_group, p2p_group) or a2a_size, not both")
        return CPGroups(comm_for(group[0], timeout), comm_for(group[1], timeout))
    if a2a_size is None:
        raise ValueError("comm='a2a+p2p' needs a2a_size (ranks per inner a2a group) or group=(a2a_group, p2p_group)")
    return split_groups(group, a2a_size, timeout)


class ReplicatedGrad(torch.autograd.Function):
    """Identity forward; backward applies the ``sink_grad`` contract to a replicated tensor's
    gradient (each rank computed its own part): ``full`` all-reduces it over the CP group."""

    @staticmethod
    def forward(ctx, x, groups: CPGroups, opts: CPOptions, what: str):
        ctx.groups, ctx.opts, ctx.what = groups, opts, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        opts = ctx.opts
        if opts.sink_grad is SinkGrad.FULL and faults.active.reduces_replicated_grads():
            grad = grad.clone()
            for comm in (ctx.groups.inner, ctx.groups.outer):  # inner then outer: every CP rank once
                if comm.size > 1:
                    comm.all_reduce_(grad, ctx.what)
        return grad, None, None, None
