"""The communicator the library runs on: a CP process group seen as a ring, with timeouts.

- p2p exchanges with the ring neighbours, all-to-alls and all-reduces, each counted per
  (phase, step, kind) so the check can hold them to the plan's comm-count contract.
- Over NCCL the exchanges run on their own stream; over gloo CUDA tensors are staged through host
  memory (several ranks can share one GPU; correct but slow).
- Every wait has a timeout and turns a hang into a ``CommError`` that says which rank, case,
  phase and step it happened at (``where``). Starting the ranks is the tool's business
  (``sinkprof.tool.launcher``).
"""
from __future__ import annotations

import contextlib
import datetime
from collections import Counter
from dataclasses import dataclass
from typing import Optional

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


class Pending:
    """In-flight p2p work; ``wait`` finishes it (copying staged data back) or raises ``CommError``."""

    def __init__(self, works, recv: torch.Tensor, host_recv: Optional[torch.Tensor], comm: "Communicator",
                 what: str, token=None):
        self.works, self.recv, self.host_recv, self.comm, self.what = works, recv, host_recv, comm, what
        self.token = token

    def wait(self) -> None:
        stream = self.comm.stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.comm.wait_all(self.works, self.what)
            if self.host_recv is not None:
                self.recv.copy_(self.host_recv)
            profiling.active.comm_end(self.token, stream)
        if stream is not None:  # compute may use what arrived only once the exchange is done
            torch.cuda.current_stream(stream.device).wait_stream(stream)


class Communicator:
    """A CP process group seen as a ring, with timeouts, host staging and message counts."""

    def __init__(self, group=None, timeout: float = DEFAULT_TIMEOUT_S):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: run under torchrun, call "
                               "torch.distributed.init_process_group, or use `sinkprof check --ranks N`")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.prev = self.ranks[(self.rank - 1) % self.size]
        self.staged = dist.get_backend(self.group) == "gloo"
        self.timeout = datetime.timedelta(seconds=timeout)
        self.counts: Counter = Counter()
        # NCCL exchanges run on their own stream so compute and communication overlap and can be
        # timed apart; gloo stages through the host and needs none.
        self.stream = None
        if not self.staged and torch.cuda.is_available() and dist.get_backend(self.group) == "nccl":
            self.stream = torch.cuda.Stream(torch.cuda.current_device())

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
        self.counts[(phase, step, kind)] += 1
        where.phase, where.step, where.op = phase, step, f"{kind} exchange"
        host_recv = None
        if self._host(send):
            send = send.cpu()
            host_recv = torch.empty(recv.shape, dtype=recv.dtype)
        tag = 2 * step + (kind != "kv")
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, host_recv if host_recv is not None else recv, self.prev, self.group, tag)]
        what = f"{phase} step {step} {kind} exchange (send to rank {self.next}, receive from rank {self.prev})"
        stream = self.stream
        if stream is not None:  # send what compute produced so far
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            token = profiling.active.comm_start(phase, step, kind, stream)
            try:
                works = dist.batch_isend_irecv(ops)
            except Exception as exc:  # a dead peer can fail the post itself
                raise CommError(f"rank {dist.get_rank()}: {what} could not start at {where}: {exc}") from None
        return Pending(works, recv, host_recv, self, what, token)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, phase: str, what: str) -> None:
        """``out[j]`` = rank j's ``inp[me]``: dim 0 of both is the group size."""
        self.counts[(phase, -1, "a2a")] += 1
        where.phase, where.step, where.op = phase, -1, what
        staged = self._host(inp)
        token = profiling.active.comm_start(phase, -1, "a2a")
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
        self.counts: Counter = Counter()
