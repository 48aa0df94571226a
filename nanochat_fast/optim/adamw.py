"""
AdamW for the embedding and the lm_head, ZeRO-2 over the ranks (DistAdamW) or in one process
(AdamW, the same code with one rank). Every update goes through kernels.adamw_slice_update.

Sharding works for any shape and any world size: a parameter is flattened and padded to a
multiple of the world size W; with s = ceil(numel / W), rank r owns the flat elements
[r*s, min((r+1)*s, numel)) and keeps exp_avg/exp_avg_sq for those only (1/W of the state). A step:
reduce-scatter the (padded) gradient, update the owned slice, all-gather the parameter. Tensors
whose numel splits evenly are reduced and gathered in place, without padding copies.

Per-parameter multipliers: a parameter's `lr_mul` / `wd_mul` attributes (default 1.0) scale the
group's lr / weight_decay.
"""

import torch

from ..kernels import adamw_slice_update
from .zero import ZeroOptimizer, all_gather, check_hparam, copy_flat_pieces, reduce_scatter_sum


def owned_range(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(lo, hi, s): rank owns flat elements [lo, hi) of a tensor split into world_size chunks of s."""
    s = -(-numel // world_size)
    lo = min(rank * s, numel)
    return lo, min(lo + s, numel), s


class AdamW(ZeroOptimizer):
    """AdamW in one process (torch.optim.AdamW's math, decoupled weight decay)."""

    kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        check_hparam("lr", lr)
        check_hparam("betas[0]", betas[0], 0.0, 1.0)
        check_hparam("betas[1]", betas[1], 0.0, 1.0)
        check_hparam("eps", eps)
        check_hparam("weight_decay", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _params(self):
        for group in self.param_groups:
            yield from group["params"]

    def _owned_range(self, p) -> tuple[int, int]:
        """(lo, hi): the flat elements of p whose update and state this rank owns."""
        lo, hi, _ = owned_range(p.numel(), self.world_size, self.rank)
        return lo, hi

    def _owned_param(self, p) -> torch.Tensor:
        """The owned elements of p, a flat view this rank updates in place."""
        lo, hi = self._owned_range(p)
        return p.data.view(-1)[lo:hi]

    # -- the step protocol (zero.py) -------------------------------------------------------------

    def launch_reduce(self):
        W, r = self.world_size, self.rank
        slots = {}
        for p in self._params():
            grad = self._grad(p)
            flat = grad.reshape(-1)
            lo, hi, s = owned_range(p.numel(), W, r)
            if W == 1:
                slots[p] = dict(grad=flat, work=None, buffer=None)
                continue
            if p.numel() == W * s:
                rs_in, buffer = flat.contiguous(), None
            else:
                # pad to W*s; the buffer is reused as the all-gather output
                buffer = torch.zeros(W * s, dtype=grad.dtype, device=grad.device)
                buffer[: p.numel()].copy_(flat)
                rs_in = buffer
            out = torch.empty(s, dtype=grad.dtype, device=grad.device)
            slots[p] = dict(grad=out, work=reduce_scatter_sum(out, rs_in), buffer=buffer)
        self._pending = dict(
            slots=slots, works=[v["work"] for v in slots.values() if v["work"] is not None], gathers=[]
        )

    def _wait_grad(self, p):
        """The owned slice of p's gradient, summed over ranks (not yet divided by W)."""
        slot = self._pending["slots"][p]
        if slot["work"] is not None:
            slot["work"].wait()
            slot["work"] = None
        lo, hi = self._owned_range(p)
        return slot["grad"][: hi - lo]

    def _owned_grads(self):
        return [self._wait_grad(p) for p in self._params()]

    def apply_update(self, clip_coef):
        scale = (1.0 if clip_coef is None else clip_coef) / self.grad_divisor
        step = self.num_updates + 1
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls = [], [], [], [], [], []
            for p in group["params"]:
                g = self._wait_grad(p)
                if g.numel() == 0:
                    continue
                if scale != 1.0:
                    g.mul_(scale)
                lo, hi = self._owned_range(p)
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq"] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                params.append(self._owned_param(p))
                grads.append(g)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                lr_muls.append(getattr(p, "lr_mul", 1.0))
                wd_muls.append(getattr(p, "wd_mul", 1.0))
            beta1, beta2 = group["betas"]
            adamw_slice_update(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                step,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                lr_muls,
                wd_muls,
            )
            if self.world_size > 1 and self.grads_are_sums:  # ZeRO-2: every rank gets the whole update
                for p in group["params"]:
                    self._start_gather(p)
        self.num_updates = step

    def _start_gather(self, p):
        W, r = self.world_size, self.rank
        lo, hi, s = owned_range(p.numel(), W, r)
        flat = p.data.view(-1)
        slot = self._pending["slots"][p]
        if slot["buffer"] is None:
            # numel == W*s: gather in place, the owned slice is this rank's input
            work = all_gather(flat, flat[r * s : (r + 1) * s])
        else:
            out = slot["buffer"]
            if hi - lo == s:
                inp = flat[lo:hi]
            else:
                inp = torch.zeros(s, dtype=p.dtype, device=p.device)
                inp[: hi - lo].copy_(flat[lo:hi])
            work = all_gather(out, inp)
        self._pending["gathers"].append((p, work, slot["buffer"]))

    def gather_params(self):
        for p, work, buffer in self._pending["gathers"]:
            work.wait()
            if buffer is not None:
                p.data.view(-1).copy_(buffer[: p.numel()])
        self._pending = None

    # -- state -----------------------------------------------------------------------------------

    def _state_entries(self):
        entries = {}
        for p, state in self.state.items():
            if not state:
                continue
            lo, hi = self._owned_range(p)
            entries[self.names[p]] = dict(
                shape=list(p.shape), offset=lo, numel=hi - lo, exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"]
            )
        return entries

    def _load_entries(self, pieces, saved_ranks):
        self.state.clear()
        for p in self._params():
            name = self.names[p]
            lo, hi = self._owned_range(p)
            if hi == lo:
                continue
            entries = pieces.get(name, [])
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                copy_flat_pieces(state[key], lo, entries, key, name, p.shape, saved_ranks)


class DistAdamW(AdamW):
    """AdamW with ZeRO-2 sharding over the default torch.distributed process group (AdamW's
    arguments)."""

    distributed = True
