"""a2a and a2a+p2p: the a2a re-layout inside an inner group around the p2p ring of an outer group
(docs/design.md, section 6).

With an inner group of A ranks and an outer ring of O groups (A*O ranks, inner groups on
consecutive ranks, the fast links; ``check_grid`` checks groups a caller made the same way),
each rank gathers head group i of the inner group's rows, runs the ring over the outer group on
those heads with the sink sliced to them, and sends the output back. Plain a2a is O = 1 (the
ring is one local tile); plain p2p is A = 1.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .a2a import GatherHeads, ScatterHeads
from . import faults
from .dist import Communicator, SoloCommunicator
from .options import CPOptions, check_a2a_size
from .ring import P2PAttention, stacked


class CPGroups:
    """The inner (a2a) and outer (ring) groups of this rank."""

    def __init__(self, inner, outer):
        self.inner, self.outer = inner, outer


_groups: dict = {}


def split_groups(group, a2a_size: int, timeout: float) -> CPGroups:
    """Split ``group`` (default: world) into inner groups of ``a2a_size`` consecutive ranks and the
    outer rings that link equal inner ranks. Every rank must call this in the same order."""
    base = group if group is not None else dist.group.WORLD
    key = (base, a2a_size, timeout)
    if key in _groups:
        return _groups[key]
    ranks = dist.get_process_group_ranks(base)
    world = len(ranks)
    check_a2a_size(a2a_size, world)
    outer_size = world // a2a_size
    me = dist.get_rank()
    inner = outer = None
    for o in range(outer_size):  # new_group is collective: every rank creates every group
        members = ranks[o * a2a_size:(o + 1) * a2a_size]
        g = dist.new_group(members) if a2a_size > 1 else None
        if me in members:
            inner = Communicator(g, timeout) if a2a_size > 1 else SoloCommunicator()
    for i in range(a2a_size):
        members = ranks[i::a2a_size]
        g = dist.new_group(members) if outer_size > 1 else None
        if me in members:
            outer = Communicator(g, timeout) if outer_size > 1 else SoloCommunicator()
    _groups[key] = CPGroups(inner, outer)
    return _groups[key]


def check_grid(a2a_group, p2p_group) -> None:
    """The groups of ``group=(a2a_group, p2p_group)``, checked on this rank alone (no message): they
    must split the CP group as ``split_groups`` splits it, so that the shard a rank holds (a2a
    rank i of ring rank o holds shard ``o * A + i``, A the a2a group's size: ``join_outer`` puts the
    a2a group's rows in that order) is its position in the CP group. That is: this rank is in
    both; the a2a group's ranks step by one stride t (consecutive ranks: t = 1) and the ring's by
    A * t (they then meet in this rank only, and the CP group is the A * O ranks r, r + t, ...)."""
    me = dist.get_rank()
    inner, outer = dist.get_process_group_ranks(a2a_group), dist.get_process_group_ranks(p2p_group)
    a, o = len(inner), len(outer)
    form = f"group=(a2a_group, p2p_group) (the a2a group holds ranks {inner}, the p2p group ranks {outer})"
    shared = sorted(set(inner) & set(outer))
    if shared != [me]:
        raise ValueError(f"{form}: the two groups share ranks {shared}; they must meet in this rank ({me}) only: "
                         f"the a2a group splits the heads, the p2p group links one rank of each a2a group")
    i, r = inner.index(me), outer.index(me)
    t = inner[1] - inner[0] if a > 1 else None
    steps_in = {y - x for x, y in zip(inner, inner[1:])}
    steps_out = {y - x for x, y in zip(outer, outer[1:])}
    if len(steps_in) > 1 or len(steps_out) > 1 or (a > 1 and o > 1 and steps_out != {a * t}):
        cp = a * o
        raise ValueError(
            f"{form}: rank {me} is rank {i} of its a2a group and rank {r} of its ring, so cp_attention reads its "
            f"shard as shard {r} * {a} + {i} = {r * a + i} of the sequence (sinkprof.shard(x, {cp}, {r * a + i}, "
            f"...)), which must be its position in the CP group: the groups must split the CP group as "
            f"a2a_size={a} does, a2a groups of {a} ranks in equal steps (consecutive ranks, such as "
            f"{list(range(a))}) and rings that link the ranks at one position of every a2a group (steps of "
            f"{a} times the a2a groups' step, such as {list(range(0, cp, a))}); build them so, or pass "
            f"group=cp_group with a2a_size={a}")


def hierarchical_attention(q, k, v, offset: Optional[torch.Tensor], bias: Optional[torch.Tensor], opts: CPOptions,
                           groups: CPGroups):
    """Attention on this rank's load-balanced shard (the same layout as p2p) through a2a + ring."""
    inner, outer = groups.inner, groups.outer
    fmt = opts.spec.qkv_format
    sd, hd = fmt.seq_dim, 2
    h = q.shape[hd]
    members = inner.size
    if members == 1:
        return P2PAttention.apply(q, k, v, offset, bias, opts, outer)
    per = h // members
    mine = slice(inner.rank * per, (inner.rank + 1) * per)
    world = members * outer.size
    chunks = opts.spec.chunks(q.shape[sd] * world, world)
    q_o = ScatterHeads.apply(q, inner, sd, hd, chunks)
    kv_o = ScatterHeads.apply(stacked(k, v, sd), inner, sd, hd + 1, chunks)   # a row's K beside its V
    sink_heads = faults.active.sink_heads(mine, per)
    offset_o = offset[:, sink_heads] if offset is not None else None
    bias_o = bias[:, mine] if bias is not None and bias.shape[1] != 1 else bias
    out_o = P2PAttention.apply(q_o, *kv_o.unbind(sd + 1), offset_o, bias_o, opts, outer)   # the ring keeps kv_o
    return GatherHeads.apply(out_o, inner, sd, hd, chunks)
