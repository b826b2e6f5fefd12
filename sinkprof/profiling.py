"""Profiling hooks of the ring: NVTX ranges, ``torch.profiler`` ranges and per-step timings
(docs/design.md, section 8).

The ring loops and the communication layer call ``profiling.active``, a ``NullProbe`` unless a
benchmark installed a ``Probe``: then each ring step gets one range for its compute and one for
its communication (posted in step i, waited at step i+1), all in the NVTX domain ``sinkprof``,
mirrored by ``torch.profiler.record_function`` so Kineto traces show the same structure, and
timed: CUDA events on the compute and communication streams (read after the iteration, never
inside the loop), wall clock on the CPU. All times are relative to one mark per iteration.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

try:
    import nvtx
except Exception:  # pragma: no cover - nvtx is a core dependency, but keep the ring importable
    nvtx = None

DOMAIN = "sinkprof"


class NullProbe:
    """Profiling off: every hook is a no-op (the ring pays one attribute lookup per step)."""

    _null = contextlib.nullcontext()

    def compute(self, phase: str, step: int):
        return self._null

    def comm_start(self, phase: str, step: int, kind: str, stream=None, nbytes: int = 0):
        return None

    def comm_end(self, token, stream=None) -> None:
        """Nothing was started."""


active = NullProbe()


@dataclass
class Span:
    phase: str
    step: int
    kind: str          # compute, kv, dkv, a2a, iteration
    start: object      # CUDA event or perf_counter seconds
    end: object = None
    nbytes: object = ""  # communication spans: bytes this rank sent


class _Clock:
    """Marks on the GPU timeline (events from a reused pool) or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.pool: list = []
        self.used = 0

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        if self.used == len(self.pool):
            self.pool.append(torch.cuda.Event(enable_timing=True))
        ev = self.pool[self.used]
        self.used += 1
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def reset(self) -> None:
        self.used = 0

    def ms(self, ref, mark) -> float:
        if not self.cuda:
            return (mark - ref) * 1e3
        return ref.elapsed_time(mark)


class Probe:
    """Profiling on: NVTX + record_function ranges (each optional) and span timings."""

    def __init__(self, rank: int, device: torch.device, use_nvtx: bool = True, use_record_function: bool = True):
        self.rank = rank
        self.clock = _Clock(torch.device(device))
        self.use_nvtx = use_nvtx and nvtx is not None
        self.use_rf = use_record_function
        self.spans: list[Span] = []
        self.ref = None

    # ranges ---------------------------------------------------------------------------------

    def _open(self, name: str, nested: bool):
        handles = [None, None]
        if self.use_nvtx:
            if nested:
                nvtx.push_range(name, domain=DOMAIN)
            else:
                handles[0] = nvtx.start_range(name, domain=DOMAIN)
        if self.use_rf:
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            handles[1] = rf
        return handles

    def _close(self, handles, nested: bool) -> None:
        if handles[1] is not None:
            handles[1].__exit__(None, None, None)
        if self.use_nvtx:
            if nested:
                nvtx.pop_range(domain=DOMAIN)
            else:
                nvtx.end_range(handles[0])

    @contextlib.contextmanager
    def _timed(self, name: str, span: Span):
        handles = self._open(name, nested=True)
        if span.start is None:
            span.start = self.clock.mark()
        try:
            yield
        finally:
            span.end = self.clock.mark()
            self.spans.append(span)
            self._close(handles, nested=True)

    def iteration(self, phase: str, index: int):
        """One measured iteration of one phase: the reference mark, a range, a wall span."""
        self.clock.reset()
        self.spans = []
        self.ref = self.clock.mark()
        return self._timed(f"{phase} iter {index} rank {self.rank}", Span(phase, -1, "iteration", self.ref))

    def compute(self, phase: str, step: int):
        return self._timed(f"{phase} step {step} compute rank {self.rank}", Span(phase, step, "compute", None))

    def comm_start(self, phase: str, step: int, kind: str, stream=None, nbytes: int = 0):
        handles = self._open(f"{phase} step {step} {kind} rank {self.rank}", nested=False)
        return Span(phase, step, kind, self.clock.mark(stream), nbytes=nbytes), handles

    def comm_end(self, token, stream=None) -> None:
        span, handles = token
        span.end = self.clock.mark(stream)
        self.spans.append(span)
        self._close(handles, nested=False)

    # results --------------------------------------------------------------------------------

    def read(self) -> list[dict]:
        """Spans of the last iteration as rows (synchronises the device once)."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.clock.device)
        rows = []
        for s in self.spans:
            start, end = self.clock.ms(self.ref, s.start), self.clock.ms(self.ref, s.end)
            rows.append(dict(phase=s.phase, step=s.step, kind=s.kind, start_ms=start, end_ms=end, dur_ms=end - start,
                             bytes=s.nbytes))
        return rows


@contextlib.contextmanager
def installed(probe):
    """Make ``probe`` the active one for the duration of the block."""
    global active
    previous, active = active, probe
    try:
        yield probe
    finally:
        active = previous


def overlap_rows(rows: list[dict]) -> list[dict]:
    """Add ``overlap_ms`` and ``exposed_ms`` to communication rows (one rank, one iteration): the
    part of an exchange that ran while the rank computed, any step of its phase (K/V posted in
    step i overlaps step i; dK/dV posted after step i overlaps step i+1), and the rest
    (communication nobody hid). Steps may compute at once (step 0 beside the next step on a second
    stream, ``ring.Beside``), so the overlap is the intersection with the union of the phase's
    compute spans."""
    busy = {phase: _union([(c["start_ms"], c["end_ms"]) for c in rows
                           if c["kind"] == "compute" and c["phase"] == phase]) for phase in {r["phase"] for r in rows}}
    for r in rows:
        if r["kind"] in ("kv", "dkv", "a2a"):
            ov = sum(max(0.0, min(r["end_ms"], e) - max(r["start_ms"], s)) for s, e in busy[r["phase"]])
            r["overlap_ms"] = ov
            exposed = r["dur_ms"] - ov   # what the sums' rounding leaves of a span under compute is none
            r["exposed_ms"] = exposed if exposed > 1e-9 * r["dur_ms"] else 0.0
    return rows


def _union(spans) -> list[tuple[float, float]]:
    """Intervals ``spans`` merged where they overlap, in order."""
    out: list = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out
