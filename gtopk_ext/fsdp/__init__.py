"""The FSDP2 front end: :class:`SparseFSDPState` (data), :func:`sparse_all_reduce_hook` (the algorithm),
:func:`register_sparse_all_reduce` (sets it on every FSDP module of a model), :func:`node_mesh` (the (replicate,
shard) mesh of torchrun's nodes) and :class:`ShardLayout` (where FSDP's padding lies in a shard)."""

from gtopk_ext.fsdp.hook import register_sparse_all_reduce, sparse_all_reduce_hook
from gtopk_ext.fsdp.layout import ShardLayout, shard_layout
from gtopk_ext.fsdp.state import GroupState, SparseFSDPState, node_mesh

__all__ = ["SparseFSDPState", "register_sparse_all_reduce", "sparse_all_reduce_hook", "node_mesh", "ShardLayout",
           "shard_layout", "GroupState"]
