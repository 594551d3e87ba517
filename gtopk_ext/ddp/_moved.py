"""The constructor arguments of earlier versions of :class:`gtopk_ext.SparseGradState`, folded into the
per-feature options that replaced them."""

from __future__ import annotations

from typing import Optional, Union

from gtopk_ext.compressors import Compressor, compressor_at
from gtopk_ext.ddp.dgc import MomentumCorrection

# The constructor arguments of earlier versions, and where each now lives.
MOVED = {"density_schedule": "density=", "compressor_kwargs": "compressor=gx.make_compressor(kind, density, ...)",
          "random_seed": "compressor=gx.make_compressor('randomk', density, seed=...)",
          "per_tensor": "compressor=gx.make_compressor(kind, density, per_tensor=True)",
          "nesterov": "momentum=gx.MomentumCorrection(...)", "weight_decay": "momentum=gx.MomentumCorrection(...)",
          "masking_start_iter": "momentum=gx.MomentumCorrection(...)",
          "clip_norm": "momentum=gx.MomentumCorrection(...)",
          "local_size": "hierarchical=gx.Hierarchical(local_size)",
          "min_compress_numel": "path=gx.PathPolicy(mode, min_compress_numel=...)", "inner_collective": "collective=",
          "stats_logging_frequency": "the attribute state.stats_logging_frequency",
          "synchronous": "the attribute state.synchronous"}


def folded_compressor(compressor: Union[str, Compressor], density: float, moved: dict) -> Compressor:
    """The compressor of the state at ``density`` (the earlier arguments ``compressor_kwargs``, ``random_seed``
    and ``per_tensor`` folded in)."""
    if isinstance(compressor, Compressor):
        return compressor_at(compressor, density)
    kwargs = dict(moved.get("compressor_kwargs") or {})
    if moved.get("per_tensor"):
        kwargs["per_tensor"] = True
    seed = count("random_seed", moved.get("random_seed", 0))
    if compressor == "randomk":  # the draws of a bucket: seed + iter * 2^20 + bucket index
        kwargs["seed"] = kwargs.get("seed", 0) + seed
    return compressor_at(compressor, density, **kwargs)


def folded_momentum(momentum: Union[MomentumCorrection, float, None], moved: dict) -> Optional[MomentumCorrection]:
    """The momentum correction of the state (the earlier arguments ``nesterov``, ``weight_decay``,
    ``masking_start_iter`` and ``clip_norm`` folded in); None when it does nothing."""
    parts = {name: moved[name] for name in ("nesterov", "weight_decay", "masking_start_iter", "clip_norm")
             if name in moved}
    if isinstance(momentum, MomentumCorrection):
        if parts:
            raise TypeError(f"pass {sorted(parts)} inside momentum=gx.MomentumCorrection(...)")
        return momentum
    if momentum is None:
        momentum = 0.0
    options = MomentumCorrection(momentum, **parts)
    if not options.momentum and not options.weight_decay and options.clip_norm is None:
        return None
    return options


def count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value
