"""The FSDP2 front end: :class:`SparseFSDPState` (data), :func:`sparse_all_reduce_hook` (the algorithm) and
:func:`register_sparse_all_reduce`, :func:`node_mesh` (torchrun's nodes as a mesh), :class:`ShardLayout`."""

from gtopk_ext.fsdp.hook import register_sparse_all_reduce, sparse_all_reduce_hook
from gtopk_ext.fsdp.layout import ShardLayout, shard_layout
from gtopk_ext.fsdp.state import GroupState, SparseFSDPState, node_mesh

__all__ = ["SparseFSDPState", "register_sparse_all_reduce", "sparse_all_reduce_hook", "node_mesh", "ShardLayout",
           "shard_layout", "GroupState"]
