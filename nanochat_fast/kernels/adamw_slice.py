"""
adamw_slice_update: torch.optim.AdamW's step for the parameter slices one rank owns (ZeRO-2), over a list
of tensors in one call. Params fp32 or bf16 (grads alike), state and math fp32. Backends: cpp
(csrc/adamw_slice_cpu.cpp, csrc/cuda/adamw_slice.cu), triton (below: one launch for many tensors) and
reference (torch.optim.AdamW's single-tensor sequence). The hyperparameters reach every backend as one
small tensor (HPARAMS), so a schedule neither recompiles a compiled step nor syncs the host.
"""

import functools
import math
import numbers

import torch

from . import registry
from .triton_utils import store, tl, triton

OP = "adamw_slice_update"
# Slot i of the hyperparameter tensor (float64; float32 on MPS, which has no fp64). The C++ and CUDA
# kernels name the same slots in csrc/adamw_slice_hparams.h (kLr, ...): a test checks they agree.
HPARAMS = ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt")
SLOT = {name: i for i, name in enumerate(HPARAMS)}


def make_hparams(step, lr, beta1, beta2, eps, weight_decay, device) -> torch.Tensor:
    """The hyperparameter tensor of update number `step` (1-based) on `device`: bias_correction1 is
    1 - beta1^step, bias_correction2_sqrt sqrt(1 - beta2^step). 0-D tensors are combined on device."""
    device = torch.device(device)
    dtype = torch.float32 if device.type == "mps" else torch.float64
    given = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    if not any(isinstance(v, torch.Tensor) for v in (step, *given.values())):
        values = dict(given, bias_correction1=1.0 - beta1**step, bias_correction2_sqrt=math.sqrt(1.0 - beta2**step))
        return torch.tensor([values[name] for name in HPARAMS], dtype=dtype, device=device)
    step = torch.as_tensor(step, dtype=dtype, device=device)
    values = {k: torch.as_tensor(v, dtype=dtype, device=device) for k, v in given.items()}
    values.update(
        bias_correction1=1.0 - values["beta1"] ** step, bias_correction2_sqrt=torch.sqrt(1.0 - values["beta2"] ** step)
    )
    return torch.stack([values[name] for name in HPARAMS])


def _check_range(name, value, low, high=None):
    """ValueError naming the argument when a Python number is out of [low, high) (a tensor's value is not
    read: on a GPU that would sync the host every step)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{name} must be a Python float or a 0-D tensor, got a tensor of shape {tuple(value.shape)}"
            )
        return
    if not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value!r}")


def _check_tensors(params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls):
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "lr_muls": lr_muls, "wd_muls": wd_muls}
    for name, seq in lists.items():
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries but params has {n}")
    device = params[0].device if n else None
    for i, p in enumerate(params):
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"params[{i}] must be float32 or bfloat16, got {p.dtype}")
        for name, dtype in (("grads", p.dtype), ("exp_avgs", torch.float32), ("exp_avg_sqs", torch.float32)):
            t = lists[name][i]
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
    params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, lr_muls=None, wd_muls=None,
    *, backend=None,
):  # fmt: skip
    """One AdamW step over lists of same-device tensors, in place. `step` is the 1-based count of
    updates including this one; lr_muls/wd_muls are per-tensor multipliers (None: all 1.0).
    `backend` forces a backend by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
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


# -- backends: each takes (params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls) ----------


@registry.register(OP, "reference")
def adamw_reference(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
    # 0-D float64 scalars, in HPARAMS order: like torch.optim.AdamW's Python floats, they do not promote fp32
    lr, beta1, beta2, eps, wd, bc1, bc2_sqrt = hparams.unbind()
    for p, g, m, v, lr_mul, wd_mul in zip(params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls):
        p32, g32 = p.float(), g.float()  # no-ops for fp32 params
        p32.mul_(1 - lr * lr_mul * wd * wd_mul)
        m.lerp_(g32, 1 - beta1)
        v.mul_(beta2).add_((1 - beta2) * g32 * g32)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p32.sub_((lr * lr_mul / bc1) * m / denom)
        if p32 is not p:
            p.copy_(p32)


@registry.register(OP, "cpp")
def adamw_cpp(*args):
    torch.ops.nanochat_fast.adamw_slice_update(*args)


@registry.register(OP, "triton")
def adamw_triton(*args):
    torch.ops.nanochat_fast.adamw_slice_update_triton(*args)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::adamw_slice_update")
    def _(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls):
        return None  # updates in place, returns nothing: nothing to allocate when tracing


# -- the Triton kernel: the multi-tensor-apply pattern -----------------------------------------------
# The host builds a table of raw pointers (param, grad, exp_avg, exp_avg_sq per tensor) and one of
# blocks (which tensor, which offset); program i updates block i, so ~50 small slices cost one launch.
# Loads go to fp32 before any arithmetic and bf16 stores round to nearest even: the interpreter then
# gives a GPU's bits. The interpreter runs one program at a time: bigger blocks, fewer (slow) iterations.
CONFIGS = {"cuda": dict(BLOCK=2048, num_warps=8), "cpu": dict(BLOCK=4096, num_warps=1)}
GPU_CONFIGS = {"default": CONFIGS["cuda"]}  # every config a GPU may launch (benchmarks/triton_aot.py)
LR, BETA1, BETA2, EPS, WEIGHT_DECAY, BIAS_CORRECTION1, BIAS_CORRECTION2_SQRT = (tl.constexpr(SLOT[n]) for n in HPARAMS)


@triton.jit
def _adamw_multi_tensor_kernel(
    table_ptr,  # int64[5, n_tensors]: param, grad, exp_avg, exp_avg_sq pointers; numel
    muls_ptr,  # float32[2, n_tensors]: lr_mul, wd_mul
    blocks_ptr,  # int64[2, n_blocks]: tensor index, element offset
    hparams_ptr,  # float64[7], the slots of HPARAMS
    n_tensors,
    n_blocks,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid)
    start = tl.load(blocks_ptr + n_blocks + pid)
    param_dtype = tl.bfloat16 if IS_BF16 else tl.float32
    p_ptr = tl.load(table_ptr + t).to(tl.pointer_type(param_dtype))
    g_ptr = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(param_dtype))
    m_ptr = tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    numel = tl.load(table_ptr + 4 * n_tensors + t)

    lr = tl.load(hparams_ptr + LR) * tl.load(muls_ptr + t)
    beta1 = tl.load(hparams_ptr + BETA1).to(tl.float32)
    beta2 = tl.load(hparams_ptr + BETA2).to(tl.float32)
    eps = tl.load(hparams_ptr + EPS).to(tl.float32)
    wd = tl.load(hparams_ptr + WEIGHT_DECAY) * tl.load(muls_ptr + n_tensors + t)
    decay = (1.0 - lr * wd).to(tl.float32)
    step_size = (lr / tl.load(hparams_ptr + BIAS_CORRECTION1)).to(tl.float32)
    inv_bc2_sqrt = (1.0 / tl.load(hparams_ptr + BIAS_CORRECTION2_SQRT)).to(tl.float32)

    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p * decay - step_size * (m / (tl.sqrt(v) * inv_bc2_sqrt + eps))
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    store(p_ptr + offs, p, mask)


@functools.lru_cache(maxsize=32)
def _block_table(numels: tuple, block: int, device: torch.device) -> torch.Tensor:
    """(2, n_blocks) int64 on `device`: tensor index and start of every block. Built once per parameter
    layout, not per step (a 60M-parameter model has ~30K blocks)."""
    block_tensor, block_start = [], []
    for i, numel in enumerate(numels):
        starts = range(0, numel, block)
        block_tensor += [i] * len(starts)
        block_start += starts
    return torch.tensor([block_tensor, block_start], dtype=torch.int64, device=device)


def _launch(hparams, params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls):
    device = params[0].device
    cfg = CONFIGS["cuda" if device.type == "cuda" else "cpu"]
    numels = [p.numel() for p in params]
    blocks = _block_table(tuple(numels), cfg["BLOCK"], device)
    if blocks.size(1) == 0:
        return
    pointers = [[t.data_ptr() for t in seq] for seq in (params, grads, exp_avgs, exp_avg_sqs)]
    table = torch.tensor([*pointers, numels], dtype=torch.int64)
    muls = torch.tensor([lr_muls, wd_muls], dtype=torch.float32)
    if device.type != "cpu":  # tiny tables: one pinned host->device copy each, no sync
        table, muls = (x.pin_memory().to(device, non_blocking=True) for x in (table, muls))
    _adamw_multi_tensor_kernel[(blocks.size(1),)](
        table, muls, blocks, hparams, len(params), blocks.size(1),
        IS_BF16=params[0].dtype == torch.bfloat16, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
    )  # fmt: skip


# An op torch.compile keeps whole (one call, no graph break): it cannot trace into a table of raw pointers.
@torch.library.custom_op("nanochat_fast::adamw_slice_update_triton", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_slice_update_triton(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], hparams: torch.Tensor, lr_muls: list[float], wd_muls: list[float],
) -> None:  # fmt: skip
    """One launch per param dtype present (normally one)."""
    by_dtype = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for idx in by_dtype.values():
        _launch(hparams, *([seq[i] for i in idx] for seq in (params, grads, exp_avgs, exp_avg_sqs, lr_muls, wd_muls)))
