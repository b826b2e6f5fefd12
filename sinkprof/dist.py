"""The communicator the library runs on: a CP process group seen as a ring, with timeouts.

- p2p messages (to the ring neighbours, or to any peer of the direct schedule), all-to-alls and
  all-reduces; every message is counted with its bytes per (phase, step, kind, peer) so the check
  can hold them to the plan's byte contract (``sinkprof.schedule``).
- Over NCCL the exchanges run on their own stream; over gloo CUDA tensors are staged through host
  memory (several ranks can share one GPU; correct but slow).
- Every wait has a timeout and turns a hang into a ``CommError`` that says which rank, case,
  phase and step it happened at (``where``). Starting the ranks is the tool's business
  (``sinkprof.tool.launcher``).
- ``gather_rows``: the small all-gather by which cp_attention's ranks compare their arguments.
- ``differentiable_once``: the backward of an autograd Function that communicates runs once; a
  double backward raises on every rank before anything is sent.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import profiling

DEFAULT_TIMEOUT_S = 120.0


class CommError(RuntimeError):
    """A collective or p2p exchange failed or timed out; the message says where."""


@dataclass
class Where:
    """What this rank is doing now, for hang reports. Updated at step boundaries (no I/O)."""

    case: str = "-"
    phase: str = "-"
    step: int = -1
    op: str = "-"

    def __str__(self) -> str:
        step = f" step {self.step}" if self.step >= 0 else ""
        return f"case {self.case}, {self.phase}{step}, {self.op}"


where = Where()


def require_initialized() -> None:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: run under torchrun, call "
                           "torch.distributed.init_process_group, or use `sinkprof check --ranks N`")


def wait_works(works, timeout: datetime.timedelta, what: str) -> None:
    """Wait for every work of ``works``, each for at most ``timeout``; a failure or a timeout is a
    ``CommError`` that says ``what`` was waited for and where (``where``)."""
    try:
        for w in works:
            if w.wait(timeout) is False:
                raise RuntimeError("wait returned False")
    except Exception as exc:  # gloo raises on timeout and on a dead peer
        raise CommError(f"rank {dist.get_rank()}: {what} failed or hung (timeout "
                        f"{timeout.total_seconds():g}s) at {where}: {exc}") from None


def gather_rows(group, row: list, timeout: float, what: str) -> list:
    """Every rank's ``row`` (ints; as many on every rank) over ``group``, in group rank order: one
    small all-gather, then a host sync. A rank that never arrives is a ``CommError`` naming the
    group's ranks after ``timeout`` seconds."""
    ranks = dist.get_process_group_ranks(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in ranks]
    where.op = what
    label = f"{what} (an all-gather over the group of ranks {ranks})"
    try:
        work = dist.all_gather(out, mine, group=group, async_op=True)
    except Exception as exc:
        raise CommError(f"rank {dist.get_rank()}: {label} could not start at {where}: {exc}") from None
    wait_works([work], datetime.timedelta(seconds=timeout), label)
    return torch.stack(out).tolist()


class Traffic(defaultdict):
    """(phase, step, kind, peer) -> [messages sent, bytes sent, messages received, bytes received].
    A message is what one post moves to or from one peer, in one tensor or several (K and V
    apart, ``ring.kv_pieces``)."""

    def __init__(self):
        super().__init__(lambda: [0, 0, 0, 0])

    def sent(self, key: tuple, tensors: list) -> None:
        self[key][0] += 1
        self[key][1] += sum(t.nbytes for t in tensors)

    def received(self, key: tuple, tensors: list) -> None:
        self[key][2] += 1
        self[key][3] += sum(t.nbytes for t in tensors)

    def as_dict(self) -> dict:
        return {k: tuple(v) for k, v in self.items()}


def by_peer(pairs: list) -> dict:
    """``(tensor, peer)`` pairs as peer -> its tensors, in order: the messages of one post."""
    out: dict = {}
    for t, peer in pairs:
        out.setdefault(peer, []).append(t)
    return out


class Pending:
    """In-flight p2p work; ``wait`` finishes it (copying staged data back) or raises ``CommError``."""

    def __init__(self, works, staged: list, comm: "Communicator", what: str, token=None, at=None):
        """``at``: the (phase, step label, op) a hang report names while this is waited for (several
        exchanges may be in flight at once: the last posted is not always the one waited for)."""
        self.works, self.staged, self.comm, self.what, self.token, self.at = works, staged, comm, what, token, at

    def wait(self) -> None:
        if self.at is not None:
            where.phase, where.step, where.op = self.at
        stream = self.comm.stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.comm.wait_all(self.works, self.what)   # (NCCL: the communication stream marks the end)
            for recv, host_recv in self.staged:
                recv.copy_(host_recv)
            profiling.active.comm_end(self.token, stream)
        if stream is not None:
            # compute may use what arrived only once the exchange is done: it waits for this exchange's
            # work, not for the communication stream's tail, which waits for every stream that posted
            # since (a step 0 running beside the next step, ring.Beside, would hold that step back)
            self.comm.wait_all(self.works, self.what)


class Communicator:
    """A CP process group seen as a ring, with timeouts, host staging and message and byte counts."""

    def __init__(self, group=None, timeout: float = DEFAULT_TIMEOUT_S):
        require_initialized()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.staged = dist.get_backend(self.group) == "gloo"
        self.timeout = datetime.timedelta(seconds=timeout)
        self.traffic = Traffic()
        # NCCL exchanges run on their own stream so compute and communication overlap and can be
        # timed apart; gloo stages through the host and needs none.
        self.stream = None
        if not self.staged and torch.cuda.is_available() and dist.get_backend(self.group) == "nccl":
            self.stream = torch.cuda.Stream(torch.cuda.current_device())
            # A batch of p2p ops may involve a subset of the group (the direct schedule) only once
            # the group has run a collective (torch.distributed.batch_isend_irecv's first-call rule).
            self.all_reduce_(torch.zeros(1, device=torch.cuda.current_device()), "communicator start")

    def _host(self, t: torch.Tensor) -> bool:
        return self.staged and t.is_cuda

    def wait_all(self, works, what: str) -> None:
        wait_works(works, self.timeout, what)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, kind: str, phase: str, step: int) -> Pending:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
        return self.post([(send, (self.rank + 1) % self.size)], [(recv, (self.rank - 1) % self.size)],
                         kind, phase, step)

    def post(self, sends: list, recvs: list, kind: str, phase: str, step: int) -> Pending:
        """Send each ``(tensor, peer)`` of ``sends`` and receive into each of ``recvs``
        asynchronously, as one batch; peers are ranks of this group."""
        key = (phase, step, kind)
        where.phase, where.step, where.op = phase, step, f"{kind} exchange"
        tag = 2 * step + (kind != "kv")
        ops, staged = [], []
        to, of = by_peer(sends), by_peer(recvs)   # a peer once, however many tensors its message has
        for peer, tensors in to.items():
            self.traffic.sent((*key, peer), tensors)
        for peer, tensors in of.items():
            self.traffic.received((*key, peer), tensors)
        for t, peer in sends:
            ops.append(dist.P2POp(dist.isend, t.cpu() if self._host(t) else t, self.ranks[peer], self.group, tag))
        for t, peer in recvs:
            if self._host(t):
                host = torch.empty(t.shape, dtype=t.dtype)
                staged.append((t, host))
                t = host
            ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], self.group, tag))
        what = (f"{phase} step {step} {kind} exchange (send to rank "
                f"{', '.join(str(self.ranks[p]) for p in to) or '-'}, "
                f"receive from rank {', '.join(str(self.ranks[p]) for p in of) or '-'})")
        stream = self.stream
        if stream is not None:  # send what compute produced so far
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            token = profiling.active.comm_start(phase, step, kind, stream, sum(t.nbytes for t, _ in sends))
            try:
                works = dist.batch_isend_irecv(ops)
            except Exception as exc:  # a dead peer can fail the post itself
                raise CommError(f"rank {dist.get_rank()}: {what} could not start at {where}: {exc}") from None
        return Pending(works, staged, self, what, token, (phase, step, f"{kind} exchange"))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, phase: str, what: str) -> None:
        """``out[j]`` = rank j's ``inp[me]``: dim 0 of both is the group size."""
        for peer in range(self.size):
            if peer != self.rank:
                self.traffic.sent((phase, -1, "a2a", peer), [inp[peer]])
                self.traffic.received((phase, -1, "a2a", peer), [out[peer]])
        where.phase, where.step, where.op = phase, -1, what
        staged = self._host(inp)
        token = profiling.active.comm_start(phase, -1, "a2a", None,
                                            sum(inp[p].nbytes for p in range(self.size) if p != self.rank))
        send = inp.cpu() if staged else inp
        recv = torch.empty(out.shape, dtype=out.dtype) if staged else out
        try:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        except Exception as exc:
            raise CommError(f"rank {dist.get_rank()}: {what} could not start at {where}: {exc}") from None
        self.wait_all([work], f"{phase} {what}")
        if staged:
            out.copy_(recv)
        profiling.active.comm_end(token)

    def all_reduce_(self, t: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``t`` over the group (sum by default), in place."""
        where.op = what
        buf = t.cpu() if self._host(t) else t
        self.wait_all([dist.all_reduce(buf, op=op, group=self.group, async_op=True)], what)
        if buf is not t:
            t.copy_(buf)
        return t


class SoloCommunicator:
    """A group of one: the degenerate ring of a2a, where no message is ever sent."""

    size, rank = 1, 0

    def __init__(self):
        self.traffic = Traffic()


class _SecondBackward(torch.autograd.Function):
    """Stands in for the gradients a once-differentiable backward returned under
    ``create_graph=True``: they alias its results, and differentiating them raises."""

    @staticmethod
    def forward(ctx, n: int, *tensors):
        """The first ``n`` tensors, detached; the others (what they were computed from) only link
        this node to the graph, so that a gradient asked of them reaches it."""
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "cp_attention has no double backward: its backward communicates across the CP group and is "
            "differentiable once, so a gradient of its gradients (torch.autograd.grad(..., create_graph=True) "
            "and then a backward through that result) cannot be taken; differentiate cp_attention once, "
            "or use sinkprof.attention on one device for higher-order gradients")


def differentiable_once(backward):
    """The ``backward`` of an autograd Function that communicates (the ring, the a2a re-layout, the
    replicated gradients' all-reduce): it runs once, without recording a graph, and under
    ``create_graph=True`` the gradients it returns raise a ``NotImplementedError`` naming
    cp_attention when they are differentiated (on every rank, before anything is sent), as
    ``torch.autograd.function.once_differentiable`` does with its own message. A backward that
    records no graph (the usual case) is called as it is."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        linked = [t for t in (*grads, *getattr(ctx, "saved_tensors", ()))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not linked:
            return out
        many = isinstance(out, tuple)
        outs = out if many else (out,)
        at = [n for n, g in enumerate(outs) if isinstance(g, torch.Tensor)]
        if not at:
            return out
        fenced = _SecondBackward.apply(len(at), *(outs[n] for n in at), *linked)
        outs = list(outs)
        for n, g in zip(at, fenced):
            outs[n] = g
        return tuple(outs) if many else outs[0]

    return wrapper
