"""Start the ranks of a run (torchrun or self-launched) and bound it in time.

- Under torchrun the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used
  as is. Otherwise ``launch`` spawns ``nproc`` local processes that behave the same way.
- NCCL with one GPU per rank when there are enough GPUs; else gloo (see ``sinkprof.dist``).
- Every exchange has its own timeout (``sinkprof.dist``); each rank also runs a watchdog for the
  whole run. Either one prints which rank, case, phase and step hung and exits non-zero.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..dist import DEFAULT_TIMEOUT_S, CommError, where
from .errors import EXIT_FAILED
from .output import OutputError


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
    except (CommError, OutputError) as exc:
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
