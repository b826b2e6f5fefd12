"""Distributed runtime: start ranks (torchrun or self-launched), talk over a CP group with
timeouts, and turn a hang into an error that says where it happened.

- Under torchrun the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used
  as is. Otherwise ``launch`` spawns ``nproc`` local processes that behave the same way.
- NCCL with one GPU per rank when there are enough GPUs; else gloo, where CUDA tensors are staged
  through host memory (several ranks can share one GPU; correct but slow).
- Every wait has a timeout; each rank also runs a watchdog for the whole run. Either one prints
  which rank, case, phase and step hung and exits non-zero.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import profiling

EXIT_FAILED = 1
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

    def __init__(self, works, recv: torch.Tensor, host_recv: Optional[torch.Tensor], comm: "Comm", what: str,
                 token=None):
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


class Comm:
    """A CP process group seen as a ring, with timeouts, host staging and message counts."""

    def __init__(self, group=None, timeout: float = DEFAULT_TIMEOUT_S):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: run under torchrun, call "
                               "torch.distributed.init_process_group, or use `sinkprof check --nproc N`")
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


class SoloComm:
    """A group of one: the degenerate ring of a2a, where no message is ever sent."""

    size, rank = 1, 0

    def __init__(self):
        self.counts: Counter = Counter()


@dataclass
class RankInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str          # torch.distributed backend: gloo or nccl


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend(device: str, local_world: int, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    if device == "cuda" and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def init_from_env(device: str, requested_backend: str, timeout: float) -> RankInfo:
    """Join the process group described by the torchrun-style environment."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = choose_backend(device, local_world, requested_backend)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: no CUDA device is visible to this process")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share the cores
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return RankInfo(rank, world, local_rank, dev, backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watchdog:
    """Kills this rank with a report when the whole run outlives ``seconds``."""

    def __init__(self, seconds: float, rank: int):
        self.seconds, self.rank = seconds, rank
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        if not self._done.wait(self.seconds):
            print(f"sinkprof: rank {self.rank}: run timed out after {self.seconds:g}s, hung at {where}",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_FAILED)

    def stop(self) -> None:
        self._done.set()


def _rank_main(job: Callable, args, device: str, backend: str, timeout: float, run_timeout: float) -> int:
    """Body of every rank: init, run ``job(info, *args)`` under the watchdog, report, clean up."""
    rank = int(os.environ.get("RANK", 0))
    dog = Watchdog(run_timeout, rank)
    try:
        info = init_from_env(device, backend, timeout)
        code = job(info, *args)
    except CommError as exc:
        print(f"sinkprof: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)  # peers may be stuck in a collective: do not wait for a clean shutdown
    except Exception:
        print(f"sinkprof: rank {rank} failed at {where}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)
    try:
        if dist.is_initialized():
            dist.barrier()  # nobody tears down the group while a peer still uses it
            dist.destroy_process_group()
    finally:
        dog.stop()
    return code


def _spawned(rank: int, world: int, port: int, job, args, device, backend, timeout, run_timeout) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = _rank_main(job, args, device, backend, timeout, run_timeout)
    # Leave without interpreter teardown: the rank's results are written and flushed, and a
    # process group still referenced at teardown can abort the process from a C++ destructor
    # (seen once as "terminate called without an active exception" after every case passed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def _supervise(procs, run_timeout: float) -> list[int]:
    """Wait for the ranks; after a failure give the rest a moment, then stop them. Returns the
    ranks that had to be stopped."""
    deadline = time.monotonic() + run_timeout + 30.0
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            print(f"sinkprof: the run exceeded {run_timeout:g}s; stopping all ranks", file=sys.stderr)
            break
        if any(p.exitcode not in (None, 0) for p in procs):
            grace = time.monotonic() + 5.0
            while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                time.sleep(0.05)
            break
        time.sleep(0.05)
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    return stopped


def launch(job: Callable, args: tuple, *, nproc: int, device: str = "cpu", backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT_S, run_timeout: float = 900.0) -> int:
    """Run ``job(info, *args)`` on every rank and return the run's exit code.

    Under torchrun this process is one rank. Otherwise ``nproc`` processes are spawned; when one
    fails the others are stopped, and the whole run is bounded by ``run_timeout`` plus a grace.
    """
    if under_torchrun():
        return _rank_main(job, args, device, backend, timeout, run_timeout)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_spawned, args=(r, nproc, port, job, args, device, backend, timeout, run_timeout))
             for r in range(nproc)]
    for p in procs:
        p.start()
    stopped = _supervise(procs, run_timeout)
    if stopped:
        print(f"sinkprof: stopped rank(s) {', '.join(map(str, stopped))}, still running after the run failed",
              file=sys.stderr)
    code = 0
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            code = EXIT_FAILED
            if r in stopped or p.exitcode is None:
                continue
            if p.exitcode < 0:
                print(f"sinkprof: rank {r} was killed by signal {signal.Signals(-p.exitcode).name}", file=sys.stderr)
            elif p.exitcode != EXIT_FAILED:
                print(f"sinkprof: rank {r} exited with code {p.exitcode}", file=sys.stderr)
    return code
