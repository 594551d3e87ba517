"""The state of the FSDP2 front end: plain data (the configuration, the mesh, one :class:`GroupState` per FSDP
parameter group with its residual), as :class:`gtopk_ext.SparseGradState` is for DDP; the algorithm is
:func:`gtopk_ext.fsdp.sparse_all_reduce_hook`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gtopk_ext._validate import check_int
from gtopk_ext.collectives import SPARSE_COLLECTIVES, Traffic, agree
from gtopk_ext.compressors import Compressor
from gtopk_ext.config import DensitySchedule, SparseConfig, recipe
from gtopk_ext.costs import SUMMARY_ROWS, format_bytes, sent_and_received
from gtopk_ext.fsdp.layout import ShardLayout
from gtopk_ext.momentum import AdamLink, MomentumCorrection, watch
from gtopk_ext.paths import PathPolicy
from gtopk_ext.reduction import Memory, Slot, StepStats

MESH_DIM_NAMES = ("replicate", "shard")


def node_mesh(node_size: Optional[int] = None, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D mesh (nodes x node_size, torchrun's numbering) named ``("replicate", "shard")``: shard over
    ``mesh["shard"]``, exchange over ``mesh["replicate"]``. ``node_size`` (default ``$LOCAL_WORLD_SIZE``) must be
    the same on every rank, else all raise the same error."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    if node_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("node_size must be given when $LOCAL_WORLD_SIZE is not set (torchrun sets it)")
        node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    check_int("node_size", node_size, 1)
    world = dist.get_world_size()
    # Every rank checks the others' node size before building groups (a mismatch would hang in new_group).
    agree({"node_size": node_size}, dist.group.WORLD, torch.device("cpu"), "gtopk_ext.fsdp.node_mesh")
    if world % node_size:
        raise ValueError(f"node_size {node_size} does not divide the world size {world}")
    return init_device_mesh(device_type, (world // node_size, node_size), mesh_dim_names=MESH_DIM_NAMES)


@dataclass
class GroupState:
    """One FSDP parameter group on this rank: ``name`` (its module's path), ``layout``, ``memory`` (float32
    ``"residual"`` and, with SGD's momentum correction, ``"velocity"`` of the real elements), ``calls`` (its iteration),
    the reduction's ``slot``, the run's bytes, and FSDP's parameter group (``fsdp_group``, not saved)."""

    index: int
    name: str
    layout: ShardLayout
    memory: Memory
    slot: Slot
    calls: int = 0
    run_traffic: Traffic = field(default_factory=Traffic)
    fsdp_group: object = field(default=None, repr=False)

    def trained(self) -> list[torch.Tensor]:
        """The group's trainable parameters (FSDP's sharded DTensors), in the shard's order."""
        return [p.sharded_param for p in self.fsdp_group.fsdp_params if p.sharded_param.requires_grad]

    def parameters(self) -> list[torch.Tensor]:
        """This rank's pieces of the group's trainable parameters (flat, real elements), in the shard's order."""
        return [p.to_local().detach().reshape(-1) for p in self.trained()]


class SparseFSDPState:
    r"""State of :func:`gtopk_ext.fsdp.sparse_all_reduce_hook`, one per model and rank (docs/fsdp.md). Plain data:

    * ``mesh``: the 2-D :class:`DeviceMesh` (replicate, shard), default :func:`node_mesh`: every module is
      ``fully_shard``-ed over ``shard_mesh`` (one node's ranks); the sparse exchange runs over ``mesh["replicate"]``
      (the ranks with the same local rank on every node, which hold the same shard positions).
    * ``config``: the :class:`gtopk_ext.SparseConfig` of the other arguments, as for DDP, but: the collective is a
      sparse one; ``start_iter`` (default 0) counts the hook's calls; ``momentum`` corrects each shard (the
      optimizer then runs WITHOUT momentum or weight decay; no ``clip_norm``), or :class:`gtopk_ext.DecoupledMomentum`
      (with :class:`gtopk_ext.SparseAdamW`, float32 gradients; it clips each module's gradient over the world; on
      one node nothing is selected and the optimizer gets the clipped gradient); no per-tensor selection.
    * ``groups``: a :class:`GroupState` per FSDP parameter group, filled by
      :func:`gtopk_ext.fsdp.register_sparse_all_reduce`; ``world_size``; ``adam``: what the hook and
      :class:`gtopk_ext.SparseAdamW` share (:class:`gtopk_ext.momentum.AdamLink`).

    An iteration is one call of the hook for a group: one per optimizer step when microbatches skip the reduction
    with ``model.set_requires_gradient_sync(False)`` (with ``set_requires_all_reduce(False)``: one per microbatch).
    """

    __slots__ = ("mesh", "config", "groups", "world_size", "adam", "__weakref__")

    def __init__(self, mesh: Optional[DeviceMesh] = None, density: DensitySchedule = 0.01,
                 compressor: Union[str, Compressor] = "gaussiank", collective: str = "gtopk", wire: str = "plain",
                 start_iter: int = 0, path: Union[str, PathPolicy] = "auto",
                 momentum: Union[MomentumCorrection, float, None] = None, *, optimizer_check: str = "raise"):
        config = SparseConfig(density, compressor, collective, wire, start_iter, path, momentum,
                              optimizer_check=optimizer_check)
        if collective not in SPARSE_COLLECTIVES:
            raise ValueError(f"collective must be one of the sparse collectives {SPARSE_COLLECTIVES}, got "
                             f"{collective!r}")
        if isinstance(config.momentum, MomentumCorrection) and config.momentum.clip_norm is not None:
            raise ValueError("momentum: clip_norm is not supported by the FSDP hook (a rank holds a shard of its "
                             "node's average gradient, not its own gradient): clip after the exchange, e.g. "
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before optimizer.step()")
        if config.compressor.per_tensor:
            raise ValueError("compressor: per_tensor selection is not supported by the FSDP hook (a shard holds "
                             "pieces of parameters); make it with per_tensor=False")
        if mesh is None:
            mesh = node_mesh()
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            raise ValueError(f"mesh must be a 2-D DeviceMesh (replicate, shard), e.g. gtopk_ext.fsdp.node_mesh() "
                             f"or init_device_mesh('cpu', (nodes, node_size), mesh_dim_names={MESH_DIM_NAMES}), "
                             f"got {mesh!r}")
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
            raise ValueError(f"mesh's dimensions must be named {MESH_DIM_NAMES} (replicate first), got "
                             f"{mesh.mesh_dim_names}")
        self.mesh = mesh
        self.config = config
        self.groups: list[GroupState] = []
        self.world_size = dist.get_world_size()
        self.adam = AdamLink()
        if config.momentum is not None:
            watch(self, _reduced_parameters)

    @property
    def iter(self) -> int:
        """Iterations done: the hook's calls of a group (of the first; every group is called once an iteration)."""
        return self.groups[0].calls if self.groups else 0

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's node: ``fully_shard(module, mesh=state.shard_mesh)``."""
        return self.mesh[MESH_DIM_NAMES[1]]

    @classmethod
    def recipe(cls, mesh: Optional[DeviceMesh] = None, density: float = 0.01, warmup_steps: Optional[int] = None,
               momentum: float = 0.9, *, optimizer: str = "sgd", clip_norm: Optional[float] = 1.0,
               **options) -> "SparseFSDPState":
        """The DDP recipes (:meth:`gtopk_ext.SparseGradState.recipe`; ``warmup_steps`` counts calls) for FSDP2: with
        ``optimizer="sgd"`` train with an optimizer WITHOUT momentum or weight decay, with ``"adamw"`` with
        :class:`gtopk_ext.SparseAdamW` (the hook clips each module's gradient at ``clip_norm``); ``options``: the
        other arguments."""
        return cls(mesh, **{**recipe(density, warmup_steps, momentum, optimizer, clip_norm), **options})

    def state_dict(self) -> dict:
        """This rank's resumable state: ``{"world_size", "rank<r>": {"group<i>": {"calls", "numel", "residual",
        "velocity" (with SGD's momentum correction), "oktopk", "plan"}}}`` (the rank keeps the ranks' residuals apart
        in a ``torch.distributed.checkpoint``); the residual and velocity are the state's own tensors, the rest
        copies."""
        rank = dist.get_rank()
        return {"world_size": self.world_size,
                f"rank{rank}": {f"group{g.index}": {"calls": g.calls, "numel": g.layout.numel, **g.memory.tensors,
                                                    "oktopk": g.slot.oktopk.state_dict() if g.slot.oktopk else {},
                                                    "plan": g.slot.plan.state_dict()}
                                for g in self.groups}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`'s output on the same world size, after ``register_sparse_all_reduce``
        (which sizes the groups): the run continues bitwise."""
        if not self.groups:
            raise RuntimeError("load_state_dict: call gtopk_ext.fsdp.register_sparse_all_reduce(model, state) first "
                               "(it finds the parameter groups the residuals belong to)")
        key = f"rank{dist.get_rank()}"
        if state_dict.get("world_size") != self.world_size or key not in state_dict:
            raise ValueError(f"state_dict was saved by a job of world size {state_dict.get('world_size')!r}, this "
                             f"one has {self.world_size} (residuals are per rank: resume on the same world size)")
        saved = state_dict[key]
        if sorted(saved) != sorted(f"group{g.index}" for g in self.groups):
            raise ValueError(f"state_dict holds groups {sorted(saved)}, the model {len(self.groups)}")
        for g in self.groups:
            entry = saved[f"group{g.index}"]
            if entry["numel"] != g.layout.numel or entry["residual"].numel() != g.layout.numel:
                raise ValueError(f"state_dict: group {g.index} ({g.name!r}) holds {entry['numel']} elements, "
                                 f"this model's shard {g.layout.numel}")
            if ("velocity" in entry) != ("velocity" in g.memory.tensors):
                raise ValueError(f"state_dict was saved {'with' if 'velocity' in entry else 'without'} momentum "
                                 f"correction, this state has momentum={self.config.momentum}")
            for kind, tensor in g.memory.tensors.items():
                if entry[kind] is not tensor:
                    tensor.copy_(entry[kind])
            g.calls = int(entry["calls"])
            g.slot = Slot(self.config.reducer)
            if g.slot.oktopk is not None and entry["oktopk"]:
                g.slot.oktopk.load_state_dict(entry["oktopk"])
            if "plan" in entry:
                g.slot.plan.load_state_dict(entry["plan"])

    def stats(self) -> dict:
        """``{"groups": {index: {...}}, "total": {...}}``: per group its ``name``, ``calls``, ``padded_numel``, the
        latest call's figures (as for DDP; bytes between nodes) and the run's ``run_bytes_sent`` /
        ``run_bytes_received``; "total" sums them."""
        groups = {g.index: {"name": g.name, "calls": g.calls, "padded_numel": g.layout.padded_numel,
                            **(g.slot.stats or StepStats("none", g.layout.numel, 0)).as_dict(),
                            "run_bytes_sent": g.run_traffic.sent, "run_bytes_received": g.run_traffic.received}
                  for g in self.groups}
        summed = (*StepStats.SUMMED, "padded_numel", "run_bytes_sent", "run_bytes_received")
        return {"groups": groups, "total": {key: sum(g[key] for g in groups.values()) for key in summed}}

    def summary(self) -> str:
        """:meth:`stats` as a few lines to print: the configuration, this rank's bytes between nodes beside HSDP's
        all-reduce of the same shards, each group's latest call."""
        stats = self.stats()
        total, nodes = stats["total"], self.mesh.size(0)
        hsdp = 2 * (nodes - 1) * total["padded_numel"] * 4 // nodes  # a float32 ring all-reduce of the padded shards
        lines = [f"SparseFSDPState: {self.config.describe(self.iter)}; {nodes} node(s) of {self.mesh.size(1)} ranks",
                 f"run: {self.iter} calls a group; between nodes "
                 + sent_and_received(total["run_bytes_sent"], total["run_bytes_received"], self.iter, "call"),
                 f"  (HSDP's float32 all-reduce of these shards between nodes: {format_bytes(hsdp)} a call)"]
        if not self.iter:
            return "\n".join(lines + ["latest call: none yet"])
        lines.append(f"  {'group':>5} {'path':<9} {'elements':>11} {'k':>9} {'sent':>10}  name")
        rows = list(stats["groups"].items())
        for index, g in rows[:SUMMARY_ROWS]:
            lines.append(f"  {index:>5} {g['path']:<9} {g['numel']:>11,} {g['k']:>9,} "
                         f"{format_bytes(g['bytes_sent']):>10}  {g['name']}")
        if len(rows) > SUMMARY_ROWS:
            lines.append(f"  ... {len(rows) - SUMMARY_ROWS} more groups (state.stats()['groups'])")
        return "\n".join(lines)


def _reduced_parameters(state: SparseFSDPState) -> Optional[set[int]]:
    """The ids of the parameters the hook reduces (None before registration)."""
    return {id(p.sharded_param) for g in state.groups for p in g.fsdp_group.fsdp_params} if state.groups else None
