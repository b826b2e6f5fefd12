"""``sinkprof emulate``: every rank's ring schedule replayed in fp64 in one process (the library's
emulator, ``sinkprof.emulate``) against the reference, for every (cp, mask, strategy) asked for.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Optional

from ..emulate import emulate_hierarchical, emulate_ring
from ..options import KVSchedule, MaskType, SinkStrategy, SoftmaxType, make_spec, window_pair
from ..testing import Shape, make_inputs, reference
from .errors import EXIT_FAILED, EXIT_OK
from .output import Output


@dataclass
class EmulateRow:
    comm: str
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
            schedules=(KVSchedule.AUTO,)) -> list[EmulateRow]:
    """Every (cp, mask, strategy, K/V schedule) against the fp64 reference, with a learnable sink
    of ``randn * 5``.

    With ``a2a_size`` the schedule is a2a+p2p: cp ranks in inner groups of ``a2a_size``."""
    rows = []
    for mask in masks:
        spec = make_spec(SoftmaxType.LEARNABLE, mask, window, "bshd")
        for cp in cps:
            shape.validate(cp)
            inputs = make_inputs(shape, spec, seed)
            ref = reference(inputs, spec)
            for strategy, kv in itertools.product(strategies, schedules):
                run = (emulate_ring(inputs, spec, cp, strategy, kv_schedule=kv) if a2a_size is None else
                       emulate_hierarchical(inputs, spec, cp, a2a_size, strategy, kv_schedule=kv))
                got = run.result
                err = {k: (got.named()[k] - v).abs().max().item() for k, v in ref.named().items()}
                ratio = (got.d_offset / ref.d_offset).flatten()
                passed = max(err.values()) <= EMULATE_TOLERANCE
                rows.append(EmulateRow("p2p" if a2a_size is None else f"a2a+p2p({a2a_size})",
                                       run.kv_schedule.value, cp, MaskType.parse(mask, "mask").value, strategy.value,
                                       err["out"], err["dq"], err["dk"], err["dv"], err["d_sink"], ratio.min().item(),
                                       ratio.max().item(), passed, passed != (strategy is SinkStrategy.EVERY_TILE)))
    return rows


def run(cps, comm: str, a2a_size: int, masks, strategies, shape: Shape, seed: int, window: Optional[str],
        output: Output, schedules=(KVSchedule.AUTO,)) -> int:
    """The command: replay, compare, write the rows; 0 when every row is as expected. ``window``
    is the ``LEFT,RIGHT`` text of ``--window``."""
    pair = None if window is None else window_pair(window, "--window")
    for n in cps:
        shape.validate(n)
    if comm not in ("p2p", "a2a+p2p"):
        raise ValueError(f"--comm {comm!r}: emulate replays p2p or a2a+p2p")
    rows = emulate(cps, masks, strategies, shape, seed, pair, a2a_size if comm == "a2a+p2p" else None, schedules)
    ok = all(r.ok for r in rows)

    def table(console):
        from rich.table import Table
        t = Table(title=f"fp64 ring replay vs reference (tolerance {EMULATE_TOLERANCE:g}, b={shape.b} s={shape.s} "
                        f"h={shape.h} g={shape.g} d={shape.d}, learnable sink randn*5)")
        for col in ("comm", "kv", "cp", "mask", "strategy", "out", "dq", "dk", "dv", "d_sink", "d_sink ratio", "verdict"):
            t.add_column(col, justify="right" if col not in ("kv", "mask", "strategy", "verdict") else "left")
        for r in rows:
            verdict = ("ok" if r.passed else "WRONG") if r.strategy != "every-tile" else \
                ("bug detected" if not r.passed else "BUG NOT DETECTED")
            style = "green" if r.ok else "red"
            t.add_row(r.comm, r.kv_schedule, str(r.cp), r.mask, r.strategy, *(f"{x:.1e}" for x in (
                r.out_max_abs_err, r.dq_max_abs_err, r.dk_max_abs_err, r.dv_max_abs_err, r.dsink_max_abs_err)),
                f"{r.dsink_ratio_min:.4f}..{r.dsink_ratio_max:.4f}", f"[{style}]{verdict}[/{style}]")
        console.print(t)

    output.emit(doc={"passed": ok, "tolerance": EMULATE_TOLERANCE, "shape": asdict(shape), "window": window,
                     "seed": seed, "results": [asdict(r) for r in rows]},
                rows=[asdict(r) for r in rows], table=table)
    return EXIT_OK if ok else EXIT_FAILED
