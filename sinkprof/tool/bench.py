"""``sinkprof bench``: timed, NVTX-annotated CP attention runs, per ring step, into one tidy CSV.

Each rank times every ring step's compute and communication (``profiling.Probe``); after each
iteration the rows are gathered to rank 0, which appends them to ``FILE.partial`` and renames it
to ``FILE`` at the end, so a crash leaves the rows already measured. ``--simulate`` runs every
rank's compute schedule of a cp=N ring in one process (no communication) to show per-rank
compute and load balance before renting the cluster.
"""
from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import __version__, faults, profiling
from ..context_parallel import cp_attention
from ..dist import DEFAULT_TIMEOUT_S, where
from ..faults import RANK_FAILURES, Fault
from ..kernels import get_kernel
from ..options import DTYPES, CommType, CPOptions, KVSchedule, QKVFormat, accum_dtype, check_scale
from ..plan import shard, spec_layout
from ..ring import (BackwardState, BiasTiles, ForwardState, LocalDKV, LocalKV, joined_plan, run_backward,
                    run_forward)
from ..schedule import comm_schedule, row_bytes
from ..sink import sink_logits
from ..testing import make_inputs
from .cases import Case, Settings, check_seq_len, expand
from .errors import EXIT_OK
from .launcher import RankInfo, last_words
from .linkmodel import Link, predict
from .output import STDOUT, CsvStream, OutputError, atomic_path, check_writable, same_target, under_file

# The CSV schema (README documents it); metadata columns repeat on every row so each row stands alone.
COLUMNS = ["run_id", "timestamp", "rank", "iteration", "phase", "step", "kind", "start_ms", "end_ms", "dur_ms",
           "overlap_ms", "exposed_ms", "bytes", "comm", "softmax", "sink_strategy", "sink_grad", "mask", "window", "bias",
           "qkv_format", "docs", "pack_layout", "dtype", "b", "s",
           "h", "g", "d", "cp", "a2a_size", "kv_schedule", "backend", "merges", "simulated", "predicted", "link", "flops", "device_name", "torch", "cudnn", "nccl",
           "sinkprof", "git_sha"]


@dataclass(frozen=True)
class BenchOptions:
    warmup: int = 2
    iters: int = 5
    phase: str = "fwdbwd"
    csv: Optional[str] = None
    trace: Optional[str] = None
    nvtx: bool = True
    simulate: tuple = ()            # cp sizes to simulate on one device; empty = a real run
    fault: Optional[Fault] = None   # stall/crash on the second measured iteration (tests the CSV)
    timeout: float = DEFAULT_TIMEOUT_S
    link: Optional[Link] = None     # with simulate: predict each step's communication over this link

    def __post_init__(self):
        if self.link is not None and not self.simulate:
            raise ValueError("--link predicts the communication of a --simulate run: give --simulate too")
        from .report import PHASES   # the reader's list; pandas stays out of the ranks
        if self.phase not in PHASES:
            raise ValueError(f"--phase {self.phase!r}: use fwd, bwd or fwdbwd")
        if self.trace is not None and self.simulate:
            raise ValueError("--trace profiles the ranks of a real run; a --simulate run replays them on one "
                             "process and writes no trace: drop --trace (or --simulate)")
        if self.trace is not None and self.csv not in (None, STDOUT):
            if same_target(self.csv, self.trace):
                raise ValueError(f"--csv {self.csv} and --trace {self.trace} name the same path: the CSV is a file, "
                                 f"the traces go into a folder; give them different paths")
            if under_file(self.trace, self.csv):
                raise ValueError(f"--trace {self.trace} needs a folder where --csv {self.csv} writes a file; give "
                                 f"them different paths")
        if self.csv is not None:   # FILE.partial, which the run writes first, must fit its folder too
            check_writable(self.csv, "--csv", partial=True)
        if self.fault not in (None, *RANK_FAILURES):
            raise ValueError(f"--inject {self.fault.value!r}: bench injects only stall or crash; "
                             f"the others belong to check")
        if self.fault is not None and self.simulate:
            raise ValueError(f"--inject {self.fault.value} with --simulate: the fault stops a rank of a real run, and "
                             f"a simulation is one process; drop --inject (or --simulate)")
        if self.fault is not None and self.iters < 2:
            raise ValueError(f"--inject {self.fault.value} --iters {self.iters}: the fault stops rank 1 in the second "
                             f"measured iteration, which this run has not; use --iters 2 or more")


def trace_file(trace: str, rank: int) -> Path:
    """Where a rank's torch.profiler trace goes in the ``--trace`` folder."""
    return Path(trace) / f"rank{rank}.json"


def check_trace_files(opts: BenchOptions, ranks: int) -> None:
    """Each trace file a run of ``ranks`` writes can be: not a folder, and not the CSV (the trace
    would replace it)."""
    if opts.trace is None:
        return
    for rank in range(ranks):
        path = trace_file(opts.trace, rank)
        if path.is_dir():
            raise ValueError(f"--trace {opts.trace}: {path} is a folder, where rank {rank}'s trace file goes; "
                             f"move it away or choose another --trace folder")
        if opts.csv not in (None, STDOUT) and same_target(opts.csv, str(path)):
            raise ValueError(f"--csv {opts.csv}: is rank {rank}'s trace file in --trace {opts.trace}; "
                             f"write the CSV elsewhere")


def useful_flops(case: Case, phase: str) -> int:
    """FLOPs of the whole sequence's attention, each visible pair once (causal counted once; a
    pack's documents each see only themselves)."""
    spec = case.spec()
    sh = case.shape
    pairs = sum(spec.band.count(n, n) for n in case.docs) if case.docs else spec.band.count(sh.s, sh.s)
    fwd = 4 * sh.b * sh.h * sh.d * pairs
    return int(fwd * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[phase])


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _merges(device: torch.device) -> str:
    """What runs the merges, folds and sink gradient: the fused Triton kernels or torch ops."""
    if device.type != "cuda":
        return "torch"
    from .. import fused
    return "triton" if fused.disabled_reason() is None else "torch"


def metadata(case: Case, cp: int, device: torch.device, backend_name: str, simulated: bool, phase: str) -> dict:
    from ..kernels.cudnn import versions
    return {
        **case.columns(cp),
        "backend": backend_name, "merges": _merges(device), "simulated": simulated, "predicted": False, "link": "",
        "flops": useful_flops(case, phase),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cudnn": versions()["backend"] or "",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "",
        "sinkprof": __version__, "git_sha": _git_sha(),
    }


class RowWriter:
    """Every row of a run, kept for the summary and streamed to the CSV (``output.CsvStream``)."""

    def __init__(self, path: Optional[str]):
        self.rows: list[dict] = []
        self.stream = CsvStream(path, COLUMNS) if path else None
        if self.stream is not None and self.stream.kept is not None:
            print(f"sinkprof bench: kept the {self.stream.partial.name} found there as {self.stream.kept}",
                  file=sys.stderr)

    def append(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        if self.stream is not None:
            self.stream.append(rows)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def abandon(self) -> None:
        """The run stopped early: keep ``FILE.partial`` and say so."""
        if self.stream is not None:
            self.stream.abandon()
        if self.stream is not None and self.stream.renames:
            print(f"sinkprof bench: stopped early; the rows measured so far are in {self.stream.partial}",
                  file=sys.stderr)

    def stopped(self, reason: str) -> None:
        """The last words of a run that a signal or its --run-timeout ends (``launcher.last_words``,
        from another thread while this one may be writing): ``FILE.partial`` cut back to its last
        whole row, and said so."""
        if self.stream is not None and self.stream.renames:
            self.stream.cut_to_whole()
            print(f"sinkprof bench: stopped early ({reason}); the rows measured so far are in "
                  f"{self.stream.partial}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _capture(device: torch.device, trace: Optional[str], rank: int):
    """The CUDA profiler capture range (for nsys --capture-range=cudaProfilerApi) and an optional
    torch.profiler trace around the measured iterations."""
    prof = None
    if trace:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaProfilerStart()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaProfilerStop()
        if prof is not None:
            prof.__exit__(None, None, None)
            path = trace_file(trace, rank)
            try:
                with atomic_path(path) as tmp:
                    prof.export_chrome_trace(str(tmp))
            except OSError as exc:   # a full disk, a folder removed: named, as every output's failure is
                raise OutputError(f"cannot write the trace {path}: {exc.strerror or exc}") from None


def _progress(enabled: bool):
    """A progress bar on rank 0, on stderr when it is a terminal; nothing elsewhere (stdout may be the CSV)."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import Progress
    return Progress(transient=True, console=Console(stderr=True), disable=not sys.stderr.isatty())


def _run_iterations(phase: str, iters: int, warmup: int, probe, fwd, bwd, rows_of, on_rows, progress=None,
                    task=None, fault_at=None):
    """Warm up, then measure ``iters`` iterations of ``phase``; ``rows_of(it, rows)`` stamps rows."""
    for it in range(warmup + iters):
        measured = it >= warmup
        index = it - warmup
        inject = fault_at is not None and measured and index == 1
        with profiling.installed(probe if measured else profiling.NullProbe()):
            if phase == "bwd":   # the untimed forward of the iteration is where the fault fires
                out = fwd(inject)
                with probe.iteration("bwd", index) if measured else contextlib.nullcontext():
                    bwd(out)
            else:
                with probe.iteration(phase, index) if measured else contextlib.nullcontext():
                    out = fwd(inject)
                    if phase == "fwdbwd":
                        bwd(out)
        if measured:
            on_rows(rows_of(index, profiling.overlap_rows(probe.read())))
            if progress is not None:
                progress.advance(task)


def bench_job(info: RankInfo, groups: list, opts: BenchOptions) -> int:
    """Every rank: run each case, gather its rows to rank 0 after every iteration."""
    writer = RowWriter(opts.csv) if info.rank == 0 else None
    run_id = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    cases = [(settings, case) for settings in groups for case in expand(settings)]
    ran: dict = {}
    try:
        with last_words(None if writer is None else writer.stopped):
            for number, (settings, case) in enumerate(cases, 1):
                meta = metadata(case, info.world, info.device, get_kernel(settings.backend, info.device).name, False,
                                opts.phase)
                if not _first(ran, meta, number, case, loud=info.rank == 0):
                    continue
                _bench_case(case, settings, info, opts, writer, run_id, meta)
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    if writer is not None:
        writer.close()
        _summary(writer.rows, opts.csv)
    return EXIT_OK


def _first(ran: dict, meta: dict, number: int, case: Case, loud: bool) -> bool:
    """Whether case ``number`` writes rows no earlier case of the run wrote (``ran``: a case's
    metadata columns, every one the same on its rows, to the first case of them). A case that would
    write an earlier one's (``--kv-schedule auto,direct`` where auto runs direct; two profile
    groups that share a case) is skipped with a note: its rows would be summed into that case's.
    (The metadata, not report's ``CASE_KEYS``: the ranks run this, and report imports pandas.)"""
    identity = tuple(sorted((key, str(value)) for key, value in meta.items()))
    first, label = ran.setdefault(identity, (number, case.label))
    if first != number and loud:
        at = f" at --simulate {meta['cp']}" if meta["simulated"] else ""
        print(f"sinkprof bench: skipped case {number} ({case.label}){at}: it runs as case {first} ({label}) "
              f"does, and its rows would be counted as that case's", file=sys.stderr)
    return first == number


def _summary(rows: list, csv_path: Optional[str]) -> None:
    """The summary table and where the CSV went; on stderr when the CSV itself is on stdout."""
    from .report import print_summary
    with contextlib.redirect_stdout(sys.stderr) if csv_path == STDOUT else contextlib.nullcontext():
        print_summary(rows)
        if csv_path and csv_path != STDOUT:
            print(f"sinkprof bench: wrote {csv_path} ({len(rows)} rows)")


def _bench_case(case: Case, settings: Settings, info: RankInfo, opts: BenchOptions, writer, run_id: str,
                meta: dict):
    where.case, where.phase, where.step, where.op = case.label, "setup", -1, "inputs"
    cp, rank, device = info.world, info.rank, info.device
    spec = case.spec()
    dtype = DTYPES[case.dtype]
    sd, cu = spec.qkv_format.seq_dim, spec.cu_seqlens
    host = make_inputs(case.shape, spec, settings.seed, with_bias=case.bias)
    x = host.to(device, dtype)
    pl = spec.pack_layout
    q, k, v = (shard(t, cp, rank, sd, cu, pl).requires_grad_() for t in (x.q, x.k, x.v))
    offset = x.offset.requires_grad_() if x.offset is not None else None
    bias = x.bias.requires_grad_() if x.bias is not None else None
    grad_out = shard(x.grad_out, cp, rank, sd, cu, pl)
    a2a_size = case.a2a_size if case.comm is CommType.A2A_P2P else None
    stamp = datetime.datetime.now().isoformat(timespec="seconds")

    def fwd(inject: bool):
        for t in (q, k, v, offset, bias):
            if t is not None:
                t.grad = None
        with faults.injected(opts.fault if inject else None):
            return cp_attention(q, k, v, offset, comm=case.comm, softmax_type=case.softmax, mask=case.mask,
                                window=case.window, bias=bias, qkv_format=case.qkv_format, backend=settings.backend,
                                sink_strategy=case.sink_strategy, sink_grad=case.sink_grad, timeout=opts.timeout,
                                a2a_size=a2a_size, kv_schedule=case.kv_schedule, cu_seqlens=cu, pack_layout=pl)

    def bwd(out):
        out.backward(grad_out)

    def rows_of(index, rows):
        return [dict(r, rank=rank, iteration=index) for r in rows]

    def on_rows(rows):
        gathered = [None] * cp if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if writer is not None:
            writer.append([dict(r, run_id=run_id, timestamp=stamp, **meta) for part in gathered for r in part])

    probe = profiling.Probe(rank, device, use_nvtx=opts.nvtx)
    progress = _progress(rank == 0)
    with progress as bar, _capture(device, opts.trace, rank):
        task = bar.add_task(case.label, total=opts.iters) if bar is not None else None
        _run_iterations(opts.phase, opts.iters, opts.warmup, probe, fwd, bwd, rows_of, on_rows, bar, task,
                        fault_at=opts.fault)



def check_simulated_sizes(groups: list, cps: tuple) -> None:
    """Every ``--simulate`` size can lay out every case (before anything, the memory check included,
    asks the layout of it); the error names the size and the option to change."""
    for settings in groups:
        if set(settings.qkv_format) != {"thd"}:   # the bshd and sbhd cases (a pack's documents name their own)
            check_seq_len(settings.seq_len, cps, "--simulate")
    for cp in cps:
        for settings in groups:
            try:
                settings.shape.validate(cp)
                for case in expand(settings):
                    spec_layout(case.spec(), case.shape.s, cp)   # zigzag: every document in 2 * cp chunks
            except ValueError as exc:
                raise ValueError(f"--simulate {cp}: {exc}") from None


def simulate(groups: list, opts: BenchOptions, device: torch.device) -> int:
    """``--simulate``: every rank's compute schedule of a cp=N p2p ring (``profiles.settings_for``
    refuses other comms), one rank after another, on one device (K/V held as the case's K/V
    schedule holds them); the same CSV schema without communication rows. With ``opts.link``,
    each rank's rows become a prediction (``linkmodel.predict``): its exchanges from the plan's
    bytes over the link, the exposed part against the compute measured here, rows marked
    ``predicted``. The sizes are checked first (``check_simulated_sizes``, by the command)."""
    writer = RowWriter(opts.csv)
    run_id = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}-sim"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    cases = [(settings, case) for settings in groups for case in expand(settings)]
    try:
        _simulate_cases(cases, device, opts, writer, run_id, stamp)
    except BaseException:   # a Ctrl-C, a failure: the rows so far stay in FILE.partial, as a run's do
        writer.abandon()
        raise
    writer.close()
    _summary(writer.rows, opts.csv)
    return EXIT_OK


def _simulate_cases(cases: list, device: torch.device, opts: BenchOptions, writer: RowWriter, run_id: str,
                    stamp: str) -> None:
    inputs: dict = {}   # made once per shape: at 128k they take the CPU most of a minute
    ran: dict = {}
    for number, (settings, case) in enumerate(cases, 1):
        backend = get_kernel(settings.backend, device).name
        metas = {cp: metadata(case, cp, device, backend, True, opts.phase) for cp in opts.simulate}
        metas = {cp: meta for cp, meta in metas.items() if _first(ran, meta, number, case, loud=True)}
        if not metas:
            continue
        spec = case.spec()
        key = (case.shape, spec.softmax_type, spec.qkv_format, spec.docs, settings.seed, case.bias, case.dtype)
        if key not in inputs:
            inputs.clear()
            inputs[key] = make_inputs(case.shape, spec, settings.seed, with_bias=case.bias).to(device,
                                                                                              DTYPES[case.dtype])
        for cp, meta in metas.items():
            if opts.link is not None:
                meta["link"] = opts.link.describe()
            for rows in _simulate_case(case, settings, cp, device, opts, inputs[key]):
                writer.append([dict(meta, **r, run_id=run_id, timestamp=stamp) for r in rows])


def _simulate_case(case: Case, settings: Settings, cp: int, device: torch.device, opts: BenchOptions, x):
    spec = case.spec()
    case.shape.validate(cp)
    dtype = DTYPES[case.dtype]
    acc = accum_dtype(dtype)
    if spec.qkv_format is QKVFormat.THD:   # the loops run a pack as one bshd sequence of b = 1
        x, spec = x.batched(), spec.batched()
    fmt, sd, cu = spec.qkv_format, spec.qkv_format.seq_dim, spec.cu_seqlens
    kernel = get_kernel(settings.backend, device)
    copts = CPOptions(spec, check_scale(None, case.shape.d), kernel, case.sink_strategy)
    sink = sink_logits(spec.softmax_type, x.offset, case.shape.h, device)
    layout, pl = spec_layout(spec, case.shape.s, cp), spec.pack_layout
    schedule = comm_schedule(case.kv_schedule, cp, layout, spec.band,
                             *row_bytes(case.shape.b, case.shape.g, case.shape.d, dtype))
    ks = [fmt.to_bhsd(shard(x.k, cp, r, sd, cu, pl)) for r in range(cp)]
    vs = [fmt.to_bhsd(shard(x.v, cp, r, sd, cu, pl)) for r in range(cp)]
    positions = [layout.rows(r, device) for r in range(cp)]
    for rank in range(cp):
        plan = joined_plan(schedule, rank, x.k, fmt, x.bias is not None)   # its runs of steps joined
        q = shard(x.q, cp, rank, sd, cu, pl)
        do = fmt.to_bhsd(shard(x.grad_out, cp, rank, sd, cu, pl))
        bias = BiasTiles(x.bias, plan, positions[rank], positions, acc) if x.bias is not None else None
        lse = torch.empty(q.shape[1 - sd], case.shape.h, q.shape[sd], dtype=acc, device=device)
        out = torch.empty_like(q)
        dq = torch.empty_like(q)
        # an accumulator per owner, as on the ranks: step 0's tiles may run beside the next step's (ring.Beside)
        dkv = LocalDKV([torch.zeros(k.shape, dtype=acc, device=device) for k in ks],
                       [torch.zeros(v.shape, dtype=acc, device=device) for v in vs], schedule, reader=rank,
                       kv_dtype=dtype)
        rows: list = []
        fwd_state = ForwardState.make(plan, fmt.to_bhsd(q), fmt.to_bhsd(out), lse)
        bwd_state = BackwardState(fmt.to_bhsd(q), fmt.to_bhsd(out), do, lse, fmt.to_bhsd(dq))

        def fwd(_inject):
            run_forward(plan, LocalKV(ks, vs, schedule, rank, "fwd"), state=fwd_state, sink=sink, bias=bias,
                        opts=copts)

        def bwd(_out):
            run_backward(plan, LocalKV(ks, vs, schedule, rank, "bwd"), dkv, state=bwd_state, sink=sink, bias=bias, opts=copts)

        probe = profiling.Probe(rank, device, use_nvtx=opts.nvtx)
        with _capture(device, None, rank):
            _run_iterations(opts.phase, opts.iters, opts.warmup, probe, fwd, bwd,
                            lambda index, rs: [dict(r, rank=rank, iteration=index) for r in rs], rows.extend)
        if opts.link is not None:
            rows = predict(rows, schedule.transfers(rank, *row_bytes(case.shape.b, case.shape.g, case.shape.d, dtype)),
                           opts.link, blocking_kv=schedule.kind is KVSchedule.ALLGATHER,
                           posted_at=plan.posted_at, computed_at=plan.computed_at)
        yield rows
