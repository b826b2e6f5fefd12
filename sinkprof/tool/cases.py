"""The case matrix of ``check`` and ``bench``: ``Settings`` (lists of options, as a profile and the
command line give them) crossed into ``Case``s.

A ``thd`` case is one pack of documents (``b = 1``, no bias): ``--seqlens`` gives the documents'
lengths (their sum is the pack, ``--seq-len``), ``--docs N`` draws N lengths from the seed, and
without either a thd case packs ``DEFAULT_DOCS`` random documents.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import sys
from dataclasses import dataclass
from typing import Optional

from ..dist import DEFAULT_TIMEOUT_S
from ..kernels import unavailable_reason
from ..options import a2a_members as options_a2a_members
from ..options import (DTYPES, A2AError, A2AProblem, AttnSpec, Backend, CommType, KVSchedule, MaskType, PackLayout,
                       QKVFormat, SinkGrad, SinkStrategy, SoftmaxType, check_a2a_size, check_gqa, check_heads,
                       check_seed, check_sink_strategy, make_spec, parse_dtype, window_pair)
from ..plan import spec_layout
from ..schedule import resolved_kv_schedule
from ..testing import Shape

DEFAULT_A2A_SIZE = 2   # ranks per inner a2a group of a2a+p2p when --a2a-size is not given
DEFAULT_DOCS = 3    # documents of a thd pack given neither --seqlens nor --docs (fewer if the pack is short)
MAX_DOCS = 2 ** 20  # random documents drawn at most


def check_head_counts(heads: int, kv_heads: int) -> None:
    """``--heads`` and ``--kv-heads`` by the library's rule (``options.check_gqa``), in the options' words."""
    try:
        check_gqa(heads, kv_heads)
    except ValueError:
        raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} (GQA)") from None


def as_given(name: str, value) -> str:
    """A value as the user gave it: ``--ranks 3`` for an option, ``WORLD_SIZE=3`` for a variable."""
    return f"{name} {value}" if name.startswith("-") else f"{name}={value}"


def check_seq_len(seq_len: int, cps, cp_option: str) -> None:
    """``--seq-len`` splits into ``2 * cp`` load-balanced chunks under every cp of ``cps`` (the
    values of ``cp_option``); the error names the cp and suggests a length every cp takes."""
    for cp in cps:
        if seq_len % (2 * cp):
            step = math.lcm(*(2 * c for c in cps))
            drop = f", or drop {cp} from {cp_option}" if len(set(cps)) > 1 else ""
            raise ValueError(f"{as_given(cp_option, cp)}: --seq-len {seq_len} must be divisible by 2 * cp = {2 * cp} "
                             f"(load-balanced chunks); use --seq-len {max(step, seq_len // step * step)}{drop}")


def check_window(window: Optional[tuple], masks) -> None:
    """``--window`` under every ``--mask``, by the library's rules (``make_spec``), in the options'
    words: a pair that fails without a mask is wrong in itself (a side below -1); one that fails
    only under a mask sees keys after the row, which that mask (causal) hides."""
    if window is None:
        return
    text = f"--window {window[0]},{window[1]}"
    try:
        make_spec(SoftmaxType.VANILLA, MaskType.NO_MASK, window, QKVFormat.BSHD)
    except ValueError as exc:
        raise ValueError(f"{text}: {exc}") from None
    for mask in masks:
        try:
            make_spec(SoftmaxType.VANILLA, mask, window, QKVFormat.BSHD)
        except ValueError:
            raise ValueError(f"{text}: right {window[1]} contradicts --mask {mask} (it implies right = 0); use "
                             f"--window {window[0]},0 or --mask no_mask") from None


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
    pack_layout: str = "zigzag"       # thd: which rows of the pack each rank holds
    window: Optional[tuple] = None
    bias: bool = False
    a2a_size: int = DEFAULT_A2A_SIZE
    batch: int = 2
    seq_len: int = 64
    seqlens: Optional[tuple] = None   # thd: the documents' lengths (they sum to seq_len)
    docs: Optional[int] = None        # thd: this many random documents from the seed
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ranks: int = 2
    device: str = "cpu"
    backend: str = "auto"
    seed: int = 0

    def validate(self, ranks_name: str = "--ranks", here: bool = True) -> None:
        """Raise ValueError naming the option for anything a run would trip over later, with the
        library's own checks (the ones ``cp_attention`` runs on the tensors). ``ranks_name`` is
        where the ranks came from (``WORLD_SIZE`` under torchrun, where --ranks is refused);
        ``here``: also whether the backend runs on this machine (not for showing a profile)."""
        for name in LIST_FIELDS:
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{option(name)} needs at least one value, e.g. {ALL[name][0]} (or 'all')")
            check_once(values, option(name))
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
        if here and backend not in (Backend.AUTO, Backend.TORCH):
            reason = unavailable_reason(backend, self.device)
            if reason is not None:
                raise ValueError(f"--backend {backend.value} cannot run here: {reason}; "
                                 f"use --backend torch (or auto, which picks what runs)")
        check_seed(self.seed, option("seed"))   # a profile's too
        for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "ranks", "a2a_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{option(name)} {getattr(self, name)} must be >= 1")
        check_head_counts(self.heads, self.kv_heads)
        self.validate_pack(ranks_name)   # first: explicit lengths get the library's message (it names pad_pack)
        check_seq_len(self.seq_len, (self.ranks,), ranks_name)
        check_window(self.window, [MaskType(m) for m in self.mask])
        for comm in map(CommType, self.comm):
            members = a2a_members(comm, self.ranks, self.a2a_size)
            try:   # the library's rules for an a2a group, the ones cp_attention enforces
                check_a2a_size(members, self.ranks, self.heads, self.kv_heads)
                check_heads(self.heads, self.kv_heads, members, self.ranks)
            except A2AError as exc:
                raise ValueError(a2a_usage(comm, exc, ranks_name)) from None

    def validate_pack(self, ranks_name: str = "--ranks") -> None:
        """The thd options: given only with thd, documents that sum to the pack and that every rank
        can cut into load-balanced chunks (the library's check, which names ``sinkprof.pad_pack``)."""
        if self.docs is not None and self.docs < 1:
            raise ValueError(f"--docs {self.docs} must be >= 1 (the number of documents in a thd pack)")
        given = [name for name in ("seqlens", "docs") if getattr(self, name) is not None]
        if given and not self.thd:
            raise ValueError(f"{' and '.join(map(option, given))} describe{'s' if len(given) == 1 else ''} the "
                             f"documents of a thd pack, but "
                             f"--qkv-format is {','.join(self.qkv_format)}; add thd (e.g. --qkv-format thd) "
                             f"or drop {' and '.join(map(option, given))}")
        layout = PackLayout.parse(self.pack_layout, "--pack-layout")
        if layout is PackLayout.BALANCED:
            if not self.thd:
                raise ValueError(f"--pack-layout balanced lays out the documents of a thd pack, but --qkv-format is "
                                 f"{','.join(self.qkv_format)}; add thd (e.g. --qkv-format thd) or drop --pack-layout")
            others = [c for c in self.comm if CommType.parse(c, "--comm") is not CommType.P2P]
            rings = [k for k in self.kv_schedule
                     if KVSchedule.parse(k, "--kv-schedule") not in (KVSchedule.AUTO, KVSchedule.ALLGATHER)]
            if others or rings:
                given = " ".join(f"{o} {','.join(v)}" for o, v in (("--comm", others), ("--kv-schedule", rings)) if v)
                raise ValueError(f"--pack-layout balanced ({given}): its pieces of a document sit on a few ranks, "
                                 f"not in 2 * cp chunks on every rank, so it runs on --comm p2p with --kv-schedule "
                                 f"allgather (or auto, which takes it); run the other cases with --pack-layout zigzag")
        if not self.thd:
            return
        if self.bias and set(self.qkv_format) == {QKVFormat.THD.value}:
            raise ValueError("--bias: a thd pack takes no bias (a [1, h, T, T] bias over a pack defeats packing); "
                             "drop --bias, or add bshd or sbhd to --qkv-format (their cases take it)")
        if self.seqlens is not None:
            text = seqlens_text(self.seqlens)
            if not self.seqlens or any(type(n) is not int or n < 1 for n in self.seqlens):
                raise ValueError(f"--seqlens {text}: every document needs at least one token, e.g. --seqlens 96,160,256")
            if sum(self.seqlens) != self.seq_len:
                raise ValueError(f"--seqlens {text} sums to {sum(self.seqlens)} tokens but --seq-len is {self.seq_len}; "
                                 f"--seqlens sets the pack's length: drop --seq-len")
            try:
                spec_layout(self.pack_spec(self.seqlens, self.pack_layout), self.seq_len, self.ranks)
            except ValueError as exc:
                raise ValueError(f"--seqlens {text} at {as_given(ranks_name, self.ranks)}: {exc}") from None
        elif self.seq_len % (2 * self.ranks) == 0:   # else the --seq-len check below says so
            self.documents()

    @property
    def thd(self) -> bool:
        """Whether some case is a thd pack."""
        return QKVFormat.THD.value in self.qkv_format

    @staticmethod
    def pack_spec(docs, pack_layout="zigzag") -> AttnSpec:
        return make_spec("vanilla", "no_mask", None, "thd", [0, *itertools.accumulate(docs)], pack_layout)

    def documents(self, cps: tuple = ()) -> tuple[int, ...]:
        """The documents of this run's thd pack: ``seqlens``, or ``docs`` (default ``DEFAULT_DOCS``,
        fewer when the pack is short) lengths drawn from the seed, each a multiple of ``2 * cp`` for
        every cp of ``cps`` (default: ``ranks``) and summing to ``seq_len``."""
        if self.seqlens is not None:
            return tuple(self.seqlens)
        cps = tuple(cps) or (self.ranks,)
        multiple = math.lcm(*(2 * cp for cp in cps))
        why = (f"2 * cp = {multiple}" if len(cps) == 1 else
               f"2 * cp for every cp of the run ({','.join(map(str, cps))}): {multiple}")
        if self.seq_len % multiple:
            raise ValueError(f"--seq-len {self.seq_len}: a thd pack of random documents needs a multiple of {why}; "
                             f"use --seq-len {max(multiple, self.seq_len // multiple * multiple)}, or give the "
                             f"lengths with --seqlens")
        units = self.seq_len // multiple
        count = min(DEFAULT_DOCS, units) if self.docs is None else self.docs
        if count < 1:
            raise ValueError(f"--docs {count} must be >= 1 (the number of documents in a thd pack)")
        if count > MAX_DOCS:   # their lengths alone would take gigabytes before the memory check could refuse
            raise ValueError(f"--docs {count}: at most {MAX_DOCS} random documents (a pack of more is far past "
                             f"what a check or a bench runs); use --docs {MAX_DOCS} or fewer")
        if count > units:
            raise ValueError(f"--docs {count}: {count} documents of at least {multiple} tokens ({why}) need "
                             f"--seq-len >= {count * multiple}, and it is {self.seq_len}; use --docs {units} or "
                             f"--seq-len {count * multiple}")
        return random_documents(self.seq_len, count, multiple, self.seed)

    def with_documents(self, cps: tuple = ()) -> "Settings":
        """These settings with the thd pack drawn (``seqlens`` set), so every rank and the report
        see the same lengths; unchanged without thd."""
        return dataclasses.replace(self, seqlens=self.documents(cps)) if self.thd else self

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.seq_len, self.heads, self.kv_heads, self.head_dim)


def random_documents(total: int, count: int, multiple: int, seed: int) -> tuple[int, ...]:
    """``count`` lengths, each a positive multiple of ``multiple``, summing to ``total`` (itself a
    multiple): ``count - 1`` distinct cut points drawn from a generator seeded with ``seed``, in
    memory of the count, not of the pack (a pack too long to run is refused later, by the memory
    check that needs its documents)."""
    units = total // multiple
    # torch's seeds run from -2**63 to 2**64-1; Random would seed -5 as 5
    draw = random.Random(seed % 2 ** 64)
    if units <= sys.maxsize:
        cuts = sorted(draw.sample(range(1, units), count - 1))
    else:   # a range past sys.maxsize has no len(); among 2**63 points a repeat is all but impossible
        picked: set = set()
        while len(picked) < count - 1:
            picked.add(draw.randrange(1, units))
        cuts = sorted(picked)
    ends = [0, *cuts, units]
    return tuple((b - a) * multiple for a, b in zip(ends, ends[1:]))


def seqlens_text(docs) -> str:
    return ",".join(map(str, docs))


def docs_label(docs) -> str:
    """A pack's document lengths as a label shows them: the list, or ``N documents`` when long (a
    pack of 300000 made one message 600 kB long)."""
    text = seqlens_text(docs)
    return text if len(text) <= 24 else f"{len(docs)} documents"


def parse_seqlens(text: str, arg: str = "--seqlens") -> tuple[int, ...]:
    """``"96,160,256"`` -> document lengths; the error names ``arg`` and the bad item."""
    items = [v.strip() for v in str(text).split(",")]
    if not any(items):
        raise ValueError(f"{arg} needs the documents' lengths, e.g. {arg} 96,160,256")
    out = []
    for n, item in enumerate(items):
        if not re.fullmatch(r"[0-9]+", item):
            raise ValueError(f"{arg} {text}: {item!r} is not a document length (a positive integer), "
                             f"e.g. {arg} 96,160,256")
        if int(item) < 1:
            raise ValueError(f"{arg} {text}: document {n} has {int(item)} tokens; every document needs at least one")
        out.append(int(item))
    return tuple(out)


def check_pack_layer(layer: dict, where: str = "") -> None:
    """One layer of settings (a profile, a ``[[cases]]`` group, the command line) gives the pack
    once: ``seqlens`` or ``docs``, and a ``seq_len`` beside ``seqlens`` only if it is their sum."""
    seqlens, docs, seq_len = (layer.get(k) for k in ("seqlens", "docs", "seq_len"))
    if seqlens is None:
        return
    if docs is not None:
        raise ValueError(f"--seqlens and --docs both given{where}: give the lengths (--seqlens) or a number of "
                         f"random documents (--docs), not both")
    if seq_len is not None and all(type(n) is int for n in seqlens) and sum(seqlens) != seq_len:
        raise ValueError(f"--seqlens {seqlens_text(seqlens)} sums to {sum(seqlens)} tokens but --seq-len is "
                         f"{seq_len}{where}; --seqlens sets the pack's length: drop --seq-len (or make them agree)")


def merge_layers(layers: list) -> dict:
    """Settings fields from layers (a profile, a ``[[cases]]`` group, the command line), later
    ones overriding earlier ones. A layer that gives the pack's lengths (``seqlens``) sets
    ``seq_len`` to their sum and replaces an earlier ``docs``; one that gives ``seq_len`` or
    ``docs`` replaces an earlier ``seqlens`` (its length stays, unless ``seq_len`` is given)."""
    merged: dict = {}
    for layer in layers:
        given = {k: v for k, v in layer.items() if v is not None}
        if "seqlens" in given:
            merged.pop("docs", None)
        if "seq_len" in given or "docs" in given:
            merged.pop("seqlens", None)
        merged.update(given)
        if "seqlens" in given and all(type(n) is int for n in given["seqlens"]):
            merged["seq_len"] = sum(given["seqlens"])
    return merged


LIST_FIELDS = ("comm", "softmax", "mask", "qkv_format", "dtype", "sink_strategy", "sink_grad", "kv_schedule")


def split_values(text: str) -> tuple:
    """The values of a comma list (``"fp64, bf16"``), blanks dropped."""
    return tuple(v.strip() for v in str(text).split(",") if v.strip())


def check_once(values, option: str) -> None:
    """No value twice in a list option: its cases would run twice, and bench would sum their rows
    as one case's."""
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise ValueError(f"{option} {','.join(map(str, values))}: {twice} is given twice; give each value once")


def list_value(name: str, value) -> tuple:
    """A list setting as the command line (a comma string) or a profile (that, or a TOML list)
    gives it; ``all`` is every value (``ALL``)."""
    items = split_values(value) if isinstance(value, str) else tuple(str(v).strip() for v in value)
    return ALL[name] if items == ("all",) else items


def option(name: str) -> str:
    """The command-line option of a ``Settings`` field (its profile key is the field name)."""
    return "--" + name.replace("_", "-")


def a2a_members(comm: CommType, cp: int, a2a_size: int) -> int:
    """Ranks of the inner a2a group: 1 for p2p, the whole group for a2a (the library's rule; a
    case carries ``--a2a-size`` whatever its comm, and only a2a+p2p reads it)."""
    return options_a2a_members(comm, cp, a2a_size if comm is CommType.A2A_P2P else None)


def a2a_usage(comm: CommType, exc: A2AError, ranks_name: str = "--ranks") -> str:
    """The library's verdict on an a2a group (``check_a2a_size``, ``check_heads`` with the heads
    and the ranks) in option names, with a fix the library says fits."""
    heads = f"--heads {exc.h} and --kv-heads {exc.g}"
    ranks = as_given(ranks_name, exc.world)
    if exc.problem is A2AProblem.GROUP:
        fit = max(n for n in exc.sizes if n <= exc.members)
        return (f"--a2a-size {exc.members} must divide {ranks} (a2a+p2p runs a ring of a2a groups of "
                f"that size); use --a2a-size {fit} (the a2a sizes that divide {ranks} and split "
                f"{heads}: {', '.join(map(str, exc.sizes))})")
    above_one = [n for n in exc.sizes if n > 1]
    size = (f"an --a2a-size that divides both and {ranks}: --a2a-size {max(above_one)}" if above_one
            else None)
    if comm is CommType.A2A:
        fix = (f"use --heads and --kv-heads divisible by {exc.members} (a2a splits them over every rank), or "
               + (f"--comm a2a+p2p with {size}" if size else
                  f"--comm p2p (no --a2a-size above 1 divides both and {ranks})"))
    else:
        fix = (f"use {size}" if size else
               f"use --comm p2p (no --a2a-size above 1 divides both and {ranks})")
    return (f"--comm {comm.value} over {exc.members} ranks splits the heads: {heads} must both be divisible by "
            f"{exc.members}; {fix}")


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
    a2a_size: int = DEFAULT_A2A_SIZE
    kv_schedule: KVSchedule = KVSchedule.AUTO
    docs: tuple = ()                 # thd: the documents' lengths, in order
    pack_layout: PackLayout = PackLayout.ZIGZAG   # thd: which rows of the pack each rank holds

    @property
    def cu_seqlens(self) -> Optional[list]:
        """The pack's document boundaries ``[0, end_0, ..., t]``; None for bshd and sbhd."""
        return [0, *itertools.accumulate(self.docs)] if self.docs else None

    def spec(self) -> AttnSpec:
        return make_spec(self.softmax, self.mask, self.window, self.qkv_format, self.cu_seqlens, self.pack_layout)

    def parts(self) -> dict:
        """The case in words, one entry per option it sets (option name -> text), in label order."""
        parts = {"comm": f"a2a+p2p({self.a2a_size})" if self.comm is CommType.A2A_P2P else self.comm.value,
                 "softmax": self.softmax.value, "mask": self.mask.value, "qkv_format": self.qkv_format.value}
        if self.docs:
            parts["docs"] = f"docs={docs_label(self.docs)}"
        if self.pack_layout is not PackLayout.ZIGZAG:
            parts["pack_layout"] = f"layout={self.pack_layout.value}"
        parts["dtype"] = self.dtype
        if self.softmax.has_sink:
            parts["sink_strategy"] = self.sink_strategy.value
        if self.has_grad_contract:
            parts["sink_grad"] = f"grad={self.sink_grad.value}"
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

    def columns(self, cp: int) -> dict:
        """The case at ``cp`` ranks as bench's CSV columns write it: a field that does not apply is
        empty (a vanilla case's strategy, a contract without a replicated gradient, an a2a size
        outside a2a+p2p, a pack's layout without a pack) and the K/V schedule is the one that runs
        (``auto`` resolved; empty without a ring). Cases with the same columns run the same thing."""
        schedule = self.schedule_run(cp)
        return {
            "comm": self.comm.value, "softmax": self.softmax.value,
            "sink_strategy": self.sink_strategy.value if self.softmax.has_sink else "",
            "sink_grad": self.sink_grad.value if self.has_grad_contract else "",
            "mask": self.mask.value, "window": window_text(self.window),
            "bias": self.bias, "qkv_format": self.qkv_format.value,
            "docs": seqlens_text(self.docs), "pack_layout": self.pack_layout.value if self.docs else "",
            "dtype": self.dtype, "b": self.shape.b, "s": self.shape.s, "h": self.shape.h, "g": self.shape.g,
            "d": self.shape.d, "cp": cp, "a2a_size": self.a2a_size if self.comm is CommType.A2A_P2P else "",
            "kv_schedule": "" if schedule is None else schedule.value,
        }

    def schedule_run(self, cp: int) -> Optional[KVSchedule]:
        """The K/V schedule this case's ring runs at ``cp`` ranks (``auto`` resolved); None where
        no ring runs (a2a)."""
        sh = self.shape
        return resolved_kv_schedule(s=sh.s, b=sh.b, h=sh.h, g=sh.g, d=sh.d, dtype=DTYPES[self.dtype], cp=cp,
                                    mask=self.mask, window=self.window, comm=self.comm, a2a_size=self.a2a_size,
                                    kv_schedule=self.kv_schedule, cu_seqlens=self.cu_seqlens,
                                    pack_layout=self.pack_layout)

    @property
    def has_grad_contract(self) -> bool:
        """Whether ``sink_grad`` means something here (``grad_contract_applies``)."""
        return grad_contract_applies(self.softmax, self.bias)


def window_text(window: Optional[tuple]) -> str:
    """A window as a CSV cell writes it, ``LEFT,RIGHT``; empty without one."""
    return "" if window is None else f"{window[0]},{window[1]}"


def grad_contract_applies(softmax: SoftmaxType, bias: bool) -> bool:
    """Whether a case's ``sink_grad`` means something: it has a replicated gradient (the sink's, the
    bias's) whose all-reduce the contract decides; ``expand`` crosses the contracts only then."""
    return softmax.has_sink or bias


def expand(settings: Settings) -> list[Case]:
    """The cross product of the settings' lists; sink options only multiply cases that have a sink,
    and K/V schedules only cases that run a ring (a2a runs none: its cases take ``auto``, once).
    A thd case is the pack of ``settings.documents()`` with ``b = 1`` and no bias."""
    docs = settings.documents() if settings.thd else ()
    cases = []
    for comm, softmax, mask, fmt, dtype, kv in itertools.product(settings.comm, settings.softmax, settings.mask,
                                                                 settings.qkv_format, settings.dtype,
                                                                 settings.kv_schedule):
        if CommType.parse(comm, "comm") is CommType.A2A:
            if kv != settings.kv_schedule[0]:
                continue
            kv = KVSchedule.AUTO.value
        sm = SoftmaxType.parse(softmax, "softmax")
        fmt = QKVFormat.parse(fmt, "qkv_format")
        thd = fmt is QKVFormat.THD
        bias = settings.bias and not thd
        shape = dataclasses.replace(settings.shape, b=1) if thd else settings.shape
        strategies = settings.sink_strategy if sm.has_sink else settings.sink_strategy[:1]
        contracts = settings.sink_grad if grad_contract_applies(sm, bias) else settings.sink_grad[:1]
        for strategy, contract in itertools.product(strategies, contracts):
            cases.append(Case(CommType.parse(comm, "comm"), sm, MaskType.parse(mask, "mask"), fmt, dtype,
                              SinkStrategy.parse(strategy, "sink_strategy"), SinkGrad.parse(contract, "sink_grad"),
                              settings.window, bias, shape, settings.a2a_size, KVSchedule.parse(kv, "kv_schedule"),
                              docs if thd else (), PackLayout.parse(settings.pack_layout, "--pack-layout")
                              if thd else PackLayout.ZIGZAG))
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
    pack_layout: Optional[str] = None
    window: Optional[str] = None
    bias: Optional[bool] = None
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    seqlens: Optional[str] = None
    docs: Optional[int] = None
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
                value = list_value(f.name, value)
            elif f.name == "window":
                value = window_pair(value, "--window")
            elif f.name == "seqlens":
                value = parse_seqlens(value, "--seqlens")
            out[f.name] = value
        check_pack_layer(out)
        return out
