"""Tile kernels: the interface (``base``), one file per backend, and the registry here.

``torch_tiles`` runs anywhere (CPU, fp64, the reference of the checks); ``cudnn`` runs the cuDNN
frontend's SDPA graphs; ``fa4`` runs FlashAttention-4 (CuTe DSL). The GPU backends fall back per
tile (bias, a band or dtype they cannot take) and record why in ``refused()``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..options import Backend
from .base import BackendUnavailable, TileGrads, TileKernel
from .torch_tiles import TorchTiles

__all__ = ["BackendUnavailable", "TileGrads", "TileKernel", "TorchTiles", "get_kernel", "resolve_backend",
           "unavailable_reason"]

_kernels: dict = {}


def unavailable_reason(backend: Backend, device) -> Optional[str]:
    """None when ``backend`` (cudnn or fa4) can run on ``device``, else a sentence saying why not."""
    backend = Backend.parse(backend, "backend")
    device = torch.device(device)
    if backend is Backend.TORCH:
        return None
    if device.type != "cuda":
        return f"{backend.value} tiles need a CUDA device, got {device}"
    if backend is Backend.CUDNN:
        from .cudnn import unavailable_reason as why
    elif backend is Backend.FA4:
        from .fa4 import unavailable_reason as why
    else:
        raise ValueError(f"backend={backend.value!r} names no single backend")
    return why(device)


def resolve_backend(backend, device) -> Backend:
    """The backend ``backend`` runs as on ``device``; ``auto``: fa4 where it runs (sm90/sm100), else
    cudnn, else torch."""
    backend, device = Backend.parse(backend, "backend"), torch.device(device)
    if backend is not Backend.AUTO:
        return backend
    for candidate in (Backend.FA4, Backend.CUDNN):
        if unavailable_reason(candidate, device) is None:
            return candidate
    return Backend.TORCH


def get_kernel(backend: Backend, device) -> TileKernel:
    """The tile kernel for ``backend`` on ``device``; an explicit backend that cannot run here
    raises ``BackendUnavailable`` with the reason. One instance per (backend, device index)."""
    backend = Backend.parse(backend, "backend")
    device = torch.device(device)
    backend = resolve_backend(backend, device)
    if backend is Backend.TORCH:
        return TorchTiles()
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise BackendUnavailable(f"backend={backend.value!r} cannot run: {reason}; use backend='torch'")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (backend, index)
    if key not in _kernels:
        if backend is Backend.CUDNN:
            from .cudnn import CudnnTiles as kind
        else:
            from .fa4 import FA4Tiles as kind
        _kernels[key] = kind(index)
    return _kernels[key]
