"""``sinkprof emulate``: every rank's ring schedule replayed in fp64 in one process (the library's
emulator, ``sinkprof.emulate``) against the reference, for every (layout, cp, mask, strategy)
asked for; a thd layout is one pack of documents (``b = 1``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..emulate import emulate_hierarchical, emulate_ring
from ..options import (A2AError, AttnSpec, KVSchedule, MaskType, PackLayout, QKVFormat, SinkStrategy, SoftmaxType,
                       a2a_sizes, check_a2a_size, check_heads, make_spec, window_pair)
from ..plan import spec_layout
from ..schedule import resolved_kv_schedule
from ..testing import Shape, make_inputs, reference
from .cases import (DEFAULT_A2A_SIZE, Settings, check_head_counts, check_pack_layer, check_window, docs_label,
                    merge_layers, seqlens_text, window_text)
from .errors import EXIT_FAILED, EXIT_OK
from .output import Output
from .preflight import check_replay_memory, sink_counted_again

DEFAULT_SEQ_LEN = 64
DEFAULT_BATCH = 2


@dataclass
class EmulateRow:
    comm: str
    qkv_format: str
    window: str       # LEFT,RIGHT of --window ("128,0"); empty without one
    docs: str         # thd: the documents' lengths ("24,48,24"); empty otherwise
    pack_layout: str  # thd: which rows of the pack each rank holds (zigzag, balanced); empty otherwise
    kv_schedule: str  # the K/V schedule replayed (auto resolved)
    cp: int
    mask: str
    strategy: str
    out_max_abs_err: float
    dq_max_abs_err: float
    dk_max_abs_err: float
    dv_max_abs_err: float
    dsink_max_abs_err: float
    dsink_ratio_min: float
    dsink_ratio_max: float
    passed: bool      # matches the reference to EMULATE_TOLERANCE
    ok: bool          # as expected: correct strategies pass, the every-tile bug is detected


EMULATE_TOLERANCE = 1e-12


def emulate(cps, masks, strategies, shape: Shape, seed: int, window=None, a2a_size: Optional[int] = None,
            schedules=(KVSchedule.AUTO,), formats=(QKVFormat.BSHD,), docs: tuple = (),
            pack_layout=PackLayout.ZIGZAG) -> list[EmulateRow]:
    """Every (layout, mask, cp, strategy, K/V schedule) against the fp64 reference, with a
    learnable sink of ``randn * 5``. A thd layout packs the documents ``docs`` (their sum is
    ``shape.s``) with ``b = 1``, laid out over the ranks as ``pack_layout`` says.

    With ``a2a_size`` the schedule is a2a+p2p: cp ranks in inner groups of ``a2a_size``. A replay
    that runs as an earlier one does gives no second row: a note on stderr says so where a ring
    runs (``--kv-schedule auto,direct`` where auto runs direct); without a ring every schedule is
    the same replay, one row."""
    rows = []
    seen: dict = {}   # (format, cp, mask, strategy, schedule run) -> the --kv-schedule value that runs it
    for fmt, mask in itertools.product(formats, masks):
        fmt = QKVFormat.parse(fmt, "--qkv-format")
        thd = fmt is QKVFormat.THD
        spec = replay_spec(fmt, mask, window, docs, pack_layout)
        fmt_shape = dataclasses.replace(shape, b=1) if thd else shape
        for cp in cps:
            fmt_shape.validate(cp)
            spec_layout(spec, fmt_shape.s, cp)
            inputs = make_inputs(fmt_shape, spec, seed)
            ref = reference(inputs, spec)
            for strategy, kv in itertools.product(strategies, replayed(spec, schedules)):
                if strategy is SinkStrategy.EVERY_TILE and not sink_counted_again(spec, fmt_shape.s, cp // (a2a_size or 1),
                                                                                  kv):
                    continue   # each row's keys in one tile (allgather): the bug cannot change a result
                sh = fmt_shape
                ran = resolved_kv_schedule(s=sh.s, b=sh.b, h=sh.h, g=sh.g, d=sh.d, dtype=torch.float64, cp=cp,
                                           mask=mask, window=window, comm="p2p" if a2a_size is None else "a2a+p2p",
                                           a2a_size=a2a_size, kv_schedule=kv, cu_seqlens=spec.cu_seqlens,
                                           pack_layout=spec.pack_layout)   # None: a ring of one rank runs none
                again = seen.setdefault((fmt, cp, mask, strategy, ran), kv)
                if again is not kv:
                    if ran is not None:   # without a ring no schedule means anything: nothing to say
                        print(f"sinkprof emulate: --kv-schedule {kv.value} runs as {again.value} does at cp {cp} "
                              f"({fmt.value}, {mask}, {strategy.value}): one row for both", file=sys.stderr)
                    continue
                run = (emulate_ring(inputs, spec, cp, strategy, kv_schedule=kv) if a2a_size is None else
                       emulate_hierarchical(inputs, spec, cp, a2a_size, strategy, kv_schedule=kv))
                got = run.result
                err = {k: (got.named()[k] - v).abs().max().item() for k, v in ref.named().items()}
                ratio = (got.d_offset / ref.d_offset).flatten()
                passed = max(err.values()) <= EMULATE_TOLERANCE
                rows.append(EmulateRow("p2p" if a2a_size is None else f"a2a+p2p({a2a_size})", fmt.value,
                                       window_text(window),
                                       seqlens_text(docs) if thd else "", spec.pack_layout.value if thd else "",
                                       "" if ran is None else ran.value, cp, MaskType.parse(mask, "mask").value,
                                       strategy.value,
                                       err["out"], err["dq"], err["dk"], err["dv"], err["d_sink"], ratio.min().item(),
                                       ratio.max().item(), passed, passed != (strategy is SinkStrategy.EVERY_TILE)))
    return rows


def replay_spec(fmt: QKVFormat, mask, window, docs: tuple, pack_layout=PackLayout.ZIGZAG) -> AttnSpec:
    """The spec a replay runs: a learnable sink, the pack's documents in ``pack_layout`` under thd."""
    thd = fmt is QKVFormat.THD
    cu = [0, *itertools.accumulate(docs)] if thd else None
    return make_spec(SoftmaxType.LEARNABLE, mask, window, fmt, cu, pack_layout if thd else PackLayout.ZIGZAG)


def check_every_tile(strategies, cps, a2a_size: Optional[int], masks, window, formats, s: int, docs: tuple,
                     schedules=(KVSchedule.AUTO,), pack_layout=PackLayout.ZIGZAG) -> None:
    """``--strategy every-tile`` replays the bug the run must detect, so each of its rows must be
    able to fail: refuse a cp, mask or layout whose ring tiles see each row once (a ring of one
    rank, or a diagonal window), where the sink counted once per tile is still counted once
    (``preflight.sink_counted_again``, which also says where ``check --inject sink-every-tile`` applies).
    Under ``allgather`` (which ``auto`` is in the balanced pack layout) every row's keys are one
    tile: its every-tile rows are left out, and a run of allgather alone is refused."""
    if SinkStrategy.EVERY_TILE not in strategies:
        return
    specs = {(fmt, mask): replay_spec(QKVFormat.parse(fmt, "--qkv-format"), mask, window, docs, pack_layout)
             for fmt, mask in itertools.product(formats, masks)}
    if all(only_allgather(replayed(spec, schedules), spec.pack_layout) for spec in specs.values()):
        fix = ("add ring or direct to --kv-schedule" if pack_layout is PackLayout.ZIGZAG else
               "the balanced pack layout runs under allgather alone")
        raise ValueError(f"--strategy every-tile: --kv-schedule allgather gives each row's keys one tile, so the bug "
                         f"(the sink counted once per tile) cannot change a result; {fix}; leave every-tile out "
                         f"(--strategy step0,post-merge)")
    members = a2a_size or 1
    for fmt, mask, cp in itertools.product(formats, masks, cps):
        ring = cp // members
        spec = specs[fmt, mask]
        kinds = replayed(spec, schedules)
        if only_allgather(kinds, spec.pack_layout) or any(sink_counted_again(spec, s, ring, k) for k in kinds):
            continue   # (allgather's every-tile rows are left out)
        skip = "or leave every-tile out (--strategy step0,post-merge)"
        if ring == 1:
            where = (f"--cp {cp} with --comm a2a+p2p --a2a-size {a2a_size} runs a p2p ring of one rank (cp / a2a-size)"
                     if a2a_size else f"--cp {cp} runs a ring of one rank")
            fix = f"give every --cp at least {2 * members}{' (2 * --a2a-size)' if a2a_size else ''}, {skip}"
        else:
            where = f"--window {window[0]},{window[1]} (--mask {mask}) puts each row's keys in one tile"
            fix = f"widen --window, {skip}"
        raise ValueError(f"--strategy every-tile: {where}, so the bug (the sink counted once per tile) cannot change "
                         f"a result and the replay cannot detect it; {fix}")


def check_heads_and_groups(shape: Shape, cps, members: Optional[int]) -> None:
    """``--heads`` a multiple of ``--kv-heads``, and under a2a+p2p (``members`` ranks per inner
    group) an ``--a2a-size`` that divides every ``--cp`` and splits the heads: the library's checks
    (``check_a2a_size``, ``check_heads``, which ``emulate_hierarchical`` runs), in the options' words."""
    check_head_counts(shape.h, shape.g)
    if members is None:
        return
    for n in cps:
        try:
            check_a2a_size(members, n)
        except A2AError:
            raise ValueError(f"--a2a-size {members} must divide every --cp, and --cp {n} is not a multiple of it; "
                             f"give --cp multiples of {members} or a smaller --a2a-size") from None
    try:
        check_heads(shape.h, shape.g, members)
    except A2AError:
        fits = [m for m in a2a_sizes(math.gcd(*cps), shape.h, shape.g) if m > 1]   # sizes that fit every --cp
        fix = (f"use --a2a-size {max(fits)}, which divides both and every --cp" if fits else
               "use --comm p2p (no --a2a-size above 1 divides both and every --cp)")
        raise ValueError(f"--comm a2a+p2p --a2a-size {members} splits the heads over each a2a group: --heads "
                         f"{shape.h} and --kv-heads {shape.g} must both be divisible by {members}; {fix}") from None


def replayed(spec: AttnSpec, schedules) -> list:
    """The schedules of ``schedules`` that ``spec`` replays under: a pack in the balanced layout
    under allgather alone (``auto`` takes it; its pieces of a document sit on a few ranks), any
    other layout under each."""
    if spec.pack_layout is PackLayout.BALANCED:
        return [k for k in schedules if k in (KVSchedule.AUTO, KVSchedule.ALLGATHER)]
    return list(schedules)


def only_allgather(schedules, pack_layout: PackLayout) -> bool:
    """Every schedule replayed is allgather (``auto`` is, in the balanced pack layout)."""
    gathered = {KVSchedule.ALLGATHER} | ({KVSchedule.AUTO} if pack_layout is PackLayout.BALANCED else set())
    return all(KVSchedule.parse(k, "--kv-schedule") in gathered for k in schedules)


def check_pack_layout(pack_layout: PackLayout, formats, comm: str, schedules) -> None:
    """``--pack-layout balanced`` lays out thd packs and runs on p2p under allgather (or auto)."""
    if pack_layout is PackLayout.ZIGZAG:
        return
    if QKVFormat.THD not in formats:
        raise ValueError("--pack-layout balanced lays out the documents of a thd pack; add thd to --qkv-format "
                         "(e.g. --qkv-format thd) or drop --pack-layout")
    rings = [k.value for k in schedules if k not in (KVSchedule.AUTO, KVSchedule.ALLGATHER)]
    if comm != "p2p" or rings:
        given = f"--comm {comm}" if comm != "p2p" else f"--kv-schedule {','.join(rings)}"
        raise ValueError(f"--pack-layout balanced ({given}): its pieces of a document sit on a few ranks, so it "
                         f"replays on --comm p2p with --kv-schedule allgather (or auto, which takes it)")


def pack(formats, cps, *, seq_len: Optional[int], seqlens: Optional[tuple], docs: Optional[int], batch: Optional[int],
         seed: int, pack_layout=PackLayout.ZIGZAG) -> tuple[int, int, tuple]:
    """(sequence length, batch, the thd pack's documents) from the options, as ``check`` reads
    them: ``--seqlens`` sets the length, ``--docs`` draws lengths from the seed (multiples of
    2 * cp for every cp), a thd pack is ``b = 1``; errors name the options."""
    thd = QKVFormat.THD in formats
    given = {"seqlens": seqlens, "docs": docs, "seq_len": seq_len}
    check_pack_layer(given)
    s = merge_layers([{"seq_len": DEFAULT_SEQ_LEN}, given])["seq_len"]
    settings = Settings(qkv_format=tuple(f.value for f in formats), seq_len=s, seqlens=seqlens, docs=docs,
                        ranks=max(cps), seed=seed)
    if not thd:
        settings.validate_pack()    # names --seqlens or --docs given without thd
        return s, batch or DEFAULT_BATCH, ()
    if batch not in (None, 1) and set(formats) == {QKVFormat.THD}:
        raise ValueError(f"--batch {batch}: a thd pack is one sequence of documents (b = 1); drop --batch, or add "
                         f"bshd or sbhd to --qkv-format")
    if set(formats) == {QKVFormat.THD}:
        batch = 1
    lengths = settings.documents(tuple(cps))
    for cp in cps:
        try:
            spec_layout(Settings.pack_spec(lengths, pack_layout), s, cp)
        except ValueError as exc:
            raise ValueError(f"--seqlens {seqlens_text(lengths)} at --cp {cp}: {exc}") from None
    return s, batch or DEFAULT_BATCH, lengths


def run(cps, comm: str, a2a_size: Optional[int], masks, strategies, shape: Shape, seed: int, window: Optional[str],
        output: Output, schedules=(KVSchedule.AUTO,), formats=(QKVFormat.BSHD,), docs: tuple = (),
        pack_layout=PackLayout.ZIGZAG, every_schedule: bool = False) -> int:
    """The command: every option checked and the replay's memory estimated before the first tensor,
    then replay, compare, write the rows; 0 when every row is as expected. ``window`` is the
    ``LEFT,RIGHT`` text of ``--window``; ``docs`` the thd pack (``pack``) in ``pack_layout``.
    ``every_schedule``: ``schedules`` is ``--kv-schedule all``, each case replayed under every one
    its layout runs (``replayed``), where a schedule named is one every case must run."""
    pair = None if window is None else window_pair(window, "--window")
    if comm not in ("p2p", "a2a+p2p"):
        raise ValueError(f"--comm {comm!r}: emulate replays p2p or a2a+p2p")
    if a2a_size is not None and comm != "a2a+p2p":
        raise ValueError(f"--a2a-size {a2a_size} with --comm {comm}: only a2a+p2p reads it; use --comm a2a+p2p, "
                         f"or drop --a2a-size")
    check_pack_layout(pack_layout, formats, comm, () if every_schedule else schedules)
    members = (a2a_size or DEFAULT_A2A_SIZE) if comm == "a2a+p2p" else None
    check_heads_and_groups(shape, cps, members)
    check_window(pair, masks)
    specs = [replay_spec(QKVFormat.parse(fmt, "--qkv-format"), mask, pair, docs, pack_layout)
             for fmt, mask in itertools.product(formats, masks)]
    for spec in specs:   # before the first tensor
        check_replay_memory(shape, [spec], cps, members or 1, replayed(spec, schedules))
    check_every_tile(strategies, cps, members, masks, pair, formats, shape.s, docs, schedules, pack_layout)
    rows = emulate(cps, masks, strategies, shape, seed, pair, members, schedules, formats, docs, pack_layout)
    ok = all(r.ok for r in rows)
    sizes = [f"b={shape.b} s={shape.s}"] if set(formats) != {QKVFormat.THD} else []
    sizes += [f"thd t={shape.s} docs={docs_label(docs)}"
              + (f" layout={pack_layout.value}" if pack_layout is not PackLayout.ZIGZAG else "")] if docs else []

    def table(console):
        from rich.table import Table
        t = Table(title=f"fp64 ring replay vs reference (tolerance {EMULATE_TOLERANCE:g}, {', '.join(sizes)} "
                        f"h={shape.h} g={shape.g} d={shape.d}, learnable sink randn*5)")
        for col in ("comm", "format", "kv", "cp", "mask", "strategy", "out", "dq", "dk", "dv", "d_sink",
                    "d_sink ratio", "verdict"):
            t.add_column(col, justify="right" if col not in ("format", "kv", "mask", "strategy", "verdict") else "left")
        for r in rows:
            verdict = ("ok" if r.passed else "WRONG") if r.strategy != "every-tile" else \
                ("bug detected" if not r.passed else "BUG NOT DETECTED")
            style = "green" if r.ok else "red"
            t.add_row(r.comm, r.qkv_format, r.kv_schedule, str(r.cp), r.mask, r.strategy, *(f"{x:.1e}" for x in (
                r.out_max_abs_err, r.dq_max_abs_err, r.dk_max_abs_err, r.dv_max_abs_err, r.dsink_max_abs_err)),
                f"{r.dsink_ratio_min:.4f}..{r.dsink_ratio_max:.4f}", f"[{style}]{verdict}[/{style}]")
        console.print(t)

    def as_json(key: str, value):   # as check's JSON has them: numbers as lists, null for none (the CSV's "")
        if key in ("window", "docs", "pack_layout", "kv_schedule") and value == "":
            return None
        return [int(x) for x in value.split(",")] if key in ("window", "docs") else value

    output.emit(doc={"passed": ok, "tolerance": EMULATE_TOLERANCE, "shape": asdict(shape),
                     "window": None if pair is None else list(pair), "docs": list(docs) or None, "seed": seed,
                     "results": [{k: as_json(k, v) for k, v in asdict(r).items()} for r in rows]},
                rows=[asdict(r) for r in rows], table=table)
    return EXIT_OK if ok else EXIT_FAILED
