"""
optim.step: one step of several optimizers (e.g. [adamw, muon]) as one, clipped by the norm of
their whole gradient, averaged over ranks, which it returns for the log and the NaN guard.

It drives the step protocol of ZeroOptimizer (zero.py), which every optimizer of this package
follows. The norm costs no extra pass over full gradients and no all-reduce of them: each rank
sums the squares of the gradient parts it owns after the reduction (each element is owned by
exactly one rank), and the per-rank sums are gathered and added in rank order, so every rank gets
the same bits and 1 and N processes agree up to rounding.
"""

import math

import torch

from .zero import all_gather


@torch.no_grad()
def global_grad_norm(optimizers) -> torch.Tensor:
    """Start the gradient reductions of every optimizer and return the global L2 norm (0-D fp32) of
    the averaged gradient. Leaves the optimizers mid-step: follow with their apply_update,
    gather_params and mark_updated, or with discard."""
    for opt in optimizers:
        opt.launch_reduce()
    local = torch.stack([opt.owned_grad_sq().float() for opt in optimizers]).sum()
    world_size = max(opt.world_size for opt in optimizers)
    if world_size > 1:
        gathered = torch.empty(world_size, dtype=local.dtype, device=local.device)
        all_gather(gathered, local.reshape(1)).wait()
        local = gathered.sum()
    return local.sqrt()


@torch.no_grad()
def step(optimizers, grad_clip: float | None = None) -> torch.Tensor:
    """Update with every optimizer in `optimizers` (e.g. [adamw, muon]) and return the global
    gradient norm before clipping (0-D fp32 tensor).

    If the norm is not finite nothing is applied (no parameter, state or step count changes) and the
    caller decides what to do (the training loop's NaN guard). Otherwise, when grad_clip is set
    (None and 0 mean no clipping, as nanochat's grad_clip=0.0), the gradients are scaled by
    min(1, grad_clip / (norm + 1e-6)) before the updates. Reading the norm makes the host wait for
    the reductions once per step.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip >= 0):
        raise ValueError(f"grad_clip must be a number >= 0 (0 or None: no clipping), got {grad_clip!r}")
    norm = global_grad_norm(optimizers)
    value = norm.item()
    if not math.isfinite(value):
        for opt in optimizers:
            opt.discard()
        return norm
    coef = None
    if grad_clip:
        c = grad_clip / (value + 1e-6)
        coef = c if c < 1.0 else None
    # every optimizer's update before any gather waits: the all-gathers of one overlap the
    # updates of the next
    for opt in optimizers:
        opt.apply_update(coef)
    for opt in optimizers:
        opt.gather_params()
        opt.mark_updated()
    return norm
