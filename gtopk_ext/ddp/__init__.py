"""The DDP front end: :class:`SparseGradState` (data) and :func:`sparse_grad_hook` (the algorithm), with the
per-bucket store of residuals and velocities that follows DDP's buckets (:mod:`.store`)."""

from gtopk_ext.ddp.hook import reduce_buffer, sparse_grad_hook
from gtopk_ext.ddp.state import SparseGradState
from gtopk_ext.ddp.store import BucketStore

__all__ = ["SparseGradState", "sparse_grad_hook", "reduce_buffer", "BucketStore"]
