"""Benchmark (not a test): the tile kernels of every GPU backend (cuDNN, FA4) with and without the
sink, FA4 called directly, and one rank's whole ring schedule on each backend against the FA4
monolithic kernel on the whole sequence. Needs a CUDA GPU (and the backends' packages).

    python scripts/bench_kernels.py --out kernel_bench.json
    python scripts/bench_kernels.py --rings h16-d128:2,4,8 --masks causal --profile-step
    python scripts/bench_kernels.py --skip-tiles --rings "" --packs gpt-oss:8 --ring-backends fa4

Tiles (one tile = the whole sequence): per backend, vanilla, the native sink (``step0``) and
``post-merge`` (vanilla + the sink folded into the output / vanilla + the closed-form sink
gradient); FA4 called directly through ``flash_attn.cute.interface`` on contiguous bshd tensors
(the figure the fa4 tiles must match); a gpt-oss window-(127, 0) tile.

Rings: per configuration (heads, K/V heads, head dim; s per rank fixed, so s = cp x s_rank), for
cp in the list and each mask, every backend runs the schedule of ranks 0, cp/2 and cp-1 (K/V of
the other ranks from memory, no communication) for vanilla, learnable ``step0`` and learnable
``post-merge``; the slowest is reported, and its rate against FA4's monolithic rate on the whole
sequence (vanilla against vanilla, learnable against FA4 with the sink) is the ring efficiency:
the monolithic calls are replayed in the same interleaved run as the rank's variants, so the
ratio holds no drift between runs ("timed apart": against the monolithic calls' own run, as
sessions before the fourteenth measured it). Beside each fa4 vanilla row, "its calls
standalone": the efficiency that rank would have if its FA4 calls, each timed standalone at its
shape in the same run as the monolithic call, were all it did
(what the tile shapes of its steps cost: its runs of steps joined as the ring runs them,
``plan.join_runs``; not an upper bound on the backward, where each standalone call pays FA4's pre-
and post-processing passes that the ring pays once per row), and "the backward's step by step":
the same with the backward's runs not joined (what joining them gives).
``--ring-backends fa4+comm`` (any backend, ``+comm``) times instead what ``cp_attention`` runs on a
rank: ``P2PAttention``'s forward and backward (its K/V and dK/dV buffers, exchanges and passes)
over a loopback communicator whose messages are device copies on a
stream of their own, so only the link is missing. ``fa4+null`` runs the same code with no message
moved (its received buffers filled once with normal values after the capture): the ring's own code
without communication, the issue's measure for the backward too, where the bare schedule adds each
step's dK/dV into fp32 per owner as the ring does not. ``fa4+comm-concurrent`` issues every copy on
a stream of its own, all at once, as one NCCL launch would move a post's tensors (over the plain
loopback, the copies after a post's first wait behind the compute call issued after them; the
twenty-second session found the two alike within a cell's spread). Both run under each K/V schedule of
``--kv-schedules`` (default ``direct``: what ``cp_attention``'s ``auto`` takes for these shapes).

Packs (issue 15's target: the slowest rank's ring on a 64k pack of documents of 2k-16k tokens at
cp = 8 at >= 0.90x FA4's varlen rate on the same pack): document lengths drawn from a seeded
generator (multiples of 2 cp, summing to ``--pack-len``), each document cut into 2 cp chunks as
``sinkprof.shard(..., cu_seqlens)`` cuts it, causal within each document (``--pack-layouts
balanced``: also in the balanced layout, under allgather, every rank timed); ranks 0, cp/2 and cp-1
run their whole schedule as above, against one ``_flash_attn_fwd`` / ``_flash_attn_bwd`` call with
``cu_seqlens_q = cu_seqlens_k`` on the whole pack. FLOPs on both sides: each document's own causal
pairs. ``pack_setup`` builds the pack, its plans and shards on any device (the CPU tests use it).

GPU times come from CUDA graph replays of each variant, alternated round after round: launch
cost stays out of the kernel figures, and clock drift hits every variant alike (plain repeated
runs of one kernel differed by up to 10% on the H200 of this workplace). Each replay keeps the GPU
about as long busy (``--rounds equal``): a shorter variant's holds more calls. FA4 runs these
GPUs at their power limit (an H100 at 697 W, its SM clock 1245-1980 MHz, throttled by the power
cap in 98% of its busy samples, twenty-third session), so a GPU rested between rounds can start
the next one at a higher clock, and any rest must weigh alike on every figure.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sinkprof import fused  # noqa: E402
from sinkprof.dist import by_peer  # noqa: E402
from sinkprof.kernels import get_kernel, unavailable_reason  # noqa: E402
from sinkprof.options import Band, CPOptions, KVSchedule, PackLayout, SinkStrategy, make_spec  # noqa: E402
from sinkprof import plan as plan_module  # noqa: E402
from sinkprof.plan import shard, spec_layout  # noqa: E402
from sinkprof.ring import (BackwardState, ForwardState, LocalDKV, LocalKV, P2PAttention, joined_plan,  # noqa: E402
                           run_backward, run_forward)
from sinkprof.schedule import CommSchedule  # noqa: E402
from sinkprof.kernels import fa4 as fa4_module  # noqa: E402
from sinkprof.sink import merge_parts_, sink_grad  # noqa: E402
from sinkprof.tool.report import union_ms  # noqa: E402

FA4_WINDOW = fa4_module.fa4_window   # FA4's own reading of a band (``--fa4-full-window`` replaces the ring's)

BWD_FLOPS = 2.5     # a backward counted as 2.5 forwards


def positive_ints(ap: argparse.ArgumentParser, option: str, text: str, what: str, example: str) -> list[int]:
    """A probe's comma-separated list of positive whole numbers, or its usage error (exit 2)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        ap.error(f"{option} {text}: give {what}, comma-separated, e.g. {example}")
    return values


def probe_ms(fns: dict) -> dict:
    """A probe's functions, each called once (FA4 compiles on first use), then ``interleaved_ms``."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    return interleaved_ms(fns, calls=2, rounds=15)


def fa4_interface_or_exit(ap: argparse.ArgumentParser):
    """FA4's ``flash_attn.cute.interface`` for a probe script, or its usage error (exit 2) naming
    why FA4 cannot run here; the command line is cut to the program name first, as the CuTe DSL
    parses it at every compile (sinkprof.kernels.fa4)."""
    why = unavailable_reason("fa4", "cuda") if torch.cuda.is_available() else "no CUDA device is visible"
    if why:
        ap.error(f"needs FlashAttention-4 on a GPU: {why}")
    sys.argv = sys.argv[:1]
    from flash_attn.cute import interface
    return interface


def capture(fn, calls: int, keep: bool = False) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn``, warmed on a side stream first.
    ``keep``: the graph is kept beside its executable one (``graph_census`` reads it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    if keep:
        graph.instantiate()
    return graph


# cudaGraphNodeType, by value (CUDA runtime API, driver_types.h)
GRAPH_NODE_TYPES = ("kernel", "memcpy", "memset", "host", "child graph", "empty", "event wait", "event record",
                    "semaphore signal", "semaphore wait", "mem alloc", "mem free", "batch mem op", "conditional")


def census_text(counts: dict) -> str:
    """``{node type: count}`` as one line, the most frequent type first: ``12 nodes: 7 kernel, ...``."""
    total = sum(counts.values())
    parts = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total} node{'s' if total != 1 else ''}" + (f": {parts}" if parts else "")


def _cudart():
    """The CUDA runtime library this process has loaded (torch's), through ctypes."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    if path is None:
        raise RuntimeError("no libcudart.so is loaded in this process")
    return ctypes.CDLL(path)


def graph_census(graph: torch.cuda.CUDAGraph) -> dict:
    """The nodes of ``graph`` (``capture(..., keep=True)``) by type: what its launch submits (a
    kernel, a copy or a memset each, and the empty, event and other nodes a capture across
    streams may leave), read through the CUDA runtime's ``cudaGraphGetNodes`` and
    ``cudaGraphNodeGetType``."""
    lib = _cudart()

    def check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: cudaError {err}")
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    check(lib.cudaGraphGetNodes(raw, None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(lib.cudaGraphGetNodes(raw, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    counts: dict = collections.Counter()
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        check(lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        counts[GRAPH_NODE_TYPES[kind.value] if 0 <= kind.value < len(GRAPH_NODE_TYPES) else f"type {kind.value}"] += 1
    return dict(counts)


LAUNCH = "waited"          # ``--launch``: waited, hidden (a GPU sleep covers each timed replay's launch) or rested
REST_S = 0.002             # ``--launch rested``: the host waits this long before each timed replay, the GPU idle
LAUNCH_COVER_CYCLES = 4_000_000   # ~2 ms of GPU clock: longer than any replay's launch measured (0.42 ms)
FIXED_ROUNDS = False       # ``--rounds fixed``: every replay holds the same number of calls


def interleaved_ms(fns: dict, calls: int = 4, rounds: int = 25, graphed: bool = True,
                   ready: Optional[Callable] = None) -> dict:
    """GPU milliseconds per call of each function: each one captured, then replayed in alternating
    order, round after round, so clock and thermal drift hit every variant alike. Median and spread
    (max - min) over the rounds, ``launch_us``, the host's median microseconds to launch a
    round's replay (or its eager calls), and ``calls`` a round. Each round starts on an idle GPU
    (``LAUNCH`` waited): the figure holds the time the GPU waits for the launch to reach its first
    kernel. ``hidden``: a GPU sleep issued first covers the launch, as the work before it would in
    a training step; ``rested``: the GPU rests as long first, the launch not hidden.
    ``graphed=False``: ``calls`` eager calls per round instead of a replay (launch cost included).
    Graphed, unless ``FIXED_ROUNDS``, a shorter function's replay holds more calls (``round_calls``),
    so that every round keeps the GPU busy about as long, and any rest between rounds (the
    host's sync, the launch sleep) weighs alike on each figure: with two calls a replay, the launch
    sleep sped an 8-rank ring's 6 ms rounds by 8% and FA4's 50 ms monolithic ones by 2%; with
    rounds as long, by under 1% both (twenty-third session).
    ``ready``: called once every graph is captured, before the rounds (``Loopback.fill``)."""
    per = dict.fromkeys(fns, calls)
    if graphed:
        graphs = {name: capture(fn, calls) for name, fn in fns.items()}
        if not FIXED_ROUNDS:
            if ready is not None:
                ready()
            per = round_calls({name: replay_ms(g) / calls for name, g in graphs.items()}, calls)
            for name, n in per.items():
                if n != calls:
                    graphs[name] = None   # (its memory back before the longer capture)
                    graphs[name] = capture(fns[name], n)
        runs = {name: g.replay for name, g in graphs.items()}
        del graphs
    else:
        runs = {name: (lambda fn=fn: [fn() for _ in range(calls)]) for name, fn in fns.items()}
    if ready is not None:
        ready()
    times = {name: [] for name in fns}
    launch = {name: [] for name in fns}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            if LAUNCH == "hidden":
                torch.cuda._sleep(LAUNCH_COVER_CYCLES)
            elif LAUNCH == "rested":
                time.sleep(REST_S)
            start.record()
            t0 = time.perf_counter()
            runs[name]()
            launch[name].append((time.perf_counter() - t0) * 1e6)
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) / per[name])
    del runs
    return {name: {"ms": statistics.median(t), "spread_ms": max(t) - min(t),
                   "launch_us": statistics.median(launch[name]), "calls": per[name]} for name, t in times.items()}


ROUND_MS = 50.0          # a round's GPU time at least, under equal rounds
ROUND_CALLS_MAX = 256    # calls in one replay at most (a short tile beside a long monolithic call)


def round_calls(call_ms: dict, calls: int) -> dict:
    """Calls per replay of each function (name -> GPU ms of one call) so that every replay takes
    about as long: ``calls`` of the longest, or ``ROUND_MS`` if that is longer; at least ``calls``,
    at most ``ROUND_CALLS_MAX``."""
    if not call_ms:
        return {}
    target = max(calls * max(call_ms.values()), ROUND_MS)
    return {name: min(ROUND_CALLS_MAX, max(calls, round(target / max(ms, 1e-3)))) for name, ms in call_ms.items()}


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """GPU milliseconds of one replay, after a warm one."""
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def host_us(fn, calls: int = 20) -> float:
    """Host microseconds to issue one call of ``fn`` (the GPU runs behind; no sync inside)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def backends() -> list:
    return [name for name in ("cudnn", "fa4") if unavailable_reason(name, "cuda") is None]


def fa4_direct(q, k, v, band: Band, sink, scale):
    """FA4 through its own interface on bshd tensors: (forward, backward) closures (a full band
    as FA4 takes it by default, whatever ``--fa4-full-window`` does to the ring's calls)."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    causal, left, right = FA4_WINDOW(band, q.shape[1], k.shape[1])
    kw = dict(softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
              learnable_sink=None if sink is None else sink.reshape(-1))
    o, lse = _flash_attn_fwd(q, k, v, return_lse=True, **kw)[:2]
    do = torch.randn_like(o)
    return (lambda: _flash_attn_fwd(q, k, v, return_lse=True, **kw),
            lambda: _flash_attn_bwd(q, k, v, o, do, lse, **kw))


def _full_as_window(band: Band, n_q: int, n_kv: int) -> tuple:
    """``fa4_window``, but a full band as a window covering the whole tile (``--fa4-full-window``):
    FA4's forward then runs its non-persistent scheduler, whose blocks retire through the call,
    rather than one persistent block per SM until the end."""
    if band == Band():
        return False, n_kv, n_q
    return FA4_WINDOW(band, n_q, n_kv)


def _forward_full_as_window(forward: Callable) -> Callable:
    """``FA4Tiles.forward`` reading full bands as ``_full_as_window`` does, during its call only
    (the backward is not persistent: it keeps FA4's own reading)."""
    def wrapped(*args, **kwargs):
        fa4_module.fa4_window = _full_as_window
        try:
            return forward(*args, **kwargs)
        finally:
            fa4_module.fa4_window = FA4_WINDOW
    return wrapped


def tile_bench(b, h, g, s, d, band: Band, label: str) -> dict:
    """Every backend's tile on one whole-sequence tile, and FA4 called directly, interleaved."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (_rand(gen, b, s, h, d) for _ in range(2))
    k, v = (_rand(gen, b, s, g, d) for _ in range(2))
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    qh, kh, vh, doh = (x.permute(0, 2, 1, 3) for x in (q, k, v, do))
    scale = d ** -0.5
    flops = 4 * b * h * d * band.count(s, s)
    fwd, bwd = {}, {}
    for name in backends():
        kernel = get_kernel(name, "cuda")
        o_v, lse_v = kernel.forward(qh, kh, vh, band, None, None, scale)
        o_s, lse_s = kernel.forward(qh, kh, vh, band, sink, None, scale)

        def post_merge_fwd(kernel=kernel):  # one tile standing alone: the fold is a pass of its own
            o, lse = kernel.forward(qh, kh, vh, band, None, None, scale)
            merge_parts_(o, lse, o.unsqueeze(0)[:0], lse.unsqueeze(0)[:0], sink=sink)   # no parts: the fold alone

        def post_merge_bwd(kernel=kernel, o_s=o_s, lse_s=lse_s):
            kernel.backward(qh, kh, vh, o_s, doh, lse_s, band, None, None, scale)
            sink_grad(o_s, doh, lse_s, sink)
        fwd |= {f"{name} vanilla fwd": lambda k_=kernel: k_.forward(qh, kh, vh, band, None, None, scale),
                f"{name} sink (step0) fwd": lambda k_=kernel: k_.forward(qh, kh, vh, band, sink, None, scale),
                f"{name} post-merge fwd": post_merge_fwd}
        bwd |= {f"{name} vanilla bwd": lambda k_=kernel, o=o_v, l=lse_v: k_.backward(qh, kh, vh, o, doh, l, band,
                                                                                   None, None, scale),
                f"{name} sink (step0) bwd": lambda k_=kernel, o=o_s, l=lse_s: k_.backward(qh, kh, vh, o, doh, l, band,
                                                                                        sink, None, scale),
                f"{name} post-merge bwd": post_merge_bwd}
    if "fa4" in backends():
        for tag, a in (("vanilla", None), ("sink", sink)):
            f, bw = fa4_direct(q, k, v, band, a, scale)
            fwd[f"FA4 direct {tag} fwd"], bwd[f"FA4 direct {tag} bwd"] = f, bw
    timed = interleaved_ms(fwd) | interleaved_ms(bwd)
    return {"label": label, "shape": dict(b=b, h=h, g=g, s=s, d=d), "band": str(band),
            "kernels": {n: dict(r, tflops=flops * (BWD_FLOPS if n.endswith("bwd") else 1) / r["ms"] / 1e9)
                        for n, r in timed.items()}}


RUNS = [("vanilla", SinkStrategy.STEP0), ("learnable", SinkStrategy.STEP0), ("learnable", SinkStrategy.POST_MERGE)]


@dataclass
class RankRing:
    """One rank's whole schedule as two closures writing into preallocated buffers, and the buffers
    (what a forward and a backward leave there; dK/dV add up over calls)."""

    fwd: Callable
    bwd: Callable
    out: Optional[torch.Tensor]     # [b, h, 2c, d] (None: the ring's own buffers)
    dq: Optional[torch.Tensor]      # [b, h, 2c, d], q's dtype
    dks: list             # every rank's dK, [b, g, 2c, d] fp32
    dvs: list
    comm: Optional["Loopback"] = None   # the ring's own code: the communicator it ran over


def _ring_fns(kernel, schedule, rank, qh, dol, ks, vs, sink, softmax, strategy, mask, d, rows_path=True) -> RankRing:
    """One rank's whole schedule into preallocated buffers (every step reads its owner's shard in
    place; under allgather the sequence, and under direct each run's K/V (``Step.joins``), are put
    together once, before the timed calls);
    ``rows_path``: FA4's backward keeps dq across tiles (False: tile by tile)."""
    b, h = qh.shape[:2]
    opts = CPOptions(make_spec(softmax, mask, None, "bshd"), d ** -0.5, kernel, strategy)
    plan = joined_plan(schedule, rank, qh.transpose(1, 2), opts.spec.qkv_format, False)   # runs joined
    a = sink if softmax == "learnable" else None
    # buffers laid out as the ring lays them out (the user's bshd storage, seen as bhsd)
    lse = torch.empty(b, h, qh.shape[2], dtype=torch.float32, device=qh.device)
    out = torch.empty_like(qh)
    dq = torch.empty_like(qh)
    dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    fwd_state = ForwardState.make(plan, qh, out, lse)
    bwd_state = BackwardState(qh, out, dol, lse, dq)
    # made once: under allgather the K/V in sequence order are gathered at the first call, not timed
    kv_fwd, kv_bwd = LocalKV(ks, vs, schedule, rank, "fwd"), LocalKV(ks, vs, schedule, rank, "bwd")

    def fwd():
        run_forward(plan, kv_fwd, state=fwd_state, sink=a, bias=None, opts=opts)

    def bwd():
        if kernel.name == "fa4":
            kernel.rows_path = rows_path
        run_backward(plan, kv_bwd, LocalDKV(dks, dvs, schedule, reader=rank, kv_dtype=ks[0].dtype), state=bwd_state,
                     sink=a, bias=None, opts=opts)
    return RankRing(fwd, bwd, out, dq, dks, dvs)


class _Arrived:
    """A loopback message: done once the compute stream waits for the end of its copies (events
    recorded when they were posted, as NCCL's work ends with its own op: a message posted later
    on the copy stream is not waited for); on the CPU, at once."""

    def __init__(self, events: list):
        self.events = events

    def wait(self) -> None:
        for event in self.events:
            torch.cuda.current_stream().wait_event(event)


class Loopback:
    """The communicator of one rank timed alone: each message is a device copy on a stream of its
    own (into each received buffer from the sent one of the same size, else from a buffer kept
    for it), so a step's messages read and write this GPU's memory as much as a ring's sends and
    receives do, beside the compute, and the ring's own code (``P2PAttention``, its K/V and dK/dV
    movers) runs as under NCCL. No link is modelled: a message takes the time of its copy.

    A kept buffer holds standard normal values, as the benchmark's inputs do, never zeros: on the
    H200 FA4 ran a 4096 x 8192 tile 5% (forward) and 3% (backward) faster on all-zero K/V than on
    normal values, which made the ranks whose messages all came from zeros look faster than
    they are."""

    PRIORITY = 0   # the copy stream's CUDA priority (lower is higher; ``--loopback-priority``)
    POOL = 8   # the streams concurrent copies take in turn

    def __init__(self, rank: int, size: int, device, copies: bool = True, concurrent: bool = False):
        """``concurrent`` (``BACKEND+comm-concurrent``): each copy on a stream of its own, every copy
        of every post issued at once (as one NCCL launch moves a post's tensors together), not one
        after another on the copy stream. ``copies=False`` (``BACKEND+null``): no message moves. A buffer received into under a
        CUDA graph's capture is filled once with normal values after the capture (``fill``), so
        the graph reads what a message would have brought, never zeros; issued eagerly, the first
        time its memory is received into. Unlike a copy's, its data is not in L2 when it is read."""
        self.rank, self.size, self.copies, self.concurrent = rank, size, copies, concurrent
        self.unfilled: list = []   # the buffers received into under capture, with copies off
        self.filled: set = set()   # (address, shape, strides, dtype) of those filled eagerly
        self.stream = (torch.cuda.Stream(device, priority=self.PRIORITY) if torch.device(device).type == "cuda"
                       else None)
        self.streams = ([torch.cuda.Stream(device, priority=self.PRIORITY) for _ in range(self.POOL)]
                        if self.stream is not None and concurrent else [])   # concurrent copies, in turn
        self.turn = 0
        self.sources: dict = {}
        self.gen = torch.Generator(device=device).manual_seed(1000 + rank)
        self.received: dict = collections.Counter()   # (phase, kind) -> messages received
        self.received_bytes: dict = collections.Counter()   # (phase, kind) -> bytes received

    def exchange(self, send, recv, kind: str, phase: str, step: int) -> _Arrived:
        return self.post([(send, (self.rank + 1) % self.size)], [(recv, (self.rank - 1) % self.size)],
                         kind, phase, step)

    def post(self, sends: list, recvs: list, kind: str, phase: str, step: int) -> _Arrived:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        ends = []   # the events the message's arrival waits for
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.received[(phase, kind)] += len(by_peer(recvs))   # a message a peer (K and V apart: two tensors)
            for n, (t, _) in enumerate(recvs):
                self.received_bytes[(phase, kind)] += t.numel() * t.element_size()
                if not self.copies:
                    if self.capturing():
                        self.unfilled.append(t)
                    elif (key := (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)) not in self.filled:
                        t.normal_(generator=self.gen)
                        self.filled.add(key)
                    continue
                same = n < len(sends) and (sends[n][0].shape, sends[n][0].dtype) == (t.shape, t.dtype)
                src = sends[n][0] if same else None
                if src is None:   # a buffer kept per shape: made (and filled) once, not at every message
                    key = (tuple(t.shape), t.dtype)
                    if key not in self.sources:
                        self.sources[key] = torch.randn(t.shape, generator=self.gen, device=t.device).to(t.dtype)
                    src = self.sources[key]
                if self.streams:   # concurrent: a stream of the pool, after the same wait
                    side = self.streams[self.turn % len(self.streams)]
                    self.turn += 1
                    side.wait_stream(self.stream)
                    with torch.cuda.stream(side):
                        t.copy_(src)
                    ends.append(torch.cuda.Event())
                    ends[-1].record(side)
                else:
                    t.copy_(src)
            if self.stream is not None and not ends:
                ends.append(torch.cuda.Event())
                ends[-1].record(self.stream)
        return _Arrived(ends)

    def capturing(self) -> bool:
        return self.stream is not None and torch.cuda.is_current_stream_capturing()

    def fill(self) -> None:
        """Normal values into every buffer received into under capture (``copies=False``)."""
        for t in self.unfilled:
            t.normal_(generator=self.gen)
        self.unfilled.clear()


class _Ctx:
    """What ``P2PAttention.forward`` keeps for its backward, outside autograd."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _spec(softmax: str, mask: str, cu_seqlens=None, pack_layout=PackLayout.ZIGZAG):
    """A sequence's spec (bshd), or a pack's (thd with ``cu_seqlens`` in ``pack_layout``, seen as
    one bshd sequence)."""
    if cu_seqlens is None:
        return make_spec(softmax, mask, None, "bshd")
    return make_spec(softmax, mask, None, "thd", cu_seqlens, pack_layout).batched()


def _comm_ring_fns(kernel, schedule: CommSchedule, rank: int, q, k, v, do, sink, softmax, strategy, mask, d,
                   cu_seqlens=None, copies: bool = True, concurrent: bool = False) -> RankRing:
    """One rank's forward and backward through the ring's own code, ``P2PAttention`` under
    ``schedule``'s K/V schedule, over a ``Loopback`` communicator: what ``cp_attention`` runs on a
    rank, but for the link (``copies=False``: and the messages; ``concurrent``: ``Loopback``'s). ``q``, ``k``, ``v``, ``do``: this
    rank's ``[b, 2c, h|g, d]`` shards (a pack: ``b = 1`` and its ``cu_seqlens``)."""
    opts = CPOptions(_spec(softmax, mask, cu_seqlens, schedule.layout.kind), d ** -0.5, kernel, strategy,
                     kv_schedule=schedule.kind)
    cp = schedule.cp
    comm = Loopback(rank, cp, q.device, copies, concurrent)
    offset = sink if softmax == "learnable" else None
    ctx = _Ctx()

    def fwd():
        P2PAttention.forward(ctx, q, k, v, offset, None, opts, comm)

    def bwd():
        P2PAttention.backward(ctx, do)
    return RankRing(fwd, bwd, None, None, [], [], comm)


def rank_flops(plan, b: int, h: int, d: int) -> int:
    """Forward FLOPs of one rank's tiles: 4 b h d per visible (query, key) pair."""
    return sum(4 * b * h * d * t.band.count(t.q_rows.stop - t.q_rows.start, t.kv_rows.stop - t.kv_rows.start)
               for st in plan.steps for t in st.tiles)


def rank_calls(plan) -> Optional[list[tuple[int, int, Band]]]:
    """The kernel calls of a rank's forward, one per step's tile, as ``(query rows, key rows,
    band)``; None where a step runs several tiles in one call (a pack's varlen groups), which
    one dense call of a shape cannot stand for."""
    if any(len(group) > 1 for step in plan.steps for group in step.groups):
        return None
    return [(t.q_rows.stop - t.q_rows.start, t.kv_rows.stop - t.kv_rows.start, t.band)
            for step in plan.steps for t in step.tiles]


def vs_fa4_mono(timed: dict, phase: str, flops: int, total: int, ms: float) -> float:
    """The rate of ``flops`` done in ``ms`` against FA4's monolithic vanilla call (``timed``'s
    ``f"fa4 vanilla {phase}"``) on ``total`` FLOPs."""
    return timed[f"fa4 vanilla {phase}"]["ms"] * flops / total / ms


def with_standalone_calls(rows: list, calls: dict, total: int, timed: dict, label: str = "calls") -> list:
    """Each fa4 vanilla row's efficiency if its rank's FA4 calls, timed standalone, were all it did:
    its FLOPs at FA4's monolithic vanilla rate over the sum of those calls' times (``calls``:
    (K/V schedule, rank, phase) -> ``rank_calls``, named by ``label`` in the row's keys;
    ``timed``: ``interleaved_ms`` of the monolithic calls and of every ``f"{shape_key(...)}
    fwd|bwd"``). The calls are timed without the sink, so only vanilla rows get it, and only
    FA4's: the other backends' calls were not timed."""
    for row in rows:
        if not row["backend"].startswith("fa4") or not row["variant"].startswith("vanilla"):
            continue
        for phase in ("fwd", "bwd"):
            rank_calls_ = calls.get((row["kv_schedule"], row["rank"], phase))
            if rank_calls_ is None:
                continue
            standalone = sum(timed[f"{shape_key(*c)} {phase}"]["ms"] for c in rank_calls_)
            row[f"{phase}_vs_fa4_mono_{label}_standalone"] = vs_fa4_mono(timed, phase, row["flops"], total, standalone)
    return rows


def shape_key(n_q: int, n_kv: int, band: Band) -> str:
    """A call shape's name, as printed and as the JSON's key: ``tile 8192x4096 full``, ``... causal``,
    or the band's range of ``j - i`` (``... band -127..0``)."""
    if band.is_full:
        name = "full"
    elif band == Band(None, 0):
        name = "causal"
    else:
        name = f"band {'-inf' if band.lo is None else band.lo}..{'inf' if band.hi is None else band.hi}"
    return f"tile {n_q}x{n_kv} {name}"


def _timed(fns: dict, calls: int = 1, rounds: int = 15, ready: Optional[Callable] = None) -> tuple[dict, str]:
    """``interleaved_ms`` from CUDA graphs, or issued eagerly when a capture fails (said, and
    returned as the timing used). One call a replay for the longest function (FA4's monolithic
    backward): under equal rounds every other replay holds as much GPU time (at h16 cp 8, about 8
    backward and 21 forward calls of a rank's ring)."""
    try:
        return interleaved_ms(fns, calls, rounds, ready=ready), "graphs"
    except RuntimeError as exc:
        print(f"warning: CUDA graph capture failed ({str(exc)[:200]}); timing {sorted(fns)} eagerly")
        torch.cuda.synchronize()
        return interleaved_ms(fns, calls, rounds, graphed=False), "eager"


CONTROLS = {   # a control variant of vanilla step0 -> the kernel settings it turns off
    "one-stream": ("concurrent",),       # every step on the ring's one stream (no ring.Beside)
    "whole-causal": ("causal_pieces",),  # the rows backward runs a causal tile whole (no fa4_rows.causal_cuts)
    "masked-config": ("unmasked_config",),  # a causal rank's rows backward runs FA4's configuration for masked tiles
}


def _configured(fn: Callable, kernel, off: tuple = ()) -> Callable:
    """``fn`` with the kernel's settings of ``CONTROLS`` as its class has them, less those named in
    ``off``: set at each call (a capture takes what is set then), as the variants of one kernel run
    interleaved."""
    settings = {flag: getattr(type(kernel), flag) and flag not in off
                for flags in CONTROLS.values() for flag in flags if hasattr(type(kernel), flag)}

    def call():
        for flag, on in settings.items():
            setattr(kernel, flag, on)
        fn()
    return call


def slowest_rank(names: list, schedule: CommSchedule, ranks, shards, ks, vs, sink, mask: str, d: int,
                 profile: Optional[str] = None, cu_seqlens=None, mono: Optional[dict] = None,
                 controls: tuple = ()) -> list:
    """Per name (a backend; ``fa4-per-tile``: FA4 with its backward tile by tile; a backend and
    ``+comm``: the ring's own code over a ``Loopback`` communicator) and variant of ``RUNS``: the
    slowest (forward + backward) of ``ranks``, each running its whole schedule, the variants
    interleaved. ``shards(rank)``: that rank's (q, dO) as ``[b, h, 2c, d]`` views; ``ks``,
    ``vs``: every rank's K/V the same way. ``profile``: print the kernels of each rank's learnable
    step0 ring under this title. ``cu_seqlens``: a pack's boundaries. ``mono``: the monolithic
    calls (name -> function), interleaved with each rank's variants, so that a row's ratio to
    them comes from one run (``with_rates``: the row's ``mono_ms``); the machine drifts by up to
    10% between runs. ``controls``: names of ``CONTROLS``, each also timed as vanilla step0 with
    those settings off (``vanilla step0 one-stream``: every step on one stream; ``vanilla step0
    whole-causal``: causal tiles' backward whole; ``vanilla step0 masked-config``: a causal rank's
    backward under FA4's configuration for masked tiles), against the variants, which have them on
    where the backend allows it."""
    cp = schedule.cp
    runs = [(softmax, strategy, "") for softmax, strategy in RUNS] + [
        ("vanilla", SinkStrategy.STEP0, control) for control in controls]
    rows = []
    for name in names:
        kernel = get_kernel(name.split("+")[0].removesuffix("-per-tile"), ks[0].device)
        slowest, every = {}, collections.defaultdict(dict)   # variant -> rank -> [fwd ms, bwd ms]
        for rank in ranks:
            plan = schedule.plans[rank]
            qh, dol = shards(rank)
            flops = rank_flops(plan, qh.shape[0], qh.shape[1], d)
            fns, host, comms = {}, {}, []
            for softmax, strategy, control in runs:
                variant = f"{softmax} {strategy.value} {control}".rstrip()
                if name.endswith(("+comm", "+comm-concurrent", "+null")):
                    ring = _comm_ring_fns(kernel, schedule, rank,
                                          *(x.transpose(1, 2) for x in (qh, ks[rank], vs[rank], dol)),
                                          sink, softmax, strategy, mask, d, cu_seqlens,
                                          copies=not name.endswith("+null"), concurrent=name.endswith("-concurrent"))
                    comms.append(ring.comm)
                else:
                    ring = _ring_fns(kernel, schedule, rank, qh, dol, ks, vs, sink, softmax, strategy, mask, d,
                                     rows_path=not name.endswith("-per-tile"))
                off = CONTROLS.get(control, ())
                ring = dataclasses.replace(ring, fwd=_configured(ring.fwd, kernel, off),
                                           bwd=_configured(ring.bwd, kernel, off))
                ring.fwd(), ring.bwd()
                host[variant] = (host_us(ring.fwd) + host_us(ring.bwd)) / (2 * len(plan.steps))
                fns[variant + " fwd"], fns[variant + " bwd"] = ring.fwd, ring.bwd
                if profile and (softmax, strategy) == RUNS[1]:
                    _profile_step(f"{name} {profile} rank {rank} {variant}", ring.fwd, ring.bwd,
                                  ready=getattr(ring.comm, "fill", None))
            timed, timing = _timed(fns | {f"mono {n}": fn for n, fn in (mono or {}).items()},
                                   ready=lambda: [c.fill() for c in comms])
            for c in comms:   # (what a failed capture left)
                c.unfilled.clear()
            for softmax, strategy, control in runs:
                variant = f"{softmax} {strategy.value} {control}".rstrip()
                row = dict(backend=name, kv_schedule=schedule.kind.value, layout=schedule.layout.kind.value, cp=cp,
                           mask=mask, variant=variant,
                           rank=rank, flops=flops,
                           fwd_ms=timed[variant + " fwd"]["ms"], bwd_ms=timed[variant + " bwd"]["ms"],
                           launch_us=[timed[variant + " fwd"]["launch_us"], timed[variant + " bwd"]["launch_us"]],
                           calls_per_replay=[timed[variant + " fwd"]["calls"], timed[variant + " bwd"]["calls"]],
                           host_us_per_step_eager=host[variant], timing=timing)
                if mono:
                    row["mono_ms"] = {n: timed[f"mono {n}"] for n in mono}
                every[variant][rank] = [row["fwd_ms"], row["bwd_ms"]]
                best = slowest.get(variant)
                if best is None or row["fwd_ms"] + row["bwd_ms"] > best["fwd_ms"] + best["bwd_ms"]:
                    slowest[variant] = row
        rows += [dict(row, ranks_ms=dict(every[variant])) for variant, row in slowest.items()]
    return rows


def with_rates(rows: list, total: int, mono_ms: dict, mono: str = "fa4") -> list:
    """Each row's TFLOP/s, and against the monolithic rate of ``total`` FLOPs (``mono_ms``: keys
    ``f"{mono} {vanilla|learnable} {fwd|bwd}"``; vanilla against vanilla, learnable against the sink),
    timed in the row's own run where it has them (its ``mono_ms``: ``slowest_rank``'s ``mono``)."""
    for row in rows:
        row["fwd_tflops"] = row["flops"] / row["fwd_ms"] / 1e9
        row["bwd_tflops"] = BWD_FLOPS * row["flops"] / row["bwd_ms"] / 1e9
        tag = row["variant"].split()[0]
        for suffix, ref in (("_separate_run", mono_ms if row.get("mono_ms") else None),
                            ("", row.get("mono_ms") or mono_ms)):
            if not ref:
                continue
            mono_fwd = total / ref[f"{mono} {tag} fwd"]["ms"] / 1e9
            mono_bwd = BWD_FLOPS * total / ref[f"{mono} {tag} bwd"]["ms"] / 1e9
            row |= {f"fa4_mono_fwd_tflops{suffix}": mono_fwd, f"fa4_mono_bwd_tflops{suffix}": mono_bwd,
                    f"fwd_vs_fa4_mono{suffix}": row["fwd_tflops"] / mono_fwd,
                    f"bwd_vs_fa4_mono{suffix}": row["bwd_tflops"] / mono_bwd}
    return rows


def ring_bench(cp, b, h, g, s_rank, d, mask: str, profile: bool, names: list, kinds=(KVSchedule.DIRECT,),
               controls: tuple = ()) -> dict:
    """The slowest of ranks 0, cp/2, cp-1 per backend, variant and K/V schedule (``kinds``),
    against FA4 monolithic; ``names``: backends, and ``fa4-per-tile`` (FA4 with its backward tile
    by tile); ``controls``: ``slowest_rank``'s."""
    s = s_rank * cp
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, do = _rand(gen, b, s, h, d), _rand(gen, b, s, h, d)
    k, v = _rand(gen, b, s, g, d), _rand(gen, b, s, g, d)
    sink = torch.randn(1, h, 1, 1, generator=gen, device="cuda") * 5
    band = make_spec("vanilla", mask, None, "bshd").band
    total = 4 * b * h * d * band.count(s, s)
    ranks = sorted({0, cp // 2, cp - 1})
    schedules = {kind: CommSchedule(kind, cp, s // (2 * cp), band) for kind in kinds}
    mono, calls, shapes = {}, {}, set()
    if "fa4" in backends():
        for tag, a in (("vanilla", None), ("learnable", sink)):
            mono[f"fa4 {tag} fwd"], mono[f"fa4 {tag} bwd"] = fa4_direct(q, k, v, band, a, d ** -0.5)
    whole = dict(mono)   # timed again beside each rank's ring, in its run
    if mono:
        # every timed rank's calls at their shapes, FA4 standalone, in the same interleaved run (with
        # its runs of steps joined, as the ring runs them; the backward's also step by step: what
        # joining its runs gives)
        calls, steps = {}, {}
        for kind, schedule in schedules.items():
            for r in ranks:
                for phase in ("fwd", "bwd"):
                    calls[(kind.value, r, phase)] = rank_calls(schedule.joined_plans[r])
                steps[(kind.value, r, "bwd")] = rank_calls(schedule.plans[r])
        shapes = {c for cs in (*calls.values(), *steps.values()) if cs for c in cs}
        for n_q, n_kv, tile_band in sorted(shapes, key=str):
            key = shape_key(n_q, n_kv, tile_band)
            mono[f"{key} fwd"], mono[f"{key} bwd"] = fa4_direct(_rand(gen, b, n_q, h, d), _rand(gen, b, n_kv, g, d),
                                                                _rand(gen, b, n_kv, g, d), tile_band, None, d ** -0.5)
    mono_ms = interleaved_ms(mono, calls=1, rounds=15)
    shape_rates = {}   # each standalone call shape's fwd / bwd rate against the monolithic call's
    for n_q, n_kv, tile_band in sorted(shapes, key=str):
        key = shape_key(n_q, n_kv, tile_band)
        flops = 4 * b * h * d * tile_band.count(n_q, n_kv)
        shape_rates[key] = [vs_fa4_mono(mono_ms, phase, flops, total, mono_ms[f"{key} {phase}"]["ms"])
                            for phase in ("fwd", "bwd")]
        print(f"{key}: FA4 standalone fwd / bwd {shape_rates[key][0]:.3f} / {shape_rates[key][1]:.3f} of monolithic")
    ks = [shard(k, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    vs = [shard(v, cp, r, 1).permute(0, 2, 1, 3) for r in range(cp)]
    def shards(rank):
        return shard(q, cp, rank, 1).permute(0, 2, 1, 3), shard(do, cp, rank, 1).permute(0, 2, 1, 3)
    rows = []
    for kind, schedule in schedules.items():
        rows += slowest_rank(names, schedule, ranks, shards, ks, vs, sink, mask, d,
                             profile=f"cp={cp} {mask} {kind.value}" if profile else None, mono=whole,
                             controls=controls)
    rows = with_rates(rows, total, mono_ms)
    if calls:
        rows = with_standalone_calls(rows, calls, total, mono_ms)
        rows = with_standalone_calls(rows, steps, total, mono_ms, "steps")
    return {"cp": cp, "shape": dict(b=b, h=h, g=g, s=s, d=d), "mask": mask, "rows": rows,
            "call_shapes_vs_fa4_mono": shape_rates}


PACK_MASK = "causal"


def pack_lengths(total: int, lo: int, hi: int, multiple: int, seed: int) -> list:
    """Document lengths from ``random.Random(seed)``: multiples of ``multiple`` in ``[lo, hi]``,
    summing to ``total``, in drawn order shuffled (the remainder is not always last)."""
    for name, n in (("the pack", total), ("the shortest document", lo), ("the longest document", hi)):
        if n < 1 or n % multiple:
            raise ValueError(f"{name} has {n} tokens: a positive multiple of {multiple} (2 * cp) is needed")
    if not lo <= total or hi < 2 * lo:
        raise ValueError(f"documents of {lo}-{hi} tokens in a pack of {total}: need lo <= total and hi >= 2 lo")
    rng = random.Random(seed)
    docs, left = [], total
    while left > hi:   # leave at least lo for the rest: hi >= 2 lo makes any rest above hi splittable
        n = rng.randrange(lo, min(hi, left - lo) + 1, multiple)
        docs.append(n)
        left -= n
    docs.append(left)
    rng.shuffle(docs)
    return docs


@dataclass
class Pack:
    """A seeded pack of documents (thd: ``[t, h|g, d]``) and its ring of ``cp`` ranks in one layout
    (``sinkprof.shard``): zigzag (each document cut into 2 cp chunks, rank r holding chunks r and
    2cp-1-r of every document) under the ring K/V schedule, or balanced under allgather."""

    docs: list
    cu_seqlens: torch.Tensor    # int32 [documents + 1], on the pack's device
    q: torch.Tensor             # [t, h, d]
    k: torch.Tensor             # [t, g, d]
    v: torch.Tensor
    do: torch.Tensor            # [t, h, d]
    sink: torch.Tensor          # [1, h, 1, 1] fp32
    schedule: CommSchedule      # the layout's K/V schedule (``pack_bench`` may run others on a zigzag layout)
    ks: list                    # every rank's K shard, [1, g, t / cp, d] (bhsd views of bshd storage)
    vs: list

    @property
    def cp(self) -> int:
        return self.schedule.cp

    @property
    def flops(self) -> int:
        """Forward FLOPs of the whole pack: each document's own causal pairs, 4 h d each."""
        _, h, d = self.q.shape
        band = self.schedule.band
        return sum(4 * h * d * band.count(n, n) for n in self.docs)

    def rank_shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a ``[t, heads, d]`` pack tensor as a ``[1, heads, rows, d]`` view."""
        return shard(x.unsqueeze(0), self.cp, rank, 1, [0, *itertools.accumulate(self.docs)],
                     self.schedule.layout.kind).permute(0, 2, 1, 3)

    def laid_out(self, pack_layout) -> "Pack":
        """The same pack in ``pack_layout`` (``PackLayout``): its schedule (ring for zigzag,
        allgather for balanced) and every rank's K/V shard."""
        p = dataclasses.replace(self, schedule=_pack_schedule(self.cu_seqlens.tolist(), self.cp, pack_layout))
        p.ks = [p.rank_shard(self.k, r) for r in range(self.cp)]
        p.vs = [p.rank_shard(self.v, r) for r in range(self.cp)]
        return p

    def shards(self, rank: int) -> tuple:
        """(q, dO) of rank ``rank``, as ``slowest_rank`` takes them."""
        return self.rank_shard(self.q, rank), self.rank_shard(self.do, rank)


def _pack_schedule(cu_seqlens: list, cp: int, pack_layout) -> CommSchedule:
    """A causal pack's schedule in ``pack_layout``: ring for zigzag, allgather for balanced."""
    spec = make_spec("vanilla", PACK_MASK, None, "thd", cu_seqlens, pack_layout)
    kind = KVSchedule.RING if spec.pack_layout is PackLayout.ZIGZAG else KVSchedule.ALLGATHER
    return CommSchedule(kind, cp, spec_layout(spec, cu_seqlens[-1], cp), spec.band)


def pack_setup(cp: int, h: int, g: int, d: int, docs: list, device, dtype=torch.bfloat16, seed: int = 1,
               pack_layout=PackLayout.ZIGZAG) -> Pack:
    """Seeded inputs of a pack of ``docs`` on ``device``, its schedule in ``pack_layout`` and every rank's
    K/V shard."""
    cu = [0, *itertools.accumulate(docs)]
    t = cu[-1]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)
    q, do = rand(t, h, d), rand(t, h, d)
    k, v = rand(t, g, d), rand(t, g, d)
    sink = torch.randn(1, h, 1, 1, generator=gen, device=device) * 5
    p = Pack(list(docs), torch.tensor(cu, dtype=torch.int32, device=device), q, k, v, do, sink,
             _pack_schedule(cu, cp, pack_layout), [], [])
    return p.laid_out(pack_layout)


def fa4_varlen(p: Pack, sink, scale: float):
    """FA4's varlen call on the whole pack (``cu_seqlens_q = cu_seqlens_k``, causal within each
    document, lse ``[h, t]``): (forward, backward) closures."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    longest = max(p.docs)
    kw = dict(softmax_scale=scale, causal=True, cu_seqlens_q=p.cu_seqlens, cu_seqlens_k=p.cu_seqlens,
              max_seqlen_q=longest, max_seqlen_k=longest, learnable_sink=None if sink is None else sink.reshape(-1))
    o, lse = _flash_attn_fwd(p.q, p.k, p.v, return_lse=True, **kw)[:2]
    return (lambda: _flash_attn_fwd(p.q, p.k, p.v, return_lse=True, **kw),
            lambda: _flash_attn_bwd(p.q, p.k, p.v, o, p.do, lse, **kw))


def pack_bench(cp: int, h: int, g: int, d: int, docs: list, profile: bool, names: list,
               kinds=(KVSchedule.DIRECT,), layouts=(PackLayout.ZIGZAG,)) -> dict:
    """Per layout, backend, variant and K/V schedule (``kinds``; the balanced layout runs under
    allgather alone) the slowest rank's schedule on a pack (causal within each document), against
    FA4's varlen monolithic call on the same pack; FLOPs on both sides are the documents' own causal
    work. The slowest of ranks 0, cp/2, cp-1 in the zigzag layout (every rank has each document's
    shape of work), of every rank in the balanced one."""
    p = pack_setup(cp, h, g, d, docs, "cuda")
    mono = {}
    if "fa4" in backends():
        for tag, a in (("vanilla", None), ("learnable", p.sink)):
            mono[f"fa4 varlen {tag} fwd"], mono[f"fa4 varlen {tag} bwd"] = fa4_varlen(p, a, d ** -0.5)
    mono_ms, timing = _timed(mono)
    for name, r in mono_ms.items():   # in the log before the ring runs, should the step be stopped
        rate = p.flops * (BWD_FLOPS if name.endswith("bwd") else 1) / r["ms"] / 1e9
        print(f"{name}: {r['ms']:.3f} ms, {rate:.1f} TFLOP/s ({timing})")
    cu = [0, *itertools.accumulate(docs)]
    rows, keys_read = [], {}
    for layout in layouts:
        laid = p.laid_out(layout)
        balanced = layout is PackLayout.BALANCED
        lay = laid.schedule.layout   # a causal piece reads its document's keys up to its last row
        keys_read[layout.value] = [sum(q.stop - lay.starts[q.doc] for q in lay.ranks[r]) for r in range(cp)]
        print(f"{layout.value} layout: keys read per rank (causal, allgather) {keys_read[layout.value]}, "
              f"pieces {[len(lay.ranks[r]) for r in range(cp)]}")
        for kind in ((KVSchedule.ALLGATHER,) if balanced else kinds):
            schedule = CommSchedule(kind, cp, lay, laid.schedule.band)
            ranks = range(cp) if balanced else sorted({0, cp // 2, cp - 1})
            rows += slowest_rank(names, schedule, ranks, laid.shards, laid.ks, laid.vs, p.sink, PACK_MASK, d,
                                 profile=f"pack cp={cp} {layout.value} {kind.value}" if profile else None,
                                 cu_seqlens=cu, mono=mono)
    return {"cp": cp, "shape": dict(t=sum(docs), h=h, g=g, d=d), "docs": list(docs), "mask": PACK_MASK,
            "flops": p.flops, "fa4_varlen_ms": mono_ms, "fa4_varlen_timing": timing, "keys_read": keys_read,
            "rows": with_rates(rows, p.flops, mono_ms, mono="fa4 varlen")}


def _profile_step(title: str, fwd, bwd, ready: Optional[Callable] = None) -> None:
    """Where one warm ring's time goes: a CUDA graph of its forward and one of its backward (as
    the timings replay them), each replayed once under the profiler (the graph's first replay,
    which also uploads it). Per phase: the graph's nodes by type (``graph_census``: what its
    launch submits); the kernels by total time, with the host's calls (``cudaGraphLaunch``); then
    one by one in the order they started (microseconds from the first; the gap since the previous
    kernel of any stream ended; the CUDA stream); and a summary (``timeline``). Eagerly issued
    calls instead where a capture fails or the profiler sees no kernel of a graph. ``ready``:
    called once both are captured (``Loopback.fill``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    eager = {"fwd": fwd, "bwd": bwd}
    censuses = {}
    try:
        graphs = {"fwd": capture(fwd, 1, keep=True), "bwd": capture(bwd, 1, keep=True)}
        runs, how = {phase: g.replay for phase, g in graphs.items()}, "graphed"
        if ready is not None:
            ready()
        for phase, g in graphs.items():
            try:
                censuses[phase] = census_text(graph_census(g))
            except (RuntimeError, OSError, AttributeError) as exc:   # (no runtime found, a torch without raw graphs)
                censuses[phase] = f"no census: {str(exc)[:200]}"
    except RuntimeError as exc:
        print(f"warning: CUDA graph capture failed ({str(exc)[:200]}); profiling eager calls")
        runs, how = eager, "eager"
    for phase in ("fwd", "bwd"):
        while True:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runs[phase]()
                torch.cuda.synchronize()
            kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                             key=lambda e: e.time_range.start)
            if kernels or how == "eager":
                break
            print(f"warning: the profiler saw no kernel of the {phase} graph; profiling eager calls")
            runs, how = eager, "eager"
        print(f"\n## kernels of one warm ring, {title}, {phase} ({how})")
        if how == "graphed" and phase in censuses:
            print(f"graph: {censuses[phase]}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        print(timeline(kernels))


def _is_copy(name: str) -> bool:
    """A message's copy: ``Memcpy DtoD`` issued eagerly, a ``memcpy128``-style kernel in a CUDA
    graph (where the driver runs a memcpy node as a kernel)."""
    return name.lower().startswith("memcpy")


def timeline(kernels) -> str:
    """Profiler events (``.time_range.start``/``.end`` in us, ``.name``, ``.device_resource_id``)
    one by one in start order, with the gap since the previous one of any stream ended, then the
    span, the time some kernel ran (their union), the time only copies ran (a message's copy
    that no kernel overlapped: the compute waited for it) and the time nothing did."""
    if not kernels:
        return "(no kernels)"
    t0 = kernels[0].time_range.start
    lines, end = ["start us   took us    gap us  stream  kernel"], t0
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end
        lines.append(f"{start - t0:9.1f} {stop - start:9.1f} {max(0.0, start - end):9.1f}  "
                     f"{e.device_resource_id:6d}  {e.name[:90]}")
        end = max(end, stop)
    span = end - t0
    busy = union_ms([(e.time_range.start, e.time_range.end) for e in kernels])
    compute = union_ms([(e.time_range.start, e.time_range.end) for e in kernels if not _is_copy(e.name)])
    lines.append(f"span {span:.1f} us: kernels running {busy:.1f} us, only copies {busy - compute:.1f} us "
                 f"({(busy - compute) / span:.1%}), none running {span - busy:.1f} us ({(span - busy) / span:.1%})")
    return "\n".join(lines)


CONFIGS = {"h16-d128": (16, 16, 128), "h32-d128": (32, 32, 128), "gpt-oss": (64, 8, 64)}


def _configs(text: str) -> list:
    """``name:cp,cp;name:cp`` -> [(name, [cp...])]."""
    out = []
    for part in filter(None, text.split(";")):
        name, _, cps = part.partition(":")
        out.append((name, [int(c) for c in cps.split(",")]))
    return out


def _print_rows(rows: list, against: str) -> None:
    for row in rows:
        eff = (f" | vs {against} fwd {row['fwd_vs_fa4_mono']:.3f} bwd {row['bwd_vs_fa4_mono']:.3f}"
               if "fwd_vs_fa4_mono" in row else "")
        if "fwd_vs_fa4_mono_separate_run" in row:
            eff += (f" (timed apart: {row['fwd_vs_fa4_mono_separate_run']:.3f}"
                    f" / {row['bwd_vs_fa4_mono_separate_run']:.3f})")
        if "fwd_vs_fa4_mono_calls_standalone" in row:
            eff += (f" (its calls standalone: {row['fwd_vs_fa4_mono_calls_standalone']:.3f}"
                    f" / {row['bwd_vs_fa4_mono_calls_standalone']:.3f}; the backward's step by step:"
                    f" {row['bwd_vs_fa4_mono_steps_standalone']:.3f})")
        print(f"{row['backend']:12s} {row['kv_schedule']:9s} {row['layout']:8s} {row['variant']:21s} rank {row['rank']}: "
              f"fwd {row['fwd_tflops']:6.1f} "
              f"bwd {row['bwd_tflops']:6.1f}{eff} | host {row['host_us_per_step_eager']:6.1f} us/step"
              + " | launch fwd / bwd {:.0f} / {:.0f} us".format(*row["launch_us"])
              + " ({} / {} calls a replay)".format(*row["calls_per_replay"]))
        print("    fwd / bwd ms per rank: " + ", ".join(f"{r}: {f:.3f} / {b:.3f}" for r, (f, b) in row["ranks_ms"].items()))


def pack_cases(args) -> list:
    """``--packs`` with ``--pack-len``, ``--pack-docs``, ``--pack-seed`` -> [(config, cp, document
    lengths)]; ValueError when a config or the lengths cannot be."""
    lo, sep, hi = args.pack_docs.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise ValueError(f"--pack-docs {args.pack_docs!r}: give LO-HI, e.g. 2048-16384")
    cases = []
    for name, cps in _configs(args.packs):
        if name not in CONFIGS:
            raise ValueError(f"--packs: {name!r} is not one of {sorted(CONFIGS)}")
        for cp in cps:
            cases.append((name, cp, pack_lengths(args.pack_len, int(lo), int(hi), 2 * cp, args.pack_seed)))
    return cases


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile-s", type=int, default=8192)
    ap.add_argument("--s-rank", type=int, default=8192, help="tokens per rank in the ring benchmarks")
    ap.add_argument("--rings", default="h16-d128:2,4,8;gpt-oss:2,4,8", help=f"configs from {sorted(CONFIGS)}")
    ap.add_argument("--masks", default="causal,no_mask")
    ap.add_argument("--kv-schedules", default="direct", help="K/V schedules of the ring and pack benchmarks: ring, "
                    "direct, allgather (comma list; direct is what auto takes for these shapes)")
    ap.add_argument("--ring-backends", default=None,
                    help="backends of the ring and pack benchmarks, fa4-per-tile, BACKEND+comm: the ring's own "
                         "code over a loopback communicator, BACKEND+comm-concurrent: the same with every copy "
                         "issued at once, and BACKEND+null: the same with no message moved (default: every "
                         "backend here, and fa4-per-tile)")
    ap.add_argument("--packs", default="", help="pack benchmarks, config:cp,cp;... (e.g. gpt-oss:8): a pack of "
                    "--pack-len tokens in documents of --pack-docs lengths, causal (default: none)")
    ap.add_argument("--pack-len", type=int, default=65536, help="tokens in a pack")
    ap.add_argument("--pack-docs", default="2048-16384", help="LO-HI: document lengths, drawn from --pack-seed "
                    "as multiples of 2 * cp")
    ap.add_argument("--pack-seed", type=int, default=0)
    ap.add_argument("--pack-layouts", default="zigzag", help="layouts of the pack benchmarks: zigzag, balanced "
                    "(comma list; balanced runs under the allgather K/V schedule alone)")
    ap.add_argument("--run-rows", type=int, default=None, help="K/V rows of a joined run at most (an experiment "
                    f"on the ring's calls; default: sinkprof's, {plan_module.RUN_ROWS})")
    ap.add_argument("--loopback-priority", choices=("normal", "high"), default="normal",
                    help="CUDA priority of the loopback's copy stream (high: its copies are dispatched before "
                         "the compute kernels' waiting blocks, as NCCL's on a high-priority stream)")
    ap.add_argument("--fa4-full-window", action="store_true",
                    help="the ring's full FA4 forward tiles as a window covering the tile (FA4's non-persistent "
                         "scheduler: its blocks retire through the call, so the copies get SMs; an experiment)")
    ap.add_argument("--one-stream-too", action="store_true",
                    help="the ring benchmarks also time vanilla step0 with every step on one stream ('vanilla step0 "
                         "one-stream'), beside the variants' step 0 on a second stream where the backend allows it")
    ap.add_argument("--whole-causal-too", action="store_true",
                    help="the ring benchmarks also time vanilla step0 with its causal tiles' backward run whole "
                         "('vanilla step0 whole-causal'), beside the variants' cut into pieces where the backend does")
    ap.add_argument("--masked-config-too", action="store_true",
                    help="the ring benchmarks also time vanilla step0 with a causal rank's rows backward under FA4's "
                         "configuration for masked tiles ('vanilla step0 masked-config'), beside the variants' under "
                         "its configuration for unmasked ones")
    ap.add_argument("--skip-tiles", action="store_true")
    ap.add_argument("--profile-step", action="store_true", help="print the kernels of one warm ring per config "
                    "and timed rank (learnable step0), by total time and one by one")
    ap.add_argument("--launch", choices=("waited", "hidden", "rested"), default="waited",
                    help="waited (as before the twenty-second session): each timed replay starts on an idle GPU, "
                         "which waits for the host's launch; hidden: a GPU sleep issued first covers the launch; "
                         "rested: the GPU idles as long first, the launch not hidden")
    ap.add_argument("--rounds", choices=("equal", "fixed"), default="equal",
                    help="equal: a shorter function's replay holds more calls, so that every timed round keeps "
                         "the GPU about as busy; fixed: every replay holds as many calls as the longest function's "
                         "(the ring benchmarks: one; before the twenty-third session they held two)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        args.pack_cases = pack_cases(args)
        args.kinds = [KVSchedule.parse(k, "--kv-schedules") for k in args.kv_schedules.split(",")]
        if KVSchedule.AUTO in args.kinds:
            raise ValueError("--kv-schedules: name ring, direct or allgather (auto is one of the first two)")
        args.layouts = [PackLayout.parse(x, "--pack-layouts") for x in args.pack_layouts.split(",")]
        if args.run_rows is not None and args.run_rows < 1:
            raise ValueError(f"--run-rows {args.run_rows}: give a positive number of rows")
    except ValueError as exc:
        ap.error(str(exc))
    return args


def controls(args) -> tuple:
    """The control variants (``CONTROLS``) the flags ask for."""
    return tuple(c for c, on in (("one-stream", args.one_stream_too), ("whole-causal", args.whole_causal_too),
                                 ("masked-config", args.masked_config_too)) if on)


def main() -> None:
    args = parse_args()
    if args.fa4_full_window:
        fa4_module.FA4Tiles.forward = _forward_full_as_window(fa4_module.FA4Tiles.forward)
    global LAUNCH, FIXED_ROUNDS
    LAUNCH = args.launch
    FIXED_ROUNDS = args.rounds == "fixed"
    if args.loopback_priority == "high":
        Loopback.PRIORITY = -100   # torch maps it to the highest the device has
    if args.run_rows is not None:   # every schedule made from here on joins its runs up to this many rows
        plan_module.join_runs.__defaults__ = (args.run_rows,)
    sys.argv = sys.argv[:1]   # the CuTe DSL parses the command line at every FA4 compile (sinkprof.kernels.fa4)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backends": backends(),
              "fused sink kernels": fused.disabled_reason() or "on", "args": vars(args), "tiles": [], "rings": [],
              "packs": []}
    print("backends:", report["backends"], "| fused sink kernels:", report["fused sink kernels"], "| launch:", args.launch)
    if not args.skip_tiles:
        for label, (h, g, d), band in (("h32 d128 causal", CONFIGS["h32-d128"], Band(None, 0)),
                                       ("h32 d128 no_mask", CONFIGS["h32-d128"], Band()),
                                       ("gpt-oss causal", CONFIGS["gpt-oss"], Band(None, 0)),
                                       ("gpt-oss window (127, 0)", CONFIGS["gpt-oss"], Band(-127, 0))):
            t = tile_bench(1, h, g, args.tile_s, d, band, label)
            report["tiles"].append(t)
            print(f"\n## tile {label}, s={args.tile_s} bf16 (graphed, interleaved)")
            for name, r in t["kernels"].items():
                print(f"{name:28s} {r['ms'] * 1e3:9.1f} us (spread {r['spread_ms'] * 1e3:.1f}) {r['tflops']:7.1f} TFLOP/s")
    ring_names = (args.ring_backends.split(",") if args.ring_backends else
                  backends() + (["fa4-per-tile"] if "fa4" in backends() else []))
    for name, cps in _configs(args.rings):
        h, g, d = CONFIGS[name]
        for cp in cps:
            for mask in args.masks.split(","):
                r = ring_bench(cp, 1, h, g, args.s_rank, d, mask, args.profile_step, ring_names, args.kinds,
                               controls(args))
                report["rings"].append(r | {"config": name})
                print(f"\n## ring {name} cp={cp} s={r['shape']['s']} {mask}: slowest rank's schedule, TFLOP/s "
                      "(and against FA4 monolithic)")
                _print_rows(r["rows"], "FA4 mono")
    for name, cp, docs in args.pack_cases:
        h, g, d = CONFIGS[name]
        r = pack_bench(cp, h, g, d, docs, args.profile_step, ring_names, args.kinds, args.layouts)
        report["packs"].append(r | {"config": name})
        print(f"\n## pack {name} cp={cp} t={sum(docs)}, {len(docs)} documents {docs}, causal: slowest rank's "
              f"schedule, TFLOP/s (and against FA4 varlen monolithic on the pack; target >= 0.90)")
        _print_rows(r["rows"], "FA4 varlen")
        if args.out:   # a pack is minutes of work: keep what is measured if a later one is stopped
            Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    refused = {}
    for name in backends():
        refused |= {f"{name}: {k[0]}": v for k, v in get_kernel(name, "cuda").refused().items()}
    report["refused"] = refused
    if refused:
        print("\nrefused:", refused)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
