"""Collectives on torch.distributed (Gloo or NCCL, any process group), one module each behind one protocol
(:mod:`gtopk_ext.collectives._protocol`): TopK-SGD's sparse allgather, gTop-k (Shi et al., ICDCS 2019), Ok-Topk (Li
and Hoefler, PPoPP 2022) and the dense allreduces (in the tensor's dtype, bfloat16 or 8 bits). :data:`COLLECTIVES`
maps names to the :class:`Collective` classes that the reduction (:mod:`gtopk_ext.reduction`) drives.
"""

from gtopk_ext.backends import BackendLike
from gtopk_ext.collectives._protocol import (DTYPE_CODES, FIELD_NAMES, MAX_NUMEL, Agreement, Collective, Disagreement,
                                             Reduced, agree, carried_dtype, group_rank_and_size, keep_unapplied)
from gtopk_ext.collectives.allgather import Allgather, sparse_allgather
from gtopk_ext.collectives.dense import Dense8, Dense16, DenseAllreduce, RoundedDense
from gtopk_ext.collectives.gtopk import GTopK, gtopk_allreduce
from gtopk_ext.collectives.oktopk import OKTOPK_PERIOD, OKTOPK_REUSE_BOUNDS, OkTopk, OkTopkState, oktopk_allreduce
from gtopk_ext.collectives._transport import Traffic
from gtopk_ext.costs import ring_allgather_bytes, ring_allreduce_bytes

# The one registry of collectives by name.
COLLECTIVES: dict[str, type[Collective]] = {c.name: c for c in (GTopK, Allgather, OkTopk, DenseAllreduce, Dense16,
                                                                   Dense8)}
SPARSE_COLLECTIVES = tuple(name for name, c in COLLECTIVES.items() if c.sparse)
FIELD_NAMES["collective"] = dict(enumerate(COLLECTIVES))  # SparseConfig.fields()'s code, named in errors


def collective_named(name: str, backend: BackendLike = None) -> Collective:
    """A new :class:`Collective` of a name in :data:`COLLECTIVES`, whose ops run on ``backend``."""
    if name not in COLLECTIVES:
        raise ValueError(f"collective must be one of {tuple(COLLECTIVES)}, got {name!r}")
    return COLLECTIVES[name](backend)


__all__ = ["COLLECTIVES", "SPARSE_COLLECTIVES", "collective_named", "Collective", "Reduced", "Agreement",
           "Disagreement", "agree", "sparse_allgather", "gtopk_allreduce", "oktopk_allreduce", "OkTopkState",
           "OKTOPK_PERIOD", "OKTOPK_REUSE_BOUNDS", "Allgather", "GTopK", "OkTopk", "DenseAllreduce", "Dense16",
           "Dense8", "RoundedDense", "Traffic", "ring_allgather_bytes", "ring_allreduce_bytes", "carried_dtype",
           "group_rank_and_size", "keep_unapplied", "DTYPE_CODES", "MAX_NUMEL"]
