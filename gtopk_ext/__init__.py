"""gtopk_ext: sparse gradient communication for PyTorch data-parallel training."""

from typing import TYPE_CHECKING

import torch  # noqa: F401  (first: the compiled library links against torch's libraries)

try:
    from gtopk_ext import _C  # noqa: F401  (loading the library registers the torch.ops.gtopk_ext kernels)
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "gtopk_ext's compiled kernels (gtopk_ext._C) are missing or do not match this torch: build them with "
        "`pip install --no-build-isolation -e .` in the source tree (see README.md)"
    ) from error

from gtopk_ext import (backends, collectives, compressors, costs, dct, hierarchical, ops,  # noqa: E402,F401
                       paths, reduction, reference, wire)
from gtopk_ext.averaging import GroupModelAverager  # noqa: E402,F401
from gtopk_ext.compressors import make_compressor  # noqa: E402,F401
from gtopk_ext.message import SparseMessage  # noqa: E402,F401
from gtopk_ext.config import SparseConfig, exponential_warmup  # noqa: E402,F401
from gtopk_ext.momentum import DecoupledMomentum, MomentumCorrection  # noqa: E402,F401
from gtopk_ext.ddp import SparseGradState, sparse_grad_hook  # noqa: E402,F401
from gtopk_ext.hierarchical import Hierarchical  # noqa: E402,F401
from gtopk_ext.paths import PathPolicy  # noqa: E402,F401
from gtopk_ext.local_sgd import SparseLocalSGD  # noqa: E402,F401
from gtopk_ext.optim import SparseAdamW  # noqa: E402,F401
from gtopk_ext.utils import destroy_process_group  # noqa: E402,F401

__all__ = ["ops", "reference", "collectives", "compressors", "costs", "dct", "hierarchical", "reduction", "wire",
           "SparseMessage", "make_compressor", "SparseConfig", "SparseGradState", "sparse_grad_hook",
           "exponential_warmup", "MomentumCorrection", "DecoupledMomentum", "SparseAdamW",
           "Hierarchical", "PathPolicy",
           "paths", "fsdp", "SparseFSDPState", "register_sparse_all_reduce", "GroupModelAverager", "SparseLocalSGD",
           "destroy_process_group", "backends"]

# The FSDP2 front end is imported at its first use: torch.distributed.fsdp (and DTensor) take about a second to
# import, which a DDP program, and each of its ranks, would pay for nothing.
_FSDP_NAMES = ("SparseFSDPState", "register_sparse_all_reduce")
if TYPE_CHECKING:
    from gtopk_ext import fsdp  # noqa: F401
    from gtopk_ext.fsdp import SparseFSDPState, register_sparse_all_reduce  # noqa: F401


def __getattr__(name: str):
    if name == "fsdp" or name in _FSDP_NAMES:
        import importlib  # not `from gtopk_ext import fsdp`: it would ask this function for fsdp again

        fsdp = importlib.import_module("gtopk_ext.fsdp")  # binds gtopk_ext.fsdp
        for lazy in _FSDP_NAMES:
            globals()[lazy] = getattr(fsdp, lazy)
        return globals()[name]
    raise AttributeError(f"module 'gtopk_ext' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "fsdp", *_FSDP_NAMES})
