"""
decode_attention: a decode step's attention, one new token per row, from the projections on. Row b's
query and key are rotated and QK-normed (times qk_scale), its key and value written at its position
p = positions[b] in slot rows[b] of the cache block, and its query attends to its own entries s..p,
read in place (s = max(0, p - window), 0 without a window):

    q [B, 1, H, D], k, v [B, 1, Hkv, D] as the projections made them; cos, sin [B, 1, 1, D/2] each
    row's rotary angles; cache [2, S, Hkv, L, D] one layer's keys and values of a block of slots (a
    view of the slot cache); rows int64 [B]; positions int64 [B] < L -> [B, 1, H * D]
Every key and value is written before any row attends: rows of one slot (a prompt's) see earlier ones.

Backends:
    cpp        CPU, float32: csrc/decode_attention_cpu.cpp, one call where PyTorch takes some forty
               small ops; each (row, head) reads only its own entries, once; a row's result does not
               depend on the other rows of the step.
    reference  those PyTorch ops and SDPA over each row's slot with a mask; anywhere, any dtype.
"""

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_why_not, register_backend, register_op

OP = "decode_attention"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})


def apply_rotary_emb(x, cos, sin):
    """Rotate channel pairs (i, i + d/2) of x (B, T, H, D) by the position's angles: the models'
    rotary embedding, defined here beside the kernel that reproduces it."""
    d = x.shape[3] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 tables; bf16 activations under autocast
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3)


def decode_attention(
    q, k, v, cos, sin, cache, rows, positions, *, qk_scale=1.0, window=None, enable_gqa=False, backend=None
):
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    if q.dim() != 4 or q.size(1) != 1 or k.dim() != 4 or k.shape != v.shape or cache.dim() != 5:
        raise ValueError(
            f"decode_attention takes q [B, 1, H, D], k, v [B, 1, Hkv, D] and cache [2, S, Hkv, L, D], got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(cache.shape)}"
        )
    if k.size(2) != q.size(2) and not enable_gqa:
        raise ValueError(f"{q.size(2)} query heads over {k.size(2)} key heads needs enable_gqa=True")
    impl = registry.select_for_inputs(
        OP,
        q.device.type,
        backend,
        lambda name: (
            f"takes float32, got q {q.dtype}, cache {cache.dtype}"
            if name == "cpp" and not q.dtype == k.dtype == v.dtype == cache.dtype == torch.float32
            else None
        ),
    )
    return impl.fn(q, k, v, cos, sin, cache, rows, positions, qk_scale, window)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(q, k, v, cos, sin, cache, rows, positions, qk_scale, window):
    scale = q.size(-1) ** -0.5
    return torch.ops.nanochat_fast.decode_attention(q, k, v, cos, sin, qk_scale, cache, rows, positions, window, scale)


def _rotate_and_norm(x, cos, sin, qk_scale):
    x = F.rms_norm(apply_rotary_emb(x, cos, sin), (x.size(-1),))
    return x * qk_scale if qk_scale != 1.0 else x


@register_backend(OP, "reference", always)
def _reference(q, k, v, cos, sin, cache, rows, positions, qk_scale, window):
    """SDPA of each row over its slot's entries, masked to its own s..p. Every key and value is
    written before any row attends, as the cpp kernel does."""
    B, _, H, D = q.shape
    q, k = _rotate_and_norm(q, cos, sin, qk_scale), _rotate_and_norm(k, cos, sin, qk_scale)
    keys, values = cache[0], cache[1]
    keys[rows, :, positions] = k[:, 0]
    values[rows, :, positions] = v[:, 0]
    cols = torch.arange(keys.size(2), device=q.device)[None, :]
    mask = cols <= positions[:, None]
    if window is not None:
        mask &= cols >= (positions - window).clamp_min(0)[:, None]
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys[rows], values[rows], attn_mask=mask[:, None, None], enable_gqa=H != k.size(2)
    )
    return y.transpose(1, 2).reshape(B, 1, H * D)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::decode_attention")
    def _(q, k, v, cos, sin, qk_scale, cache, rows, positions, window, scale):
        return q.new_empty(q.size(0), 1, q.size(2) * q.size(3))
