"""
softcap: the models' logit softcap, cap * tanh(x / cap), where no gradient is wanted (decode steps,
prefill, logits for evaluation and sampling).

Backends:
    cpp        CPU, float32, no autograd: csrc/softcap_cpu.cpp, one vectorised pass with a polynomial
               tanh (relative error ~1e-7, the fused cross-entropy's), where torch.tanh's libm-accurate
               one and the division and product around it cost a decode step three passes.
    reference  cap * torch.tanh(x / cap): anywhere, any dtype, with autograd.
"""

import torch

from . import registry
from .registry import always, cpp_takes_float32_without_grad, cpp_why_not, register_backend, register_op

OP = "softcap"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})


def softcap(x: torch.Tensor, cap: float, *, backend=None) -> torch.Tensor:
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    impl = registry.select_for_inputs(OP, x.device.type, backend, cpp_takes_float32_without_grad(x))
    return impl.fn(x, cap)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(x, cap):
    return torch.ops.nanochat_fast.softcap(x, cap)


@register_backend(OP, "reference", always)
def _reference(x, cap):
    return cap * torch.tanh(x / cap)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::softcap")
    def _(x, cap):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
