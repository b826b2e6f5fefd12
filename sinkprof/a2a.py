"""a2a (Ulysses) re-layout: trade a sequence shard of every head for more sequence of fewer heads
(docs/design.md, section 6).

Inside a group of A ranks, each holding its load-balanced shard (world chunks w and 2W-1-w),
``scatter_heads`` gives every member head group i (of A) for the rows of the whole group. Those
rows are exactly the load-balanced shard of the group in a ring of groups: with world chunks of c
rows, group o holds outer chunks o and 2O-1-o of A*c rows each. So a2a is this re-layout around a
one-rank "ring" (``SoloCommunicator``), and a2a+p2p is the same re-layout around a real ring of groups.

Both functions are autograd-aware: the backward of one is the other.
"""
from __future__ import annotations

import torch

from .dist import Communicator


def join_outer(pieces: list, seq_dim: int) -> torch.Tensor:
    """The group's rows in outer-shard order from the members' local shards (inner rank order).

    Member i's first chunk is world chunk oA+i, its second 2W-1-(oA+i): first halves ascend with
    i, second halves descend.
    """
    c = pieces[0].shape[seq_dim] // 2
    firsts = [p.narrow(seq_dim, 0, c) for p in pieces]
    seconds = [p.narrow(seq_dim, c, c) for p in reversed(pieces)]
    return torch.cat(firsts + seconds, dim=seq_dim)


def split_outer(y: torch.Tensor, members: int, seq_dim: int) -> list:
    """Inverse of ``join_outer``: member i's local shard rows out of the group's rows."""
    half = y.shape[seq_dim] // 2
    c = half // members
    return [torch.cat([y.narrow(seq_dim, i * c, c), y.narrow(seq_dim, half + (members - 1 - i) * c, c)], dim=seq_dim)
            for i in range(members)]


def _scatter(x: torch.Tensor, comm: Communicator, seq_dim: int, head_dim: int, phase: str) -> torch.Tensor:
    a = comm.size
    inp = x.unflatten(head_dim, (a, x.shape[head_dim] // a)).movedim(head_dim, 0).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, phase, "a2a scatter heads")
    return join_outer(list(out.unbind(0)), seq_dim)


def _gather(y: torch.Tensor, comm: Communicator, seq_dim: int, head_dim: int, phase: str) -> torch.Tensor:
    inp = torch.stack(split_outer(y, comm.size, seq_dim))
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, phase, "a2a gather heads")
    return out.movedim(0, head_dim).flatten(head_dim, head_dim + 1)


class ScatterHeads(torch.autograd.Function):
    """Local shard, all heads -> the group's rows, this member's head group."""

    @staticmethod
    def forward(ctx, x, comm, seq_dim, head_dim):
        ctx.args = (comm, seq_dim, head_dim)
        return _scatter(x, comm, seq_dim, head_dim, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, *ctx.args, "bwd"), None, None, None


class GatherHeads(torch.autograd.Function):
    """The group's rows, this member's head group -> local shard, all heads."""

    @staticmethod
    def forward(ctx, y, comm, seq_dim, head_dim):
        ctx.args = (comm, seq_dim, head_dim)
        return _gather(y, comm, seq_dim, head_dim, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, *ctx.args, "bwd"), None, None, None
