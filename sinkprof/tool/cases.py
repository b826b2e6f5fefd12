"""The case matrix of ``check`` and ``bench``: ``Settings`` (lists of options, as a profile and the
command line give them) crossed into ``Case``s.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from ..dist import DEFAULT_TIMEOUT_S
from ..kernels import unavailable_reason
from ..options import (DTYPES, Backend, CommType, KVSchedule, MaskType, QKVFormat, SinkGrad, SinkStrategy, SoftmaxType,
                       check_a2a_size, check_heads, check_sink_strategy, make_spec, parse_dtype, window_pair)
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
    kv_schedule: tuple = ("auto",)
    window: Optional[tuple] = None
    bias: bool = False
    a2a_size: int = 2
    batch: int = 2
    seq_len: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ranks: int = 2
    device: str = "cpu"
    backend: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the option for anything a run would trip over later, with the
        library's own checks (the ones ``cp_attention`` runs on the tensors)."""
        for name in LIST_FIELDS:
            if not getattr(self, name):
                raise ValueError(f"{option(name)} needs at least one value, e.g. {ALL[name][0]} (or 'all')")
        for name, enum in (("comm", CommType), ("softmax", SoftmaxType), ("mask", MaskType),
                           ("qkv_format", QKVFormat), ("sink_grad", SinkGrad), ("kv_schedule", KVSchedule)):
            for value in getattr(self, name):
                enum.parse(value, option(name))
        for value in self.sink_strategy:
            check_sink_strategy(value, option("sink_strategy"))
        for name in self.dtype:
            parse_dtype(name, option("dtype"))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r} is not supported; use cpu or cuda")
        backend = Backend.parse(self.backend, "--backend")
        if backend not in (Backend.AUTO, Backend.TORCH):
            reason = unavailable_reason(backend, self.device)
            if reason is not None:
                raise ValueError(f"--backend {backend.value} cannot run here: {reason}; "
                                 f"use --backend torch (or auto, which picks what runs)")
        for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "ranks", "a2a_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option(name)} {getattr(self, name)} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads} (GQA)")
        if self.seq_len % (2 * self.ranks):
            step = 2 * self.ranks
            raise ValueError(f"--seq-len {self.seq_len} must be divisible by 2 * cp = {step} (load-balanced "
                             f"chunks, cp = --ranks {self.ranks}); use --seq-len {max(step, self.seq_len // step * step)}")
        for mask in self.mask:
            try:
                make_spec("vanilla", mask, self.window, "bshd")
            except ValueError as exc:
                raise ValueError(f"--window {','.join(map(str, self.window))}: {exc}") from None
        for comm in map(CommType, self.comm):
            if comm is CommType.A2A_P2P:
                check_a2a_size(self.a2a_size, self.ranks)
            check_heads(self.heads, self.kv_heads, a2a_members(comm, self.ranks, self.a2a_size))

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.seq_len, self.heads, self.kv_heads, self.head_dim)


LIST_FIELDS = ("comm", "softmax", "mask", "qkv_format", "dtype", "sink_strategy", "sink_grad")


def option(name: str) -> str:
    """The command-line option of a ``Settings`` field (its profile key is the field name)."""
    return "--" + name.replace("_", "-")


def a2a_members(comm: CommType, cp: int, a2a_size: int) -> int:
    """Ranks of the inner a2a group: 1 for p2p, the whole group for a2a."""
    return {CommType.P2P: 1, CommType.A2A: cp, CommType.A2A_P2P: a2a_size}[comm]


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
    kv_schedule: KVSchedule = KVSchedule.AUTO

    def parts(self) -> dict:
        """The case in words, one entry per option it sets (option name -> text), in label order."""
        parts = {"comm": f"a2a+p2p({self.a2a_size})" if self.comm is CommType.A2A_P2P else self.comm.value,
                 "softmax": self.softmax.value, "mask": self.mask.value, "qkv_format": self.qkv_format.value,
                 "dtype": self.dtype}
        if self.softmax.has_sink:
            parts.update(sink_strategy=self.sink_strategy.value, sink_grad=f"grad={self.sink_grad.value}")
        if self.window is not None:
            parts["window"] = f"window={self.window[0]},{self.window[1]}"
        if self.bias:
            parts["bias"] = "bias"
        if self.kv_schedule is not KVSchedule.AUTO:
            parts["kv_schedule"] = f"kv={self.kv_schedule.value}"
        return parts

    @property
    def label(self) -> str:
        return "/".join(self.parts().values())


def expand(settings: Settings) -> list[Case]:
    """The cross product of the settings' lists; sink options only multiply cases that have a sink."""
    shape = settings.shape
    cases = []
    for comm, softmax, mask, fmt, dtype, kv in itertools.product(settings.comm, settings.softmax, settings.mask,
                                                                 settings.qkv_format, settings.dtype,
                                                                 settings.kv_schedule):
        sm = SoftmaxType.parse(softmax, "softmax")
        strategies = settings.sink_strategy if sm.has_sink else settings.sink_strategy[:1]
        contracts = settings.sink_grad if sm.has_sink or settings.bias else settings.sink_grad[:1]
        for strategy, contract in itertools.product(strategies, contracts):
            cases.append(Case(CommType.parse(comm, "comm"), sm, MaskType.parse(mask, "mask"),
                              QKVFormat.parse(fmt, "qkv_format"), dtype, SinkStrategy.parse(strategy, "sink_strategy"),
                              SinkGrad.parse(contract, "sink_grad"), settings.window, settings.bias, shape,
                              settings.a2a_size, KVSchedule.parse(kv, "kv_schedule")))
    return cases


# What ``all`` means for each list setting on the command line.
ALL = {"comm": tuple(c.value for c in CommType), "softmax": tuple(s.value for s in SoftmaxType),
       "mask": tuple(m.value for m in MaskType), "qkv_format": tuple(f.value for f in QKVFormat),
       "dtype": tuple(DTYPES), "sink_grad": tuple(g.value for g in SinkGrad),
       "sink_strategy": tuple(s.value for s in SinkStrategy if s is not SinkStrategy.EVERY_TILE),
       "kv_schedule": tuple(k.value for k in KVSchedule if k is not KVSchedule.AUTO)}


@dataclass(frozen=True)
class CaseOptions:
    """The case options ``check`` and ``bench`` share, as the command line gave them: None is
    "not given" (the profile's value, else the ``Settings`` default); lists are comma strings."""

    profile: Optional[str] = None
    comm: Optional[str] = None
    a2a_size: Optional[int] = None
    softmax: Optional[str] = None
    mask: Optional[str] = None
    qkv_format: Optional[str] = None
    dtype: Optional[str] = None
    sink_strategy: Optional[str] = None
    sink_grad: Optional[str] = None
    kv_schedule: Optional[str] = None
    window: Optional[str] = None
    bias: Optional[bool] = None
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    ranks: Optional[int] = None
    device: Optional[str] = None
    backend: Optional[str] = None
    dist_backend: str = "auto"
    seed: Optional[int] = None
    timeout: float = DEFAULT_TIMEOUT_S
    run_timeout: float = 900.0

    def overrides(self) -> dict:
        """The ``Settings`` fields given on the command line, parsed."""
        out = {}
        for f in dataclasses.fields(Settings):
            value = getattr(self, f.name, None)
            if value is None:
                continue
            if f.name in ALL:
                value = tuple(v.strip() for v in value.split(",") if v.strip())
                if value == ("all",):
                    value = ALL[f.name]
            elif f.name == "window":
                value = window_pair(value, "--window")
            out[f.name] = value
        return out
