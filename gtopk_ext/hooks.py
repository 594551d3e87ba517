"""The names of the DDP hook's earlier module; the hook now lives in :mod:`gtopk_ext.ddp`."""

from gtopk_ext.compressors import tensor_shares  # noqa: F401
from gtopk_ext.ddp import (COLLECTIVES, BucketStats, MomentumCorrection, ResidualStore,  # noqa: F401
                           SparseGradState, exponential_warmup, sparse_grad_hook)
