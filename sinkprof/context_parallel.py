"""``sinkprof.cp_attention``: context-parallel attention with a sink, on a load-balanced shard.

Validates the public arguments once, checks on the first call of each configuration that every
rank of the group passed the same ones (``agree``: one small all-gather), builds a ``CPOptions``
and hands the tensors to the module of the chosen communication scheme. The sink-gradient
contract (``ReplicatedGrad``) is in docs/design.md, section 5.
"""
from __future__ import annotations

import collections
import hashlib
import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist

from . import faults
from .dist import (DEFAULT_TIMEOUT_S, Communicator, SoloCommunicator, differentiable_once, gather_rows,
                   require_initialized)
from .hierarchical import CPGroups, check_grid, hierarchical_attention, split_groups
from .kernels import get_kernel
from .options import (CommType, CPOptions, KVSchedule, QKVFormat, SinkGrad, check_a2a_heads, check_a2a_size, check_bias,
                      check_docs, check_int, check_offset, check_qkv, check_runs, check_scale, check_sink_strategy,
                      check_timeout, make_spec)
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

    Every rank of the group must pass the same arguments (each its own shard). The first call
    of each configuration checks that (one small all-gather, and a host sync): the ranks compare
    the shapes and dtypes of q, k, v, the offset and the bias, every other argument but
    ``timeout`` and ``backend``, which tensors require grad, and the offset's values (a replicated
    parameter: compared on that first call only, since comparing them on every call would cost a
    sync each); a difference raises a ``ValueError`` on every rank, naming the first argument that
    differs and the ranks on each side. Later calls with a configuration already agreed on (the
    latest ``AGREED_MAX`` of each group) send nothing more. That first call cannot be captured in
    a CUDA graph: run each configuration once before capturing (the usual warm-up does).
    A rank that never arrives is a ``CommError`` after ``timeout`` seconds (1 to 365 days).

    ``group=(a2a_group, p2p_group)`` must split the CP group as ``a2a_size`` does: a2a groups of
    A ranks in equal steps (consecutive ranks, or every t-th) and rings that link the ranks at one
    position of every a2a group, in steps of A times that (for 4 ranks: a2a groups [0, 1] and
    [2, 3], rings [0, 2] and [1, 3]); the rank at position i of its a2a group and o of its ring
    then holds shard ``o * A + i``, its position in the CP group. Other groups are refused, naming
    ``group`` and the shard such a rank would have to hold.
    """
    check_types(timeout=timeout, a2a_size=a2a_size)
    spec = make_spec(softmax_type, mask, window, qkv_format, cu_seqlens, pack_layout)
    comm_type = CommType.parse(comm, "comm")
    strategy = None if sink_strategy is None else check_sink_strategy(sink_strategy)
    grad_contract = SinkGrad.parse(sink_grad, "sink_grad")
    schedule = KVSchedule.parse(kv_schedule, "kv_schedule")
    check_runs(spec.pack_layout, comm_type, schedule)
    dims = check_qkv(q, k, v, spec.qkv_format)
    shapes = (tuple(q.shape), tuple(k.shape))
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
    kernel = get_kernel(backend, q.device)
    opts = CPOptions(spec, check_scale(scale, dims.d), kernel, strategy or kernel.sink_strategy, grad_contract,
                     schedule)
    scope = Scope.of(comm_type, group, a2a_size, timeout)
    if scope.size > 1:
        agree(scope, configuration(opts, comm_type, a2a_size, shapes, q, k, v, softmax_offset, bias, scope),
              softmax_offset, timeout)
    # every rank passed the same arguments: the checks below fail on every rank or on none
    world = scope.size
    check_docs(spec, dims.s_q, dims.s_kv, world)
    spec_layout(spec, dims.s_q * world, world)   # the layout exists (zigzag: every document in 2 * cp chunks)
    full = dims.s_q * world
    check_bias(bias, dims.b, dims.h, full, full, q.device)
    groups = scope.groups(dims.h, dims.g, comm_type)
    # autograd cannot save a tensor made under torch.inference_mode; the ring saves the offset and the
    # bias for its backward, so such an argument is used as a copy (torch's own ops on it would save it too)
    saves = torch.is_grad_enabled()
    offset = softmax_offset
    if saves and offset is not None and offset.is_inference():
        offset = offset.clone()
    if saves and bias is not None and bias.is_inference():
        bias = bias.clone()
    if offset is not None:
        offset = ReplicatedGrad.apply(_at_least_fp32(offset), groups, opts, "sink gradient all-reduce")
    bias_given = bias
    if bias is not None:
        bias = ReplicatedGrad.apply(bias, groups, opts, "bias gradient all-reduce")
    out = hierarchical_attention(q, k, v, offset, bias, opts, groups)
    if out.requires_grad:
        for name, t in (("softmax_offset", softmax_offset), ("bias", bias_given)):
            if t is not None and not t.is_inference():
                out.register_hook(_unchanged(name, t, t._version))
    return out.squeeze(0) if thd else out


def _unchanged(name: str, t: torch.Tensor, version: int):
    """A hook on the output's gradient (it runs before any backward of the call, so before the
    ring unpacks what it saved): the backward needs the values of argument ``name`` (the offset,
    the bias: the tiles recompute their scores) that the forward used."""
    def check(grad):
        if t._version != version:
            raise RuntimeError(
                f"{name} was modified in place after cp_attention's forward and before its backward "
                f"(its version went from {version} to {t._version}): the backward needs the values the "
                "forward used. Change it after the backward (optimizer.step() after loss.backward()), or pass "
                f"cp_attention a copy ({name}.clone())")
        return grad
    return check


def _at_least_fp32(offset: torch.Tensor) -> torch.Tensor:
    """A bf16/fp16 offset (gpt-oss stores its sinks in bf16) as fp32: the sink math runs in fp32,
    and autograd returns the gradient in the offset's own dtype."""
    return offset.float() if offset.dtype in (torch.bfloat16, torch.float16) else offset


def check_types(*, timeout, a2a_size) -> None:
    """The types of the numeric arguments that only cp_attention takes (the window's and the
    scale's are the library's: ``options.parse_window``, ``options.check_scale``): a string or a
    bool is not taken for a number."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds, got {type(timeout).__name__}")
    check_timeout(timeout, "timeout")
    if a2a_size is not None:
        check_int(a2a_size, "a2a_size", what=" (ranks per a2a group)")


def _one_group(group, arg: str):
    """``group`` as a ProcessGroup this rank belongs to (None: the world), or a ValueError naming ``arg``."""
    require_initialized()
    if group is None:
        return dist.group.WORLD
    me = dist.get_rank()
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {me} is not a member of {arg}: torch.distributed.new_group gave this rank "
                         f"GroupMember.NON_GROUP_MEMBER; every rank that calls cp_attention must be in the group "
                         f"it passes")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{arg}={group!r} must be a torch.distributed ProcessGroup (None: the world), "
                         f"got {type(group).__name__}")
    ranks = dist.get_process_group_ranks(group)
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of {arg} (ranks {ranks}); every rank that calls cp_attention "
                         f"must be in the group it passes")
    return group


_grids: dict = {}   # the (a2a group, p2p group) pairs already checked (``check_grid``)


class Scope:
    """The groups one call runs on, found without sending anything: ``over``, the process groups
    the ranks' arguments are compared over (the CP group; the a2a then the p2p group of
    ``group=(a2a_group, p2p_group)``), and the (inner a2a, outer ring) ``CPGroups``, made after
    that comparison (``a2a_size`` splits the group with collective ``new_group`` calls)."""

    def __init__(self, over: tuple, sizes: tuple, groups: Optional[CPGroups] = None, split=None):
        self.over, self.sizes, self._groups, self._split = over, sizes, groups, split
        self.size = math.prod(sizes)   # the CP group's

    @classmethod
    def of(cls, comm_type: CommType, group, a2a_size: Optional[int], timeout: float) -> "Scope":
        if isinstance(group, (tuple, list)):
            if comm_type is not CommType.A2A_P2P:
                raise ValueError(f"group=(a2a_group, p2p_group) is the form of comm='a2a+p2p', not "
                                 f"comm={comm_type.value!r}: pass one ProcessGroup (None: the world)")
            if len(group) != 2:
                raise ValueError(f"group=(a2a_group, p2p_group) takes exactly two process groups, got {len(group)}")
            if a2a_size is not None:
                raise ValueError("comm='a2a+p2p' takes group=(a2a_group, p2p_group) or a2a_size, not both")
            pair = (_one_group(group[0], "group[0] (the a2a group)"),
                    _one_group(group[1], "group[1] (the p2p group)"))
            if pair not in _grids:
                check_grid(*pair)
                _grids[pair] = None
            inner, outer = (comm_for(g, timeout) for g in pair)
            return cls(pair, (inner.size, outer.size), CPGroups(inner, outer))
        base = _one_group(group, "group")
        comm = comm_for(base, timeout)
        over, sizes = (base,), (comm.size,)
        if comm_type is CommType.P2P:
            if a2a_size not in (None, 1):
                raise ValueError(f"a2a_size={a2a_size} only applies to comm='a2a+p2p'")
            return cls(over, sizes, CPGroups(SoloCommunicator(), comm))
        if comm_type is CommType.A2A:
            if a2a_size is not None and a2a_size != comm.size:
                raise ValueError(f"a2a_size={a2a_size}: comm='a2a' uses the whole group; use comm='a2a+p2p'")
            return cls(over, sizes, CPGroups(comm, SoloCommunicator()))
        if a2a_size is None:
            raise ValueError("comm='a2a+p2p' needs a2a_size (ranks per inner a2a group) or "
                             "group=(a2a_group, p2p_group)")
        return cls(over, sizes, split=(base, a2a_size, timeout))

    def groups(self, h: Optional[int] = None, g: Optional[int] = None,
               comm_type: Optional[CommType] = None) -> CPGroups:
        """The (inner, outer) groups; given the heads, the a2a group must split them (``A2AError``)."""
        if self._groups is None:
            group, a2a_size, timeout = self._split
            check_a2a_size(a2a_size, self.size, h, g)
            self._groups = split_groups(group, a2a_size, timeout)
        if h is not None:
            check_a2a_heads(h, g, self._groups.inner.size, self.size, comm_type)
        return self._groups


def cp_groups(comm_type: CommType, group, a2a_size: Optional[int], timeout: float) -> CPGroups:
    """The (inner a2a, outer ring) groups a comm type runs on; p2p and a2a are the degenerate splits."""
    return Scope.of(comm_type, group, a2a_size, timeout).groups()


# -- every rank passed the same arguments ---------------------------------------------------------

AGREED_MAX = 1024   # configurations a process remembers as agreed on, per group (the latest ones)
_agreed: dict = {}  # the process groups compared over -> {configuration: None}, oldest first


def configuration(opts: CPOptions, comm_type: CommType, a2a_size, shapes, q, k, v, offset, bias,
                  scope: Scope) -> tuple:
    """(argument, value) of everything the ranks of a call must agree on, in the order a
    difference is reported (the causes first); pure Python on shapes and flags."""
    spec = opts.spec
    grad = torch.is_grad_enabled()
    tensors = (q, k, v, offset, bias)
    return (
        ("comm", comm_type.value),
        ("a2a_size", a2a_size),
        ("group", scope.sizes),   # (the CP group's size), or (the a2a group's, the p2p group's)
        ("qkv_format", spec.qkv_format.value),
        ("q.dtype", str(q.dtype)),
        ("q.shape", shapes[0]),
        ("k.shape", shapes[1]),
        ("cu_seqlens", spec.cu_seqlens and tuple(spec.cu_seqlens)),
        ("pack_layout", spec.pack_layout.value),
        ("softmax_type", spec.softmax_type.value),
        ("softmax_offset", None if offset is None else (tuple(offset.shape), str(offset.dtype))),
        ("bias", None if bias is None else (tuple(bias.shape), str(bias.dtype))),
        ("mask", spec.mask.value),
        ("window", tuple(-1 if w is None else w for w in spec.window)),
        ("scale", opts.scale),
        ("sink_strategy", opts.sink_strategy.value),
        ("sink_grad", opts.sink_grad.value),
        ("kv_schedule", opts.kv_schedule.value),
        ("requires_grad (q, k, v, softmax_offset, bias)",
         tuple(grad and t is not None and t.requires_grad for t in tensors)),
    )


def _digest(value) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def agree(scope: Scope, config: tuple, offset, timeout: float) -> None:
    """Check that every rank of the call's groups passed ``config`` (and the same offset values),
    once per configuration and group; raise a ``ValueError`` on every rank otherwise. One
    all-gather of a row of ints over the CP group (two, over the a2a then the p2p group, for
    ``group=(a2a_group, p2p_group)``), before anything else of the call is sent; nothing at all
    for a configuration already agreed on, or a group of one."""
    if scope.size == 1:
        return
    key = tuple(value for _, value in config)
    seen = _agreed.setdefault(scope.over, collections.OrderedDict())
    if key in seen:
        seen.move_to_end(key)
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cp_attention's first call with these arguments compares them across the ranks (an "
                           "all-gather and a host sync), which a CUDA graph cannot capture: run the call once "
                           "with the same arguments (shapes, dtypes, options) before capturing")
    values = None if offset is None else tuple(offset.detach().double().cpu().flatten().tolist())
    named = (*config, ("softmax_offset values", values))
    names = [n for n, _ in named]
    row = [dist.get_rank(), *(_digest(value) for _, value in named)]
    what = "the check that every rank passed the same arguments"
    tables = []
    for n, (group, size) in enumerate(zip(scope.over, scope.sizes)):
        if n:   # the p2p group of the tuple form: each row with what its a2a group found
            row = row + list((tables and _verdict(tables[0], len(named))) or (-1, -1, -1))
        if size > 1:
            tables.append(gather_rows(group, row, timeout, what))
    found = _difference(tables, len(named))
    if found is not None:
        f, sides = found
        mine = dict(named)[names[f]]
        shown = repr(mine) if len(repr(mine)) <= 200 else repr(mine)[:200] + "..."
        raise ValueError(
            f"the ranks of cp_attention's group passed different {names[f]}: "
            + " vs ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in sides)
            + f" (this rank, {dist.get_rank()}, passed {shown}); every rank of the group must pass the same arguments, "
              f"each with its own shard of the same sequence")
    seen[key] = None
    if len(seen) > AGREED_MAX:
        seen.popitem(last=False)


def _verdict(table: list, fields: int) -> Optional[tuple]:
    """(the first field that differs, a rank on each side) of an a2a group's table, or None."""
    found = _difference([table], fields)
    return None if found is None else (found[0], found[1][0][0], found[1][1][0])


def _difference(tables: list, fields: int) -> Optional[tuple]:
    """(field, the ranks on each side) of the first argument the ranks differ in, or None. The
    a2a group's table is whole; the p2p group's rows also carry what their a2a groups found (a
    field and a rank on each side), so every rank of the grid learns every difference."""
    found = []
    for table in tables:
        rows = [row[:fields + 1] for row in table]
        for f in range(1, fields + 1):
            sides: dict = {}
            for row in rows:
                sides.setdefault(row[f], []).append(row[0])
            if len(sides) > 1:
                found.append((f - 1, list(sides.values())))
                break
        for row in table:
            if len(row) > fields + 1 and row[fields + 1] >= 0:
                found.append((row[fields + 1], [[row[fields + 2]], [row[fields + 3]]]))
    return min(found, key=lambda x: x[0]) if found else None


class ReplicatedGrad(torch.autograd.Function):
    """Identity forward; backward applies the ``sink_grad`` contract to a replicated tensor's
    gradient (each rank computed its own part): ``full`` all-reduces it over the CP group."""

    @staticmethod
    def forward(ctx, x, groups: CPGroups, opts: CPOptions, what: str):
        ctx.groups, ctx.opts, ctx.what = groups, opts, what
        return x.view_as(x)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        opts = ctx.opts
        if opts.sink_grad is SinkGrad.FULL and faults.active.reduces_replicated_grads():
            grad = grad.clone()
            for comm in (ctx.groups.inner, ctx.groups.outer):  # inner then outer: every CP rank once
                if comm.size > 1:
                    comm.all_reduce_(grad, ctx.what)
        return grad, None, None, None
