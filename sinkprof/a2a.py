"""a2a (Ulysses) re-layout: trade a sequence shard of every head for more sequence of fewer heads
(docs/design.md, section 6).

Inside a group of A ranks, each holding its load-balanced shard (world chunks w and 2W-1-w),
``scatter_heads`` gives every member head group i (of A) for the rows of the whole group. Those
rows are exactly the load-balanced shard of the group in a ring of groups: with world chunks of c
rows, group o holds outer chunks o and 2O-1-o of A*c rows each. So a2a is this re-layout around a
one-rank "ring" (``SoloCommunicator``), and a2a+p2p is the same re-layout around a real ring of groups.

A thd pack is cut per document (each document into 2W chunks, the local shard holding a chunk
pair of every document, document after document): the re-layout is then the same, document by
document, with each document's own chunk size (``chunks``: one per document, one for a sequence).

Both functions are autograd-aware: the backward of one is the other (once: no double backward).
"""
from __future__ import annotations

import torch

from .dist import Communicator, differentiable_once


def join_outer(pieces: list, seq_dim: int, chunks: tuple[int, ...]) -> torch.Tensor:
    """The group's rows in outer-shard order from the members' local shards (inner rank order);
    ``chunks``: the members' rows per chunk of each document.

    Member i's first chunk is world chunk oA+i, its second 2W-1-(oA+i): first halves ascend with
    i, second halves descend.
    """
    parts, at = [], 0
    for c in chunks:
        parts += [p.narrow(seq_dim, at, c) for p in pieces]
        parts += [p.narrow(seq_dim, at + c, c) for p in reversed(pieces)]
        at += 2 * c
    return torch.cat(parts, dim=seq_dim)


def split_outer(y: torch.Tensor, members: int, seq_dim: int, chunks: tuple[int, ...]) -> list:
    """Inverse of ``join_outer``: member i's local shard rows out of the group's rows."""
    mine: list = [[] for _ in range(members)]
    at = 0
    for c in chunks:
        half = members * c
        for i in range(members):
            mine[i] += [y.narrow(seq_dim, at + i * c, c), y.narrow(seq_dim, at + half + (members - 1 - i) * c, c)]
        at += 2 * half
    return [torch.cat(parts, dim=seq_dim) for parts in mine]


def _scatter(x: torch.Tensor, comm: Communicator, seq_dim: int, head_dim: int, chunks, phase: str) -> torch.Tensor:
    a = comm.size
    inp = x.unflatten(head_dim, (a, x.shape[head_dim] // a)).movedim(head_dim, 0).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, phase, "a2a scatter heads")
    return join_outer(list(out.unbind(0)), seq_dim, chunks)


def _gather(y: torch.Tensor, comm: Communicator, seq_dim: int, head_dim: int, chunks, phase: str) -> torch.Tensor:
    inp = torch.stack(split_outer(y, comm.size, seq_dim, chunks))
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, phase, "a2a gather heads")
    return out.movedim(0, head_dim).flatten(head_dim, head_dim + 1)


class ScatterHeads(torch.autograd.Function):
    """Local shard, all heads -> the group's rows, this member's head group."""

    @staticmethod
    def forward(ctx, x, comm, seq_dim, head_dim, chunks):
        ctx.args = (comm, seq_dim, head_dim, chunks)
        return _scatter(x, comm, seq_dim, head_dim, chunks, "fwd")

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        return _gather(grad, *ctx.args, "bwd"), None, None, None, None


class GatherHeads(torch.autograd.Function):
    """The group's rows, this member's head group -> local shard, all heads."""

    @staticmethod
    def forward(ctx, y, comm, seq_dim, head_dim, chunks):
        ctx.args = (comm, seq_dim, head_dim, chunks)
        return _gather(y, comm, seq_dim, head_dim, chunks, "fwd")

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        return _scatter(grad, *ctx.args, "bwd"), None, None, None, None
