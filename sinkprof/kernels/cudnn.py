"""cuDNN tile kernels through the cuDNN frontend SDPA graphs (``import cudnn``).

Forward: SDPA with Stats (fp32 natural-log LSE, sink included) and ``sink_token`` when the tile
carries the sink. Backward: SDPA backward driven with the given (merged) Stats and output,
``dSink_token`` when the tile carries the sink, ``dBias`` with a bias. Layouts go through strides
(no copies). Graphs are cached by everything that changes them, so after warm-up a ring step
only looks one up and executes it; one handle per device, bound to the current stream. A warm
ring is therefore safe to capture in a CUDA graph (no build, no sync, no host-side data); a
build that would happen during capture raises instead, naming the missing warm-up.

Visibility: a tile's ``Band(lo, hi)`` is first normalised to ``lo <= 0 <= hi`` by slicing off the
query rows and keys it cannot see (those rows get ``lse = -inf``, ``o = 0``), then expressed as a
top-left causal mask or a diagonal band (``left_bound = 1 - lo``, ``right_bound = hi``). A shape,
dtype or mask that cuDNN refuses falls back to the torch tiles for that key, logged once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..options import Band, SinkStrategy
from .base import (IO_DTYPES, TileByTile, TileGrads, backward_trimmed, deliver, empty_bshd, forward_trimmed,
                   optional_module, trim_band)
from .torch_tiles import TorchTiles

log = logging.getLogger("sinkprof.cudnn")

MIN_BACKEND_FOR_SINK = 91300     # cuDNN 9.13
MIN_FRONTEND_FOR_SINK = (1, 19)
PACKED_STATS_BEFORE = 92600      # below cuDNN 9.26 the backward's Stats input must be packed BHSD

cudnn, _IMPORT_ERROR = optional_module("cudnn")   # the GPU extra
if cudnn is not None and not hasattr(cudnn, "backend_version"):  # e.g. a bare namespace package of that name
    _IMPORT_ERROR = f"the module 'cudnn' found at {getattr(cudnn, '__path__', '?')} is not the cuDNN frontend"
    cudnn = None


def versions() -> dict:
    if cudnn is None:
        return {"frontend": None, "backend": None}
    return {"frontend": cudnn.__version__, "backend": cudnn.backend_version()}


def _frontend_tuple() -> tuple:
    return tuple(int(x) for x in cudnn.__version__.split(".")[:2])


def unavailable_reason(device=None) -> Optional[str]:
    """None when the cuDNN tiles can run here, else why not."""
    if cudnn is None:
        return f"nvidia-cudnn-frontend is not importable ({_IMPORT_ERROR}); pip install 'sinkprof[gpu]'"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if cudnn.backend_version() < MIN_BACKEND_FOR_SINK:
        return f"sinks need cuDNN >= 9.13, found {cudnn.backend_version()}"
    if _frontend_tuple() < MIN_FRONTEND_FOR_SINK:
        return f"sinks need nvidia-cudnn-frontend >= 1.19, found {cudnn.__version__}"
    return None


_CUDNN_TYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}


def _layout(t: Optional[torch.Tensor]):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.data_ptr() % 16)


@dataclass
class _Graph:
    graph: object
    tensors: dict          # name -> cudnn tensor
    workspace: torch.Tensor


def _mask_kwargs(band: Band) -> dict:
    kw = {}
    if band.hi == 0:
        kw["use_causal_mask"] = True
    elif band.hi is not None:
        kw["diagonal_band_right_bound"] = band.hi
        kw["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
    if band.lo is not None:
        kw["diagonal_band_left_bound"] = 1 - band.lo
        kw.setdefault("diagonal_alignment", cudnn.diagonal_alignment.TOP_LEFT)
    return kw


class CudnnTiles(TileByTile):
    """The tile kernel interface on cuDNN SDPA; see the module docstring."""

    name = "cudnn"
    sink_strategy = SinkStrategy.POST_MERGE      # the faster one here (docs/benchmarks.md)

    def __init__(self, device_index: int):
        self.device = torch.device("cuda", device_index)
        with torch.cuda.device(self.device):
            self.handle = cudnn.create_handle()
        self._graphs: dict = {}
        self._refused: dict = {}
        self._torch = TorchTiles()
        self._stream = None
        self.builds = 0

    # -- graph cache -------------------------------------------------------------------------

    def _bind_stream(self) -> None:
        """Point the handle at the current stream; a no-op (no cuDNN call) when it already is."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream != self._stream:
            cudnn.set_stream(handle=self.handle, stream=stream)
            self._stream = stream

    def _get(self, key, build):
        g = self._graphs.get(key)
        if g is not None:
            return g
        if key in self._refused:
            return None
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a cuDNN tile graph ({key[0]}) would be built during CUDA graph capture, which cuDNN "
                "cannot do: run the attention once with the same shapes, layouts and masks before "
                "capturing (the warm-up torch.cuda.graph and make_graphed_callables expect)")
        try:
            g = build()
        except Exception as exc:  # cuDNN refuses this shape/mask: fall back for this key, once logged
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._refused[key] = reason
            log.warning("cudnn refused a tile graph (%s); using torch tiles for it: %s", key[0], reason)
            return None
        self.builds += 1
        self._graphs[key] = g
        return g

    def refused(self) -> dict:
        """Keys cuDNN refused, with the reason: what ``doctor`` and the benchmarks report."""
        return dict(self._refused)

    def _new_graph(self, dtype):
        io = getattr(cudnn.data_type, _CUDNN_TYPES[dtype])
        return cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)

    @staticmethod
    def _finish(g) -> None:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()

    def _build_fwd(self, q, k, v, band, sink, bias, scale, o, stats):
        g = self._new_graph(q.dtype)
        t = {"q": g.tensor_like(q), "k": g.tensor_like(k), "v": g.tensor_like(v)}
        kw = dict(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale,
                  **_mask_kwargs(band))
        if sink is not None:
            t["sink"] = g.tensor_like(sink)
            kw["sink_token"] = t["sink"]
        if bias is not None:
            t["bias"] = g.tensor_like(bias)
            kw["bias"] = t["bias"]
        t["o"], t["stats"] = g.sdpa(**kw)
        t["o"].set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
        t["stats"].set_output(True).set_data_type(cudnn.data_type.FLOAT) \
            .set_dim(list(stats.shape)).set_stride(list(stats.stride()))
        self._finish(g)
        return _Graph(g, t, torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=self.device))

    def _build_bwd(self, q, k, v, o, do, stats, band, sink, bias, scale, dq, dk, dv, d_sink, d_bias):
        g = self._new_graph(q.dtype)
        t = {n: g.tensor_like(x) for n, x in dict(q=q, k=k, v=v, o=o, dO=do, stats=stats).items()}
        kw = dict(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                  attn_scale=scale, **_mask_kwargs(band))
        if sink is not None:
            t["sink"], t["d_sink"] = g.tensor_like(sink), g.tensor_like(d_sink)
            kw.update(sink_token=t["sink"], dSink_token=t["d_sink"])
        if bias is not None:
            t["bias"], t["d_bias"] = g.tensor_like(bias), g.tensor_like(d_bias)
            kw.update(bias=t["bias"], dBias=t["d_bias"])
        t["dq"], t["dk"], t["dv"] = g.sdpa_backward(**kw)
        for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            t[name].set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride()))
        if sink is not None:
            t["d_sink"].set_output(True)
        if bias is not None:
            t["d_bias"].set_output(True)
        self._finish(g)
        return _Graph(g, t, torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=self.device))

    def _run(self, g: _Graph, tensors: dict) -> None:
        self._bind_stream()
        g.graph.execute({g.tensors[n]: x for n, x in tensors.items()}, g.workspace, handle=self.handle)

    # -- the tile interface ------------------------------------------------------------------

    def forward(self, q, k, v, band, sink, bias, scale, *, out=None, lse=None):
        if q.dtype not in IO_DTYPES:
            return self._torch.forward(q, k, v, band, sink, bias, scale, out=out, lse=lse)
        n_q, n_kv = q.shape[2], k.shape[2]
        trimmed = trim_band(band, n_q, n_kv)
        if trimmed is None or trimmed[0] != slice(0, n_q):
            return deliver(*forward_trimmed(self, q, k, v, band, sink, bias, scale, trimmed), out, lse)
        _, cols, band = trimmed
        if cols != slice(0, n_kv):
            k, v = k[:, :, cols], v[:, :, cols]
            bias = bias[:, :, :, cols] if bias is not None else None
        o = empty_bshd(q, n_q) if out is None else out
        stats = (torch.empty(q.shape[0], q.shape[1], n_q, dtype=torch.float32, device=q.device)
                 if lse is None else lse).unsqueeze(-1)
        key = ("fwd", _layout(q), _layout(k), _layout(v), band, _layout(sink), _layout(bias), scale,
               _layout(o), _layout(stats))
        g = self._get(key, lambda: self._build_fwd(q, k, v, band, sink, bias, scale, o, stats))
        if g is None:
            return self._torch.forward(q, k, v, band, sink, bias, scale, out=out, lse=lse)
        tensors = dict(q=q, k=k, v=v, o=o, stats=stats)
        if sink is not None:
            tensors["sink"] = sink
        if bias is not None:
            tensors["bias"] = bias
        self._run(g, tensors)
        return o, stats.squeeze(-1)

    def backward(self, q, k, v, o, grad_out, lse, band, sink, bias, scale):
        if q.dtype not in IO_DTYPES:
            return self._torch.backward(q, k, v, o, grad_out, lse, band, sink, bias, scale)
        n_q, n_kv = q.shape[2], k.shape[2]
        trimmed = trim_band(band, n_q, n_kv)
        if trimmed is None or trimmed != (slice(0, n_q), slice(0, n_kv), trimmed[2]):
            return backward_trimmed(self, q, k, v, o, grad_out, lse, band, sink, bias, scale, trimmed)
        band = trimmed[2]
        stats = lse.unsqueeze(-1)
        if not stats.is_contiguous() and cudnn.backend_version() < PACKED_STATS_BEFORE:
            stats = stats.contiguous()  # a row slice of the merged stats; older cuDNN wants them packed
        dq = empty_bshd(q, n_q)
        dk, dv = empty_bshd(k, n_kv), empty_bshd(v, n_kv)
        # zeroed, in case the kernel accumulates into them across its blocks
        d_sink = torch.zeros_like(sink) if sink is not None else None
        d_bias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device) if bias is not None else None
        key = ("bwd", _layout(q), _layout(k), _layout(v), _layout(o), _layout(grad_out), _layout(stats), band,
               _layout(sink), _layout(bias), scale)
        g = self._get(key, lambda: self._build_bwd(q, k, v, o, grad_out, stats, band, sink, bias, scale,
                                                   dq, dk, dv, d_sink, d_bias))
        if g is None:
            return self._torch.backward(q, k, v, o, grad_out, lse, band, sink, bias, scale)
        tensors = dict(q=q, k=k, v=v, o=o, dO=grad_out, stats=stats, dq=dq, dk=dk, dv=dv)
        if sink is not None:
            tensors.update(sink=sink, d_sink=d_sink)
        if bias is not None:
            tensors.update(bias=bias, d_bias=d_bias)
        self._run(g, tensors)
        return TileGrads(dq, dk, dv, d_sink, d_bias)
