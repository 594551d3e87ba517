"""Triton versions of the gtopk_ext kernels (installed as gtopk_ext.triton_kernels)."""
