"""The state of the FSDP2 front end: plain data (configuration, the cross-node group, one :class:`GroupState` per
FSDP parameter group with its residual), as :class:`gtopk_ext.SparseGradState` is for DDP; the algorithm is
:func:`gtopk_ext.fsdp.sparse_all_reduce_hook`."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gtopk_ext.collectives import COLLECTIVES, SPARSE_COLLECTIVES, agree, collective_named
from gtopk_ext.compressors import COMPRESSOR_KINDS, Compressor, check_density, compressor_at
from gtopk_ext.costs import Traffic
from gtopk_ext.ddp import dgc, optimizer_check
from gtopk_ext.ddp.dgc import MomentumCorrection
from gtopk_ext.ddp.schedule import DensitySchedule, checked_schedule, density_at
from gtopk_ext.fsdp.layout import ShardLayout
from gtopk_ext.paths import PathPlan, PathPolicy, path_policy
from gtopk_ext.wire import wire_named

MESH_DIM_NAMES = ("replicate", "shard")


def node_mesh(node_size: Optional[int] = None, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D mesh (nodes x node_size) named ``("replicate", "shard")``: shard with ``mesh["shard"]`` (the ranks
    of one node), exchange sparsely over ``mesh["replicate"]`` (the ranks with the same local rank on every node).
    ``node_size`` defaults to ``$LOCAL_WORLD_SIZE`` (torchrun's ranks per agent); every rank must see the same
    (checked on every rank: all raise the same error). Ranks ``n * node_size ...`` form node n, as torchrun numbers
    them."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    if node_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("node_size must be given when $LOCAL_WORLD_SIZE is not set (torchrun sets it)")
        node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be an int >= 1, got {node_size!r}")
    world = dist.get_world_size()
    # Every rank checks the others' node size before building groups (a mismatch would hang in new_group).
    agree({"node_size": node_size}, dist.group.WORLD, torch.device("cpu"), "gtopk_ext.fsdp.node_mesh")
    if world % node_size:
        raise ValueError(f"node_size {node_size} does not divide the world size {world}")
    return init_device_mesh(device_type, (world // node_size, node_size), mesh_dim_names=MESH_DIM_NAMES)


@dataclass
class GroupStats:
    """What the hook did with one parameter group's shard in its latest call."""

    path: str = "none"  # "sparse", "dense16", "dense8" or "dense" (gtopk_ext.paths); "nonfinite" (a rank's sum was
    # not)
    numel: int = 0  # real elements
    padded_numel: int = 0  # the shard's elements
    k: int = 0  # slots sent per rank (numel on the dense paths)
    selected: int = 0
    select_seconds: float = 0.0
    exchange_seconds: float = 0.0
    traffic: Traffic = field(default_factory=Traffic, repr=False)


@dataclass
class GroupState:
    """One FSDP parameter group on this rank: ``name`` (its module's path), ``layout`` (the shard's real and
    padding elements), ``residual`` (float32, the real elements only), ``velocity`` (momentum correction's, laid
    out as the residual; None without it), ``calls`` (the hook's calls so far: the iteration of the density
    schedule and the warm-up), the ``plan`` agreed and its path, Ok-Topk's state, the latest call's ``stats``, the
    run's bytes (``run_traffic``), and FSDP's parameter group (``fsdp_group``, not saved)."""

    index: int
    name: str
    layout: ShardLayout
    residual: torch.Tensor
    velocity: Optional[torch.Tensor] = None
    calls: int = 0
    plan: PathPlan = field(default_factory=PathPlan)
    oktopk: object = None
    stats: GroupStats = field(default_factory=GroupStats)
    run_traffic: Traffic = field(default_factory=Traffic)
    fsdp_group: object = field(default=None, repr=False)

    def parameters(self) -> list[torch.Tensor]:
        """This rank's pieces of the group's trainable parameters (flat, real elements), in the shard's order."""
        return [p.sharded_param.to_local().detach().reshape(-1) for p in self.fsdp_group.fsdp_params
                if p.sharded_param.requires_grad]


class SparseFSDPState:
    r"""State of :func:`gtopk_ext.fsdp.sparse_all_reduce_hook`, one per model and rank. Plain data:

    * ``mesh``: the 2-D :class:`DeviceMesh` (replicate, shard): ``mesh["shard"]`` (``shard_mesh``) is one node's
      ranks, the mesh every module is ``fully_shard``-ed over; ``replicate_group`` (``mesh["replicate"]``) the
      ranks with the same local rank on every node, which hold the same shard positions: the sparse exchange runs
      over it. Default: :func:`node_mesh` (nodes of ``$LOCAL_WORLD_SIZE`` ranks).
    * ``density`` (in (0, 1]) or ``density_schedule`` (a list of ``(start_iter, density)`` or a function of the
      iteration, as for DDP: :func:`gtopk_ext.exponential_warmup`); k = ceil(density x the shard's real elements).
    * ``compressor``: a kind (``"gaussiank"``, ``"topk"``, ``"randomk"``) or a ``gx.make_compressor(...)``;
      ``collective``: a sparse collective of :data:`gtopk_ext.collectives.COLLECTIVES`; ``wire``: ``"plain"`` or
      ``"compact"``.
    * ``start_iter``: the hook's calls before which a group is averaged densely (a warm-up).
    * ``momentum``: :class:`gtopk_ext.MomentumCorrection` (a number m is ``MomentumCorrection(m)``), or None: Deep
      Gradient Compression's momentum correction, as the DDP hook applies it, to each shard (the node's average):
      the velocity lives in the hook, per group and rank, and the optimizer runs WITHOUT momentum or weight decay
      (``torch.optim.SGD(params, lr)``; one with either is reported before its first step, ``optimizer_check``
      as for DDP). Low densities need it: error feedback delays a gradient by many steps, and an optimizer's own
      momentum then follows a stale direction. ``clip_norm`` is not supported (a rank holds a shard of its node's
      average, not its own gradient: clip after the exchange, before the optimizer's step).
    * ``path``: each call's path once a group may compress (:class:`gtopk_ext.PathPolicy`, as for DDP):
      ``"auto"`` (default) takes the cheapest of sparse, dense bfloat16 or scaled 8-bit floats (their rounding
      kept in the residual) and dense, as the replicas' measured costs predict, the same on every replica;
      ``"sparse"``, ``"dense16"``, ``"dense8"`` or ``"dense"`` force one; shards under ``min_compress_numel``
      real elements go dense. Each group's plan (``GroupState.plan``) holds this rank's measured costs of its paths.
    * ``groups``: a :class:`GroupState` per FSDP parameter group, filled by
      :func:`gtopk_ext.fsdp.register_sparse_all_reduce` (the per-shard residuals live there).

    An iteration is one call of the hook for a group: one per optimizer step when microbatches skip the
    reduction with ``model.set_requires_gradient_sync(False)`` (FSDP then reduce-scatters, and calls the hook,
    once, after the last microbatch). With ``set_requires_all_reduce(False)`` alone FSDP still calls the hook
    for every microbatch on a 1-D shard mesh: each is then exchanged (correct, more bytes).
    """

    def __init__(self, mesh: Optional[DeviceMesh] = None, density: float = 0.01, *,
                 density_schedule: Optional[DensitySchedule] = None,
                 compressor: Union[str, Compressor] = "gaussiank", collective: str = "gtopk", wire: str = "plain",
                 start_iter: int = 0, path: Union[str, PathPolicy] = "auto",
                 momentum: Union[MomentumCorrection, float, None] = None):
        check_density(density)
        if momentum is not None and not isinstance(momentum, MomentumCorrection):
            momentum = MomentumCorrection(momentum)
        if momentum is not None and momentum.clip_norm is not None:
            raise ValueError("momentum: clip_norm is not supported by the FSDP hook (a rank holds a shard of its "
                             "node's average gradient, not its own gradient): clip after the exchange, e.g. "
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before optimizer.step()")
        if momentum is not None and not momentum.momentum and not momentum.weight_decay:
            momentum = None
        policy = path_policy(path)
        schedule = checked_schedule(density_schedule)
        if collective not in SPARSE_COLLECTIVES:
            raise ValueError(f"collective must be one of the sparse collectives {SPARSE_COLLECTIVES}, got "
                             f"{collective!r}")
        wire_named(wire)
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        template = compressor_at(compressor, float(density))
        if template.per_tensor:
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
        # Configuration.
        self.mesh = mesh
        self.density = float(density)
        self.density_schedule = schedule
        self.compressor = template.kind
        self.compressor_template = template
        self.collective = collective
        self.wire = wire
        self.start_iter = start_iter
        self.path_policy = policy
        self.momentum_correction = momentum
        self.optimizer_check = "raise"
        # The groups' states (filled at registration) and the run's world.
        self.groups: list[GroupState] = []
        self.world_size = dist.get_world_size()
        # Runtime: the compressor of the current density, and the collective (on the compressor's backend).
        self.compressor_now: Compressor = template
        self.collective_now = collective_named(collective, template.backend)
        if momentum is not None:
            optimizer_check.watch(self)

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's node: ``fully_shard(module, mesh=state.shard_mesh)``."""
        return self.mesh[MESH_DIM_NAMES[1]]

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(0)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(1)

    @property
    def nodes(self) -> int:
        return self.mesh.size(0)

    @classmethod
    def recipe(cls, mesh: Optional[DeviceMesh] = None, density: float = 0.01, warmup_steps: int = 44,
               momentum: float = 0.9, **options) -> "SparseFSDPState":
        """The DDP recipe's settings (:meth:`gtopk_ext.SparseGradState.recipe`) for FSDP2: Deep Gradient
        Compression's exponential warm-up of the density from 0.25 to ``density`` over ``warmup_steps`` calls, and
        momentum correction with Nesterov momentum ``momentum`` in the hook, its masking from the warm-up's end.
        Train with an optimizer WITHOUT momentum or weight decay (``torch.optim.SGD(model.parameters(), lr)``).
        ``options``: the other arguments (``collective``, ``wire``, ``start_iter``, ``path``, ...)."""
        schedule, correction = dgc.recipe(density, warmup_steps, momentum)
        return cls(mesh, density, density_schedule=schedule, momentum=correction, **options)

    def density_at(self, iteration: int) -> float:
        return density_at(self.density, self.density_schedule, iteration)

    def knows_parameters(self) -> bool:
        """Whether the hook is registered (the optimizer check waits for it)."""
        return bool(self.groups)

    def knows(self, parameter: torch.Tensor) -> bool:
        """Whether the hook reduces ``parameter``'s gradient."""
        return any(parameter is p.sharded_param for g in self.groups for p in g.fsdp_group.fsdp_params)

    def use_density(self, density: float) -> None:
        """The compressor of ``density`` becomes the current one."""
        self.compressor_now = self.compressor_now.with_density(density)

    def config_fields(self) -> dict[str, int]:
        """The configuration every rank must share, as header fields (checked at registration)."""
        return {"density_ppb": round(self.density * 1e9), "collective": list(COLLECTIVES).index(self.collective),
                "wire": wire_named(self.wire).code, "start_iter": self.start_iter, "path": self.path_policy.code,
                "compressor": COMPRESSOR_KINDS.index(self.compressor), "nodes": self.nodes,
                "schedule": int(self.density_schedule is not None),
                "momentum": zlib.crc32(repr(self.momentum_correction).encode())}

    # ----- checkpoints (per rank) and statistics -----

    def state_dict(self) -> dict:
        """This rank's resumable state: ``{"world_size", "rank<r>": {"group<i>": {"calls", "numel", "residual",
        "velocity" (with momentum correction), "oktopk"}}}``. The rank in the key keeps ranks' residuals apart in a
        ``torch.distributed.checkpoint`` (which saves one copy of a plain tensor that every rank names alike); the
        residual and velocity tensors are the state's own (a checkpoint loader may fill them in place), the rest
        copies."""
        rank = dist.get_rank()
        return {"world_size": self.world_size,
                f"rank{rank}": {f"group{g.index}": {"calls": g.calls, "numel": g.layout.numel,
                                                    "residual": g.residual,
                                                    **({} if g.velocity is None else {"velocity": g.velocity}),
                                                    "oktopk": g.oktopk.state_dict() if g.oktopk is not None else {}}
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
            if ("velocity" in entry) != (g.velocity is not None):
                raise ValueError(f"state_dict was saved {'with' if 'velocity' in entry else 'without'} momentum "
                                 f"correction, this state has momentum={self.momentum_correction}")
            for name in ("residual", "velocity"):
                if name in entry and entry[name] is not getattr(g, name):
                    getattr(g, name).copy_(entry[name])
            g.calls = int(entry["calls"])
            if g.oktopk is not None and entry["oktopk"]:
                g.oktopk.load_state_dict(entry["oktopk"])
            g.plan = PathPlan()

    def stats(self) -> dict:
        """``{"groups": {index: {...}}, "total": {...}}``: per group the latest call's ``path``, ``calls``,
        ``numel``, ``padded_numel``, ``k``, ``selected``, ``bytes_sent`` / ``bytes_received`` (this rank, between
        nodes), ``select_seconds``, ``exchange_seconds``, and the run's ``run_bytes_sent`` /
        ``run_bytes_received``; "total" sums them."""
        groups = {}
        for g in self.groups:
            s = g.stats
            groups[g.index] = {"name": g.name, "path": s.path, "calls": g.calls, "numel": s.numel,
                               "padded_numel": s.padded_numel, "k": s.k, "selected": s.selected,
                               "bytes_sent": s.traffic.sent, "bytes_received": s.traffic.received,
                               "select_seconds": s.select_seconds, "exchange_seconds": s.exchange_seconds,
                               "run_bytes_sent": g.run_traffic.sent, "run_bytes_received": g.run_traffic.received}
        summed = ("numel", "padded_numel", "k", "selected", "bytes_sent", "bytes_received", "select_seconds",
                  "exchange_seconds", "run_bytes_sent", "run_bytes_received")
        return {"groups": groups, "total": {key: sum(g[key] for g in groups.values()) for key in summed}}
