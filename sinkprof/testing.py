"""What the tests and ``sinkprof check`` share: seeded inputs, the high-precision reference, and
the tolerance table.

The reference is exact attention in fp64 with its backward written out (no autograd), computed
blockwise over query rows, so its memory grows linearly with the sequence; its
results are fresh tensors that nothing else writes into. ``sinkprof.attention`` (autograd on the
whole score matrix) is the independent formulation the tests compare it with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .options import AttnSpec, QKVFormat, SoftmaxType, check_scale, type_name
from .reference import doc_ids
from .sink import sink_logits

REFERENCE_BLOCK_BYTES = 64 * 2 ** 20   # one [b, h, rows, s] fp64 block of the reference


@dataclass(frozen=True)
class Shape:
    b: int = 2
    s: int = 64          # full sequence length
    h: int = 4
    g: int = 2
    d: int = 16

    def validate(self, cp: int) -> None:
        for name in ("b", "s", "h", "g", "d"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.h % self.g:
            raise ValueError(f"h={self.h} must be a multiple of g={self.g} (GQA)")
        if self.s % (2 * cp):
            raise ValueError(f"s={self.s} must be divisible by 2 * cp = {2 * cp} (load-balanced chunks)")


@dataclass
class Inputs:
    """Full-sequence inputs in the layout of ``spec.qkv_format``; ``offset`` is fp32 unless fp64."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    offset: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    grad_out: torch.Tensor

    def to(self, device, dtype: torch.dtype) -> "Inputs":
        off_dtype = torch.float64 if dtype == torch.float64 else torch.float32

        def conv(x, dt):
            return None if x is None else x.to(device=device, dtype=dt)
        return Inputs(conv(self.q, dtype), conv(self.k, dtype), conv(self.v, dtype),
                      conv(self.offset, off_dtype), conv(self.bias, dtype), conv(self.grad_out, dtype))

    def batched(self) -> "Inputs":
        """A thd pack's ``[t, h, d]`` tensors as one ``bshd`` sequence ``[1, t, h, d]`` (views)."""
        return Inputs(*(x.unsqueeze(0) for x in (self.q, self.k, self.v)), self.offset, self.bias,
                      self.grad_out.unsqueeze(0))


def make_inputs(shape: Shape, spec: AttnSpec, seed: int, *, with_bias: bool = False,
                offset_scale: float = 5.0) -> Inputs:
    """Seeded fp64 CPU inputs; offsets are ``randn * 5`` so the sink is visible even in bf16."""
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d = shape.b, shape.s, shape.h, shape.g, shape.d

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    fmt = spec.qkv_format
    if fmt is QKVFormat.THD and b != 1:
        raise ValueError(f"b={b}: a thd pack is one sequence of documents; use b=1")
    if spec.docs and sum(spec.docs) != s:
        raise ValueError(f"the documents' lengths sum to {sum(spec.docs)}, not s={s}")

    def qkv(heads):
        if fmt is QKVFormat.THD:
            return randn(s, heads, d)
        return randn(s, b, heads, d) if fmt is QKVFormat.SBHD else randn(b, s, heads, d)
    q, k, v, grad_out = qkv(h), qkv(g), qkv(g), qkv(h)
    offset = randn(1, h, 1, 1) * offset_scale if spec.softmax_type is SoftmaxType.LEARNABLE else None
    bias = randn(1, h, s, s) if with_bias else None
    return Inputs(q, k, v, offset, bias, grad_out)


@dataclass
class Result:
    """Outputs and gradients of one attention (reference or CP); absent ones are None."""

    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    d_offset: Optional[torch.Tensor] = None
    d_bias: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None

    def unbatched(self) -> "Result":
        """The inverse of ``Inputs.batched`` for the per-token tensors (``lse`` stays ``[1, h, t]``)."""
        return Result(*(x.squeeze(0) for x in (self.out, self.dq, self.dk, self.dv)), self.d_offset, self.d_bias,
                      self.lse)

    def named(self) -> dict[str, torch.Tensor]:
        names = {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv,
                 "d_sink": self.d_offset, "d_bias": self.d_bias}
        return {k: v for k, v in names.items() if v is not None}


def reference(inputs: Inputs, spec: AttnSpec, scale: Optional[float] = None,
              rows: Optional[torch.Tensor] = None, heads: Optional[torch.Tensor] = None,
              block_bytes: int = REFERENCE_BLOCK_BYTES) -> Result:
    """Attention and all its gradients in fp64, computed blockwise over query rows.

    A block of query rows needs only its own scores: its forward (out, lse) and then its backward
    (dq of those rows, their contributions to dk, dv, the sink and bias gradients), so memory
    grows linearly with the sequence (one ``[b, h, rows, s]`` block of at most ``block_bytes``
    per tensor) and no autograd graph is kept. ``rows`` (bool over the full sequence) computes only
    those query rows: ``out``, ``dq`` and ``lse`` of the others are zero, and dk, dv and the
    replicated gradients are those rows' contributions (their sum over a partition of the rows is
    the whole). ``heads`` (bool over query heads) restricts the loss to those heads (with ``rows``:
    the reference for a rank's own part of a replicated gradient, the ``partial`` contract).
    """
    x = inputs.to(inputs.q.device, torch.float64)
    fmt = spec.qkv_format
    q, k, v, do = (fmt.to_bhsd(t) for t in (x.q, x.k, x.v, x.grad_out))      # [b, h|g, s, d]
    b, h, s, d = q.shape
    g = k.shape[1]
    r = h // g
    scale = check_scale(scale, d)
    dev = q.device
    for name, flags, n, each in (("rows", rows, s, "query row of the sequence"), ("heads", heads, h, "query head")):
        if flags is None:
            continue
        if not isinstance(flags, torch.Tensor):
            raise TypeError(f"{name} must be a bool tensor of shape [{n}], a flag for each {each}; got "
                            f"{type_name(flags)}")
        if flags.dtype != torch.bool or tuple(flags.shape) != (n,):
            raise ValueError(f"{name} must be a bool tensor of shape [{n}], a flag for each {each}; got "
                             f"{flags.dtype} of shape {tuple(flags.shape)}")
    if heads is not None:
        do = do * heads.to(dev, torch.float64).view(1, -1, 1, 1)
    sink = sink_logits(spec.softmax_type, x.offset, h, dev)
    a = None if sink is None else sink.reshape(1, h, 1).to(torch.float64)
    band = spec.band
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    lse_all = torch.zeros(b, h, s, dtype=torch.float64, device=dev)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    d_sink = torch.zeros(h, dtype=torch.float64, device=dev) if a is not None else None
    d_bias = torch.zeros_like(x.bias) if x.bias is not None else None
    keys = torch.arange(s, device=dev)
    doc = doc_ids(spec, dev)
    selected = torch.arange(s, device=dev) if rows is None else rows.to(dev).nonzero().squeeze(1)
    per_row = b * h * s * 8
    n = max(1, min(s, block_bytes // per_row))
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)                                # [b, g, 1, s, d]
    for start in range(0, selected.numel(), n):
        idx = selected[start:start + n]
        qb = q[:, :, idx].unflatten(1, (g, r))                             # [b, g, r, m, d]
        dob = do[:, :, idx].unflatten(1, (g, r))
        scores = (qb @ kg.transpose(-1, -2)).flatten(1, 2) * scale          # [b, h, m, s]
        if x.bias is not None:
            scores += x.bias[:, :, idx]
        diff = keys.view(1, -1) - idx.view(-1, 1)
        visible = torch.ones_like(diff, dtype=torch.bool)
        if band.lo is not None:
            visible &= diff >= band.lo
        if band.hi is not None:
            visible &= diff <= band.hi
        if doc is not None:
            visible &= doc[idx].view(-1, 1) == doc.view(1, -1)
        scores.masked_fill_(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                               # -inf for a row that sees nothing
        if a is not None:
            lse = torch.logaddexp(lse, a.expand_as(lse))
        finite = lse.masked_fill(lse == float("-inf"), 0.0)
        p = torch.exp(scores - finite.unsqueeze(-1))                        # 0 where masked
        del scores
        pg = p.unflatten(1, (g, r))
        ob = pg @ vg                                                        # [b, g, r, m, d]
        delta = (dob * ob).sum(-1).flatten(1, 2)                            # [b, h, m]
        ds = p * ((dob @ vg.transpose(-1, -2)).flatten(1, 2) - delta.unsqueeze(-1))
        dsg = ds.unflatten(1, (g, r))
        out[:, :, idx] = ob.flatten(1, 2)
        lse_all[:, :, idx] = lse
        dq[:, :, idx] = (dsg @ kg).flatten(1, 2) * scale
        dk += (dsg.transpose(-1, -2) @ qb).sum(2) * scale
        dv += (pg.transpose(-1, -2) @ dob).sum(2)
        if d_bias is not None:
            part = ds.sum(0, keepdim=True) if d_bias.shape[0] == 1 else ds
            d_bias[:, :, idx] += part.sum(1, keepdim=True) if d_bias.shape[1] == 1 else part
        if d_sink is not None:
            d_sink -= (torch.exp(a - finite) * delta).sum(dim=(0, 2))
    return Result(fmt.from_bhsd(out), fmt.from_bhsd(dq), fmt.from_bhsd(dk), fmt.from_bhsd(dv),
                  None if d_sink is None or spec.softmax_type is not SoftmaxType.LEARNABLE
                  else d_sink.reshape(1, h, 1, 1), d_bias, lse_all)


@dataclass(frozen=True)
class Tolerance:
    """Pass when ``|actual - expected| <= atol + rtol * |expected|`` everywhere."""

    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol {self.atol:g}, rtol {self.rtol:g}"


# One table for every dtype (bf16/fp16 as in TransformerEngine's attention tests).
TOLERANCES = {
    torch.float64: Tolerance(1e-10, 1e-10),
    torch.float32: Tolerance(1e-5, 1e-5),
    torch.bfloat16: Tolerance(2.5e-2, 2.5e-2),
    torch.float16: Tolerance(5e-3, 5e-3),
}
GQA_FACTOR = 2.0  # half-precision GQA sums more rows into each dK/dV element


def tolerance_for(dtype: torch.dtype, gqa: bool = False) -> Tolerance:
    tol = TOLERANCES[dtype]
    if gqa and dtype in (torch.bfloat16, torch.float16):
        return Tolerance(tol.atol * GQA_FACTOR, tol.rtol * GQA_FACTOR)
    return tol


@dataclass
class Error:
    max_abs: float
    worst: float     # max of |err| / (atol + rtol |expected|); <= 1 passes
    passed: bool
    note: str = ""


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Error:
    if tuple(actual.shape) != tuple(expected.shape):
        return Error(float("inf"), float("inf"), False,
                     f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    same = a == e                       # an infinity matches only itself (an lse of -inf: a row that sees no key)
    if not ((torch.isfinite(a) & torch.isfinite(e)) | same).all():
        return Error(float("inf"), float("inf"), False, "non-finite values")
    err = (a - e).abs().masked_fill(same, 0.0)
    bound = tol.atol + tol.rtol * e.abs().masked_fill(same, 0.0)
    worst = (err / bound).max().item() if err.numel() else 0.0
    return Error(err.max().item() if err.numel() else 0.0, worst, worst <= 1.0)


@dataclass
class Snapshot:
    """A fingerprint of a reference taken when it was computed, to prove nothing wrote into it."""

    sums: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, result: Result) -> "Snapshot":
        return cls({k: float(v.detach().double().abs().sum()) for k, v in result.named().items()})

    def changed(self, result: Result) -> list[str]:
        now = Snapshot.of(result).sums
        return [k for k, v in self.sums.items() if now.get(k) != v]


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
