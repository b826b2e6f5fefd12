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
import enum
import functools
import json
import multiprocessing as mp
import multiprocessing.resource_tracker
import os
import signal
import socket
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
from .errors import EXIT_FAILED, EXIT_USAGE, StartError, describe, say


@dataclass
class RankInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str          # torch.distributed backend: gloo or nccl


STORE_ENV = "SINKPROF_STORE"     # the FileStore of self-launched ranks
PARENT_ENV = "SINKPROF_PARENT"   # the pid of the process that launched them


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (or a launcher like it) tells this process: its rank of ``world``, and of the
    ``local_world`` ranks on this host."""
    rank: int
    world: int
    local_rank: int
    local_world: int


def torchrun_env() -> Optional[TorchrunEnv]:
    """This process's torchrun-style environment, checked; None outside torchrun (neither RANK nor
    WORLD_SIZE set: a leftover LOCAL_WORLD_SIZE or LOCAL_RANK is then ignored). A ``ValueError``
    names the variable and the fix (exit 2), before the process group is joined."""
    given = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]
    if not given:
        return None
    if len(given) == 1:
        (name,), other = given, "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise ValueError(f"{name}={os.environ[name]} is set but {other} is not: torchrun sets both; set {other} too, "
                         f"or unset {name} to self-launch the ranks (--ranks)")
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0, world - 1)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, world, default=world)
    local_rank = _env_int("LOCAL_RANK", 0, local_world - 1, default=rank % local_world)
    if STORE_ENV not in os.environ:   # self-launched ranks meet in a file, torchrun's at MASTER_ADDR:MASTER_PORT
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are set (a torchrun run) but {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not: start the ranks with torchrun, which sets "
                             f"them, set {' and '.join(missing)}, or unset RANK and WORLD_SIZE to self-launch (--ranks)")
        _env_int("MASTER_PORT", 1, 65535)
        _check_resolves(os.environ["MASTER_ADDR"])
    return TorchrunEnv(rank, world, local_rank, local_world)


NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@functools.lru_cache(maxsize=None)
def _check_resolves(addr: str) -> None:
    """MASTER_ADDR names a host: one that does not resolve would only show after ``--timeout``, as
    ranks that never met."""
    try:
        socket.getaddrinfo(addr, None)
        return
    except socket.gaierror as exc:
        if exc.errno not in NO_SUCH_HOST:
            return   # the resolver failed for now (EAI_AGAIN): the join says so if it lasts
        why = exc.strerror or str(exc)
    except UnicodeError as exc:   # a name no resolver takes (a label over 63 characters)
        why = str(exc)
    raise ValueError(f"MASTER_ADDR={addr!r} does not resolve ({why}); set it to the address of rank 0's host, as "
                     f"torchrun does")


def _env_int(name: str, low: int, high: Optional[int] = None, default: Optional[int] = None) -> int:
    """The integer environment variable ``name``, in ``low..high``; ``default`` when unset."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    bounds = f">= {low}" if high is None else f"in {low}..{high}"
    if high is not None and name in ("RANK", "LOCAL_RANK"):
        bounds += f" ({'WORLD_SIZE' if name == 'RANK' else 'LOCAL_WORLD_SIZE'} - 1 = {high})"
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={text!r} must be an integer {bounds}; torchrun sets it") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} must be {bounds}; torchrun sets it")
    return value


def under_torchrun() -> bool:
    return torchrun_env() is not None


def local_ranks(procs: int) -> int:
    """The ranks of this run on this host: torchrun's LOCAL_WORLD_SIZE (default its world size), at
    most ``procs``; the ``procs`` self-launched ranks outside torchrun."""
    env = torchrun_env()
    return procs if env is None else min(procs, env.local_world)


def choose_backend(device: str, local_world: int, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    if device == "cuda" and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def init_from_env(device: str, requested_backend: str, timeout: float) -> RankInfo:
    """Join the process group described by the torchrun-style environment; a group that does not
    form within ``timeout`` (a rank that never came) is a ``CommError``."""
    env = torchrun_env()
    rank, world, local_rank, local_world = env.rank, env.world, env.local_rank, env.local_world
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
        at = ""
    else:
        at = f" at MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}"

    def unmet(why: str) -> CommError:
        return CommError(f"rank {rank}: the {world} ranks did not meet{at} within --timeout {timeout:g}s ({why}); "
                         f"start every rank, with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT")

    # a client of the store waits for it here: c10d's own wait logs C++ stack frames at every retry
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # torchrun's agent holds the store
    if STORE_ENV not in os.environ and (rank != 0 or agent):
        why = _store_unreachable(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)
        if why is not None:
            owner = "torchrun's agent" if agent else "rank 0"
            raise unmet(f"no store answered there, last {why}: {owner} never started it, or this host cannot "
                        f"reach MASTER_ADDR")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout), **kwargs)
    except dist.DistError as exc:
        raise unmet(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    return RankInfo(rank, world, local_rank, dev, backend)


def _store_unreachable(addr: str, port: int, timeout: float) -> Optional[str]:
    """None once something accepts a connection at ``addr:port`` (rank 0's store, or torchrun's
    agent's), trying again while it refuses (the rank that holds it may start later); after
    ``timeout`` seconds without one, the last error in words."""
    deadline = time.monotonic() + timeout
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            socket.create_connection((addr, port), timeout=min(left, 1.0)).close()
            return None
        except OSError as exc:   # refused (not listening yet), timed out, unreachable for now
            why = (exc.strerror or str(exc) or type(exc).__name__).lower()
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                     # not Linux: the watchdog watches the parent


_LAST_WORDS: list = []   # called with the reason before the watchdog or a signal ends this rank (``last_words``)
STOPPING = (signal.SIGINT, signal.SIGTERM)   # the signals that stop a run: Ctrl-C, a launcher or a scheduler


@contextlib.contextmanager
def last_words(fn: Optional[Callable[[str], None]]):
    """While inside, ``fn(reason)`` runs before the watchdog (the run outlived its time) or a SIGINT
    or SIGTERM ends this rank: a job's report of what it finished; ``None``: nothing."""
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


def _last_words_on_signal(rank: int) -> None:
    """A SIGINT or SIGTERM (Ctrl-C; torchrun stopping its workers when one failed; the launcher
    passing on the signal it got; a job scheduler's time limit) ends this rank after its
    ``last_words``, which name the signal, with exit 128 + its number: a thread woken through the
    signals' wakeup fd says them, since a Python handler runs only once the main thread is out of a
    blocking wait. Only the main thread can set the signals' handling: elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for signum in STOPPING:
        signal.signal(signum, lambda signum, frame: None)   # the wakeup fd does the work

    def stopped(signum: signal.Signals) -> NoReturn:
        _say_last_words(rank, f"the rank was stopped by {signum.name} at {where}")
        _flush()
        os._exit(128 + signum)

    def watch() -> None:
        came = b""   # the numbers of the signals that came, in the order they came
        while not any(signum in came for signum in STOPPING):
            came = os.read(read, 64)
        stopped(signal.Signals(next(n for n in came if n in STOPPING)))
    threading.Thread(target=watch, daemon=True).start()   # (it inherits the block: signals go to the main thread)
    if signal.SIGINT in signal.sigpending():   # it came while the rank started (``_start``): end here, before the
        stopped(signal.SIGINT)                 # rank joins its peers (the thread would race it there)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)


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
                _mark(Marker.RUN_TIMEOUT, f"the {what} on rank {self.rank} (--run-timeout)")
                print(f"sinkprof: rank {self.rank}: {what}", file=sys.stderr, flush=True)
                _say_last_words(self.rank, f"the {what} (--run-timeout)")
                _flush()
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
    rank = torchrun_env().rank
    parent = int(os.environ[PARENT_ENV]) if PARENT_ENV in os.environ else None
    dog = Watchdog(run_timeout, rank, parent)
    _last_words_on_signal(rank)
    try:
        info = init_from_env(device, backend, timeout)
        where.phase, where.op = "setup", "comparing the ranks' options"
        agree(config or {}, info)
        code = job(info, *args)
    except Disagreement as exc:
        _end(str(exc), EXIT_USAGE)
    except SystemExit as exc:   # rich ends a write to a closed pipe so (its stdout now /dev/null)
        if _stdout_dropped():
            _mark(Marker.PIPE_CLOSED)
        _end("", exc.code if isinstance(exc.code, int) else EXIT_FAILED)
    except Exception as exc:
        if isinstance(exc, BrokenPipeError):
            _mark(Marker.PIPE_CLOSED)
        elif _marked(Marker.PIPE_CLOSED) is not None:   # a peer's exchange with the rank that ended so: quiet too
            _end("", EXIT_FAILED)
        # the options were checked before the ranks started: a ValueError here is a bug, and shows
        known = None if isinstance(exc, ValueError) else describe(exc)
        if known is None:
            say(f"rank {rank} failed at {where}:\n{traceback.format_exc()}")
            os._exit(EXIT_FAILED)
        _end(*known)   # peers may be stuck in a collective: do not wait for a clean shutdown
    try:
        if dist.is_initialized():
            dist.barrier()  # nobody tears down the group while a peer still uses it
            dist.destroy_process_group()
    except RuntimeError:    # a peer ended first (its result could not be written, it was stopped): it said why
        code = code or EXIT_FAILED
    finally:
        dog.stop()
    return code


class Marker(enum.Enum):
    """How a run ends, told by a rank to its peers and the launcher in a file beside the
    self-launched ranks' store (under torchrun the ranks share no folder: nothing is told)."""

    PIPE_CLOSED = "pipe-closed"   # rank 0's stdout lost its reader (bench --csv - | head): all end quietly
    RUN_TIMEOUT = "run-timeout"   # a watchdog ended its rank (--run-timeout); the text says where it hung

    def path(self, store: str) -> str:
        return f"{store}.{self.value}"


def _mark(marker: Marker, text: str = "") -> None:
    if STORE_ENV in os.environ:
        with contextlib.suppress(OSError), open(marker.path(os.environ[STORE_ENV]), "w") as f:
            f.write(text)


def _marked(marker: Marker) -> Optional[str]:
    """What a rank of this run marked ``marker`` with, or None."""
    if STORE_ENV in os.environ:
        with contextlib.suppress(OSError), open(marker.path(os.environ[STORE_ENV])) as f:
            return f.read()
    return None


def _stdout_dropped() -> bool:
    """Whether stdout now points at /dev/null: what rich (``errors.drop_stdout`` too) does once the
    reader of stdout went away."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    return False


def run_timed_out() -> Optional[str]:
    """Why the run ended, when a rank's watchdog ended it (``--run-timeout``): a peer's exchange
    with that rank then fails at once, and that failure is not the reason."""
    return _marked(Marker.RUN_TIMEOUT)


def _end(text: str, code: int) -> NoReturn:
    """End this rank at once with ``text`` (nothing for a closed pipe) and ``code``."""
    say(text)
    os._exit(code)


def _spawned(rank: int, world: int, store: str, parent: int, job, args, device, backend, timeout,
             run_timeout, config) -> None:
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
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError as exc:   # the last of the result did not reach stdout
        _end(*describe(exc))
    _flush()
    os._exit(int(code or 0))


def _flush() -> None:
    """Flush stdout and stderr before ``os._exit``; one that is closed or broken takes nothing more."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.flush()


def _start(proc) -> None:
    """Start a rank with SIGINT blocked. The rank inherits the block across ``exec``: a Ctrl-C while
    it imports torch stays pending (no KeyboardInterrupt traceback) until it has set its own
    handling and unblocks it (``_last_words_on_signal``), and then ends it with its last words.
    Here, a SIGINT or SIGTERM during ``proc.start()`` (a SIGINT another thread of this process may
    take while this one blocks it) is held and passed to this process's handler once the start has
    ended, even by an error: raised in the middle of the start, it would leave a rank reading half
    of what it was sent, with no pid to be stopped by. SIGTERM is not blocked, so that a rank still
    importing torch can be stopped at once. multiprocessing's resource tracker is made sure of first,
    before the block: (re)starting it unblocks SIGINT, and ``proc.start()`` restarts it if it died."""
    mp.resource_tracker.ensure_running()
    came: list = []   # (signal number, frame) of what came during the start
    handlers = {s: signal.signal(s, lambda signum, frame: came.append((signum, frame))) for s in STOPPING}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if came:
            signum, frame = came[0]
            if callable(handlers[signum]):
                handlers[signum](signum, frame)
            elif handlers[signum] in (signal.SIG_DFL, None):
                signal.raise_signal(signum)


class _Stop(Exception):
    """SIGINT or SIGTERM reached the parent of self-launched ranks."""

    def __init__(self, signum: int):
        self.signum = signum


class _Stops:
    """The parent's SIGINT and SIGTERM handler while it starts and watches the ranks: the first
    signal raises ``_Stop``, unless ``armed`` was cleared first; those that come after are kept in
    ``late``. The clauses that stop the ranks clear ``armed`` as their first statement, so a second
    signal cannot raise in the middle of the stopping, which would leave ranks running and show a
    traceback."""

    def __init__(self):
        self.armed = True
        self.late: list = []

    def __call__(self, signum, frame) -> None:
        if not self.armed:
            self.late.append(signum)
            return
        self.armed = False
        raise _Stop(signum)


def _stop_all(procs, signum: int = signal.SIGTERM) -> list[int]:
    """Pass ``signum`` on to every live rank, then SIGKILL what is left after a short grace; the
    stopped ranks. A rank still starting holds a SIGINT pending until it handles it (``_start``):
    after a SIGINT, what is alive a second later gets a SIGTERM (a rank that handles both has named
    the SIGINT by then)."""
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    start = time.monotonic()
    for s, after in [(signum, 0.0)] + ([(signal.SIGTERM, 1.0)] if signum != signal.SIGTERM else []):
        for p in procs:
            p.join(max(0.0, start + after - time.monotonic()))
        for r in stopped:
            if procs[r].is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, s)
    grace = start + 3.0
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
    previous: dict = {}
    procs: list = []
    stops = _Stops()
    try:
        for s in STOPPING:   # in the try: a SIGINT while SIGTERM's handler is set raises _Stop here
            previous[s] = signal.signal(s, stops)
        with tempfile.TemporaryDirectory(prefix="sinkprof-") as folder:   # mode 0700: this user only
            store = os.path.join(folder, "store")
            procs = [ctx.Process(target=_spawned, args=(r, nproc, store, os.getpid(), job, args, device, backend,
                                                        timeout, run_timeout, config)) for r in range(nproc)]
            for r, p in enumerate(procs):
                try:
                    _start(p)
                except OSError as exc:
                    what = ": ".join(str(x) for x in (exc.filename, exc.strerror or exc) if x)
                    raise StartError(f"rank {r} of {nproc} could not be started: {what}"
                                     + ("; the ranks started before it were stopped" if r else "")) from None
            stopped = _supervise(procs, run_timeout)
            quiet = os.path.exists(Marker.PIPE_CLOSED.path(store))   # the ranks stopped say nothing either
    except _Stop as stop:   # (``stops`` disarmed itself: a second signal cannot end the stopping half-way)
        stopped = _stop_all([p for p in procs if p.pid is not None], stop.signum)
        name = signal.Signals(stop.signum).name
        print(f"sinkprof: stopped by {name}; ended rank(s) {', '.join(map(str, stopped)) or 'none'}",
              file=sys.stderr, flush=True)
        return 128 + stop.signum
    except BaseException:   # a rank that could not start: the started ones would wait for it until their timeout
        stops.armed = False   # (a signal now is late: the run is being stopped already, and its error stands)
        _stop_all([p for p in procs if p.pid is not None])
        raise
    finally:
        stops.armed = False
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)   # what comes now waits for the handlers restored
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if stops.late:   # the ranks ended, and a signal came as the handlers were being restored: the caller's now
        signal.raise_signal(stops.late[0])
    if stopped and not quiet:
        print(f"sinkprof: stopped rank(s) {', '.join(map(str, stopped))}, still running after the run failed",
              file=sys.stderr)
    own = {}   # the exit codes of the ranks that ended by themselves
    for r, p in enumerate(procs):
        if r in stopped or p.exitcode is None:
            continue
        own[r] = p.exitcode
        if p.exitcode < 0:
            print(f"sinkprof: rank {r} was killed by signal {signal.Signals(-p.exitcode).name}", file=sys.stderr)
        elif p.exitcode - 128 in {s.value for s in STOPPING}:   # a signal to that rank alone (its last words)
            print(f"sinkprof: rank {r} was stopped by {signal.Signals(p.exitcode - 128).name} "
                  f"(exit {p.exitcode})", file=sys.stderr)
        elif p.exitcode not in (0, EXIT_FAILED, EXIT_USAGE):   # those said why (a closed pipe: silently)
            print(f"sinkprof: rank {r} exited with code {p.exitcode}", file=sys.stderr)
    if EXIT_USAGE in own.values():
        return EXIT_USAGE
    return 0 if all(p.exitcode == 0 for p in procs) else EXIT_FAILED
