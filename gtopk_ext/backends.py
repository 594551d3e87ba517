"""The backends that run the ops, as objects: what each supports, why it cannot run somewhere, and its kernels.

``CPU``, ``CUDA`` and ``TRITON`` (CUDA tensors, or any under TRITON_INTERPRET=1); on GPUs merge_topk is ``TORCH``'s.
A caller names one (``"auto"``, ``"cpu"``, ``"cuda"``, ``"triton"``, a ``Backend``) or leaves it to
``$GTOPK_EXT_BACKEND`` (default ``"auto"``: CPU for CPU tensors; CUDA, else Triton, for CUDA tensors).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace
from typing import Union

import torch

from gtopk_ext import torch_kernels
from gtopk_ext._contract import FLOAT_DTYPES

BACKEND_NAMES = ("auto", "cpu", "cuda", "triton")


class Backend:
    """Runs the ops on the devices and dtypes it declares; :attr:`kernels` holds them, loaded at first use."""

    name = ""
    dtypes = FLOAT_DTYPES
    ops = ("gaussian_threshold", "compact", "gaussian_select", "merge_topk", "scatter_add", "residual_update",
           "wire_encode", "wire_decode")
    merges_with_torch = False  # merge_topk by gtopk_ext.torch_kernels

    def not_supported_reasons(self, device: torch.device, dtype: torch.dtype | None = None,
                              op: str | None = None) -> list[str]:
        """Why this backend cannot run ``op`` (any op: None) on tensors of ``device`` and ``dtype``; [] if it can."""
        reasons = []
        if dtype is not None and dtype not in self.dtypes:
            reasons.append(f"supports {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)}, got {dtype}")
        if op is not None and op not in self.ops:
            reasons.append(f"implements {', '.join(self.ops)} only, not {op}")
        return reasons + self._device_reasons(torch.device(device))

    def _device_reasons(self, device: torch.device) -> list[str]:
        return []

    def _kernels(self):
        """The namespace whose attributes are the ops."""
        return torch.ops.gtopk_ext

    @functools.cached_property
    def ready(self) -> set[torch.device]:
        """The devices on which :func:`choose` found that this backend can run."""
        return set()

    @functools.cached_property
    def kernels(self) -> SimpleNamespace:
        """Every op this backend runs, by name, called with the C++ schema's arguments in order."""
        namespace = self._kernels()
        return SimpleNamespace(**{op: torch_kernels.merge_topk if op == "merge_topk" and self.merges_with_torch
                                  else getattr(namespace, op) for op in self.ops})

    def __reduce__(self):
        return self.name.upper()  # the module's global of that name: one object per backend, also across pickling

    def __repr__(self) -> str:
        return f"<gtopk_ext backend {self.name!r}>"


class CppCpuBackend(Backend):
    name = "cpu"

    def _device_reasons(self, device):
        return [] if device.type == "cpu" else [f"needs CPU tensors, got {device}"]


@functools.cache
def cuda_kernels_built() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("gtopk_ext::compact", "CUDA")


class CudaBackend(Backend):
    name = "cuda"
    merges_with_torch = True  # no CUDA kernel: torch's sort and unique are fast on a GPU

    def _device_reasons(self, device):
        reasons = [] if device.type == "cuda" else [f"needs CUDA tensors, got {device}"]
        if not cuda_kernels_built():
            reasons.append("the CUDA kernels were not built (install with a CUDA toolkit and a CUDA build of torch, "
                           "GTOPK_EXT_CUDA=1)")
        return reasons


class TritonBackend(Backend):
    name = "triton"
    merges_with_torch = True

    def _device_reasons(self, device):
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("needs the triton package (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append(f"needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
        return reasons

    def _kernels(self):
        from gtopk_ext import triton_kernels  # imports triton, so only when used

        return triton_kernels.ops


class TorchBackend(Backend):
    name = "torch"
    ops = ("merge_topk",)
    merges_with_torch = True

    def _kernels(self):
        return torch_kernels


CPU = CppCpuBackend()
CUDA = CudaBackend()
TRITON = TritonBackend()
TORCH = TorchBackend()
ALL = (CPU, CUDA, TRITON, TORCH)
BackendLike = Union[str, Backend, None]


def choose(device: torch.device, backend: BackendLike = None, *, op: str | None = None) -> Backend:
    """The backend that runs ``op`` on ``device``: ``backend`` (a name or object), else ``$GTOPK_EXT_BACKEND``,
    else ``"auto"``. Raises ValueError listing every backend's reasons when the requested one cannot run."""
    device = torch.device(device)
    if isinstance(backend, Backend):
        chosen = backend
    else:
        name = backend if backend is not None else os.environ.get("GTOPK_EXT_BACKEND", "auto")
        if name not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
        if name == "auto":
            name = "cuda" if device.type == "cuda" and not CUDA.not_supported_reasons(device) else (
                "triton" if device.type == "cuda" else "cpu")
        chosen = next(b for b in ALL if b.name == name)
    if chosen.not_supported_reasons(device, op=op):
        lines = [f"backend {other.name!r} " + ("; ".join(other.not_supported_reasons(device, op=op)) or "can run")
                 for other in ALL]
        raise ValueError(f"backend {chosen.name!r} cannot run on tensors on {device}"
                         + (f" ({op})" if op else "") + ". Every backend: " + "; ".join(lines))
    chosen.ready.add(device)
    return chosen


class BackendChoice(dict):
    """A backend preference (a name, a ``Backend`` or None) resolved once per device and remembered:
    ``choice[device]`` is the :class:`Backend` that compressors, collectives and the hooks hand to every op."""

    def __init__(self, backend: BackendLike = None):
        super().__init__()
        if not (backend is None or isinstance(backend, Backend) or backend in BACKEND_NAMES):
            raise ValueError(f"backend must be one of {BACKEND_NAMES} or a gtopk_ext.backends.Backend, got "
                             f"{backend!r}")
        self.preference = backend

    def __missing__(self, device: torch.device) -> Backend:
        chosen = self[device] = choose(device, self.preference)
        return chosen

    def __repr__(self) -> str:
        return f"BackendChoice({self.preference!r}, chosen={dict(self)})"
