"""
A decode step's ops, where no gradient is wanted: few-row linears through a packed weight (packed_linear),
rms_norm, the logit softcap, the attention of one new token per row (decode_attention), a whole block
(decode_block) and the windowed family's smear (smear_decode). Each: cpp (CPU, float32; the C++ kernels of
csrc/decode_step.h, each row's result the same whatever rows share the call) or reference (the PyTorch ops,
anywhere). At one row an op is a few hundred floats: one dispatch where PyTorch takes many.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import registry

PACKED_LINEAR, RMS_NORM, SOFTCAP = "packed_linear", "rms_norm", "softcap"
DECODE_ATTENTION, DECODE_BLOCK, SMEAR_DECODE = "decode_attention", "decode_block", "smear_decode"
EPS = torch.finfo(torch.float32).eps  # rms_norm's, as F.rms_norm's default
# The most rows the cpp packed_linear takes: where it beat sgemm (benchmarks/bench_decode_step.py).
MAX_ROWS = 64
PANEL = 32  # output columns per panel of the packed layout (csrc/packed_linear_cpu.cpp)


def _float32_without_grad(x: torch.Tensor):
    """cpp_refuses for the ops whose cpp backend takes float32 without autograd."""
    if x.dtype != torch.float32 or x.requires_grad:
        return f"takes float32 without autograd, got {x.dtype}{' requiring grad' if x.requires_grad else ''}"
    return None


# -- packed_linear: y = x @ weight.T for a few rows of x, through a copy of the weight packed once: the cpp
# layout holds it in column panels (csrc/packed_linear_cpu.cpp). NANOCHAT_FAST_KERNELS=packed_linear=reference
# does without the copy (F.linear on the weight itself: GPUs, bf16, MPS).


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
    """`weight` ready for packed_linear with `backend` (default: NANOCHAT_FAST_KERNELS, else auto):
    x [..., in_features] -> packed(x) [..., out_features]; again after the weight changes."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D tensor [out_features, in_features], got "
            f"{getattr(weight, 'shape', type(weight).__name__)}"
        )

    def cpp_refuses():
        return f"takes float32 weights, got {weight.dtype}" if weight.dtype != torch.float32 else None

    return registry.select_for_inputs(PACKED_LINEAR, weight.device.type, backend, cpp_refuses).fn(weight.detach())


registry.register(PACKED_LINEAR, "cpp")(
    lambda w: PackedLinear(w, torch.ops.nanochat_fast.pack_linear_weight(w.contiguous()))
)
registry.register(PACKED_LINEAR, "reference")(lambda w: PackedLinear(w, None))


# -- rms_norm and softcap: x / sqrt(mean(x^2) + EPS) over the last dimension, and cap * tanh(x / cap) -----


def rms_norm(x: torch.Tensor, *, backend=None) -> torch.Tensor:
    """The models' parameter-free RMSNorm; `backend` forces one (default: NANOCHAT_FAST_KERNELS, else auto)."""
    return registry.select_for_inputs(RMS_NORM, x.device.type, backend, lambda: _float32_without_grad(x)).fn(x)


registry.register(RMS_NORM, "cpp")(lambda x: torch.ops.nanochat_fast.rms_norm(x, EPS))
registry.register(RMS_NORM, "reference")(lambda x: F.rms_norm(x, (x.size(-1),)))


def softcap(x: torch.Tensor, cap: float, *, backend=None) -> torch.Tensor:
    """The models' logit softcap (the cpp one a polynomial tanh, the fused cross-entropy's, relative
    error ~1e-7); `backend` forces one (default: NANOCHAT_FAST_KERNELS, else auto)."""
    return registry.select_for_inputs(SOFTCAP, x.device.type, backend, lambda: _float32_without_grad(x)).fn(x, cap)


registry.register(SOFTCAP, "cpp")(lambda x, cap: torch.ops.nanochat_fast.softcap(x, cap))
registry.register(SOFTCAP, "reference")(lambda x, cap: cap * torch.tanh(x / cap))


# -- decode_attention ---------------------------------------------------------------------------------


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
    """A decode step's attention from the projections on, one new token per row -> [B, 1, H * D]: q, k
    rotated and QK-normed, k and v written at positions[b] of slot rows[b] of the cache block, each query
    over its slot's entries up to its own (csrc/ops.cpp says it all). A slot's several rows see each other."""
    if q.dim() != 4 or q.size(1) != 1 or k.dim() != 4 or k.shape != v.shape or cache.dim() != 5:
        raise ValueError(
            f"decode_attention takes q [B, 1, H, D], k, v [B, 1, Hkv, D] and cache [2, S, Hkv, L, D], got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(cache.shape)}"
        )
    if k.size(2) != q.size(2) and not enable_gqa:
        raise ValueError(f"{q.size(2)} query heads over {k.size(2)} key heads needs enable_gqa=True")

    def cpp_refuses():
        if not q.dtype == k.dtype == v.dtype == cache.dtype == torch.float32:
            return f"takes float32, got q {q.dtype}, cache {cache.dtype}"
        return None

    impl = registry.select_for_inputs(DECODE_ATTENTION, q.device.type, backend, cpp_refuses)
    return impl.fn(q, k, v, cos, sin, cache, rows, positions, qk_scale, window)


@registry.register(DECODE_ATTENTION, "cpp")
def _attention_cpp(q, k, v, cos, sin, cache, rows, positions, qk_scale, window):
    scale = q.size(-1) ** -0.5
    return torch.ops.nanochat_fast.decode_attention(q, k, v, cos, sin, qk_scale, cache, rows, positions, window, scale)


@registry.register(DECODE_ATTENTION, "reference")
def _attention_reference(q, k, v, cos, sin, cache, rows, positions, qk_scale, window):
    """SDPA of each row over its slot's entries, masked to its own s..p."""
    B, _, H, D = q.shape
    q, k = (F.rms_norm(apply_rotary_emb(t, cos, sin), (D,)) for t in (q, k))
    if qk_scale != 1.0:
        q, k = q * qk_scale, k * qk_scale
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


# -- decode_block: one block of the `gpt` or the `windowed` family (the reference below says what it
# computes); the cpp backend chains the same kernels in C++, bitwise the ops' result but for the gate's sigmoid.


def decode_block(
    x, qkv, proj, fc, mlp_proj, cos, sin, cache, rows, positions, n_head, *, qk_scale=1.0, window=None,
    x0=None, scales=(1.0, 0.0), ve=None, ve_gate=None, backend=None,
):  # fmt: skip
    """x [B, 1, C] to the next residual stream. qkv, proj, fc, mlp_proj: PackedLinear (qkv the query, key
    and value weights stacked); cos ... qk_scale as decode_attention takes them; the windowed family's x0
    (B, 1, C), scales (resid_lambda, x0_lambda), value embedding ve (B, 1, Hkv * D) and gate ve_gate (Hkv, G)."""
    packs = (qkv, proj, fc, mlp_proj)

    def cpp_refuses():
        if any(p.packed is None for p in packs):
            return "takes packed float32 weights (packed_linear's cpp backend), got unpacked ones"
        given = {"x0": x0, "ve": ve, "ve_gate": ve_gate}
        dtypes = {"x": x.dtype, "cache": cache.dtype} | {k: t.dtype for k, t in given.items() if t is not None}
        if any(d != torch.float32 for d in dtypes.values()):
            return "takes float32, got " + ", ".join(f"{name} {d}" for name, d in dtypes.items())
        return None

    impl = registry.select_for_inputs(DECODE_BLOCK, x.device.type, backend, cpp_refuses)
    windowed = (x0, *scales, ve, ve_gate)
    return impl.fn(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed)


@registry.register(DECODE_BLOCK, "cpp")
def _block_cpp(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed):
    scale = cache.size(-1) ** -0.5
    packed = (p.packed for p in packs)
    return torch.ops.nanochat_fast.decode_block(
        x, *packed, cos, sin, cache, rows, positions, n_head, window, qk_scale, scale, *windowed
    )


@registry.register(DECODE_BLOCK, "reference")
def _block_reference(x, packs, cos, sin, cache, rows, positions, n_head, qk_scale, window, windowed):
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


# -- smear_decode: y = x + gate_lambda * sigmoid(x[..., :G] @ gate_weight^T) * previous[rows] --------------


def smear_decode(x, previous, rows, gate_weight, gate_lambda, *, backend=None):
    """The windowed family's smear for x [B, 1, C], one new token per row; previous [slots, C] holds each
    slot's last input embedding and gets x. Row after row: a slot's several rows (a prompt's positions,
    consecutive, in order) each mix in the row before. `backend` forces one by name."""
    impl = registry.select_for_inputs(SMEAR_DECODE, x.device.type, backend, lambda: _float32_without_grad(x))
    return impl.fn(x, previous, rows, gate_weight, gate_lambda)


registry.register(SMEAR_DECODE, "cpp")(lambda *args: torch.ops.nanochat_fast.smear_decode(*args))


@registry.register(SMEAR_DECODE, "reference")
def _smear_reference(x, previous, rows, gate_weight, gate_lambda):
    gate = gate_lambda.to(x.dtype) * torch.sigmoid(F.linear(x[..., : gate_weight.size(1)], gate_weight.to(x.dtype)))
    follows = torch.zeros_like(rows, dtype=torch.bool)  # the rows after the first of their slot
    follows[1:] = rows[1:] == rows[:-1]
    before = torch.where(follows[:, None, None], x.roll(1, 0), previous.index_select(0, rows)[:, None].to(x.dtype))
    last = torch.ones_like(follows)
    last[:-1] = ~follows[1:]
    previous[rows[last]] = x[last, -1].float()
    return x + gate * before


# -- the C++ ops' fake kernels, for torch.compile and opcheck --------------------------------------------
if registry.extension() is not None:

    def _like_x(x, *args, **kwargs):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    for _op in ("rms_norm", "softcap", "smear_decode", "decode_block"):
        torch.library.register_fake(f"nanochat_fast::{_op}")(_like_x)

    @torch.library.register_fake("nanochat_fast::decode_attention")
    def _(q, k, v, cos, sin, qk_scale, cache, rows, positions, window, scale):
        return q.new_empty(q.size(0), 1, q.size(2) * q.size(3))

    @torch.library.register_fake("nanochat_fast::pack_linear_weight")
    def _(weight):
        n, k = weight.shape
        return weight.new_empty(-(-n // PANEL), k, PANEL)

    @torch.library.register_fake("nanochat_fast::packed_linear")
    def _(x, packed, out_features):
        return x.new_empty(*x.shape[:-1], out_features)
