"""Enums, the attention spec dataclass and the argument validation every entry point shares.

Strings are accepted at the public boundary (they are what users type) and turned into enums
here, once, with an error that names the argument and lists the accepted values.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Optional

import torch


class _Choice(str, enum.Enum):
    """A string enum whose ``parse`` names the offending argument in its error."""

    @classmethod
    def parse(cls, value, arg: str):
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.value:
                return member
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{arg}={value!r} is not supported; use one of {allowed}")

    def __str__(self) -> str:  # so f-strings and tables show the user's spelling
        return self.value


class SoftmaxType(_Choice):
    VANILLA = "vanilla"
    OFF_BY_ONE = "off-by-one"
    LEARNABLE = "learnable"

    @property
    def has_sink(self) -> bool:
        return self is not SoftmaxType.VANILLA


class MaskType(_Choice):
    CAUSAL = "causal"
    NO_MASK = "no_mask"


class QKVFormat(_Choice):
    """``bshd`` and ``sbhd`` hold ``b`` sequences; ``thd`` is one pack of documents ``[t, h, d]``
    (``cu_seqlens`` says where each starts), handled as ``bshd`` with ``b = 1``."""

    BSHD = "bshd"
    SBHD = "sbhd"
    THD = "thd"

    @property
    def seq_dim(self) -> int:
        return 1 if self is QKVFormat.BSHD else 0

    @property
    def layout(self) -> str:
        return {"bshd": "[b, s, h, d]", "sbhd": "[s, b, h, d]", "thd": "[t, h, d]"}[self.value]

    def to_bhsd(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[b, h, s, d]`` view of a tensor in this format (no copy; ``b = 1`` for thd)."""
        if self is QKVFormat.THD:
            return x.permute(1, 0, 2).unsqueeze(0)
        return x.permute(0, 2, 1, 3) if self is QKVFormat.BSHD else x.permute(1, 2, 0, 3)

    def from_bhsd(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse view of ``to_bhsd``."""
        if self is QKVFormat.THD:
            return x.squeeze(0).permute(1, 0, 2)
        return x.permute(0, 2, 1, 3) if self is QKVFormat.BSHD else x.permute(2, 0, 1, 3)


class SinkStrategy(_Choice):
    """Where the sink enters a ring: ``every-tile`` is the known bug, kept for the emulator."""

    STEP0 = "step0"
    POST_MERGE = "post-merge"
    EVERY_TILE = "every-tile"


class SinkGrad(_Choice):
    """Contract for gradients of replicated tensors (the sink and the bias) under CP."""

    FULL = "full"
    PARTIAL = "partial"


class CommType(_Choice):
    P2P = "p2p"
    A2A = "a2a"
    A2A_P2P = "a2a+p2p"


class KVSchedule(_Choice):
    """How K/V (and dK/dV) move between the ranks of a ring (docs/design.md, section 5)."""

    AUTO = "auto"      # ring or direct, whichever moves fewer bytes for this plan
    RING = "ring"      # whole shards forwarded to the next rank every step
    DIRECT = "direct"  # each owner sends each reader exactly the rows it reads, at the step it reads them
    ALLGATHER = "allgather"  # every shard's rows a rank reads to it, before one step over them (not overlapped)


class PackLayout(_Choice):
    """Which rows of a thd pack each rank holds (docs/design.md, section 3: packed documents)."""

    ZIGZAG = "zigzag"      # each document in 2 cp chunks, rank r holding chunks r and 2cp-1-r of every one
    BALANCED = "balanced"  # each document in few long pieces, equal tokens and equal causal work per rank


class Backend(_Choice):
    AUTO = "auto"
    TORCH = "torch"
    CUDNN = "cudnn"
    FA4 = "fa4"


DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def parse_dtype(name: str, arg: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{arg}={name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_dtype(dtype, arg: str = "dtype") -> torch.dtype:
    """A dtype attention runs in: one of ``DTYPES``, as a ``torch.dtype`` or by name (``parse_dtype``)."""
    if isinstance(dtype, str):
        return parse_dtype(dtype, arg)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{arg}={dtype!r} must be a torch.dtype (or its name: {', '.join(DTYPES)}), "
                        f"not {type(dtype).__name__}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{arg}={dtype} is not supported; use one of {', '.join(DTYPES)}")
    return dtype


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for statistics and accumulators: fp64 stays fp64, everything else uses fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Band:
    """Visibility of a tile in its own coordinates: key j is seen by query i iff lo <= j - i <= hi.

    ``None`` means unbounded on that side, so ``Band()`` is a full tile and ``Band(None, 0)`` the
    usual causal diagonal. One representation serves the reference, the ring plan and the kernels.
    """

    lo: Optional[int] = None
    hi: Optional[int] = None

    @property
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None

    def shifted(self, offset: int) -> "Band":
        """The same band seen from coordinates where j - i grows by ``offset``."""
        return Band(None if self.lo is None else self.lo + offset,
                    None if self.hi is None else self.hi + offset)

    def clipped(self, n_q: int, n_kv: int) -> Optional[tuple[int, int]]:
        """The band restricted to an n_q x n_kv tile as a closed interval of j - i, or None if empty."""
        lo_dom, hi_dom = -(n_q - 1), n_kv - 1
        lo = lo_dom if self.lo is None else max(self.lo, lo_dom)
        hi = hi_dom if self.hi is None else min(self.hi, hi_dom)
        return (lo, hi) if lo <= hi else None

    def count(self, n_q: int, n_kv: int) -> int:
        """Visible (query, key) pairs of an n_q x n_kv tile, without building the mask."""
        i = torch.arange(n_q, dtype=torch.int64)
        first = torch.zeros_like(i) if self.lo is None else (i + self.lo).clamp(min=0)
        last = torch.full_like(i, n_kv - 1) if self.hi is None else (i + self.hi).clamp(max=n_kv - 1)
        return int((last - first + 1).clamp(min=0).sum())

    def mask(self, n_q: int, n_kv: int, device=None) -> Optional[torch.Tensor]:
        """Boolean [n_q, n_kv] visibility, or None when every key is visible."""
        clip = self.clipped(n_q, n_kv)
        if clip == (-(n_q - 1), n_kv - 1):
            return None
        diff = (torch.arange(n_kv, device=device)[None, :]
                - torch.arange(n_q, device=device)[:, None])
        if clip is None:
            return torch.zeros(n_q, n_kv, dtype=torch.bool, device=device)
        return (diff >= clip[0]) & (diff <= clip[1])


@dataclass(frozen=True)
class AttnSpec:
    """Everything about one attention call except the tensors: built once by ``make_spec``."""

    softmax_type: SoftmaxType = SoftmaxType.VANILLA
    mask: MaskType = MaskType.NO_MASK
    window: tuple[Optional[int], Optional[int]] = (None, None)  # (left, right); None = unbounded
    qkv_format: QKVFormat = QKVFormat.BSHD
    docs: tuple[int, ...] = ()      # thd: the length of each document of the pack, in order
    pack_layout: PackLayout = PackLayout.ZIGZAG   # thd: which rows of the pack each rank holds

    def __post_init__(self) -> None:
        # built by hand (the reference, the tests' specs), a field must mean what make_spec's would:
        # the loops compare the enums by identity, and a window side of -1 (make_spec's unbounded) is None here
        for name, kind in (("softmax_type", SoftmaxType), ("mask", MaskType), ("qkv_format", QKVFormat),
                           ("pack_layout", PackLayout)):
            object.__setattr__(self, name, kind.parse(getattr(self, name), f"AttnSpec.{name}"))
        window = self.window
        if not (isinstance(window, tuple) and len(window) == 2 and all(
                w is None or (isinstance(w, numbers.Integral) and not isinstance(w, bool) and 0 <= w <= WINDOW_MAX)
                for w in window)):
            raise ValueError(f"AttnSpec.window={window!r} must be a pair (left, right) of ints >= 0 or None for "
                             f"unbounded; make_spec takes -1 for unbounded")

    @property
    def cu_seqlens(self) -> Optional[list[int]]:
        """The documents' boundaries ``[0, end_0, ..., t]``, or None without documents."""
        return [0, *itertools.accumulate(self.docs)] if self.docs else None

    def batched(self) -> "AttnSpec":
        """The spec the loops run: a thd pack is one ``bshd`` sequence of ``b = 1`` (its documents kept)."""
        return dataclasses.replace(self, qkv_format=QKVFormat.BSHD) if self.qkv_format is QKVFormat.THD else self

    def chunks(self, s: int, cp: int) -> tuple[int, ...]:
        """Rows per load-balanced chunk of each document for a ring of ``cp`` ranks: the sequence
        of ``s`` rows is one document unless the spec has ``docs``. A pack in the balanced layout has
        no such chunks (``sinkprof.plan.spec_layout`` gives any layout)."""
        if cp < 1:
            raise ValueError(f"cp_size={cp} must be >= 1")
        if self.docs and self.pack_layout is PackLayout.BALANCED:
            raise ValueError(BALANCED_RUNS)
        if not self.docs:
            if s % (2 * cp):
                raise ValueError(f"sequence length {s} must be divisible by 2 * cp = {2 * cp} for the "
                                 f"load-balanced layout; pad the sequence or choose another cp")
            return (s // (2 * cp),)
        odd = [(n, length) for n, length in enumerate(self.docs) if length % (2 * cp)]
        if odd:
            n, length = odd[0]
            raise ValueError(f"document {n} has {length} tokens ({len(odd)} of {len(self.docs)} documents are not "
                             f"multiples of 2 * cp = {2 * cp}): each document is cut into 2 * cp load-balanced "
                             f"chunks; pad every document to a multiple of {2 * cp} with "
                             f"sinkprof.pad_pack(x, cu_seqlens, {2 * cp})")
        return tuple(length // (2 * cp) for length in self.docs)

    @property
    def band(self) -> Band:
        """Visibility in global positions: i - left <= j <= i + right, causal caps right at 0."""
        left, right = self.window
        if self.mask is MaskType.CAUSAL:
            right = 0
        return Band(None if left is None else -left, right)


WINDOW_MAX = 2 ** 63 - 1   # a window side is a 64-bit signed integer in the kernels' masks


def window_pair(window, arg: str = "window") -> tuple[int, int]:
    """``(left, right)`` ints from a pair or a ``"LEFT,RIGHT"`` string (what a user types), each
    at most ``WINDOW_MAX``."""
    def one(w) -> int:   # text as typed (ASCII digits: int() also takes "1_0" and full-width digits), or an int
        if isinstance(w, str):
            if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", w):
                raise ValueError
            return int(w)
        if isinstance(w, bool):
            raise TypeError
        return operator.index(w)   # 2.5 is no window width

    try:
        left, right = (one(w) for w in (window.split(",") if isinstance(window, str) else window))
    except (TypeError, ValueError):
        raise ValueError(f"{arg}={window!r} must be a pair LEFT,RIGHT of ints, -1 meaning unbounded "
                         f"(e.g. 128,0)") from None
    for name, w in (("left", left), ("right", right)):
        if w > WINDOW_MAX:
            raise ValueError(f"{arg}={window!r}: {name} {w} is past the largest window, 2**63-1 = {WINDOW_MAX}; "
                             f"use -1 for unbounded")
    return left, right


def check_int(value, arg: str, low: Optional[int] = None, what: str = "") -> int:
    """``value`` as an int: an integer (a float, even ``2.0``, or a bool is a TypeError), at least
    ``low`` if given (a ValueError). ``what`` tells in the errors what the number counts, as
    ``" (ranks in the CP group)"``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{arg}={value!r} must be an int{what}, not {type(value).__name__}") from None
    if low is not None and n < low:
        raise ValueError(f"{arg}={n} must be >= {low}{what}")
    return n


SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)   # what torch.manual_seed (and a torch.Generator) accepts


def check_seed(seed: int, arg: str = "seed") -> None:
    """A seed torch's generators take."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise ValueError(f"{arg} {seed} is out of range: torch's generators take a seed from -2**63 to 2**64-1 "
                         f"({low}..{high})")


TIMEOUT_MAX_S = 365 * 24 * 3600   # a year: well within datetime.timedelta and gloo's nanoseconds (2**63 ns)


def check_timeout(seconds: float, arg: str = "timeout") -> None:
    """A timeout in seconds from 1 to ``TIMEOUT_MAX_S`` (not NaN, not infinite)."""
    if not 1 <= seconds <= TIMEOUT_MAX_S:
        raise ValueError(f"{arg} {seconds:g}: give a number of seconds from 1 to {TIMEOUT_MAX_S} (365 days)")


def parse_window(window, mask: MaskType) -> tuple[Optional[int], Optional[int]]:
    """A user's ``window=(left, right)`` (-1 unbounded) as ``AttnSpec.window`` (None unbounded)."""
    if window is None:
        return (None, None)
    if not isinstance(window, (tuple, list)):   # (the command line's "LEFT,RIGHT" is window_pair's)
        raise TypeError(f"window={window!r} must be a pair (left, right) of ints, -1 meaning unbounded "
                        f"(e.g. (128, 0)), got {type(window).__name__}")
    for side, w in zip(("left", "right"), window):   # a float side would be truncated, a bool taken for 0 or 1
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window={window!r}: {side} must be an int (-1 for unbounded), "
                            f"got {type(w).__name__} {w!r}")
    left, right = window_pair(window)
    for name, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(f"window {name}={w} must be >= 0, or -1 for unbounded")
    if mask is MaskType.CAUSAL and right not in (0, -1):
        raise ValueError(f"window right={right} contradicts mask='causal' (causal implies right = 0); "
                         f"use window=({left}, 0) or mask='no_mask'")
    return (None if left == -1 else left, None if right == -1 else right)


def doc_lengths(cu_seqlens, arg: str = "cu_seqlens") -> tuple[int, ...]:
    """Document lengths from ``cu_seqlens`` (``[0, end_0, end_1, ..., t]``, a 1-D integer tensor
    or a sequence of ints, as FlashAttention and TransformerEngine take it)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"{arg} must be a 1-D integer tensor [0, end_0, ..., t], got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        ends = [int(x) for x in cu_seqlens.tolist()]
    else:
        try:
            ends = [operator.index(x) for x in cu_seqlens]
        except TypeError:
            raise ValueError(f"{arg}={cu_seqlens!r} must be a sequence of ints [0, end_0, ..., t]") from None
    if len(ends) < 2 or ends[0] != 0:
        raise ValueError(f"{arg}={ends} must start at 0 and hold one end per document: [0, end_0, ..., t]")
    lengths = tuple(b - a for a, b in zip(ends, ends[1:]))
    if min(lengths) < 1:
        n = min(range(len(lengths)), key=lambda i: lengths[i])
        raise ValueError(f"{arg}={ends} must increase strictly (document {n} has {lengths[n]} tokens)")
    return lengths


BALANCED_RUNS = ("pack_layout='balanced' gives a document's pieces to a few ranks, not 2 * cp chunks to every "
                 "rank: it runs under comm='p2p' with kv_schedule='allgather' (or 'auto', which then takes it)")


def check_runs(layout: PackLayout, comm: CommType, kv_schedule: KVSchedule) -> None:
    """A pack's layout runs under this comm and K/V schedule: the balanced one under p2p with
    ``allgather`` (or ``auto``, which then takes it) only."""
    if layout is PackLayout.BALANCED and (
            comm is not CommType.P2P or kv_schedule not in (KVSchedule.AUTO, KVSchedule.ALLGATHER)):
        raise ValueError(f"comm={comm.value!r}, kv_schedule={kv_schedule.value!r}: {BALANCED_RUNS}")


def make_spec(softmax_type, mask, window, qkv_format, cu_seqlens=None, pack_layout="zigzag") -> AttnSpec:
    softmax_type = SoftmaxType.parse(softmax_type, "softmax_type")
    mask = MaskType.parse(mask, "mask")
    fmt = QKVFormat.parse(qkv_format, "qkv_format")
    if fmt is QKVFormat.THD and cu_seqlens is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens, the document boundaries [0, end_0, ..., t] of the pack")
    if fmt is not QKVFormat.THD and cu_seqlens is not None:
        raise ValueError(f"cu_seqlens describes a pack of documents: use qkv_format='thd' with q of shape [t, h, d] "
                         f"(qkv_format={fmt.value!r} holds whole sequences)")
    layout = PackLayout.parse(pack_layout, "pack_layout")
    if layout is not PackLayout.ZIGZAG and fmt is not QKVFormat.THD:
        raise ValueError(f"pack_layout={layout.value!r} lays out the documents of a thd pack; a whole sequence "
                         f"(qkv_format={fmt.value!r}) is always cut into 2 * cp chunks: drop pack_layout")
    docs = doc_lengths(cu_seqlens) if cu_seqlens is not None else ()
    return AttnSpec(softmax_type, mask, parse_window(window, mask), fmt, docs, layout)


@dataclass(frozen=True)
class Dims:
    """Sizes read off validated q, k, v."""

    b: int
    s_q: int
    s_kv: int
    h: int
    g: int
    d: int


def type_name(x) -> str:
    """``list``, ``numpy.ndarray``: a value's type as an error names it."""
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def check_tensor(x, arg: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type_name(x)}; torch.as_tensor makes one")


def check_gqa(h: int, g: int) -> None:
    """The ``h`` query heads share the ``g`` K/V heads in equal groups (GQA/MQA)."""
    if g == 0 or h % g:
        raise ValueError(f"q has {h} heads and k, v have {g}: h must be a multiple of g (GQA/MQA)")


def check_qkv(q, k, v, fmt: QKVFormat) -> Dims:
    """Validate q, k, v (``[b, s, h, d]``, ``[s, b, h, d]`` or ``[t, h, d]``, GQA allowed) and
    return their sizes (``b = 1`` for thd)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name)
        want = 3 if fmt is QKVFormat.THD else 4
        if x.dim() != want:
            raise ValueError(f"{name} must be {want}-D {fmt.layout} for qkv_format={fmt.value!r}, "
                             f"got shape {tuple(x.shape)}")
        check_dtype(x.dtype, f"{name}.dtype")
    if fmt is QKVFormat.THD:
        q, k, v = (x.unsqueeze(0) for x in (q, k, v))
        fmt = QKVFormat.BSHD
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    sd = fmt.seq_dim
    bd = 1 - sd
    b, s_q, h, d = q.shape[bd], q.shape[sd], q.shape[2], q.shape[3]
    if k.shape[bd] != b:
        raise ValueError(f"k has batch {k.shape[bd]} but q has batch {b} (qkv_format={fmt.value!r})")
    if k.shape[3] != d:
        raise ValueError(f"k head dim {k.shape[3]} differs from q head dim {d}")
    g = k.shape[2]
    if min(b, s_q, k.shape[sd], h, g, d) == 0:
        raise ValueError(f"q, k, v must not be empty, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    check_gqa(h, g)
    return Dims(b, s_q, k.shape[sd], h, g, d)


def check_docs(spec: AttnSpec, s_q: int, s_kv: int, world: int = 1) -> None:
    """A pack's ``cu_seqlens`` must end at its ``world * t`` tokens (thd self-attention)."""
    if not spec.docs:
        return
    total = sum(spec.docs)
    if s_q != s_kv:
        raise ValueError(f"q has {s_q} tokens and k has {s_kv}: a thd pack is self-attention, q and k share cu_seqlens")
    if total != s_q * world:
        where = f"{s_q} tokens" if world == 1 else f"{world} ranks x {s_q} local tokens = {s_q * world}"
        raise ValueError(f"cu_seqlens ends at {total} but the pack has {where}; cu_seqlens describes the whole pack "
                         f"(every rank passes the same one)")


def check_offset(offset, softmax_type: SoftmaxType, h: int, device) -> None:
    """The softmax offset must match the softmax type: required ``[1, h, 1, 1]`` for learnable."""
    if softmax_type is not SoftmaxType.LEARNABLE:
        if offset is not None:
            why = "has no sink" if softmax_type is SoftmaxType.VANILLA else "fixes its sink at 0"
            raise ValueError(f"softmax_offset must be None for softmax_type={softmax_type.value!r} ({why}); "
                             f"use softmax_type='learnable' to pass an offset")
        return
    if offset is None:
        raise ValueError(f"softmax_type='learnable' needs softmax_offset, a [1, {h}, 1, 1] tensor; got None")
    if not isinstance(offset, torch.Tensor):
        raise TypeError(f"softmax_offset must be a [1, {h}, 1, 1] torch.Tensor, got {type_name(offset)}; "
                        f"torch.as_tensor makes one")
    if tuple(offset.shape) != (1, h, 1, 1):
        raise ValueError(f"softmax_offset must have shape [1, {h}, 1, 1] (one logit per query head), "
                         f"got {tuple(offset.shape)}")
    if offset.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"softmax_offset.dtype={offset.dtype} is not supported; use float32, float64, bfloat16 "
                         f"or float16")
    if offset.device != torch.device(device):
        raise ValueError(f"softmax_offset is on {offset.device} but q is on {device}")


def check_bias(bias, b: int, h: int, s_q: int, s_kv: int, device) -> None:
    """A post-scale additive bias broadcastable as ``[1|b, 1|h, s_q, s_kv]``."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a 4-D torch.Tensor [1|{b}, 1|{h}, {s_q}, {s_kv}], got {type_name(bias)}; "
                        f"torch.as_tensor makes one")
    if bias.dim() != 4:
        raise ValueError(f"bias must be a 4-D tensor [1|{b}, 1|{h}, {s_q}, {s_kv}], got {tuple(bias.shape)}")
    bb, bh, bq, bk = bias.shape
    if bb not in (1, b) or bh not in (1, h) or (bq, bk) != (s_q, s_kv):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not broadcast as [1|{b}, 1|{h}, {s_q}, {s_kv}]")
    if not bias.is_floating_point():
        raise ValueError(f"bias.dtype={bias.dtype} must be floating point")
    if bias.device != torch.device(device):
        raise ValueError(f"bias is on {bias.device} but q is on {device}")


def check_sink_strategy(value, arg: str = "sink_strategy") -> SinkStrategy:
    """A sink strategy a run may use: ``every-tile`` is the known bug, only the emulator replays it."""
    strategy = SinkStrategy.parse(value, arg)
    if strategy is SinkStrategy.EVERY_TILE:
        raise ValueError(f"{arg}='every-tile' is the known bug (the sink counted once per tile); "
                         f"use 'step0' or 'post-merge'")
    return strategy


class A2AProblem(enum.Enum):
    """Which quantity an ``A2AError`` finds wrong."""

    GROUP = "group"   # the a2a group size does not divide the CP group (``check_a2a_size``)
    HEADS = "heads"   # the a2a group does not split the query and K/V heads evenly (``check_heads``)


class A2AError(ValueError):
    """An a2a group that does not fit, said in the library's words (``str``), with what a caller
    needs to say it in its own (the tool names its options): ``problem``, the numbers (``members``
    ranks per a2a group, ``world`` ranks in the CP group, ``h`` query and ``g`` K/V heads; None where
    the check was not given them) and ``sizes``, the a2a group sizes that fit, ascending (1 always)."""

    def __init__(self, message: str, problem: A2AProblem = A2AProblem.GROUP, *, members: int = 1,
                 world: Optional[int] = None, h: Optional[int] = None, g: Optional[int] = None,
                 sizes: tuple[int, ...] = (1,)):
        super().__init__(message)
        self.problem, self.members, self.world, self.h, self.g, self.sizes = problem, members, world, h, g, sizes

    def __reduce__(self):   # a rank's error survives pickling with its fields
        return type(self), (str(self), self.problem), dict(self.__dict__)


def a2a_sizes(world: Optional[int] = None, h: Optional[int] = None, g: Optional[int] = None) -> tuple[int, ...]:
    """The a2a group sizes that fit, ascending: each divides the CP group of ``world`` ranks and
    splits the ``h`` query and ``g`` K/V heads evenly (a bound not given bounds nothing, but one of
    them must be given)."""
    given = [n for n in (world, h, g) if n is not None]
    return tuple(n for n in range(1, math.gcd(*given) + 1) if all(m % n == 0 for m in given))


def a2a_members(comm: CommType, world: int, a2a_size: Optional[int]) -> int:
    """Ranks per inner a2a group of ``comm`` over a CP group of ``world`` ranks, given ``a2a_size`` as
    ``cp_attention`` takes it: ``a2a+p2p`` needs it; ``p2p`` takes none (or 1), ``a2a`` none (or the
    whole group). Whether the groups tile the CP group is ``check_a2a_size``'s to say."""
    if comm is CommType.P2P:
        if a2a_size not in (None, 1):
            raise ValueError(f"a2a_size={a2a_size} only applies to comm='a2a+p2p'")
        return 1
    if comm is CommType.A2A:
        if a2a_size is not None and a2a_size != world:
            raise ValueError(f"a2a_size={a2a_size}: comm='a2a' uses the whole group; use comm='a2a+p2p'")
        return world
    if a2a_size is None:
        raise ValueError("comm='a2a+p2p' needs a2a_size (ranks per inner a2a group)")
    return a2a_size


def check_a2a_size(a2a_size: int, world: int, h: Optional[int] = None, g: Optional[int] = None) -> None:
    """Inner a2a groups of ``a2a_size`` consecutive ranks must tile the CP group. Given the heads
    (``h``, ``g``), the sizes the error offers also split them (``check_heads``)."""
    if a2a_size < 1 or world % a2a_size:
        sizes = a2a_sizes(world, h, g)
        which = "" if h is None else f" and splits the h={h} query and g={g} K/V heads"
        raise A2AError(f"a2a_size={a2a_size} must divide the CP group size {world}; use one that divides it"
                       f"{which}: {_listing(sizes)}",
                       A2AProblem.GROUP, members=a2a_size, world=world, h=h, g=g, sizes=sizes)


def check_heads(h: int, g: int, members: int, world: Optional[int] = None) -> None:
    """a2a over ``members`` ranks gives each a share of the query and of the K/V heads. Given the
    CP group's ``world``, the sizes the error offers also divide it (``check_a2a_size``)."""
    if h % members or g % members:
        sizes = a2a_sizes(world, h, g)
        also = "" if world is None else f" and the CP group size {world}"
        raise A2AError(f"a2a over {members} ranks splits the heads: q has h={h} heads and k, v have g={g}, "
                       f"but h={h} and g={g} must both be divisible by {members}; "
                       f"use an a2a size that divides both{also}: {_listing(sizes)}",
                       A2AProblem.HEADS, members=members, world=world, h=h, g=g, sizes=sizes)


def check_a2a_heads(h: int, g: int, members: int, world: int, comm: CommType) -> None:
    """``check_heads`` for ``comm``, whose error under comm='a2a' (which takes no a2a size) is
    ``plain_a2a``'s."""
    try:
        check_heads(h, g, members, world=world)
    except A2AError as exc:
        raise (plain_a2a(exc) if comm is CommType.A2A else exc) from None


def plain_a2a(exc: A2AError) -> A2AError:
    """``check_heads``'s error in the words of comm='a2a', which takes no a2a size: p2p, or a2a+p2p
    with a smaller a2a group that splits the heads."""
    w, h, g = exc.world, exc.h, exc.g
    smaller = [n for n in exc.sizes if 1 < n < w]
    also = f", or comm='a2a+p2p' with a2a_size={' or '.join(map(str, smaller))}" if smaller else ""
    return A2AError(f"comm='a2a' splits the heads over the {w} ranks of the group: q has h={h} heads and k, v have "
                    f"g={g}, but h={h} and g={g} must both be divisible by {w}; use comm='p2p'{also}",
                    exc.problem, members=exc.members, world=w, h=h, g=g, sizes=exc.sizes)


def _listing(sizes) -> str:
    """``1, 2 or 4``."""
    *rest, last = map(str, sizes)
    return f"{', '.join(rest)} or {last}" if rest else last


def check_scale(scale, d: int) -> float:
    if scale is None:
        return d ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale={scale!r} must be a real number (None: d ** -0.5), got {type(scale).__name__}")
    scale = float(scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale={scale} must be a positive finite number (default d ** -0.5)")
    return scale


@dataclass(frozen=True)
class CPOptions:
    """How one context-parallel attention runs; built once per call from the public arguments."""

    spec: AttnSpec
    scale: float
    kernel: object                               # a kernels.TileKernel
    sink_strategy: SinkStrategy = SinkStrategy.STEP0
    sink_grad: SinkGrad = SinkGrad.FULL
    kv_schedule: KVSchedule = KVSchedule.AUTO
