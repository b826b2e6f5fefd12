"""What the tests and ``sinkprof check`` share: seeded inputs, the high-precision reference, and
the tolerance table.

The reference runs ``sinkprof.attention`` with autograd in fp64 on the full sequence, one K/V head
group at a time (so memory stays at one group's scores), and its results are fresh tensors that
nothing else writes into.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .options import AttnSpec, SoftmaxType
from .reference import attention


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


def make_inputs(shape: Shape, spec: AttnSpec, seed: int, *, with_bias: bool = False,
                offset_scale: float = 5.0) -> Inputs:
    """Seeded fp64 CPU inputs; offsets are ``randn * 5`` so the sink is visible even in bf16."""
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d = shape.b, shape.s, shape.h, shape.g, shape.d

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    seq_first = spec.qkv_format.seq_dim == 0
    def qkv(heads):
        return randn(s, b, heads, d) if seq_first else randn(b, s, heads, d)
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

    def named(self) -> dict[str, torch.Tensor]:
        names = {"out": self.out, "dq": self.dq, "dk": self.dk, "dv": self.dv,
                 "d_sink": self.d_offset, "d_bias": self.d_bias}
        return {k: v for k, v in names.items() if v is not None}


def reference(inputs: Inputs, spec: AttnSpec, scale: Optional[float] = None,
              rows: Optional[torch.Tensor] = None, heads: Optional[torch.Tensor] = None) -> Result:
    """Attention and all its gradients in fp64, computed one K/V head group at a time.

    ``rows`` (bool over the full sequence) and ``heads`` (bool over query heads) restrict the loss
    to those query rows and heads: the reference for a rank's own part of a replicated gradient
    (the ``partial`` contract).
    """
    x = inputs.to(inputs.q.device, torch.float64)
    grad_out = x.grad_out
    for keep, dim in ((rows, spec.qkv_format.seq_dim), (heads, 2)):
        if keep is not None:
            shape = [1] * grad_out.dim()
            shape[dim] = -1
            grad_out = grad_out * keep.to(grad_out.device).view(shape)
    h, g = x.q.shape[2], x.k.shape[2]
    r = h // g
    outs, lses, dqs, dks, dvs, dos, dbs = [], [], [], [], [], [], []
    for j in range(g):
        heads = slice(j * r, (j + 1) * r)
        q = x.q[:, :, heads].clone().requires_grad_()
        k = x.k[:, :, j:j + 1].clone().requires_grad_()
        v = x.v[:, :, j:j + 1].clone().requires_grad_()
        off = x.offset[:, heads].clone().requires_grad_() if x.offset is not None else None
        bias = None
        if x.bias is not None:
            bias = (x.bias if x.bias.shape[1] == 1 else x.bias[:, heads]).clone().requires_grad_()
        out, lse = attention(q, k, v, off, softmax_type=spec.softmax_type, mask=spec.mask,
                             window=_user_window(spec), bias=bias, scale=scale,
                             qkv_format=spec.qkv_format, return_lse=True)
        out.backward(grad_out[:, :, heads])
        outs.append(out.detach()); lses.append(lse.detach())
        dqs.append(q.grad); dks.append(k.grad); dvs.append(v.grad)
        if off is not None:
            dos.append(off.grad)
        if bias is not None:
            dbs.append(bias.grad)
    d_bias = None
    if dbs:
        d_bias = torch.cat(dbs, dim=1) if x.bias.shape[1] != 1 else torch.stack(dbs).sum(0)
    return Result(torch.cat(outs, 2), torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2),
                  torch.cat(dos, 1) if dos else None, d_bias, torch.cat(lses, 1))


def _user_window(spec: AttnSpec):
    left, right = spec.window
    if left is None and right is None:
        return None
    return (-1 if left is None else left, -1 if right is None else right)


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
    err = (a - e).abs()
    if not torch.isfinite(a).all():
        return Error(float("inf"), float("inf"), False, "non-finite values")
    bound = tol.atol + tol.rtol * e.abs()
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
