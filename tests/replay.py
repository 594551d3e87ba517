"""The sparse exchange of the replays (tests/test_dgc.py, tests/test_adamw.py), in plain PyTorch over the package's
collectives: one rank's top-k of its accumulation sent, what a merge dropped put back."""

import torch

import gtopk_ext as gx


def exchange_topk(v: torch.Tensor, k: int, group, size: int, collective: str):
    """Sends the k largest |v| (taken out of ``v``, in place) by ``collective`` ("allgather" or "gtopk") over
    ``group`` of ``size`` ranks; the slots gTop-k's merges dropped go back into ``v``. Returns (the average, the
    sent indices, the mask of those applied)."""
    indices = torch.topk(v.abs(), k).indices.sort().values
    values = v[indices].clone()
    v[indices] = 0
    msg = gx.SparseMessage(values, indices.int(), torch.tensor([k], dtype=torch.int32), v.numel())
    if collective == "allgather":
        return gx.collectives.sparse_allgather(msg, group) / size, indices, torch.ones(k, dtype=torch.bool)
    glob, applied = gx.collectives.gtopk_allreduce(msg, group)
    output = torch.zeros_like(v).index_add_(0, glob.indices.long(), glob.values / size)
    v[indices[~applied]] += values[~applied]
    return output, indices, applied


def differs(state, got: torch.Tensor, output: torch.Tensor, velocity: torch.Tensor, v: torch.Tensor,
            name: str, velocity_atol: float) -> str | None:
    """How the hook's step of bucket 0 (its output ``got``, the state's velocity and residual) is off from the
    replay's (``output``, ``velocity`` named ``name``, ``v``); None where it is not."""
    held = state.store.tensors["velocity"][0]
    residual = state.store.residuals.get(0, torch.zeros_like(v))
    if (torch.allclose(got, output, rtol=1e-5, atol=1e-6) and torch.allclose(held, velocity, atol=velocity_atol)
            and torch.allclose(residual, v, atol=1e-5)):
        return None
    return (f"output off by {float((got - output).abs().max()):.3g}, {name} by "
            f"{float((held - velocity).abs().max()):.3g}, v by {float((residual - v).abs().max()):.3g}")


def imbalance(entered: torch.Tensor, applied: torch.Tensor, state, group) -> float:
    """max |sum over the ranks of what entered v - what was applied - what their v keep| (NaN where not finite)."""
    total = torch.stack([entered.double(), state.store.residuals[0].double()])
    torch.distributed.all_reduce(total, group=group)
    return float((total[0] - applied - total[1]).abs().max())
