"""The case matrix of ``check`` and ``bench``: ``Settings`` (lists of options, as a profile and the
command line give them) crossed into ``Case``s.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from ..options import (Comm as CommType, DTYPES, MaskType, QKVFormat, SinkGrad, SinkStrategy, SoftmaxType,
                       make_spec)
from ..testing import Shape


@dataclass(frozen=True)
class Settings:
    """One run of ``check``: lists are crossed into cases. The defaults are the embedded CPU default."""

    comm: tuple = ("p2p",)
    softmax: tuple = ("vanilla", "off-by-one", "learnable")
    mask: tuple = ("causal", "no_mask")
    qkv_format: tuple = ("bshd",)
    dtype: tuple = ("fp64", "bf16")
    sink_strategy: tuple = ("step0",)
    sink_grad: tuple = ("full",)
    window: Optional[tuple] = None
    bias: bool = False
    a2a_size: int = 2
    b: int = 2
    s: int = 64
    h: int = 4
    g: int = 2
    d: int = 16
    nproc: int = 2
    device: str = "cpu"
    backend: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the setting for anything a run would trip over later."""
        for name, enum in (("comm", CommType), ("softmax", SoftmaxType), ("mask", MaskType),
                           ("qkv_format", QKVFormat), ("sink_strategy", SinkStrategy), ("sink_grad", SinkGrad)):
            for value in getattr(self, name):
                enum.parse(value, name)
        if SinkStrategy.EVERY_TILE.value in self.sink_strategy:
            raise ValueError("sink_strategy 'every-tile' is the known bug; inject it with --inject sink-every-tile")
        for name in self.dtype:
            if name not in DTYPES:
                raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not supported; use cpu or cuda")
        if self.nproc < 1:
            raise ValueError(f"nproc={self.nproc} must be >= 1")
        Shape(self.b, self.s, self.h, self.g, self.d).validate(self.nproc)
        for mask in self.mask:
            make_spec("vanilla", mask, self.window, "bshd")
        members = {"p2p": 1, "a2a": self.nproc, "a2a+p2p": self.a2a_size}
        for comm in self.comm:
            if comm == "a2a+p2p" and (self.a2a_size < 1 or self.nproc % self.a2a_size):
                raise ValueError(f"a2a_size={self.a2a_size} must divide nproc={self.nproc} for comm a2a+p2p")
            if self.h % members[comm] or self.g % members[comm]:
                raise ValueError(f"comm {comm} splits heads over {members[comm]} ranks: h={self.h} and g={self.g} "
                                 f"must both be divisible by {members[comm]}")


@dataclass(frozen=True)
class Case:
    comm: CommType
    softmax: SoftmaxType
    mask: MaskType
    qkv_format: QKVFormat
    dtype: str
    sink_strategy: SinkStrategy
    sink_grad: SinkGrad
    window: Optional[tuple]
    bias: bool
    shape: Shape
    a2a_size: int = 2

    @property
    def label(self) -> str:
        comm = f"a2a+p2p({self.a2a_size})" if self.comm is CommType.A2A_P2P else self.comm.value
        parts = [comm, self.softmax.value, self.mask.value, self.qkv_format.value, self.dtype]
        if self.softmax.has_sink:
            parts += [self.sink_strategy.value, f"grad={self.sink_grad.value}"]
        if self.window is not None:
            parts.append(f"window={self.window[0]},{self.window[1]}")
        if self.bias:
            parts.append("bias")
        return "/".join(parts)


def expand(settings: Settings) -> list[Case]:
    """The cross product of the settings' lists; sink options only multiply cases that have a sink."""
    shape = Shape(settings.b, settings.s, settings.h, settings.g, settings.d)
    cases = []
    for comm, softmax, mask, fmt, dtype in itertools.product(settings.comm, settings.softmax, settings.mask,
                                                             settings.qkv_format, settings.dtype):
        sm = SoftmaxType.parse(softmax, "softmax")
        strategies = settings.sink_strategy if sm.has_sink else settings.sink_strategy[:1]
        contracts = settings.sink_grad if sm.has_sink or settings.bias else settings.sink_grad[:1]
        for strategy, contract in itertools.product(strategies, contracts):
            cases.append(Case(CommType.parse(comm, "comm"), sm, MaskType.parse(mask, "mask"),
                              QKVFormat.parse(fmt, "qkv_format"), dtype, SinkStrategy.parse(strategy, "sink_strategy"),
                              SinkGrad.parse(contract, "sink_grad"), settings.window, settings.bias, shape,
                              settings.a2a_size))
    return cases
