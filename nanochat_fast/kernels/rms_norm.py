"""
rms_norm: the models' parameter-free RMSNorm over the last dimension, where no gradient is wanted
(decode steps, prefill, evaluation): x / sqrt(mean(x^2) + eps), eps float32's machine epsilon as
F.rms_norm's default.

Backends:
    cpp        CPU, float32, no autograd: csrc/rms_norm_cpu.cpp, one op where F.rms_norm runs a dozen
               (a decode step norms its one row of a few hundred floats twice a layer).
    reference  F.rms_norm: anywhere, any dtype, with autograd.
"""

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_takes_float32_without_grad, cpp_why_not, register_backend, register_op

OP = "rms_norm"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})
EPS = torch.finfo(torch.float32).eps


def rms_norm(x: torch.Tensor, *, backend=None) -> torch.Tensor:
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    impl = registry.select_for_inputs(OP, x.device.type, backend, cpp_takes_float32_without_grad(x))
    return impl.fn(x)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(x):
    return torch.ops.nanochat_fast.rms_norm(x, EPS)


@register_backend(OP, "reference", always)
def _reference(x):
    return F.rms_norm(x, (x.size(-1),))


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::rms_norm")
    def _(x, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
