"""Where the gradient of each parameter lies in the flat shard that FSDP2 hands its all-reduce hook. FSDP2 (torch
2.14, ``_fully_shard/_fsdp_collectives.foreach_reduce``) pads every parameter's gradient along dim 0 to a multiple of
the shard group's size and reduce-scatters the concatenation: a rank's shard holds, per parameter in order, its
``sharded_size`` real elements (fewer on the last ranks of an uneven dim 0, none on some), then zeros up to
``padded_sharded_param_size``. FSDP publishes no such layout: it is read from its private ``FSDPParam`` sizes, and
``tests/test_fsdp.py`` pins it against the shard FSDP builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class ShardLayout:
    """The parameters of one FSDP parameter group as this rank's shard holds them: ``(real, padded)`` elements
    of each parameter, in order (``padded >= real``; the shard is ``padded_numel`` long). Only the real
    elements enter the sparse reduction: the padding is never selected and never holds residual."""

    parts: tuple[tuple[int, int], ...]
    _index: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def numel(self) -> int:
        """Real elements: the reduction's numel (k follows from it)."""
        return sum(real for real, _ in self.parts)

    @property
    def padded_numel(self) -> int:
        """Elements of the shard FSDP hands the hook."""
        return sum(padded for _, padded in self.parts)

    @property
    def padded(self) -> bool:
        return self.numel != self.padded_numel

    def real_index(self, device: torch.device) -> torch.Tensor:
        """int64 positions of the real elements in the shard, ascending (built once per device)."""
        if device not in self._index:
            starts, offset = [], 0
            for real, padded in self.parts:
                starts.append(torch.arange(offset, offset + real))
                offset += padded
            self._index[device] = torch.cat(starts).to(device) if starts else torch.zeros(0, dtype=torch.int64)
        return self._index[device]


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """(name, module) of the FSDP2 modules of ``model`` (itself included, named ""), in ``named_modules()``
    order: the same on every rank."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module sharded with torch.distributed.fsdp.fully_shard, got "
                        f"{type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise TypeError(f"model ({type(model).__name__}) has no FSDP2 module: shard it first with "
                        f"torch.distributed.fsdp.fully_shard(module, mesh=state.shard_mesh)")
    return found


def parameter_group(module: FSDPModule, name: str):
    """The module's one FSDP parameter group (None for a module without parameters, such as a bare root)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(f"FSDP module {name!r} has {len(groups)} parameter groups (a shard_placement_fn that "
                         f"gives parameters different meshes): the hook supports one group per module")
    return groups[0] if groups else None


def shard_layout(param_group) -> ShardLayout:
    """The layout of the shard that ``param_group`` reduces on this rank: its parameters that require a gradient
    (frozen ones are never reduce-scattered), in order; an unused one is there too, as zeros (the registration sets
    ``set_reduce_scatter_unused_params(True)``)."""
    parts = []
    for fsdp_param in param_group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        parts.append((math.prod(fsdp_param.sharded_size), math.prod(fsdp_param.padded_sharded_param_size)))
    return ShardLayout(tuple(parts))
