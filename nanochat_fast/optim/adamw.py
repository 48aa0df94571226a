"""
AdamW for the embedding and the lm_head (torch.optim.AdamW's math, decoupled weight decay), ZeRO-2
over the ranks (DistAdamW) or in one process (AdamW, the same code with one rank); every update goes
through kernels.adamw_slice_update. A parameter's `lr_mul` / `wd_mul` attributes (default 1.0) scale
its group's lr / weight_decay.
"""

import torch

from ..kernels import adamw_slice_update
from .zero import Bucket, ZeroOptimizer, check_hparam


class AdamW(ZeroOptimizer):
    kind = "adamw"
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        check_hparam("lr", lr)
        check_hparam("betas[0]", betas[0], 0.0, 1.0)
        check_hparam("betas[1]", betas[1], 0.0, 1.0)
        check_hparam("eps", eps)
        check_hparam("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.buckets = [self._bucket(p) for p in self.params]

    def _bucket(self, p) -> Bucket:
        """p flattened into W chunks of s = ceil(numel / W) elements (rank r owns [r*s, min((r+1)*s,
        numel))), reduced and gathered in place where numel is W*s, through a padded copy if not."""
        n, W = p.numel(), self.world_size
        s = -(-n // W)
        slots = [[(p, r * s, min((r + 1) * s, n))] if r * s < n else [] for r in range(W)]
        return Bucket(s, slots, p if n == W * s else None)

    def _owned_param(self, p, lo: int, hi: int) -> torch.Tensor:
        return p.data.view(-1)[lo:hi]

    def update(self, chunks, scale):
        step = self.num_updates + 1
        chunk_of = dict(zip(self.params, zip(self.buckets, chunks)))
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls = [], [], [], [], [], []
            for p in group["params"]:
                b, chunk = chunk_of[p]
                for _, lo, hi in b.slots[self.rank]:  # none where this rank owns no element of p
                    g = chunk[: hi - lo]
                    if scale != 1.0:
                        g.mul_(scale)
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                        state["exp_avg_sq"] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                    params.append(self._owned_param(p, lo, hi))
                    grads.append(g)
                    exp_avgs.append(state["exp_avg"])
                    exp_avg_sqs.append(state["exp_avg_sq"])
                    lr_muls.append(getattr(p, "lr_mul", 1.0))
                    wd_muls.append(getattr(p, "wd_mul", 1.0))
            hparams = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])  # the kernel's order
            adamw_slice_update(params, grads, exp_avgs, exp_avg_sqs, step, *hparams, lr_muls, wd_muls)
            for p in group["params"]:
                self.gather(chunk_of[p][0])
        self.num_updates = step


class DistAdamW(AdamW):
    """AdamW with ZeRO-2 sharding over the default torch.distributed process group."""

    distributed = True
