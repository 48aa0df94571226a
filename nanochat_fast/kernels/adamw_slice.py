"""
adamw_slice_update: the AdamW step for the parameter slices one rank owns (ZeRO-2), over a list
of tensors in one call. The math is torch.optim.AdamW's:

    p   *= 1 - lr*lr_mul * wd*wd_mul                   (decoupled weight decay)
    m    = lerp(m, g, 1 - beta1)
    v    = beta2*v + (1 - beta2)*g*g
    p   -= (lr*lr_mul / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

Params are fp32 or bf16 (grads the same dtype), state is fp32, math is fp32. Hyperparameters may be
Python floats or 0-D tensors: they travel to every backend as one small float64 tensor whose
layout is adamw_slice_hparams.py (the C++ side: csrc/adamw_slice_hparams.h).

Backends: `cpp` (csrc/adamw_slice_cpu.cpp on CPU, csrc/cuda/adamw_slice.cu on CUDA), `triton`
(adamw_slice_triton.py, one launch for many tensors) and `reference` (torch.optim.AdamW's
single-tensor sequence).
"""

import math
import numbers

import torch

from . import registry
from .adamw_slice_hparams import SLOT, make_hparams
from .registry import always, cpp_why_not, register_backend, register_op, triton_why_not

OP = "adamw_slice_update"
register_op(
    OP,
    auto_order={
        "cuda": ("triton", "cpp", "reference"),
        "cpu": ("cpp", "reference"),
        "mps": ("reference",),
    },
)


def _check_range(name, value, low, high=None, high_inclusive=False):
    """ValueError naming the argument when a Python number is out of range (tensors are not
    inspected: reading a GPU scalar would sync the host on every step)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{name} must be a Python float or a 0-D tensor, got a tensor of shape {tuple(value.shape)}"
            )
        return
    if not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if value < low or (high is not None and (value > high if high_inclusive else value >= high)):
        bound = f"[{low}, {high}{']' if high_inclusive else ')'}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value!r}")


def _check_tensors(params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls):
    n = len(params)
    for name, seq in (
        ("grads", grads),
        ("exp_avgs", exp_avgs),
        ("exp_avg_sqs", exp_avg_sqs),
        ("lr_muls", lr_muls),
        ("wd_muls", wd_muls),
    ):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries but params has {n}")
    if n == 0:
        return
    device = params[0].device
    for i, p in enumerate(params):
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"params[{i}] must be float32 or bfloat16, got {p.dtype}")
        for name, seq, dtype in (
            ("grads", grads, p.dtype),
            ("exp_avgs", exp_avgs, torch.float32),
            ("exp_avg_sqs", exp_avg_sqs, torch.float32),
        ):
            t = seq[i]
            if t.shape != p.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)} but params[{i}] has {tuple(p.shape)}")
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but params[0] is on {device}")
            if t.dtype != dtype:
                raise ValueError(f"{name}[{i}] must be {dtype}, got {t.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] is not contiguous; pass .contiguous() slices")
        if p.device != device:
            raise ValueError(f"params[{i}] is on {p.device} but params[0] is on {device}")
        if not p.is_contiguous():
            raise ValueError(f"params[{i}] is not contiguous; pass .contiguous() slices")


def adamw_slice_update(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    lr_muls=None,
    wd_muls=None,
    *,
    backend=None,
):
    """One AdamW step over lists of same-device tensors, in place. `step` is the 1-based count of
    updates including this one; lr_muls/wd_muls are per-tensor multipliers (None: all 1.0).
    `backend` forces a backend by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    if not torch.compiler.is_compiling():
        _check_range("lr", lr, 0.0)
        _check_range("beta1", beta1, 0.0, 1.0)
        _check_range("beta2", beta2, 0.0, 1.0)
        _check_range("eps", eps, 0.0)
        _check_range("weight_decay", weight_decay, 0.0)
        if not isinstance(step, torch.Tensor) and (not isinstance(step, numbers.Integral) or step < 1):
            raise ValueError(f"step must be an int >= 1 (the 1-based count of updates), got {step!r}")
        _check_tensors(params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls)
    if len(params) == 0:
        return
    lr_muls = [1.0] * len(params) if lr_muls is None else [float(x) for x in lr_muls]
    wd_muls = [1.0] * len(params) if wd_muls is None else [float(x) for x in wd_muls]
    device = params[0].device
    impl = registry.select(OP, device.type, backend)
    hparams = make_hparams(step, lr, beta1, beta2, eps, weight_decay, device)
    impl.fn(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), hparams, lr_muls, wd_muls)


# ---------------------------------------------------------------------------------------------
# backends: each takes (params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls)


@register_backend(OP, "reference", always)
def adamw_reference(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    """Plain PyTorch, one tensor at a time, exactly torch.optim.AdamW's single-tensor sequence."""
    # 0-D float64 scalars: like the Python floats torch.optim.AdamW uses, they do not promote fp32 tensors
    hp = hparams.unbind()
    lr, beta1, beta2, eps, wd = (hp[SLOT[k]] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    bc1, bc2_sqrt = hp[SLOT["bias_correction1"]], hp[SLOT["bias_correction2_sqrt"]]
    for p, g, m, v, lr_mul, wd_mul in zip(params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls):
        p32, g32 = p.float(), g.float()  # no-ops for fp32 params
        p32.mul_(1 - lr * lr_mul * wd * wd_mul)
        m.lerp_(g32, 1 - beta1)
        v.mul_(beta2).add_((1 - beta2) * g32 * g32)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p32.sub_((lr * lr_mul / bc1) * m / denom)
        if p32 is not p:
            p.copy_(p32)


def _cpp_why_not(device_type):
    return cpp_why_not(device_type, has_cuda_kernel=True)


@register_backend(OP, "cpp", _cpp_why_not)
def adamw_cpp(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    torch.ops.nanochat_fast.adamw_slice_update(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls)


@register_backend(OP, "triton", triton_why_not)
def adamw_triton(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    from .adamw_slice_triton import adamw_slice_update_triton  # imported late: TRITON_INTERPRET is read at import

    adamw_slice_update_triton(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::adamw_slice_update")
    def _(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
        return None  # updates in place, returns nothing: nothing to allocate when tracing
