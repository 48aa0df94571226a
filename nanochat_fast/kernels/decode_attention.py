"""
decode_attention: a decode step's attention. Row b's one query token attends to its own cached
entries only, read in place from a block of the continuous-batching cache:

    out[b] = softmax(q[b] @ keys[rows[b], :, s:lengths[b]].T * scale) @ values[rows[b], :, s:lengths[b]]

    q [B, H, 1, D] the rows' queries; keys, values [S, Hkv, L, D] views of the cache (any strides but
    the last); rows int64 [B] each query's slot within keys (distinct); lengths int64 [B] its valid
    entries, 1..L; starts int64 [B] or None (all 0) its first, s = starts[b] < lengths[b] (a sliding
    window's rows begin later) -> [B, H, 1, D], grouped-query attention when Hkv < H (enable_gqa)

Backends:
    cpp        CPU, float32: csrc/decode_attention_cpu.cpp. Each (row, head) reads only its own
               entries, once; a row's result does not depend on the other rows of the step.
    reference  SDPA over the whole block with a per-row mask (every row reads up to the longest
               row's length); anywhere, any dtype.
"""

import torch
import torch.nn.functional as F

from . import registry
from .registry import always, cpp_why_not, register_backend, register_op

OP = "decode_attention"
register_op(OP, auto_order={"cpu": ("cpp", "reference"), "cuda": ("reference",), "mps": ("reference",)})


def decode_attention(q, keys, values, rows, lengths, enable_gqa: bool = False, *, starts=None, backend=None):
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    if q.dim() != 4 or q.size(2) != 1 or keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(
            f"decode_attention takes q [B, H, 1, D] and keys, values [S, Hkv, L, D], got q "
            f"{tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}"
        )
    if keys.size(1) != q.size(1) and not enable_gqa:
        raise ValueError(f"{q.size(1)} query heads over {keys.size(1)} key heads needs enable_gqa=True")
    fp32 = all(t.dtype == torch.float32 for t in (q, keys, values))
    impl = registry.select_for_inputs(
        OP,
        q.device.type,
        backend,
        lambda name: f"takes float32, got q {q.dtype}, cache {keys.dtype}" if name == "cpp" and not fp32 else None,
    )
    return impl.fn(q, keys, values, rows, lengths, enable_gqa, starts)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(q, keys, values, rows, lengths, enable_gqa, starts):
    scale = q.size(-1) ** -0.5
    return torch.ops.nanochat_fast.decode_attention(q.squeeze(2), keys, values, rows, lengths, scale, starts).unsqueeze(
        2
    )


@register_backend(OP, "reference", always)
def _reference(q, keys, values, rows, lengths, enable_gqa, starts):
    """SDPA over the block: a slot no row uses gets an all-true mask row (its answer is computed
    and dropped) so that no softmax is over nothing; masked entries weigh exactly 0."""
    S, L = keys.size(0), keys.size(2)
    valid = torch.full((S,), L, dtype=torch.long, device=q.device).index_copy_(0, rows, lengths)
    cols = torch.arange(L, device=q.device)[None, :]
    mask = cols < valid[:, None]
    if starts is not None:
        mask &= cols >= torch.zeros(S, dtype=torch.long, device=q.device).index_copy_(0, rows, starts)[:, None]
    mask = mask.view(S, 1, 1, L)
    spread = q.new_zeros(S, *q.shape[1:]).index_copy_(0, rows, q)
    y = F.scaled_dot_product_attention(spread, keys, values, attn_mask=mask, enable_gqa=enable_gqa)
    return y.index_select(0, rows)


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::decode_attention")
    def _(q, keys, values, rows, lengths, scale, starts=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
