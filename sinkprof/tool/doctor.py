"""``sinkprof doctor``: what this machine has, and which (comm, softmax, backend, dtype, layout)
combinations run here, each cell either ok or the reason it is not.

A kernel cell is probed, not assumed: a small tile forward and backward (with the sink when the
softmax type has one) on the device, compared with the fp64 torch tile.
"""
from __future__ import annotations

import importlib
import platform
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels import BackendUnavailable, TorchTiles, get_kernel
from ..options import DTYPE_NAMES, DTYPES, Band, Backend, CommType, QKVFormat, SoftmaxType
from ..testing import tolerance_for
from .output import Output


@dataclass
class Cell:
    comm: str
    softmax: str
    backend: str
    dtype: str
    layout: str
    ok: bool
    reason: str = ""


@dataclass
class Report:
    environment: dict
    cells: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"environment": self.environment, "capabilities": [asdict(c) for c in self.cells]}


def _version(module: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None


def _fused_kernels() -> str:
    """Whether merges, folds and deltas run as one-pass Triton kernels on CUDA, or why not."""
    from .. import fused
    reason = fused.disabled_reason()
    return f"on (triton {fused.triton.__version__})" if reason is None else f"off: {reason}"


def environment() -> dict:
    from ..kernels.cudnn import versions
    from ..kernels.fa4 import version as fa4_version
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn (torch)": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cudnn frontend": versions()["frontend"],
        "cudnn backend (frontend)": versions()["backend"],
        "flash-attn-4": fa4_version(),
        "fa4 backward across tiles (fa4_rows)": _fa4_rows(fa4_version()),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "gloo": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nvtx": _version("nvtx"),
        "fused sink kernels (triton)": _fused_kernels(),
        "typer": _version("typer"),
        "pandas": _version("pandas"),
    }
    return env


def _fa4_rows(fa4_version) -> str:
    """Whether a ring's fa4 backward keeps dq in FA4's accumulator across tiles here, or why not."""
    if fa4_version is None:
        return "off: flash-attn-4 is not importable"
    if not torch.cuda.is_available():
        return "off: no CUDA device is visible"
    from ..kernels.fa4_rows import unavailable_reason
    why = unavailable_reason(fa4_version, torch.device("cuda", torch.cuda.current_device()))
    return "on" if why is None else f"off: {why}"


def _probe_kernel(backend: Backend, softmax: SoftmaxType, dtype: torch.dtype, layout: QKVFormat,
                  device: torch.device) -> Optional[str]:
    """None if the tile kernel runs and matches the fp64 torch tile, else why not."""
    try:
        kernel = get_kernel(backend, device)
    except BackendUnavailable as exc:
        return str(exc)
    if backend is not Backend.TORCH and dtype not in (torch.bfloat16, torch.float16):
        return f"{backend.value} takes bf16/fp16, not {DTYPE_NAMES[dtype]}; the {backend.value} backend runs torch tiles for it"
    gen = torch.Generator().manual_seed(0)
    b, s, h, g, d = 2, 128, 4, 2, 64
    shape = {QKVFormat.BSHD: (b, s), QKVFormat.SBHD: (s, b), QKVFormat.THD: (b * s,)}[layout]  # thd: one pack

    def make(heads):
        return torch.randn(*shape, heads, d, generator=gen, dtype=torch.float64)
    q, k, v, do = make(h), make(g), make(g), make(h)
    sink = (torch.randn(1, h, 1, 1, generator=gen, dtype=torch.float64) * 5) if softmax.has_sink else None
    if softmax is SoftmaxType.OFF_BY_ONE:
        sink = torch.zeros(1, h, 1, 1, dtype=torch.float64)
    ref = TorchTiles()
    ref_o, ref_lse = ref.forward(*(layout.to_bhsd(x) for x in (q, k, v)), Band(None, 0), sink, None, d ** -0.5)
    ref_g = ref.backward(*(layout.to_bhsd(x) for x in (q, k, v)), ref_o, layout.to_bhsd(do), ref_lse, Band(None, 0),
                         sink, None, d ** -0.5)
    dev = [layout.to_bhsd(x.to(device, dtype)) for x in (q, k, v, do)]
    dsink = None if sink is None else sink.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    try:
        o, lse = kernel.forward(*dev[:3], Band(None, 0), dsink, None, d ** -0.5)
        grads = kernel.backward(*dev[:3], o, dev[3], lse, Band(None, 0), dsink, None, d ** -0.5)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    refused = getattr(kernel, "refused", lambda: {})()
    if refused:
        return f"{backend.value} refused the tile: " + "; ".join(refused.values())
    tol = tolerance_for(dtype, gqa=True)
    pairs = [("out", o, ref_o), ("dq", grads.dq, ref_g.dq), ("dk", grads.dk, ref_g.dk), ("dv", grads.dv, ref_g.dv)]
    if sink is not None:
        pairs.append(("d_sink", grads.d_sink, ref_g.d_sink))
    for name, got, want in pairs:
        err = (got.double().cpu() - want).abs()
        if not (err <= tol.atol + tol.rtol * want.abs()).all():
            return f"{name} differs from the fp64 torch tile by {err.max().item():.2e} (tolerance {tol})"
    return None


def _comm_reason(device: torch.device) -> Optional[str]:
    if device.type == "cuda" and not dist.is_nccl_available() and not dist.is_gloo_available():
        return "neither NCCL nor gloo is available"
    if device.type == "cpu" and not dist.is_gloo_available():
        return "gloo is not available for CPU tensors"
    return None


def diagnose(device: Optional[str] = None) -> Report:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = Report(environment() | {"device": str(dev)})
    cache: dict = {}
    for backend in (Backend.TORCH, Backend.CUDNN, Backend.FA4):
        for softmax in SoftmaxType:
            for dname, dtype in DTYPES.items():
                for layout in QKVFormat:
                    key = (backend, softmax, dtype, layout)
                    if key not in cache:
                        cache[key] = _probe_kernel(backend, softmax, dtype, layout, dev)
                    for comm in CommType:
                        reason = cache[key] or _comm_reason(dev)
                        report.cells.append(Cell(comm.value, softmax.value, backend.value, dname, layout.value,
                                                 reason is None, reason or ""))
    return report


def run(device: Optional[str], output: Output) -> None:
    """The command: diagnose ``device`` (default: cuda when visible) and write the report."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; run doctor on the GPU machine, or drop "
                         "--device (it then diagnoses the CPU)")
    report = diagnose(device)
    output.emit(doc=report.to_json(), table=lambda console: render(report, console))


def render(report: Report, console) -> None:
    from rich.markup import escape
    from rich.table import Table
    env = Table(title="environment", show_header=False)
    for k, v in report.environment.items():   # text, not markup: "pip install 'sinkprof[gpu]'" keeps its [gpu]
        env.add_row(k, escape(str(v)))
    console.print(env)
    reasons: list[str] = []
    rows: dict = {}
    for c in report.cells:
        key = (c.backend, c.softmax, c.dtype, c.layout)
        if c.ok:
            rows.setdefault(key, {})[c.comm] = "[green]ok[/green]"
            continue
        if c.reason not in reasons:
            reasons.append(c.reason)
        rows.setdefault(key, {})[c.comm] = f"[red]no ({reasons.index(c.reason) + 1})[/red]"
    table = Table(title=f"capabilities on {report.environment['device']}")
    for col in ("backend", "softmax", "dtype", "layout", *[c.value for c in CommType]):
        table.add_column(col)
    for key, cells in rows.items():
        table.add_row(*key, *(cells[c.value] for c in CommType))
    console.print(table)
    for i, r in enumerate(reasons, 1):
        console.print(f"({i}) {escape(r)}")
