"""Start the ranks of a run (torchrun or self-launched) and bound it in time.

- Under torchrun the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is used
  as is. Otherwise ``launch`` spawns ``nproc`` local processes that behave the same way.
- NCCL with one GPU per rank when there are enough GPUs; else gloo (see ``sinkprof.dist``).
- Every exchange has its own timeout (``sinkprof.dist``); each rank also runs a watchdog for the
  whole run. Either one prints which rank, case, phase and step hung and exits non-zero.
- Self-launched ranks stay local: they rendezvous through a ``FileStore`` in a private temporary
  folder (no listening store) and gloo/NCCL bind to the loopback interface. SIGINT or SIGTERM to
  the parent stops every rank within seconds (exit 130 / 143, one line); a rank whose parent died
  exits on its own (``PR_SET_PDEATHSIG``, and the watchdog watches its parent).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from ..dist import DEFAULT_TIMEOUT_S, CommError, where
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE
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
    if STORE_ENV in os.environ:   # self-launched: a file in a private folder, nothing listens
        kwargs["store"] = dist.FileStore(os.environ[STORE_ENV], world)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return RankInfo(rank, world, local_rank, dev, backend)


STORE_ENV = "SINKPROF_STORE"     # the FileStore of self-launched ranks
PARENT_ENV = "SINKPROF_PARENT"   # the pid of the process that launched them


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                     # not Linux: the watchdog watches the parent


_LAST_WORDS: list = []   # called with the reason before the watchdog or a SIGTERM ends this rank (``last_words``)


@contextlib.contextmanager
def last_words(fn: Optional[Callable[[str], None]]):
    """While inside, ``fn(reason)`` runs before the watchdog (the run outlived its time) or a SIGTERM
    ends this rank: a job's report of what it finished; ``None``: nothing."""
    if fn is None:
        yield
        return
    _LAST_WORDS.append(fn)
    try:
        yield
    finally:
        _LAST_WORDS.remove(fn)


def _say_last_words(rank: int, reason: str) -> None:
    for fn in list(_LAST_WORDS):
        try:
            fn(reason)
        except Exception as exc:   # the rank ends anyway; say why nothing more came
            print(f"sinkprof: rank {rank}: no report of the finished cases: {exc}", file=sys.stderr, flush=True)


def _last_words_on_sigterm(rank: int) -> None:
    """A SIGTERM (torchrun stopping its workers when one failed, the launcher stopping its ranks,
    a job scheduler's time limit) ends this rank after its ``last_words``: a thread woken through
    the signal's wakeup fd says them, since a Python handler runs only once the main thread is out
    of a blocking wait. Only the main thread can set the signal's handling: elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)   # the wakeup fd does the work

    def watch() -> None:
        signals = b""
        while signal.SIGTERM not in signals:   # the numbers of the signals that came, SIGINT's too
            signals = os.read(read, 64)
        _say_last_words(rank, f"the rank was stopped by SIGTERM at {where}")
        sys.stdout.flush()
        os._exit(128 + signal.SIGTERM)
    threading.Thread(target=watch, daemon=True).start()


class Watchdog:
    """Kills this rank with a report when the whole run outlives ``seconds`` (``last_words`` first),
    and quietly when the process that launched it (``parent``) is gone."""

    def __init__(self, seconds: float, rank: int, parent: Optional[int] = None):
        self.seconds, self.rank, self.parent = seconds, rank, parent
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        while not self._done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if self.parent is not None and os.getppid() != self.parent:
                os._exit(EXIT_FAILED)            # orphaned: nobody reads our results
            if time.monotonic() >= deadline:
                what = f"run timed out after {self.seconds:g}s, hung at {where}"
                print(f"sinkprof: rank {self.rank}: {what}", file=sys.stderr, flush=True)
                _say_last_words(self.rank, f"the {what} (--run-timeout)")
                sys.stdout.flush()
                os._exit(EXIT_FAILED)

    def stop(self) -> None:
        self._done.set()


class Disagreement(ValueError):
    """Ranks were started with different options."""


def agree(config: dict, info: RankInfo) -> None:
    """Compare this rank's configuration with rank 0's before the first case; on a difference
    every rank raises ``Disagreement`` naming the option and both values."""
    if info.world == 1:
        return
    everyone: list = [None] * info.world
    dist.all_gather_object(everyone, json.dumps(config, sort_keys=True, default=str))
    first = json.loads(everyone[0])
    for rank, theirs in enumerate(everyone):
        other = json.loads(theirs)
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                raise Disagreement(f"rank {rank} was started with {key} {other.get(key)!r} but rank 0 with "
                                   f"{first.get(key)!r}; start every rank with the same options")


def _rank_main(job: Callable, args, device: str, backend: str, timeout: float, run_timeout: float,
               config: Optional[dict] = None) -> int:
    """Body of every rank: init, run ``job(info, *args)`` under the watchdog, report, clean up."""
    rank = int(os.environ.get("RANK", 0))
    parent = int(os.environ[PARENT_ENV]) if PARENT_ENV in os.environ else None
    dog = Watchdog(run_timeout, rank, parent)
    _last_words_on_sigterm(rank)
    try:
        info = init_from_env(device, backend, timeout)
        where.phase, where.op = "setup", "comparing the ranks' options"
        agree(config or {}, info)
        code = job(info, *args)
    except KeyboardInterrupt:   # Ctrl-C under torchrun reaches every rank: one line from torchrun is enough
        os._exit(EXIT_INTERRUPTED)
    except Disagreement as exc:
        print(f"sinkprof: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_USAGE)
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


def _spawned(rank: int, world: int, store: str, parent: int, job, args, device, backend, timeout,
             run_timeout, config) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C and stops the ranks
    _die_with_parent()
    if os.getppid() != parent:                     # it died before the request took effect
        os._exit(EXIT_FAILED)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", **{STORE_ENV: store, PARENT_ENV: str(parent)},
                      GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    _leave(_rank_main(job, args, device, backend, timeout, run_timeout, config))


def _leave(code) -> NoReturn:
    """End a rank's process without interpreter teardown: its results are written and flushed, and
    torch's distributed objects destroyed at teardown can abort the process from a C++ destructor
    ("terminate called without an active exception", exit -6, after every case passed: seen on
    self-launched ranks and under torchrun)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


class _Stop(Exception):
    """SIGINT or SIGTERM reached the parent of self-launched ranks."""

    def __init__(self, signum: int):
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


def _stop_all(procs) -> list[int]:
    """SIGTERM every live rank, then SIGKILL what is left after a short grace; the stopped ranks."""
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].terminate()
    grace = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, grace - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return stopped


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
    return _stop_all(procs)


def launch(job: Callable, args: tuple, *, nproc: int, device: str = "cpu", backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT_S, run_timeout: float = 900.0, config: Optional[dict] = None) -> int:
    """Run ``job(info, *args)`` on every rank and return the run's exit code.

    ``config`` (option -> value, JSON-able) is compared across ranks before the job starts
    (``agree``): ranks started by hand or by a launcher with different options stop with exit 2.

    Under torchrun this process is one rank, and it ends here (``_leave``) once its results are
    written. Otherwise ``nproc`` processes are spawned; when one fails the others are stopped, and
    the whole run is bounded by ``run_timeout`` plus a grace.
    """
    if under_torchrun():
        _leave(_rank_main(job, args, device, backend, timeout, run_timeout, config))
    ctx = mp.get_context("spawn")
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list = []
    try:
        with tempfile.TemporaryDirectory(prefix="sinkprof-") as folder:   # mode 0700: this user only
            store = os.path.join(folder, "store")
            procs = [ctx.Process(target=_spawned, args=(r, nproc, store, os.getpid(), job, args, device, backend,
                                                        timeout, run_timeout, config)) for r in range(nproc)]
            for p in procs:
                p.start()
            stopped = _supervise(procs, run_timeout)
    except _Stop as stop:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = _stop_all([p for p in procs if p.pid is not None])
        name = signal.Signals(stop.signum).name
        print(f"sinkprof: stopped by {name}; ended rank(s) {', '.join(map(str, stopped)) or 'none'}",
              file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        print(f"sinkprof: stopped rank(s) {', '.join(map(str, stopped))}, still running after the run failed",
              file=sys.stderr)
    code = 0
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            code = EXIT_FAILED
            if r in stopped or p.exitcode is None:
                continue
            if p.exitcode == EXIT_USAGE:
                code = EXIT_USAGE
            elif p.exitcode < 0:
                print(f"sinkprof: rank {r} was killed by signal {signal.Signals(-p.exitcode).name}", file=sys.stderr)
            elif p.exitcode != EXIT_FAILED:
                print(f"sinkprof: rank {r} exited with code {p.exitcode}", file=sys.stderr)
    return code
