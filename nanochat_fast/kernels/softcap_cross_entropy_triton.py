"""
The row pass of softcap_cross_entropy as one Triton kernel (the chunk loop and its cuBLAS matmuls
are in softcap_cross_entropy.py).

One program per row of a chunk of logits z [rows, V]:
    pass 1  y = softcap * tanh(z / softcap) block by block, with an online logsumexp (running max,
            sum rescaled when the max grows): the row is read once and nothing is stored
    loss    logsumexp - y[target], 0 where target == ignore_index
    pass 2  (gradients wanted) dz = g * (exp(y - logsumexp) - onehot(target)) * (1 - tanh^2),
            written over z in place, in z's dtype
Every load is cast to fp32 before any arithmetic and bf16 stores round to nearest even
(to_bf16_rtne): fp32 math for bf16 logits, and the Triton interpreter (whose bf16 arithmetic works
on raw bits) computes what a GPU computes. A target outside [0, V) that is not ignore_index gives a
NaN loss (a kernel cannot raise; the other backends raise).
"""

import torch
import triton
import triton.language as tl

from .triton_utils import to_bf16_rtne

# BLOCK: vocabulary entries per step of a row. On a GPU a row of nanochat's 65K vocabulary takes 16
# steps of 4096 (16 fp32 per thread with 8 warps; docs/measurements.md#gpu-kernel-configs). The
# interpreter runs one program at a time in numpy, so it takes large blocks (tests use small
# vocabularies, several blocks per row with a partial last one).
CONFIGS = {
    "cuda": dict(BLOCK=4096, num_warps=8),
    "cpu": dict(BLOCK=256, num_warps=1),
}
# Every variant a GPU may compile, for the ahead-of-time check (benchmarks/triton_aot.py): the training pass
# (loss and dz) and evaluation's loss-only pass, both with the CUDA block.
GPU_CONFIGS = {"grad": dict(CONFIGS["cuda"], COMPUTE_GRAD=True), "loss": dict(CONFIGS["cuda"], COMPUTE_GRAD=False)}


@triton.jit
def _tanh(x):
    """tanh from one exp, stable for any x: (1 - e) / (1 + e) with e = exp(-2|x|), signed.
    Absolute error ~1e-7 (near 0 it is a difference of numbers close to 1), which is what the loss
    needs: softcap * tanh is a logit, compared on an absolute scale."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _softcap_ce_rows_kernel(
    z_ptr,
    z_stride,  # logits chunk [rows, V] (fp32 or bf16); dz is written over it
    targets_ptr,  # int64 [rows]
    scale_ptr,  # fp32 [rows]: per-row gradient weights (read when COMPUTE_GRAD)
    losses_ptr,  # fp32 [rows]
    n_cols,
    softcap,
    ignore_index,
    COMPUTE_GRAD: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * z_stride
    target = tl.load(targets_ptr + row)
    inv_cap = 1.0 / softcap
    cols = tl.arange(0, BLOCK)

    # pass 1: online logsumexp of the softcapped logits
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(mask, softcap * _tanh(z * inv_cap), float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    z_target = tl.load(row_ptr + target, mask=valid & in_range, other=0.0).to(tl.float32)
    # log(s) - (y_target - m): y_target - m is exactly 0 when the target is the row's maximum, so
    # a confident prediction's small loss keeps its precision
    loss = tl.log(s) - (softcap * _tanh(z_target * inv_cap) - m)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(losses_ptr + row, tl.where(valid, loss, 0.0))

    if COMPUTE_GRAD:
        g = tl.load(scale_ptr + row)
        g = tl.where(valid, g, 0.0)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            t = _tanh(z * inv_cap)
            p = tl.exp(softcap * t - lse)
            p = tl.where(start + cols == target, p - 1.0, p)
            dz = g * p * (1.0 - t * t)
            if IS_BF16:
                tl.store(row_ptr + start + cols, to_bf16_rtne(dz), mask=mask)
            else:
                tl.store(row_ptr + start + cols, dz, mask=mask)


def triton_row_pass(z, targets, scale, losses, softcap, ignore_index, config=None):
    """The row pass of softcap_cross_entropy.chunked: losses[r] for every row of z, and dz over z
    when `scale` (fp32 per-row weights) is given."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    cfg = config or CONFIGS["cuda" if z.is_cuda else "cpu"]
    block = min(cfg["BLOCK"], triton.next_power_of_2(n_cols))
    compute_grad = scale is not None
    # one contiguous weight per row (a shared weight comes as a stride-0 view): the kernel has one
    # variant per dtype and pass, whatever the reduction
    scale = scale.contiguous() if compute_grad else losses  # losses: not read
    _softcap_ce_rows_kernel[(rows,)](
        z,
        z.stride(0),
        targets,
        scale,
        losses,
        n_cols,
        softcap,
        ignore_index,
        COMPUTE_GRAD=compute_grad,
        IS_BF16=z.dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=cfg["num_warps"],
    )
