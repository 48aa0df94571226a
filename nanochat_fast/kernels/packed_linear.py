"""
packed_linear: y = x @ weight.T for a few rows of x (a decode step: one row per conversation),
through a copy of the weight packed once for the purpose.

    packed = pack_linear(weight)      # once per weight (and again after the weight changes)
    y = packed(x)                     # x [..., in_features] -> [..., out_features]

Backends:
    cpp        CPU, float32: csrc/packed_linear_cpu.cpp. The weight is stored in column panels and
               every row runs the same summation order, so a row's result is bitwise the same
               whatever other rows share the call (batch invariance), and faster than sgemm at these
               row counts (benchmarks/bench_decode_step.py).
    reference  F.linear on the weight itself, no copy: anywhere else (GPUs, where cuBLAS is already
               bound by reading the weight at these shapes; bf16 weights; MPS).
The packed copy costs one more copy of the weight; NANOCHAT_FAST_KERNELS=packed_linear=reference
does without it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_why_not, register_backend, register_op

OP = "packed_linear"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})

# The most rows the cpp backend takes: it measured faster than sgemm up to 64 rows, the most measured
# (benchmarks/bench_decode_step.py); a caller with more rows keeps F.linear.
MAX_ROWS = 64
PANEL = 32  # output columns per panel of the packed layout (csrc/packed_linear_cpu.cpp)


@dataclass(frozen=True)
class PackedLinear:
    """A weight [out_features, in_features] ready for few-row products. `packed` is the cpp
    backend's layout, None for the reference backend (which reads `weight` itself)."""

    weight: torch.Tensor
    packed: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.nanochat_fast.packed_linear(x, self.packed, self.weight.size(0))


def pack_linear(weight: torch.Tensor, backend: str | None = None) -> PackedLinear:
    """`weight` ready for packed_linear with `backend` (default: NANOCHAT_FAST_KERNELS, else auto).
    The cpp backend needs a float32 CPU weight; the reference backend takes any."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D tensor [out_features, in_features], got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )
    impl = registry.select_for_inputs(
        OP,
        weight.device.type,
        backend,
        lambda name: (
            f"takes float32 weights, got {weight.dtype}" if name == "cpp" and weight.dtype != torch.float32 else None
        ),
    )
    return impl.fn(weight.detach())


@register_backend(OP, "cpp", cpp_why_not)
def _pack_cpp(weight):
    return PackedLinear(weight, torch.ops.nanochat_fast.pack_linear_weight(weight.contiguous()))


@register_backend(OP, "reference", always)
def _pack_reference(weight):
    return PackedLinear(weight, None)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::pack_linear_weight")
    def _(weight):
        n, k = weight.shape
        return weight.new_empty(-(-n // PANEL), k, PANEL)

    @torch.library.register_fake("nanochat_fast::packed_linear")
    def _(x, packed, out_features):
        return x.new_empty(*x.shape[:-1], out_features)
