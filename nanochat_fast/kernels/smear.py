"""
smear_decode: the windowed family's smear (model/windowed_gpt.py) for a decode step's rows, one new
token each, from x [B, 1, C] and previous [slots, C], each slot's last input embedding:

    y = x + gate_lambda * sigmoid(x[..., :G] @ gate_weight^T) * previous[rows];  previous[rows] = x

row after row: a slot's several rows (a prompt's positions, consecutive and in order) each mix in the
row before it, and the slot keeps the last.

Backends:
    cpp        CPU, float32, no autograd: csrc/smear_cpu.cpp, one dispatch where torch takes ~10.
    reference  those ops in torch: anywhere, any dtype (previous stays float32).
"""

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_takes_float32_without_grad, cpp_why_not, register_backend, register_op

OP = "smear_decode"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})


def smear_decode(x, previous, rows, gate_weight, gate_lambda, *, backend=None):
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    impl = registry.select_for_inputs(OP, x.device.type, backend, cpp_takes_float32_without_grad(x))
    return impl.fn(x, previous, rows, gate_weight, gate_lambda)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(x, previous, rows, gate_weight, gate_lambda):
    return torch.ops.nanochat_fast.smear_decode(x, previous, rows, gate_weight, gate_lambda)


@register_backend(OP, "reference", always)
def _reference(x, previous, rows, gate_weight, gate_lambda):
    gate = gate_lambda.to(x.dtype) * torch.sigmoid(F.linear(x[..., : gate_weight.size(1)], gate_weight.to(x.dtype)))
    follows = torch.zeros_like(rows, dtype=torch.bool)  # the rows after the first of their slot
    follows[1:] = rows[1:] == rows[:-1]
    before = torch.where(follows[:, None, None], x.roll(1, 0), previous.index_select(0, rows)[:, None].to(x.dtype))
    last = torch.ones_like(follows)
    last[:-1] = ~follows[1:]
    previous[rows[last]] = x[last, -1].float()
    return x + gate * before


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::smear_decode")
    def _(x, previous, rows, gate_weight, gate_lambda):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
