"""Triton versions of the gtopk_ext kernels (installed as gtopk_ext.triton_kernels)."""

from . import ops  # noqa: F401  (registers torch.ops.gtopk_ext_triton.*)

__all__ = ["ops"]
