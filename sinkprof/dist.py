"""The communicator the library runs on: a CP process group seen as a ring, with timeouts.

- p2p messages (to the ring neighbours, or to any peer of the direct schedule), all-to-alls and
  all-reduces; every message is counted with its bytes per (phase, step, kind, peer) so the check
  can hold them to the plan's byte contract (``sinkprof.schedule``).
- Over NCCL the exchanges run on their own stream; over gloo CUDA tensors are staged through host
  memory (several ranks can share one GPU; correct but slow).
- Every wait has a timeout and turns a hang into a ``CommError`` that says which rank, case,
  phase and step it happened at (``where``). Starting the ranks is the tool's business
  (``sinkprof.tool.launcher``).
"""
from __future__ import annotations

import contextlib
import datetime
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
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: run under torchrun, call "
                               "torch.distributed.init_process_group, or use `sinkprof check --ranks N`")
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
        try:
            for w in works:
                if w.wait(self.timeout) is False:
                    raise RuntimeError("wait returned False")
        except Exception as exc:  # gloo raises on timeout and on a dead peer
            raise CommError(f"rank {dist.get_rank()}: {what} failed or hung (timeout "
                            f"{self.timeout.total_seconds():g}s) at {where}: {exc}") from None

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
        for peer, tensors in by_peer(sends).items():
            self.traffic.sent((*key, peer), tensors)
        for peer, tensors in by_peer(recvs).items():
            self.traffic.received((*key, peer), tensors)
        for t, peer in sends:
            ops.append(dist.P2POp(dist.isend, t.cpu() if self._host(t) else t, self.ranks[peer], self.group, tag))
        for t, peer in recvs:
            if self._host(t):
                host = torch.empty(t.shape, dtype=t.dtype)
                staged.append((t, host))
                t = host
            ops.append(dist.P2POp(dist.irecv, t, self.ranks[peer], self.group, tag))
        what = (f"{phase} step {step} {kind} exchange (send to rank {', '.join(str(self.ranks[p]) for _, p in sends) or '-'}, "
                f"receive from rank {', '.join(str(self.ranks[p]) for _, p in recvs) or '-'})")
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
