"""``sinkprof check``: CP attention against the single-device reference over a matrix of cases.

Every rank builds the same seeded inputs, computes its rows of the fp64 reference (blockwise; the
shares of dk, dv and the replicated gradients are summed over the ranks, so the reference is
computed once per case; fresh tensors nothing else writes into, fingerprinted), runs the CP
attention on its shard, and compares
its shard of out, dq, dk, dv and the replicated gradients (sink, bias) under the chosen contract.
Errors are reduced (max) over ranks; rank 0 reports. The messages and bytes every rank sends and
receives, per (phase, step, kind, peer), are checked against the plan's (the byte contract,
``sinkprof.schedule``) and reported per case.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .. import faults
from ..context_parallel import comm_for, cp_attention, cp_groups
from ..dist import CommError, where
from ..faults import Fault
from ..kernels import get_kernel
from ..options import CommType, DTYPES, SinkGrad
from ..plan import Layout, shard, spec_layout
from ..schedule import PHASE_KINDS, CaseComm, case_comm
from ..testing import (Error, Result, Shape, Snapshot, Tolerance, compare, make_inputs, reference,
                       shares_storage, tolerance_for)
from .cases import Case, a2a_members, expand
from .errors import EXIT_FAILED, EXIT_OK
from .launcher import RankInfo, last_words, run_timed_out
from .output import Format, Output


@dataclass
class CaseResult:
    case: Case
    cp: int
    passed: bool
    errors: dict              # name -> Error (max over ranks)
    tolerance: Tolerance
    seconds: float
    notes: list = field(default_factory=list)
    backend: str = "torch"        # the tile kernels that ran
    kv_schedule: Optional[str] = None   # the ring's K/V schedule (auto resolved); None without a ring
    traffic: dict = field(default_factory=dict)   # messages and bytes sent, summed over ranks
    seed: int = 0                 # of the case's inputs (its settings group's)

    def to_json(self) -> dict:
        c = self.case
        return {"comm": c.comm.value, "a2a_size": c.a2a_size if c.comm is CommType.A2A_P2P else None,
                "kv_schedule": self.kv_schedule, "traffic": self.traffic, "seed": self.seed,
                "softmax": c.softmax.value, "mask": c.mask.value,
                "qkv_format": c.qkv_format.value, "docs": list(c.docs) or None,
                "pack_layout": c.pack_layout.value if c.docs else None, "dtype": c.dtype, "cp": self.cp,
                "sink_strategy": c.sink_strategy.value if c.softmax.has_sink else None,
                "sink_grad": c.sink_grad.value if c.has_grad_contract else None,
                "window": list(c.window) if c.window else None, "bias": c.bias,
                "shape": asdict(c.shape), "passed": self.passed,
                "errors": {k: {"max_abs": e.max_abs, "worst": e.worst, "passed": e.passed} for k, e in self.errors.items()},
                "tolerance": {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol},
                "backend": self.backend, "seconds": self.seconds, "notes": self.notes}


def case_traffic(case: Case, cp: int) -> CaseComm:
    """Where a case's messages go and how big they are, from the plan."""
    sh = case.shape
    return case_comm(s=sh.s, b=sh.b, h=sh.h, g=sh.g, d=sh.d, dtype=DTYPES[case.dtype], cp=cp, mask=case.mask,
                     window=case.window, comm=case.comm, a2a_size=case.a2a_size, kv_schedule=case.kv_schedule,
                     cu_seqlens=case.cu_seqlens, pack_layout=case.pack_layout)


# The tensors compared, in a fixed order so ranks can reduce them element by element.
NAMES = ("out", "dq", "dk", "dv", "d_sink", "d_sink_sum", "d_bias", "d_bias_sum", "comm", "reference")


def shard_rows(s: int, cp: int, ranks, layout: Layout) -> torch.Tensor:
    """Bool over the ``s`` rows of the sequence (or pack): the rows of the given ranks' shards."""
    rows = torch.zeros(s, dtype=torch.bool)
    for rank in ranks:
        rows[layout.rows(rank)] = True
    return rows


def own_part(comm: CommType, shape: Shape, cp: int, rank: int, a2a_size: int, layout: Layout) -> tuple:
    """(rows, heads) masks of what a rank computes, so its ``partial`` gradients can be checked:
    its shard's rows under p2p, its heads under a2a, its group's rows and its heads under a2a+p2p."""
    members = a2a_members(comm, cp, a2a_size)
    group, inner = divmod(rank, members)
    rows = shard_rows(shape.s, cp, range(group * members, (group + 1) * members), layout)
    heads = torch.zeros(shape.h, dtype=torch.bool)
    per = shape.h // members
    heads[inner * per:(inner + 1) * per] = True
    return rows, heads


def run_case(case: Case, info: RankInfo, seed: int, backend: str, timeout: float) -> CaseResult:
    """One case on this rank; every rank returns the same (reduced) result."""
    where.case, where.phase, where.step, where.op = case.label, "setup", -1, "reference"
    cp, rank, device = info.world, info.rank, info.device
    spec = case.spec()
    dtype = DTYPES[case.dtype]
    sd, cu = spec.qkv_format.seq_dim, spec.cu_seqlens
    layout = spec_layout(spec, case.shape.s, cp)   # which rows each rank holds
    host = make_inputs(case.shape, spec, seed, with_bias=case.bias)
    # The reference sees exactly the values the CP run sees (rounded to the case's dtype).
    rounded = host.to("cpu", dtype)
    comm = comm_for(None, timeout)
    # One reference per case, shared: each rank computes its own rows (out and dq of its shard, its
    # rows' share of dk, dv and the replicated gradients), and the shares are summed.
    mine = shard_rows(case.shape.s, cp, [rank], layout)
    ref = reference(rounded.to(device, torch.float64), spec, rows=mine)
    for name, t in (("dk", ref.dk), ("dv", ref.dv), ("d_sink", ref.d_offset), ("d_bias", ref.d_bias)):
        if t is not None:
            comm.all_reduce_(t, f"reference {name} sum")
    snapshot = Snapshot.of(ref)
    ref_part = None
    if case.sink_grad is SinkGrad.PARTIAL and (host.offset is not None or host.bias is not None):
        rows, heads = own_part(case.comm, case.shape, cp, rank, case.a2a_size, layout)
        ref_part = reference(rounded.to(device, torch.float64), spec, rows=rows, heads=heads)

    x = rounded.to(device, dtype)
    pl = spec.pack_layout
    q, k, v = (shard(t, cp, rank, sd, cu, pl).requires_grad_() for t in (x.q, x.k, x.v))
    offset = x.offset.requires_grad_() if x.offset is not None else None
    bias = x.bias.requires_grad_() if x.bias is not None else None
    grad_out = shard(x.grad_out, cp, rank, sd, cu, pl)
    kernel = get_kernel(backend, device)
    refused_before = set(getattr(kernel, "refused", dict)())
    a2a_size = case.a2a_size if case.comm is CommType.A2A_P2P else None
    groups = cp_groups(case.comm, None, a2a_size, timeout)
    for c in (groups.inner, groups.outer):
        c.traffic.clear()

    t0 = time.perf_counter()
    where.phase, where.step, where.op = "fwd", 0, "cp_attention"   # the ring refines it at each exchange
    out = cp_attention(q, k, v, offset, comm=case.comm, softmax_type=case.softmax, mask=case.mask,
                       window=case.window, bias=bias, qkv_format=case.qkv_format, backend=backend,
                       sink_strategy=case.sink_strategy, sink_grad=case.sink_grad, timeout=timeout,
                       a2a_size=a2a_size, kv_schedule=case.kv_schedule, cu_seqlens=cu, pack_layout=pl)
    faults.active.alias_reference(offset, ref)
    where.phase, where.step, where.op = "bwd", 0, "cp_attention backward"
    out.backward(grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    where.phase, where.step, where.op = "compare", -1, "-"

    got = Result(out, q.grad, k.grad, v.grad, offset.grad if offset is not None else None,
                 bias.grad if bias is not None else None)
    tol = tolerance_for(dtype, gqa=case.shape.h != case.shape.g)
    errors: dict[str, Error] = {}
    for name, mine, theirs in (("out", got.out, ref.out), ("dq", got.dq, ref.dq), ("dk", got.dk, ref.dk),
                               ("dv", got.dv, ref.dv)):
        errors[name] = compare(mine, shard(theirs, cp, rank, sd, cu, pl), tol)
    for name, mine, full_ref, part_ref in (("d_sink", got.d_offset, ref.d_offset, ref_part and ref_part.d_offset),
                                           ("d_bias", got.d_bias, ref.d_bias, ref_part and ref_part.d_bias)):
        if mine is None:
            continue
        if case.sink_grad is SinkGrad.FULL:
            errors[name] = compare(mine, full_ref, tol)
        else:
            errors[name] = compare(mine, part_ref, tol)
            total = mine.detach().clone()
            comm.all_reduce_(total, f"{name} check sum")
            errors[name + "_sum"] = compare(total, full_ref, tol)

    notes = []
    planned = case_traffic(case, cp)
    errors["comm"] = Error(0.0, 0.0, True)   # the byte contract, shown for every case
    for group, expected in ((groups.outer, planned.ring_transfers(groups.outer.rank)),
                            (groups.inner, planned.a2a_transfers(groups.inner.rank))):
        want = {t.key: t.counts for t in expected}
        got_traffic = group.traffic.as_dict()
        if got_traffic != want:
            diff = {k: (got_traffic.get(k), want.get(k)) for k in sorted(set(want) | set(got_traffic), key=str)
                    if got_traffic.get(k) != want.get(k)}
            notes.append(f"rank {rank}: messages and bytes (sent, bytes, received, bytes) per (phase, step, kind, "
                         f"peer) differ from the plan's, as (moved, planned): {diff}"[:1000])
            errors["comm"] = Error(float("nan"), float("inf"), False)
    refused = {k: v for k, v in getattr(kernel, "refused", dict)().items() if k not in refused_before}
    if refused:
        notes.append(f"rank {rank}: {kernel.name} could not run {len(refused)} tile kind(s), a fallback ran them: "
                     + "; ".join(sorted(set(refused.values())))[:500])
    aliased = [n for n, t in got.named().items() if any(shares_storage(t, r) for r in ref.named().values())]
    changed = snapshot.changed(ref)
    if aliased or changed:
        notes.append(f"rank {rank}: the reference is not independent of the CP run "
                     f"(shares storage: {aliased or '-'}; modified after it was computed: {changed or '-'})")
        errors["reference"] = Error(float("nan"), float("inf"), False)
    result = _reduce(case, cp, errors, tol, seconds, notes, info, comm, kernel.name)
    result.kv_schedule = planned.schedule.kind.value if planned.schedule is not None else None
    result.traffic = _traffic(groups, info, comm)
    result.seed = seed
    return result


def _traffic(groups, info: RankInfo, comm) -> dict:
    """Messages and bytes sent per phase and kind, and in all, summed over ranks (every message
    counted once, by its sender)."""
    dev = info.device if info.backend == "nccl" else torch.device("cpu")
    values = []
    for phase, kind in PHASE_KINDS:
        sent = [v for g in (groups.outer, groups.inner) for k, v in g.traffic.items() if (k[0], k[2]) == (phase, kind)]
        values += [sum(v[0] for v in sent), sum(v[1] for v in sent)]
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    comm.all_reduce_(t, "traffic sum")
    vals = [int(x) for x in t.tolist()]
    out: dict = {}
    for (phase, kind), messages, nbytes in zip(PHASE_KINDS, vals[0::2], vals[1::2]):
        if messages:
            out.setdefault(phase, {})[kind] = {"messages": messages, "bytes": nbytes}
    out["total"] = {"messages": sum(vals[0::2]), "bytes": sum(vals[1::2])}
    return out


def _reduce(case, cp, errors, tol, seconds, notes, info: RankInfo, comm, backend: str) -> CaseResult:
    """Max of every error and of the time over ranks; a failure on any rank fails the case."""
    dev = info.device if info.backend == "nccl" else torch.device("cpu")
    # Any rank may add "comm" or "reference": agree on which entries exist before reducing values.
    present = torch.tensor([float(n in errors) for n in NAMES], dtype=torch.float64, device=dev)
    comm.all_reduce_(present, "result presence", op=dist.ReduceOp.MAX)
    names = [n for n, p in zip(NAMES, present.tolist()) if p]
    values = []
    for n in names:
        e = errors.get(n, Error(0.0, 0.0, True))
        values += [e.max_abs if e.max_abs == e.max_abs else float("inf"), e.worst, float(not e.passed)]
    t = torch.tensor(values + [seconds], dtype=torch.float64, device=dev)
    comm.all_reduce_(t, "result reduce", op=dist.ReduceOp.MAX)
    vals = t.tolist()
    reduced = {n: Error(vals[3 * i], vals[3 * i + 1], vals[3 * i + 2] == 0.0) for i, n in enumerate(names)}
    return CaseResult(case, cp, all(e.passed for e in reduced.values()), reduced, tol, vals[-1], notes, backend)


class CaseProgress:
    """Cases done out of all and the case running, as a bar on ``console`` (stderr of a terminal),
    gone when the run ends; without a console, nothing."""

    def __init__(self, total: int, console=None):
        self.total = total
        self.console = console
        self._bar = None
        self._task = None

    @classmethod
    def for_run(cls, total: int, rank: int, output: Output) -> "CaseProgress":
        """Shown by rank 0 of a table run when stderr is a terminal; CI logs, pipes and JSON get none."""
        if rank != 0 or output.format is not Format.TABLE or not sys.stderr.isatty():
            return cls(total)
        from rich.console import Console
        return cls(total, Console(stderr=True))

    def __enter__(self) -> "CaseProgress":
        if self.console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._bar = Progress(TextColumn("check"), MofNCompleteColumn(), BarColumn(bar_width=20),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), console=self.console,
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total)
        return self

    def start(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=label)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def stop(self) -> None:
        """The bar gone (before a report; again at the end: nothing)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __exit__(self, *exc) -> None:
        self.stop()


def check_job(info: RankInfo, groups: list, fault: Optional[Fault], timeout: float, output: Output) -> int:
    """The body every rank runs over every settings group; rank 0 reports (and shows progress on a
    terminal); exit 0 only if all passed. A run that stops early (a case that fails or hangs in an
    exchange, the run's own timeout, a SIGTERM) still has rank 0 report the cases it finished and
    where it stopped: one report, whichever thread comes first (``ReportOnce``)."""
    cases = distinct_cases([(settings, case) for settings in groups for case in expand(settings)], info.world,
                           loud=info.rank == 0)
    results: list = []
    with faults.injected(fault), CaseProgress.for_run(len(cases), info.rank, output) as progress:
        seeds = {g.seed for g in groups}
        seed = next(iter(seeds)) if len(seeds) == 1 else None   # the run's, where its groups share one

        def emit(done: list, stopped: Optional[Stopped]) -> None:
            progress.stop()
            passed = stopped is None and all(r.passed for r in done)
            report(done, passed, info, seed, fault, output, stopped=stopped)
        once = ReportOnce(emit)

        def report_stopped(reason: str) -> None:
            done = list(results)
            label = cases[len(done)][1].label if len(done) < len(cases) else None
            once.write(done, Stopped(label, len(done) + 1, len(cases), reason))

        with last_words(report_stopped if info.rank == 0 else None):
            for settings, case in cases:
                progress.start(case.label)
                try:
                    results.append(run_case(case, info, settings.seed, settings.backend, timeout))
                except Exception as exc:
                    if info.rank == 0:
                        report_stopped(run_timed_out() or (str(exc) if isinstance(exc, CommError)
                                                           else f"{type(exc).__name__}: {exc}"))
                    raise
                progress.done()
    if info.rank == 0 and not once.write(results, None):
        return EXIT_FAILED   # the run's timeout came first, and reported it
    return EXIT_OK if all(r.passed for r in results) else EXIT_FAILED


def distinct_cases(cases: list, cp: int, loud: bool) -> list:
    """The (settings, case) pairs of a run less each that would run as an earlier one does
    (``--kv-schedule auto,direct`` where auto runs direct; two profile groups that share a case),
    with a note on stderr (``loud``: rank 0's): it would check the same thing twice."""
    kept, seen = [], {}
    for settings, case in cases:
        key = (settings.backend, settings.seed, tuple(case.columns(cp).items()))
        first = seen.setdefault(key, case)
        if first is case:
            kept.append((settings, case))
        elif loud:
            print(f"sinkprof check: skipped {case.label}: it runs as {first.label} does", file=sys.stderr)
    return kept


class ReportOnce:
    """Rank 0's one report, from whichever thread asks first (the main one at the end of the run or
    on an error, the watchdog or a SIGTERM ending the rank); a later caller waits until it is
    written, so the rank never ends in the middle of it."""

    def __init__(self, emit):
        self._emit, self._lock, self._written = emit, threading.Lock(), threading.Event()

    def write(self, done: list, stopped: Optional["Stopped"]) -> bool:
        """Emit ``done`` (and ``stopped``) unless a report was made; True when this call made it."""
        if not self._lock.acquire(blocking=False):
            self._written.wait()
            return False
        try:
            self._emit(done, stopped)
        except Exception as exc:   # the run's own error is the one to show
            if stopped is None:
                raise
            print(f"sinkprof: rank 0: no report of the finished cases: {exc}", file=sys.stderr, flush=True)
        finally:
            self._written.set()
        return True


@dataclass(frozen=True)
class Stopped:
    """Where a run that did not finish stopped: the case running (its label; None after the last),
    its number, the cases there were, and why."""
    case: Optional[str]
    number: int
    of: int
    reason: str

    def line(self) -> str:
        where = (f"at case {self.number} of {self.of} ({self.case})" if self.case is not None
                 else f"after its last case ({self.of})")
        return f"stopped {where}: {self.reason}"


def report(results: list, passed: bool, info: RankInfo, seed: Optional[int], fault, output: Output,
           stopped: Optional[Stopped] = None) -> None:
    """Rank 0's report: the cases' results (those finished, and ``stopped`` where the run stopped
    early), as ``output`` asks; ``seed`` the run's, None where its settings groups differ in it
    (each case has its own)."""
    doc = {"passed": passed, "cp": info.world, "device": str(info.device), "dist_backend": info.backend,
           "fault": fault.value if fault else None, "seed": seed,
           "stopped": asdict(stopped) if stopped else None,
           "cases": [r.to_json() for r in results]}

    def table(console):
        title = (f"sinkprof check: cp={info.world} on {info.device} ({info.backend})"
                 + (f", injected fault {fault.value}" if fault else ""))
        from rich.text import Text
        if results:
            render_table(results, title, console)
        else:
            console.print(Text(title, style="bold"))
            console.print("0 passed, 0 failed")
        if stopped:
            console.print(Text(stopped.line(), style="red"))

    output.emit(doc=doc, table=table)
    if output.to_file:
        if passed:
            how = "passed"
        else:
            how = f"FAILED ({stopped.line()})" if stopped else "FAILED"
        print(f"sinkprof check: {how}; wrote {output.path}", flush=True)


# The tensors whose error is a ratio to the tolerance; the others ("comm", "reference") pass or fail.
COMPARED = tuple(n for n in NAMES if n not in ("comm", "reference"))


def case_parts(case: Case) -> dict:
    """What the table says about a case: its options and its shape (cases of several settings
    groups may differ in shape); a pack's documents as its label shows them, their count when the
    list is long (``--format json`` lists them)."""
    sh = case.shape
    parts = case.parts()
    size = f"t={sh.s}" if case.docs else f"b={sh.b} s={sh.s}"
    return dict(parts, shape=f"{size} h={sh.h} g={sh.g} d={sh.d}")


def split_parts(cases: list) -> tuple:
    """(the parts every case shares, in order; the sink options every case with one shares, which
    the others lack: ``step0`` and ``grad=full`` beside vanilla cases; per case the parts that
    vary). A window's or a bias's absence is a value of its own, so only the sink options are
    shared where they apply."""
    parts = [case_parts(c) for c in cases]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    texts = {k: {p[k] for p in parts if k in p} for k in keys}
    everywhere = [k for k in keys if len(texts[k]) == 1 and all(k in p for p in parts)]
    applying = [k for k in ("sink_strategy", "sink_grad") if k in texts and k not in everywhere and len(texts[k]) == 1]
    shared = everywhere + applying
    return ([next(iter(texts[k])) for k in everywhere], [next(iter(texts[k])) for k in applying],
            [[text for k, text in p.items() if k not in shared] for p in parts])


def worst_error(result: CaseResult) -> tuple:
    """(name, ratio) of the compared tensor furthest from its tolerance: max |err| / (atol + rtol
    |expected|), <= 1 passes; (None, 0.0) when nothing was compared."""
    found = [(n, result.errors[n].worst) for n in COMPARED if n in result.errors]
    if not found:
        return None, 0.0
    return max(found, key=lambda item: (item[1] != item[1], item[1]))   # nan counts as the worst


def render_table(results: list, title: str, console) -> None:
    """The report as a table that reads at 80 columns: the case options every case shares once,
    above it; per case the options that vary, the worst error as a ratio to the tolerance (and
    which tensor), the byte contract and reference checks, the time and the result. Cells wrap,
    never cut; ``--format json`` has every tensor's error."""
    from rich.table import Table
    from rich.text import Text
    common, applying, varying = split_parts([r.case for r in results])
    if len({r.seed for r in results}) > 1:   # settings groups of different seeds: otherwise alike rows
        varying = [[*parts, f"seed={r.seed}"] for parts, r in zip(varying, results)]
    console.print(Text(title, style="bold"))
    if common:
        console.print(Text("every case: " + ", ".join(common)))
    if applying:
        console.print(Text("where they apply: " + ", ".join(applying)))
    t = Table(show_edge=False, pad_edge=False)
    t.add_column("#", justify="right", overflow="fold")
    if any(varying):
        longest = max(len(p) for parts in varying for p in parts)
        t.add_column("case", overflow="fold", min_width=min(longest, 24))
    t.add_column("worst err/tol", justify="right", overflow="fold")
    t.add_column("checks", overflow="fold")
    t.add_column("time", justify="right", overflow="fold")
    t.add_column("result", overflow="fold")
    for i, (r, parts) in enumerate(zip(results, varying), 1):
        name, ratio = worst_error(r)
        worst = Text("-" if name is None else f"{ratio:.2g} {name}", style="" if ratio <= 1.0 else "red")
        failed = [n for n in ("comm", "reference") if n in r.errors and not r.errors[n].passed]
        checks = Text(" ".join(f"{n} FAIL" for n in failed), style="red") if failed else Text("ok")
        cells = [str(i)] + ([Text(" ".join(parts))] if any(varying) else [])
        t.add_row(*cells, worst, checks, f"{r.seconds:.2f}s",
                  Text("pass", style="green") if r.passed else Text("FAIL", style="red"))
    console.print(t)
    tolerances: dict = {}
    for r in results:
        tolerances.setdefault(r.case.dtype, []).append(f"{r.tolerance.atol:g}/{r.tolerance.rtol:g}")
    console.print(Text("worst err/tol: the largest |error| / (atol + rtol |expected|) over "
                       + ", ".join(n for n in COMPARED if any(n in r.errors for r in results))
                       + "; a case passes at <= 1 (every tensor's error: --format json). atol/rtol: "
                       + "; ".join(f"{dtype} {', '.join(dict.fromkeys(tols))}" for dtype, tols in tolerances.items())
                       + ". checks: the messages and bytes against the plan's, and a reference nothing wrote into.",
                       style="dim"), width=min(console.width, 80))   # wrapped as the table reads, at 80 columns
    for n in (n for r in results for n in r.notes):
        console.print(Text(f"note: {n}"))
    failed = sum(not r.passed for r in results)
    console.print(f"{len(results) - failed} passed, {failed} failed")
