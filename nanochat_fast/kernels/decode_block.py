"""
decode_block: one block of the seeds' GPT (model/gpt.py's Block) or of the windowed family
(model/windowed_gpt.py's WindowedBlock) for a decode step's rows, one new token each, from x [B, 1, C]:

    h = rms_norm(x);  q, k, v = qkv(h) split;  v = v + v_extra (when given)
    x = x + proj(decode_attention(q, k, v, ...));  h = rms_norm(x);  x = x + mlp_proj(relu(fc(h))^2)

qkv, proj, fc, mlp_proj are PackedLinear (kernels/packed_linear.py; qkv the query, key and value
weights stacked); cos, sin, cache, rows, positions, window and qk_scale as decode_attention takes them;
v_extra (B, 1, Hkv, D): the windowed family's gated value embedding, made by its caller.

Backends:
    cpp        CPU, float32, packed weights: csrc/decode_block_cpu.cpp, the same kernels as the ops
               chained in C++, bitwise their result with one dispatch a layer where they take ~15.
    reference  the ops one after another (each on its own backend): anywhere.
"""

import torch

from . import registry
from .decode_attention import decode_attention
from .registry import always, cpp_why_not, register_backend, register_op
from .rms_norm import rms_norm

OP = "decode_block"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})


def decode_block(
    x,
    qkv,
    proj,
    fc,
    mlp_proj,
    cos,
    sin,
    cache,
    rows,
    positions,
    n_head,
    *,
    qk_scale=1.0,
    window=None,
    v_extra=None,
    backend=None,
):
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    packs = (qkv, proj, fc, mlp_proj)

    def why_not(name):
        if name != "cpp":
            return None
        if any(p.packed is None for p in packs):
            return "takes packed float32 weights (packed_linear's cpp backend), got unpacked ones"
        dtypes = {"x": x.dtype, "cache": cache.dtype} | ({} if v_extra is None else {"v_extra": v_extra.dtype})
        if any(d != torch.float32 for d in dtypes.values()):
            return "takes float32, got " + ", ".join(f"{name} {d}" for name, d in dtypes.items())
        return None

    impl = registry.select_for_inputs(OP, x.device.type, backend, why_not)
    return impl.fn(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, v_extra)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, v_extra):
    scale = cache.size(-1) ** -0.5
    packed = (p.packed for p in packs)
    return torch.ops.nanochat_fast.decode_block(
        x, *packed, cos, sin, cache, rows, positions, n_head, window, qk_scale, scale, v_extra
    )


@register_backend(OP, "reference", always)
def _reference(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, v_extra):
    qkv, proj, fc, mlp_proj = packs
    B, Hkv, D = x.size(0), cache.size(2), cache.size(-1)
    q, k, v = qkv(rms_norm(x)).split((n_head * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = q.view(B, 1, n_head, D), k.view(B, 1, Hkv, D), v.view(B, 1, Hkv, D)
    if v_extra is not None:
        v = v + v_extra.view(B, 1, Hkv, D)
    y = decode_attention(
        q, k, v, cos, sin, cache, rows, positions, qk_scale=qk_scale, window=window, enable_gqa=n_head != Hkv
    )
    x = x + proj(y)
    return x + mlp_proj(torch.relu(fc(rms_norm(x))).square())


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::decode_block")
    def _(x, qkv, proj, fc, mlp_proj, cos, sin, cache, rows, positions, n_head, window, qk_scale, scale, v_extra=None):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
