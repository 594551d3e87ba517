"""The DDP front end: :class:`SparseGradState` (data) and :func:`sparse_grad_hook` (the algorithm), with the
parts the state holds: momentum correction (:mod:`.dgc`), loss scaling (:mod:`.amp`), the density schedule
(:mod:`.schedule`) and the residual store (:mod:`.residuals`)."""

from gtopk_ext.ddp.dgc import MomentumCorrection
from gtopk_ext.ddp.hook import reduce_buffer, sparse_grad_hook
from gtopk_ext.ddp.residuals import ResidualStore
from gtopk_ext.ddp.schedule import exponential_warmup
from gtopk_ext.ddp.state import COLLECTIVES, BucketStats, SparseGradState

__all__ = ["SparseGradState", "sparse_grad_hook", "reduce_buffer", "MomentumCorrection", "exponential_warmup",
           "ResidualStore", "BucketStats", "COLLECTIVES"]
