"""
decode_block: one block of the seeds' GPT (model/gpt.py's Block) or of the windowed family
(model/windowed_gpt.py's WindowedBlock) for a decode step's rows, one new token each, from x [B, 1, C]:

    x = resid_lambda * x + x0_lambda * x0 (when x0 is given);  h = rms_norm(x)
    q, k, v = qkv(h) split;  v = v + 3 * sigmoid(h[..., :G] @ ve_gate^T) * ve (when ve is given)
    x = x + proj(decode_attention(q, k, v, ...));  h = rms_norm(x);  x = x + mlp_proj(relu(fc(h))^2)

qkv, proj, fc, mlp_proj: PackedLinear (qkv the query, key and value weights stacked); cos, sin, cache,
rows, positions, window, qk_scale as decode_attention takes them; the windowed family's x0 (B, 1, C),
scales (resid_lambda, x0_lambda), value embedding ve (B, 1, Hkv * D) and gate weight ve_gate (Hkv, G).
Backends:
    cpp        CPU, float32, packed weights: csrc/decode_block_cpu.cpp, the ops' kernels chained in
               C++, bitwise their result (but for the gate's sigmoid) in one dispatch a layer, not ~15.
    reference  the ops one after another (each on its own backend): anywhere.
"""

import torch
import torch.nn.functional as F

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
    x0=None,
    scales=(1.0, 0.0),
    ve=None,
    ve_gate=None,
    backend=None,
):
    """See the module docstring; `backend` forces one by name (default: NANOCHAT_FAST_KERNELS, else auto)."""
    packs = (qkv, proj, fc, mlp_proj)

    def why_not(name):
        if name != "cpp":
            return None
        if any(p.packed is None for p in packs):
            return "takes packed float32 weights (packed_linear's cpp backend), got unpacked ones"
        given = {"x0": x0, "ve": ve, "ve_gate": ve_gate}
        dtypes = {"x": x.dtype, "cache": cache.dtype} | {k: t.dtype for k, t in given.items() if t is not None}
        if any(d != torch.float32 for d in dtypes.values()):
            return "takes float32, got " + ", ".join(f"{name} {d}" for name, d in dtypes.items())
        return None

    impl = registry.select_for_inputs(OP, x.device.type, backend, why_not)
    windowed = (x0, *scales, ve, ve_gate)
    return impl.fn(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed)


@register_backend(OP, "cpp", cpp_why_not)
def _cpp(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed):
    scale = cache.size(-1) ** -0.5
    packed = (p.packed for p in packs)
    return torch.ops.nanochat_fast.decode_block(
        x, *packed, cos, sin, cache, rows, positions, n_head, window, qk_scale, scale, *windowed
    )


@register_backend(OP, "reference", always)
def _reference(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed):
    qkv, proj, fc, mlp_proj = packs
    x0, resid_lambda, x0_lambda, ve, ve_gate = windowed
    B, Hkv, D = x.size(0), cache.size(2), cache.size(-1)
    if x0 is not None:
        x = resid_lambda * x + x0_lambda * x0
    h = rms_norm(x)
    q, k, v = qkv(h).split((n_head * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = q.view(B, 1, n_head, D), k.view(B, 1, Hkv, D), v.view(B, 1, Hkv, D)
    if ve is not None:
        gate = 3 * torch.sigmoid(F.linear(h[..., : ve_gate.size(1)], ve_gate))
        v = v + (gate.unsqueeze(-1) * ve.view(B, 1, Hkv, D)).to(v.dtype)  # under autocast: the cache's dtype
    y = decode_attention(
        q, k, v, cos, sin, cache, rows, positions, qk_scale=qk_scale, window=window, enable_gqa=n_head != Hkv
    )
    x = x + proj(y)
    return x + mlp_proj(torch.relu(fc(rms_norm(x))).square())


if registry.extension() is not None:

    @torch.library.register_fake("nanochat_fast::decode_block")
    def _(
        x, qkv, proj, fc, mlp_proj, cos, sin, cache, rows, positions, n_head, window, qk_scale, scale,
        x0=None, resid_lambda=1.0, x0_lambda=0.0, ve=None, ve_gate=None,
    ):  # fmt: skip
        return torch.empty_like(x, memory_format=torch.contiguous_format)
