"""
softcap_cross_entropy: from the final hidden states and the lm_head weight to the loss, in chunks of
rows, never holding all N x V logits.

    loss = cross_entropy(softcap * tanh(hidden @ weight.T / softcap), targets, ignore_index, reduction)

hidden [N, d] and weight [V, d] are fp32 or bf16 (the same dtype; under autocast both are cast to the
autocast dtype, as nn.Linear would be); targets int64 [N]; reduction "mean" | "sum" | "none" (per-row
losses, 0 at ignored rows). Math is fp32 whatever the input dtype; gradients come back in the inputs'
dtypes. Backends: triton (CUDA: the row pass in softcap_cross_entropy_triton.py, matmuls cuBLAS), cpp
(CPU: csrc/softcap_cross_entropy_cpu.cpp), torch (the same loop in PyTorch ops), reference (full
logits and F.cross_entropy). How the chunked backends compute both gradients in the forward pass, and
their op schema: docs/measurements.md#fused-cross-entropy.
"""

import numbers
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_why_not, register_backend, register_op, triton_why_not

OP = "softcap_cross_entropy"
register_op(
    OP,
    auto_order={
        "cuda": ("triton", "torch", "reference"),
        "cpu": ("cpp", "torch", "reference"),
        "mps": ("torch", "reference"),
    },
)
REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float32, torch.bfloat16)

# Rows per chunk. What limits the chunk is the matmuls' efficiency: smaller chunks make smaller,
# slower matmuls, and a chunk bigger than needed for full speed only holds more logits. CPU: 1024
# rows, the smallest chunk that ran at full speed (32 MiB of fp32 logits at V=8192); CUDA: 4096
# rows keep the cuBLAS matmuls large (M = 4096) at 512 MiB of bf16 logits for a 64K vocabulary.
# The measurements: docs/measurements.md#cross-entropy-chunk-rows;
# benchmarks/bench_softcap_cross_entropy.py (test_chunk_rows) repeats them.
CHUNK_ROWS = {"cpu": 1024, "cuda": 4096, "mps": 1024}


def default_chunk_rows(n_rows: int, device_type: str) -> int:
    return max(1, min(n_rows, CHUNK_ROWS.get(device_type, 1024)))


def _check(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
    """ValueError naming the argument; only metadata is read (no host sync on a GPU)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, d], got shape {tuple(hidden.shape)}; flatten the batch first")
    if weight.dim() != 2 or weight.size(1) != hidden.size(1):
        raise ValueError(
            f"weight must be [V, d] with d = hidden.size(1) = {hidden.size(1)}, got shape {tuple(weight.shape)}"
        )
    if targets.dim() != 1 or targets.size(0) != hidden.size(0) or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 [N] with N = hidden.size(0) = {hidden.size(0)}, "
            f"got {targets.dtype} of shape {tuple(targets.shape)}"
        )
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be None (automatic) or an int >= 1, got {chunk_rows!r}")


def _check_dtypes(hidden, weight):
    if hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden and weight must both be float32 or both bfloat16 (outside autocast), "
            f"got hidden {hidden.dtype} and weight {weight.dtype}"
        )


def softcap_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float,
    ignore_index: int = -1,
    reduction: str = "mean",
    *,
    backend=None,
    chunk_rows=None,
):
    """cross_entropy(softcap * tanh(hidden @ weight.T / softcap), targets), differentiable w.r.t.
    hidden and weight. `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto);
    `chunk_rows` overrides the rows per chunk of the chunked backends."""
    _check(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows)
    device_type = hidden.device.type
    impl = registry.select(OP, device_type, backend)
    no_autocast = nullcontext()
    if torch.is_autocast_enabled(device_type):
        # what nn.Linear does under autocast: the matmul inputs in the autocast dtype (the cast is
        # differentiable, so fp32 master weights get fp32 gradients); inside, every tensor keeps its dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        no_autocast = torch.autocast(device_type, enabled=False)
    _check_dtypes(hidden, weight)
    with no_autocast:
        return impl.fn(hidden, weight, targets, float(softcap), ignore_index, reduction, chunk_rows)


# ---------------------------------------------------------------------------------------------
# backends: each takes (hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows)


@register_backend(OP, "reference", always)
def reference_backend(hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
    """The stock computation: all N x V logits in fp32, then F.cross_entropy."""
    logits = softcap * torch.tanh(F.linear(hidden, weight).float() / softcap)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


def _run_chunked_op(op, hidden, weight, targets, softcap, ignore_index, reduction, chunk_rows):
    """Call a chunked op: gradients in the forward pass for sum/mean when they will be needed."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    count = None
    grad_scale = None
    if reduction == "mean":
        count = (targets != ignore_index).sum()
    if need_grad and reduction != "none":
        grad_scale = 1.0 / count if reduction == "mean" else torch.ones((), device=hidden.device)
    rows = chunk_rows or default_chunk_rows(hidden.size(0), hidden.device.type)
    losses, total, _, _ = op(
        hidden.contiguous(), weight.contiguous(), targets.contiguous(), softcap, ignore_index, grad_scale, rows
    )
    if reduction == "none":
        return losses
    if reduction == "mean" and grad_scale is None:
        return total / count
    return total


def _chunked_backend(op_name):
    def run(*args):
        return _run_chunked_op(getattr(torch.ops.nanochat_fast, op_name), *args)

    return run


register_backend(OP, "cpp", cpp_why_not)(_chunked_backend("softcap_cross_entropy"))
register_backend(OP, "torch", always)(_chunked_backend("softcap_cross_entropy_torch"))
register_backend(OP, "triton", triton_why_not)(_chunked_backend("softcap_cross_entropy_triton"))


# ---------------------------------------------------------------------------------------------
# the chunk loop of the torch and triton ops (the cpp op runs the same loop in C++)


def chunked(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows, row_pass):
    """row_pass(z, targets, scale, losses, softcap, ignore_index) turns a chunk of logits z (in
    place) into dz when scale (per-row weights) is not None, and writes the rows' losses."""
    N, V = hidden.size(0), weight.size(0)
    losses = hidden.new_empty(N, dtype=torch.float32)
    buf = hidden.new_empty(min(chunk_rows, N), V)
    if grad_scale is None:
        dhidden, dweight, scale = hidden.new_empty(0), weight.new_empty(0), None
    else:
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad_scale.float().expand(N)
    for r0 in range(0, N, chunk_rows):
        r1 = min(r0 + chunk_rows, N)
        h, z = hidden[r0:r1], buf[: r1 - r0]
        torch.mm(h, weight.T, out=z)
        row_pass(z, targets[r0:r1], None if scale is None else scale[r0:r1], losses[r0:r1], softcap, ignore_index)
        if scale is not None:
            torch.mm(z, weight, out=dhidden[r0:r1])
            if z.dtype == torch.float32:
                dweight.addmm_(z.T, h)
            else:  # bf16 matmul (fp32 accumulation inside), summed over chunks in fp32
                dweight += z.T @ h
    if scale is None:
        return losses, losses.sum(), dhidden, dweight
    return losses, (losses * scale).sum(), dhidden, dweight.to(weight.dtype)


def torch_row_pass(z, targets, scale, losses, softcap, ignore_index):
    """The row pass in plain PyTorch ops (several passes over the chunk, fp32 temporaries)."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    t = torch.tanh(z.float() / softcap)
    logp = torch.log_softmax(t * softcap, dim=1)
    losses.copy_(torch.where(valid, -logp.gather(1, safe[:, None]).squeeze(1), 0.0))
    if scale is None:
        return
    p = logp.exp_()  # softmax
    p.scatter_add_(1, safe[:, None], -torch.ones_like(p[:, :1]))
    p.mul_(t.square_().neg_().add_(1.0))  # d softcap(z) / dz = 1 - tanh^2
    p.mul_(torch.where(valid, scale, 0.0)[:, None])
    z.copy_(p)


# ---------------------------------------------------------------------------------------------
# the Python-defined ops, and the fake and autograd registrations shared by all three


@torch.library.custom_op("nanochat_fast::softcap_cross_entropy_torch", mutates_args=())
def _torch_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float,
    ignore_index: int,
    grad_scale: torch.Tensor | None,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return chunked(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows, torch_row_pass)


@torch.library.custom_op("nanochat_fast::softcap_cross_entropy_triton", mutates_args=())
def _triton_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float,
    ignore_index: int,
    grad_scale: torch.Tensor | None,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .softcap_cross_entropy_triton import triton_row_pass  # imported late: TRITON_INTERPRET is read at import

    return chunked(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows, triton_row_pass)


def _fake(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows):
    losses = hidden.new_empty(hidden.size(0), dtype=torch.float32)
    total = hidden.new_empty((), dtype=torch.float32)
    if grad_scale is None:
        return losses, total, hidden.new_empty(0), weight.new_empty(0)
    return losses, total, torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows = inputs
    _, _, dhidden, dweight = output
    ctx.mark_non_differentiable(dhidden, dweight)
    ctx.set_materialize_grads(False)  # None for an unused output: tells "only total" from "losses too"
    ctx.args = (softcap, ignore_index, chunk_rows)
    ctx.save_for_backward(hidden, weight, targets, grad_scale, dhidden, dweight)


def _backward_of(op_name):
    def backward(ctx, g_losses, g_total, _g_dhidden, _g_dweight):
        hidden, weight, targets, grad_scale, dhidden, dweight = ctx.saved_tensors
        if g_losses is None and g_total is None:
            return (None,) * 7
        if g_losses is None and grad_scale is not None:
            dhidden, dweight = dhidden * g_total, dweight * g_total  # computed in the forward pass
        else:  # recompute, chunk by chunk, with per-row weights d(output)/d(losses_i)
            rows = 0.0 if g_losses is None else g_losses
            if g_total is not None:
                rows = rows + (g_total if grad_scale is None else g_total * grad_scale)
            rows = torch.as_tensor(rows, dtype=torch.float32, device=hidden.device)
            op = getattr(torch.ops.nanochat_fast, op_name)
            _, _, dhidden, dweight = op(hidden, weight, targets, *ctx.args[:2], rows, ctx.args[2])
        return (
            dhidden if ctx.needs_input_grad[0] else None,
            dweight if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
        )

    return backward


def _register(op_name):
    qualname = f"nanochat_fast::{op_name}"
    torch.library.register_fake(qualname)(_fake)
    torch.library.register_autograd(qualname, _backward_of(op_name), setup_context=_setup_context)


_register("softcap_cross_entropy_torch")
_register("softcap_cross_entropy_triton")
if registry._C is not None:
    _register("softcap_cross_entropy")
