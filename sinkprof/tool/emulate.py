"""``sinkprof emulate``: every rank's ring schedule replayed in fp64 in one process (the library's
emulator, ``sinkprof.emulate``) against the reference, for every (cp, mask, strategy) asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..emulate import emulate_hierarchical, emulate_ring
from ..options import MaskType, SinkStrategy, SoftmaxType, make_spec
from ..testing import Shape, make_inputs, reference


@dataclass
class EmulateRow:
    comm: str
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


def emulate(cps, masks, strategies, shape: Shape, seed: int, window=None, a2a_size: Optional[int] = None) -> list[EmulateRow]:
    """Every (cp, mask, strategy) against the fp64 reference, with a learnable sink of ``randn * 5``.

    With ``a2a_size`` the schedule is a2a+p2p: cp ranks in inner groups of ``a2a_size``."""
    rows = []
    for mask in masks:
        spec = make_spec(SoftmaxType.LEARNABLE, mask, window, "bshd")
        for cp in cps:
            shape.validate(cp)
            inputs = make_inputs(shape, spec, seed)
            ref = reference(inputs, spec)
            for strategy in strategies:
                got = (emulate_ring(inputs, spec, cp, strategy) if a2a_size is None else
                       emulate_hierarchical(inputs, spec, cp, a2a_size, strategy)).result
                err = {k: (got.named()[k] - v).abs().max().item() for k, v in ref.named().items()}
                ratio = (got.d_offset / ref.d_offset).flatten()
                passed = max(err.values()) <= EMULATE_TOLERANCE
                rows.append(EmulateRow("p2p" if a2a_size is None else f"a2a+p2p({a2a_size})", cp, MaskType.parse(mask, "mask").value, strategy.value, err["out"], err["dq"],
                                       err["dk"], err["dv"], err["d_sink"], ratio.min().item(), ratio.max().item(),
                                       passed, passed != (strategy is SinkStrategy.EVERY_TILE)))
    return rows
