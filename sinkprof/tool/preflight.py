"""What ``check`` and ``bench`` verify before any rank starts: everything a run would otherwise
trip over after minutes, on every rank, with a traceback.

``Settings.validate`` checks each settings group (values, shapes, backends, with the library's own
checks); this module checks the run as a whole: the communication backend, whether an injected
fault applies to any case (``emulate`` asks the same of its every-tile rows), and whether the run
fits in memory (``emulate``'s one-process replay too: ``check_replay_memory``). Every error is a
``ValueError`` that names the option and the fix (exit 2, ``tool.errors``). Output paths are
checked by ``tool.output.check_writable``.
"""
from __future__ import annotations

import collections
import math
import os
from typing import Optional

import torch

from ..faults import RANK_FAILURES, Fault, Injected
from ..kernels import resolve_backend
from ..options import (DTYPES, AttnSpec, Backend, CommType, KVSchedule, PackLayout, QKVFormat, SinkGrad, SoftmaxType,
                       accum_dtype, check_seed, check_timeout)
from ..plan import PARTS, RUN_ROWS, ring_plan, spec_layout
from ..schedule import planless_kv_schedule
from ..testing import Shape
from .cases import Case, CaseOptions, a2a_members, expand
from .launcher import local_ranks, torchrun_env

GIB = 2 ** 30
RANK_OVERHEAD = 400 * 2 ** 20     # a rank's own process: the interpreter, torch, gloo (measured: ~350 MiB)
REFERENCE_BLOCK = 64 * 2 ** 20    # the reference's score block (``testing.reference``): per tensor


def check_values(case: CaseOptions) -> None:
    """Values of the command line that pass their option's parsing but that a rank cannot use: a
    seed torch's generators refuse, a timeout that ``datetime.timedelta`` or gloo cannot hold."""
    check_timeout(case.timeout, "--timeout")
    check_timeout(case.run_timeout, "--run-timeout")
    if case.seed is not None:
        check_seed(case.seed, "--seed")


def check_dist_backend(requested: str, device: str, ranks: int) -> None:
    """``--dist-backend``: a known name that can run here (NCCL needs a GPU per local rank)."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"--dist-backend {requested!r}: use auto, gloo or nccl")
    if requested != "nccl":
        return
    if device != "cuda":
        raise ValueError("--dist-backend nccl needs --device cuda; use --dist-backend gloo (or auto) on the CPU")
    local = local_ranks(ranks)
    have = torch.cuda.device_count()
    if have < local:
        raise ValueError(f"--dist-backend nccl needs one GPU per rank: {local} rank(s) here, {have} GPU(s) visible; "
                         f"use --dist-backend gloo (or auto, which stages through host memory)")


def applies(fault: Fault, case: Case, ranks: int) -> bool:
    """Whether ``fault`` changes anything in ``case`` (a fault that cannot, proves nothing)."""
    learnable = case.softmax is SoftmaxType.LEARNABLE
    if fault is Fault.SINK_EVERY_TILE:
        return case.softmax.has_sink and sink_counted_again(case.spec(), case.shape.s, ring_ranks(case, ranks),
                                                            _ring_schedule(case, ranks))
    if fault is Fault.NO_SINK_REDUCE:   # the full contract's all-reduce (partial has none to skip)
        return (learnable or case.bias) and ranks > 1 and case.sink_grad is SinkGrad.FULL
    if fault is Fault.ALIASED_REFERENCE:
        return learnable
    if fault is Fault.VANILLA_FALLBACK:
        return case.softmax.has_sink
    if fault is Fault.SKIP_SINK_SLICE:   # a group of one rank: the first heads' sinks are its own
        return (learnable and case.comm in (CommType.A2A, CommType.A2A_P2P)
                and a2a_members(case.comm, ranks, case.a2a_size) > 1)
    if fault is Fault.DROP_HALO:  # a row of a direct-schedule K/V message from ring rank 0 to ring rank 1
        schedule = _case_schedule(case, ranks)
        return (case.comm is not CommType.A2A and schedule is not None and schedule.kind is KVSchedule.DIRECT
                and bool(schedule.kv_rows(1, 1)))
    if fault is Fault.DOC_LEAK:
        return _doc_leak_shows(case, ranks)
    if fault in RANK_FAILURES:    # ring rank 1 stops at its first exchange
        return ring_ranks(case, ranks) > 1
    return True


def ring_ranks(case: Case, ranks: int) -> int:
    """Ranks of the p2p ring that runs ``case``'s plan on ``ranks`` ranks: all of them under p2p,
    the outer groups under a2a+p2p, one under plain a2a."""
    return ranks // a2a_members(case.comm, ranks, case.a2a_size)


def _case_schedule(case: Case, ranks: int):
    """The ``CommSchedule`` of ``case``'s ring (``auto`` resolved), None where there is no ring."""
    from .check import case_traffic
    return case_traffic(case, ranks).schedule


def _ring_schedule(case: Case, ranks: int) -> KVSchedule:
    """The K/V schedule ``case``'s ring runs (``ring`` where there is no ring): the one asked for;
    ``auto`` resolved as ``schedule.comm_schedule`` does it, allgather for a pack in the balanced
    layout, else ring or direct as the plan's bytes decide (every rank's plan: ``_kinds``)."""
    ring = ring_ranks(case, ranks)
    if ring == 1:
        return KVSchedule.RING
    kind = planless_kv_schedule(case.kv_schedule, spec_layout(case.spec(), case.shape.s, ring).kind)
    return _case_schedule(case, ranks).kind if kind is KVSchedule.AUTO else kind


def _kinds(case: Case, ranks: int) -> tuple[KVSchedule, ...]:
    """The K/V schedules ``case``'s ring may run, known without its plan: the one it runs, or under
    ``auto`` on a zigzag ring of two ranks or more, ring and direct (the bytes of every rank's plan
    choose, which takes seconds at 64 ranks and hours at 1000)."""
    ring = ring_ranks(case, ranks)
    if (KVSchedule.parse(case.kv_schedule, "kv_schedule") is KVSchedule.AUTO and ring > 1
            and spec_layout(case.spec(), case.shape.s, ring).kind is PackLayout.ZIGZAG):
        return KVSchedule.RING, KVSchedule.DIRECT
    return (_ring_schedule(case, ranks),)


def sink_counted_again(spec: AttnSpec, s: int, ring: int, kv_schedule=KVSchedule.RING) -> bool:
    """Whether the every-tile bug can change a result on a ring of ``ring`` ranks: some rank has a
    row that a second tile sees (the bug counts that row's sink again). Not on a one-rank ring (its
    one step is one tile per document), nor under a window that sees no key beyond the own chunk,
    nor under ``allgather`` (each row's keys are one tile). ``auto`` has the tiles of ``ring``, and
    of ``allgather`` for a pack in the balanced layout (which runs under it alone)."""
    layout = spec_layout(spec, s, ring)
    kind = planless_kv_schedule(kv_schedule, layout.kind)
    kind = KVSchedule.RING if kind is KVSchedule.AUTO else kind
    return any(not tile.sink for rank in range(ring) for step in ring_plan(ring, rank, layout, spec.band, kind).steps
               for tile in step.tiles)


def _doc_leak_shows(case: Case, ranks: int) -> bool:
    """Whether some rank's leaking tile (step 0, the pack's second document, its K/V rows widened
    to the first document's) lets a row see a key it did not see before: not with one document,
    nor with a window that sees no key before the diagonal."""
    if len(case.docs) < 2:
        return False
    ring = ring_ranks(case, ranks)
    spec = case.spec()
    layout = spec_layout(spec, case.shape.s, ring)
    leak = Injected(Fault.DOC_LEAK)
    kind = _ring_schedule(case, ranks)
    for rank in range(ring):
        plan = ring_plan(ring, rank, layout, spec.band, kind)
        for tile, leaked in zip(plan.steps[0].tiles, leak.ring_plan(plan).steps[0].tiles):
            n_q = tile.q_rows.stop - tile.q_rows.start
            seen = tile.band.count(n_q, tile.kv_rows.stop - tile.kv_rows.start)
            if leaked.band.count(n_q, leaked.kv_rows.stop - leaked.kv_rows.start) > seen:
                return True
    return False


# What a p2p ring of two ranks or more takes (plain a2a's ring is one rank); ``{ranks}``: where the
# ranks come from, ``--ranks`` or torchrun's ``WORLD_SIZE``.
RING_OF_TWO = "--comm p2p with {ranks} >= 2, or --comm a2a+p2p with {ranks} >= 2 * --a2a-size"

WHAT_IT_NEEDS = {
    Fault.SINK_EVERY_TILE: ("a sink (--softmax off-by-one or learnable) and a row that two ring tiles see: a ring of "
                            f"two ranks or more ({RING_OF_TWO}), a window wider than the diagonal, or none, and "
                            "--kv-schedule ring, direct or auto (allgather gives each row one tile)"),
    Fault.NO_SINK_REDUCE: ("a replicated gradient (--softmax learnable or --bias) under the full contract "
                           "(--sink-grad full: partial has no all-reduce) and {ranks} >= 2"),
    Fault.ALIASED_REFERENCE: "a learnable offset (--softmax learnable)",
    Fault.VANILLA_FALLBACK: "a sink (--softmax off-by-one or learnable)",
    Fault.SKIP_SINK_SLICE: ("--softmax learnable with --comm a2a or a2a+p2p over a group of two ranks or more "
                            "(--a2a-size >= 2; plain a2a's group is every rank)"),
    Fault.DROP_HALO: ("a direct K/V schedule in which ring rank 0 sends ring rank 1 K/V rows (--comm p2p or "
                      "a2a+p2p with --kv-schedule direct, at least two ring ranks, a window with left >= 1 or none)"),
    Fault.DOC_LEAK: ("a thd pack of which some rank holds two documents or more (--qkv-format thd with --seqlens "
                     "or --docs >= 2) whose second document's rows can see a key before their own (a window with "
                     "left >= 1, or none)"),
    Fault.STALL: f"a ring of two ranks or more ({RING_OF_TWO}): ring rank 1 stalls",
    Fault.CRASH: f"a ring of two ranks or more ({RING_OF_TWO}): ring rank 1 crashes",
}


def check_fault(fault: Optional[Fault], groups: list, ranks_name: str = "--ranks") -> None:
    """``--inject``: the fault must apply to at least one case of the run; ``ranks_name``: where the
    ranks came from (``WORLD_SIZE`` under torchrun, where --ranks is refused)."""
    if fault is None:
        return
    cases = [(case, settings.ranks) for settings in groups for case in expand(settings)]
    if not any(applies(fault, case, ranks) for case, ranks in cases):
        raise ValueError(f"--inject {fault.value}: the fault applies to none of the {len(cases)} case(s) of this "
                         f"run; it needs {WHAT_IT_NEEDS[fault].format(ranks=ranks_name)}")


def host_available() -> int:
    """Bytes of host memory available now (MemAvailable), or the physical memory if unknown."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:   # no /proc (not Linux): the physical memory
        return physical
    return physical


def device_available() -> Optional[int]:
    """Free bytes of the smallest visible GPU, None without one."""
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))


def case_need(case: Case, ranks: int, reference: bool, tile_scores: bool = True,
              kind: Optional[KVSchedule] = None) -> tuple[int, int]:
    """(host, device) bytes one rank needs for ``case`` on a ring of ``ranks``, excluding its
    process overhead, its ring running the K/V schedule ``kind`` (default: the one it runs).

    Host: the full-sequence fp64 inputs and their rounded copy (``make_inputs``). Device (the
    host when the run is on the CPU): the reference's fp64 inputs, results and one score block,
    and the CP run's shard, ring buffers (under allgather at most the whole sequence's K/V and dK/dV;
    under direct also the dK/dV parts kept until the end, at most a shard from every other rank), the
    forward's buffers of later results, gradients and, with ``tile_scores`` (the torch tiles,
    which hold a tile's scores; cuDNN and FA4 never do), a tile's scores. A thd pack's tiles are
    its documents' own (``plan.ring_plan``), so its largest tile is its longest document's, not
    the pack's. A bias is ``[1, h, S, S]`` on every rank: quadratic in the sequence whatever the
    algorithm.
    """
    sh = case.shape
    elem = DTYPES[case.dtype].itemsize
    acc = accum_dtype(DTYPES[case.dtype]).itemsize
    full = sh.b * sh.s * (2 * sh.h + 2 * sh.g) * sh.d          # q, dO (h heads); k, v (g heads)
    bias = sh.h * sh.s * sh.s if case.bias else 0
    host = (full + bias) * (8 + elem)
    device = 0
    if reference:
        block = min(REFERENCE_BLOCK, sh.b * sh.h * sh.s * sh.s * 8)
        device += (full + bias) * 8 * 2 + 4 * block    # fp64 inputs and results, the score block
    local = full // ranks
    device += local * (elem * 4 + acc * 2) + (full + bias) * elem + bias * (elem + acc)
    members = a2a_members(case.comm, ranks, case.a2a_size)
    ring = max(1, ranks // members)
    o_local = sh.b * sh.s * sh.h * sh.d // ranks
    # the forward's buffers of later results (at most 2 a step, PARTS in all) and, when they merge more
    # than once, the fp32 accumulator (ring.ForwardState)
    device += o_local * (min(PARTS, 2 * (ring - 1)) * elem + (acc if ring - 1 > PARTS else 0))
    kind = (kind or _ring_schedule(case, ranks)) if ring > 1 else KVSchedule.RING
    gather = kind is KVSchedule.ALLGATHER
    if kind is KVSchedule.DIRECT:
        kv_row = sh.b * 2 * max(1, sh.g // members) * sh.d * elem
        shard_rows = sh.s // ring
        # the two K/V buffers hold a joined run of steps (ring.DirectKV: one sequence, rows outermost,
        # no bias): up to RUN_ROWS rows each where a step's are fewer; in the backward also the two
        # dK/dV parts, in the accumulator dtype (ring.DirectDKV)
        fits = not case.bias and len(case.docs) <= 1 and (sh.b == 1 or case.spec().qkv_format is not QKVFormat.BSHD)
        runs = 2 * max(0, min(RUN_ROWS, (ring - 1) * shard_rows) - shard_rows) * kv_row if fits else 0
        # the dK/dV parts that return in K/V's dtype, kept until the backward ends (ring.DirectDKV, half
        # precision): at most a shard from every other rank
        kept = (ring - 1) * shard_rows * kv_row if elem < acc else 0
        device += runs + runs * acc // elem + kept
    if gather:   # at most the sequence's K/V three times (the rows read; the rows staged to send, and arrived),
        # and its dK/dV three times (the rows read; their parts going back, and arrived)
        kv_all = sh.b * sh.s * 2 * max(1, sh.g // members) * sh.d
        device += kv_all * 3 * elem + kv_all * 3 * acc
    if tile_scores or case.bias:    # bias tiles fall back to the torch tiles
        # on the heads a rank keeps after the inner a2a; a2a alone is a ring of one rank (c = s / 2)
        rows, keys = largest_tile(case.spec(), sh.s, ring, gather)
        # the backward's probabilities (the scores, in place), dS (dP, in place) and a copy einsum
        # makes; the forward holds two (kernels.TorchTiles; test_kernels pins it)
        device += 3 * sh.b * max(1, sh.h // members) * rows * keys * acc
    return host, device


def largest_tile(spec: AttnSpec, s: int, ring: int, gather: bool) -> tuple[int, int]:
    """(rows, keys) of the largest tile of a ring of ``ring`` ranks: step 0's 2c x 2c (every tile
    under no_mask) of the longest document; under allgather a chunk's rows against its whole
    document (a piece's, in the balanced layout)."""
    chunk = max(1, max(spec.docs, default=s) // (2 * ring))   # of the longest document
    rows, keys = 2 * chunk, (2 * ring * chunk if gather else 2 * chunk)
    if spec.pack_layout is PackLayout.BALANCED:   # a rank's pieces of a document (one tile under no_mask)
        layout = spec_layout(spec, s, ring)
        held = collections.Counter()
        for r, pieces in enumerate(layout.ranks):
            for p in pieces:
                held[(r, p.doc)] += p.stop - p.start
        rows, keys = max(((n, layout.docs[doc]) for (_, doc), n in held.items()), key=lambda rk: rk[0] * rk[1])
    return rows, keys


def check_memory(groups: list, ranks: int, device: str, reference: bool, procs: Optional[int] = None,
                 host_free: Optional[int] = None, device_free: Optional[int] = None) -> None:
    """Refuse a run that cannot fit: the largest case's need per rank of a ring of ``ranks``, times
    the ``procs`` processes on this host (default: the ranks; ``bench --simulate`` runs one).

    A case under ``auto`` needs what ring needs, or more under direct (``_kinds``): its plan is asked
    which one it runs only where the answer decides whether it fits; a refusal without the answer
    tells the smaller need ("at least", where the larger would show otherwise)."""
    procs = ranks if procs is None else procs
    local = local_ranks(procs)
    host_free = host_available() if host_free is None else host_free
    if device == "cuda":
        device_free = device_available() if device_free is None else device_free
        per_gpu = math.ceil(local / max(1, torch.cuda.device_count())) if torch.cuda.is_available() else 1
    else:
        device_free, per_gpu = None, 1

    def fits(need: tuple[int, int]) -> bool:
        host, dev = need
        return (host + RANK_OVERHEAD) * local <= host_free and (device_free is None or dev * per_gpu <= device_free)

    bounds = []   # (case, its need under the schedule that needs least, and most)
    for settings in groups:
        scores = resolve_backend(settings.backend, device) is Backend.TORCH
        for case in expand(settings):
            needs = sorted(_placed(case_need(case, ranks, reference, scores, kind), device) for kind in _kinds(case, ranks))
            if fits(needs[0]) and not fits(needs[-1]):   # the schedule it runs decides
                needs = [_placed(case_need(case, ranks, reference, scores), device)]
            bounds.append((case, needs[0], needs[-1]))
    host_need = dev_need = host_most = dev_most = 0
    worst = None
    for case, least, most in bounds:
        if least > (host_need, dev_need):
            worst = case
        host_need, dev_need = max(host_need, least[0]), max(dev_need, least[1])
        host_most, dev_most = max(host_most, most[0]), max(dev_most, most[1])
    host_need += RANK_OVERHEAD
    fewer = ("use fewer --ranks on one machine" if torchrun_env() is None else
             "start fewer ranks on one machine (torchrun's --nproc-per-node)")
    fix = (f"lower --seq-len, --batch, --heads or --head-dim, drop --bias, or {fewer}"
           if worst is None or not worst.docs else
           f"shorten the pack or its longest document (--seqlens, or --seq-len with more --docs), lower --heads or "
           f"--head-dim, or {fewer}")
    if host_need * local > host_free:
        about = _about(host_need * local, (host_most + RANK_OVERHEAD) * local)
        raise ValueError(f"this run needs {about} {_gib(host_need * local)} of host memory ({_gib(host_need)} per "
                         f"rank x {local} rank(s), largest case {worst.label if worst else '-'}, "
                         f"s={worst.shape.s if worst else '-'}) and {_gib(host_free)} is available; {fix}")
    if device_free is not None and dev_need * per_gpu > device_free:
        about = _about(dev_need * per_gpu, dev_most * per_gpu)
        raise ValueError(f"this run needs {about} {_gib(dev_need * per_gpu)} of GPU memory per GPU "
                         f"({_gib(dev_need)} per rank x {per_gpu} rank(s) per GPU) and {_gib(device_free)} is "
                         f"free; {fix}")


def replay_need(shape: Shape, spec: AttnSpec, cp: int, members: int, schedules, held: int) -> int:
    """Bytes, at most, that ``sinkprof emulate`` holds while it replays ``spec`` on ``cp`` ranks in
    inner a2a groups of ``members`` under ``schedules``: every rank's tensors are in this one
    process, all fp64. ``held``: the elements of the run's largest result (``_replay_result``),
    which the previous row's reference and replay still hold while the next are computed.

    While the reference runs (``testing.reference``): the inputs (q, k, v, dO), the previous row's
    reference and replay, the new results, a per-head dK or dV product before its sum over the
    group, and its score blocks (four at once). While the replay runs (``emulate.emulate_ring``):
    the inputs, the reference, the previous row's replay, every rank's shards, outputs and
    gradients, their unsharded copies (a pack's joined before it is reordered), one rank's
    forward buffers (``ring.ForwardState``), step buffers of at most the sequence's K/V and dK/dV
    (a gathered step's, or a rank's joined runs), and the largest torch tile's three score-sized
    tensors at once (``TorchTiles.backward``: the probabilities, dS and a copy einsum makes)."""
    b = 1 if spec.qkv_format is QKVFormat.THD else shape.b
    q, kv, lse = b * shape.s * shape.h * shape.d, b * shape.s * shape.g * shape.d, b * shape.h * shape.s
    full, result = 2 * q + 2 * kv, _replay_result(shape, spec)
    per_row = b * shape.h * shape.s * 8
    blocks = 4 * max(1, min(shape.s, REFERENCE_BLOCK // per_row)) * per_row
    reference = 8 * (full + 2 * held + result + q + kv) + blocks
    ring = cp // members
    layout = spec_layout(spec, shape.s, ring)
    kinds = set()
    for k in schedules:   # auto as ``_kinds`` reads it: ring or direct on a zigzag ring of two ranks or more
        kind = planless_kv_schedule(k, layout.kind) if ring > 1 else KVSchedule.RING
        kinds |= {KVSchedule.RING, KVSchedule.DIRECT} if kind is KVSchedule.AUTO else {kind}
    rows, keys = largest_tile(spec, shape.s, ring, KVSchedule.ALLGATHER in kinds)
    # a joined run's one tile reads every step of the run (``plan.join_runs``: direct, one sequence, rows outermost)
    if KVSchedule.DIRECT in kinds and len(spec.docs) <= 1 and (b == 1 or spec.qkv_format is not QKVFormat.BSHD):
        keys = max(keys, min(RUN_ROWS, (ring - 1) * rows))
    tile = 3 * b * (shape.h // members) * rows * keys
    state = (min(PARTS, 2 * (ring - 1)) + 1) * (q + lse) // cp   # its buffers of later results and accumulator
    replay = full + result + held + full + 2 * result + (q if spec.docs else 0) + state + 4 * kv // members + tile
    return max(reference, 8 * replay)


def _replay_result(shape: Shape, spec: AttnSpec) -> int:
    """Elements of a replay's or its reference's result: out, dq, dk, dv and lse (a thd pack is b = 1)."""
    b = 1 if spec.qkv_format is QKVFormat.THD else shape.b
    return b * shape.s * ((2 * shape.h + 2 * shape.g) * shape.d + shape.h)


def check_replay_memory(shape: Shape, specs: list, cps, members: int, schedules,
                        host_free: Optional[int] = None) -> None:
    """Refuse a replay (``sinkprof emulate``) that cannot fit in this process: the largest
    ``replay_need`` over its layouts and masks (``specs``) and its cps, against the host memory
    available now (this process's own is in use already)."""
    host_free = host_available() if host_free is None else host_free
    held = max(_replay_result(shape, s) for s in specs)
    need, spec, cp = max(((replay_need(shape, s, c, members, schedules, held), s, c) for s in specs for c in cps),
                         key=lambda item: item[0])
    if need <= host_free:
        return
    fix = ("shorten the pack or its longest document (--seqlens, or --seq-len with more --docs), or lower --heads, "
           "--kv-heads or --head-dim" if spec.docs else "lower --seq-len, --batch, --heads, --kv-heads or --head-dim")
    raise ValueError(f"this run needs up to about {_gib(need)} of host memory (largest: --qkv-format "
                     f"{spec.qkv_format.value} at --cp {cp}, s={shape.s}) and {_gib(host_free)} is available; {fix}")


def _about(least: int, most: int) -> str:
    """How a need between ``least`` and ``most`` bytes is told: as ``least``, at least where the two differ
    in the figures shown."""
    return "about" if _gib(least) == _gib(most) else "at least about"


def _placed(need: tuple[int, int], device: str) -> tuple[int, int]:
    """A (host, device) need as it lands: all on the host when the run is on the CPU."""
    host, dev = need
    return (host + dev, 0) if device == "cpu" else (host, dev)


def _gib(n: int) -> str:
    """Bytes in GiB: one decimal, or three significant digits past a million GiB (not 33 digits)."""
    return f"{n / GIB:.1f} GiB" if n < 10 ** 6 * GIB else f"{n / GIB:.3g} GiB"
