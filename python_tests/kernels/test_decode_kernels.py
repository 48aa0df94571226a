"""The decode step's kernels, packed_linear, decode_attention, rms_norm, softcap, smear_decode and
decode_block: each against float64 PyTorch, the batch invariance they promise (a row's result
bitwise the same alone as in any batch), the op contracts (opcheck, bad arguments), and the engine
running its decode steps through them: packs follow weight updates, and a model's decode logits for
a row do not depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F
from support.stub_models import byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)
from support.tiny_gpt import random_model

from nanochat_fast import optim
from nanochat_fast.kernels import registry
from nanochat_fast.kernels.decode_step import (
    decode_attention,
    decode_block,
    pack_linear,
    rms_norm,
    smear_decode,
    softcap,
)
from nanochat_fast.model import decode
from nanochat_fast.model.batch_engine import BatchEngine, Request
from nanochat_fast.model.decode import SlotBatch, SlotCache, SlotPrefill
from nanochat_fast.model.gpt import GPTConfig

pytestmark = pytest.mark.skipif(registry.extension() is None, reason="extension not built")
ops = torch.ops.nanochat_fast


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- packed_linear ----------------------------------------------------------------------------------

# (rows, in_features, out_features): row counts around the 8-row tile, K around the 64-wide k
# block, N around the 32-column panel
SHAPES = [(1, 256, 1024), (3, 63, 33), (8, 64, 32), (9, 65, 100), (17, 1000, 31), (64, 256, 520), (0, 16, 8)]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_packed_linear_matches_float64(rows, k, n):
    x, w = randn(rows, k, seed=1), randn(n, k, seed=2) / k**0.5
    y = pack_linear(w, backend="cpp")(x)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # error of fp32 sums of k products of size ~1/sqrt(k): F.linear's own is the same order
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * max(1, k / 64))
    assert torch.equal(pack_linear(w, backend="reference")(x), F.linear(x, w))


def test_packed_linear_rows_do_not_depend_on_the_batch():
    w = randn(100, 300, seed=3)
    packed = pack_linear(w, backend="cpp")
    x = randn(20, 300, seed=4)
    for rows in (1, 2, 7, 8, 9, 16, 20):
        batch = packed(x[:rows])
        for i in range(rows):
            assert torch.equal(batch[i], packed(x[i : i + 1])[0]), (rows, i)


def test_packed_linear_keeps_leading_dims_and_refuses_bad_input():
    w = randn(40, 16)
    packed = pack_linear(w, backend="cpp")
    x = randn(3, 1, 16)
    assert torch.equal(packed(x), packed(x.view(3, 16)).view(3, 1, 40))
    with pytest.raises(ValueError, match="float32"):
        pack_linear(w.bfloat16(), backend="cpp")
    assert pack_linear(w.bfloat16()).packed is None  # auto: the reference backend takes bf16
    with pytest.raises(ValueError, match="2-D"):
        pack_linear(randn(4))
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.packed_linear(randn(2, 16), packed.packed, 65)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.packed_linear(randn(2, 16).double(), packed.packed, 40)


def test_packed_linear_ops_pass_opcheck():
    w = randn(70, 24)
    torch.library.opcheck(ops.pack_linear_weight.default, (w,))
    torch.library.opcheck(ops.packed_linear.default, (randn(5, 24), ops.pack_linear_weight(w), 70))


# -- decode_attention -------------------------------------------------------------------------------


def attention_case(heads=4, kv_heads=2, slots=4, max_len=40, d=16, seed=0):
    """A block of `slots` slots; the step's rows in slots 0, 1 and 3 (a gap at 2) with their new
    tokens at positions 0, 39 and 16: the projections q, k, v, rotary angles, the cache block."""
    B = 3
    cache = randn(2, slots, kv_heads, max_len, d, seed=seed)
    rows, positions = torch.tensor([0, 1, 3]), torch.tensor([0, 39, 16])
    q, k, v = (randn(B, 1, h, d, seed=seed + i) for i, h in enumerate((heads, kv_heads, kv_heads), start=1))
    angles = randn(B, 1, 1, d // 2, seed=seed + 4) * 3
    return q, k, v, angles.cos(), angles.sin(), cache, rows, positions


def float64_attention(q, k, v, cos, sin, cache, rows, positions, qk_scale=1.0, window=None):
    """Each row alone in float64: rotary by hand, RMS norm, its key and value written, SDPA over
    exactly its own entries. -> (output (B, 1, H * D), the cache after the writes)."""
    q, k, v, cos, sin, cache = (t.double() for t in (q, k, v, cos, sin, cache.clone()))

    def rotate_and_norm(x):  # (1, H, D) with the row's (1, 1, D/2) angles
        h = x.size(-1) // 2
        x = torch.cat([x[..., :h] * c + x[..., h:] * s_, -x[..., :h] * s_ + x[..., h:] * c], -1)
        return qk_scale * x / (x.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps).sqrt()

    out = []
    for b, (r, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        c, s_ = cos[b, 0], sin[b, 0]
        cache[0, r, :, p], cache[1, r, :, p] = rotate_and_norm(k[b])[0], v[b, 0]
        start = 0 if window is None else max(0, p - window)
        keys, values = cache[0, r : r + 1, :, start : p + 1], cache[1, r : r + 1, :, start : p + 1]
        y = F.scaled_dot_product_attention(rotate_and_norm(q[b]).transpose(0, 1)[None], keys, values, enable_gqa=True)
        out.append(y[0].transpose(0, 1).reshape(1, 1, -1))
    return torch.cat(out), cache


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize(
    "heads,kv_heads,qk_scale,window,d",
    [(4, 2, 1.0, None, 16), (2, 2, 1.2, None, 16), (3, 1, 1.0, 10, 16), (2, 1, 1.0, None, 44), (2, 2, 30.0, None, 16)],
)
def test_decode_attention_matches_float64(backend, heads, kv_heads, qk_scale, window, d):
    """Rotary, QK-norm (times qk_scale), the new keys and values written at each row's position, each
    row over its own entries (with a window, from position - window: rows 1 and 2 then start at 29
    and 6): all as float64 does it; the cache's other entries untouched. d = 44: a head of whole
    vectors and a few floats more (the kernel's tails); qk_scale 30: queries 30x longer, scores spread over
    ~100, some softmax weights below float32's range (the bounds grow with the scores' size)."""
    q, k, v, cos, sin, cache, rows, positions = attention_case(heads, kv_heads, d=d)
    expected, expected_cache = float64_attention(q, k, v, cos, sin, cache, rows, positions, qk_scale, window)
    y = decode_attention(
        q, k, v, cos, sin, cache, rows, positions, qk_scale=qk_scale, window=window, enable_gqa=heads != kv_heads,
        backend=backend,
    )  # fmt: skip
    assert y.shape == (3, 1, heads * d) and y.dtype == torch.float32
    assert (y.double() - expected).abs().max() < 1e-5 * qk_scale
    assert (cache.double() - expected_cache).abs().max() < 1e-5 * qk_scale


def test_decode_attention_window_counts():
    q, k, v, cos, sin, cache, rows, positions = attention_case()
    args = (q, k, v, cos, sin)
    whole = decode_attention(*args, cache.clone(), rows, positions, enable_gqa=True, backend="cpp")
    windowed = decode_attention(*args, cache.clone(), rows, positions, window=10, enable_gqa=True, backend="cpp")
    assert torch.equal(whole[0], windowed[0]) and not torch.allclose(whole[1:], windowed[1:])


def test_decode_attention_rows_do_not_depend_on_the_batch():
    q, k, v, cos, sin, cache, rows, positions = attention_case()
    together = decode_attention(q, k, v, cos, sin, cache.clone(), rows, positions, enable_gqa=True, backend="cpp")
    for b in range(len(rows)):
        one = slice(b, b + 1)
        alone = decode_attention(
            q[one], k[one], v[one], cos[one], sin[one], cache.clone(), rows[one], positions[one], enable_gqa=True,
            backend="cpp",
        )  # fmt: skip
        assert torch.equal(together[b], alone[0]), b


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("window", [None, 2])
def test_a_prompts_rows_in_one_slot_see_the_rows_before_them(backend, window):
    """A prompt's tokens as rows of one slot (slot 2, positions 0..4) beside two decoding rows: each
    row over its slot's entries up to its own, the earlier rows' keys written in the same call
    included, as float64 row after row; and bitwise the rows given one call each, in order."""
    rows, positions = torch.tensor([0, 2, 2, 2, 2, 2, 3]), torch.tensor([12, 0, 1, 2, 3, 4, 5])
    B, cache = len(rows), randn(2, 4, 2, 40, 16, seed=40)
    q, k, v = (randn(B, 1, h, 16, seed=41 + i) for i, h in enumerate((4, 2, 2)))
    angles = randn(B, 1, 1, 8, seed=44) * 3
    args = (q, k, v, angles.cos(), angles.sin())
    expected, expected_cache = float64_attention(*args, cache, rows, positions, window=window)
    together = cache.clone()
    y = decode_attention(*args, together, rows, positions, window=window, enable_gqa=True, backend=backend)
    assert (y.double() - expected).abs().max() < 1e-5 and (together.double() - expected_cache).abs().max() < 1e-5
    one_by_one = cache.clone()
    for b in range(B if backend == "cpp" else 0):  # the reference's SDPA blocks by shape: not bitwise
        one = [t[b : b + 1] for t in args]
        alone = decode_attention(*one, one_by_one, rows[b : b + 1], positions[b : b + 1], window=window,
                                 enable_gqa=True, backend=backend)  # fmt: skip
        assert torch.equal(y[b], alone[0]), b


def test_decode_attention_refuses_bad_input():
    q, k, v, cos, sin, cache, rows, positions = attention_case()

    def op(rows=rows, positions=positions, window=None):
        ops.decode_attention(q, k, v, cos, sin, 1.0, cache, rows, positions, window, 0.25)

    with pytest.raises(RuntimeError, match=r"positions\[1\] = 40 is outside \[0, 40\)"):
        op(positions=torch.tensor([0, 40, 2]))
    with pytest.raises(RuntimeError, match=r"rows\[0\] = 4 is outside \[0, 4\)"):
        op(rows=torch.tensor([4, 1, 2]))
    with pytest.raises(RuntimeError, match=r"rows\[0\] and rows\[2\] both write position 0 of slot 1"):
        op(rows=torch.tensor([1, 0, 1]), positions=torch.tensor([0, 5, 0]))
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        op(window=-1)
    with pytest.raises(ValueError, match="enable_gqa"):
        decode_attention(q, k, v, cos, sin, cache, rows, positions)
    with pytest.raises(ValueError, match="float32"):
        bf16 = (t.bfloat16() for t in (q, k, v))
        decode_attention(*bf16, cos, sin, cache.bfloat16(), rows, positions, enable_gqa=True, backend="cpp")


def test_decode_attention_op_passes_opcheck():
    q, k, v, cos, sin, cache, rows, positions = attention_case()
    for window in (None, 10):
        args = (q, k, v, cos, sin, 1.2, cache, rows, positions, window, 0.25)
        torch.library.opcheck(ops.decode_attention.default, args)


# -- decode_block -----------------------------------------------------------------------------------


def block_case(heads=4, kv_heads=2, d=16, hidden=96, seed=10):
    """decode_attention's case (rows in slots 0, 1, 3 at positions 0, 39, 16) with a residual stream
    of C = heads * d and a block's four weights, packed (qkv stacked)."""
    _, _, _, cos, sin, cache, rows, positions = attention_case(heads, kv_heads, seed=seed)
    C = heads * d
    x = randn(3, 1, C, seed=seed + 5)
    shapes = [((heads + 2 * kv_heads) * d, C), (C, heads * d), (hidden, C), (C, hidden)]
    weights = [randn(*shape, seed=seed + 6 + i) / shape[1] ** 0.5 for i, shape in enumerate(shapes)]
    return x, weights, cos, sin, cache, rows, positions


def windowed_parts(x, kv_heads, d=16, gate_channels=12, seed=30):
    """The windowed family's arguments for block_case's x: a block input x0, per-layer scalars, a
    value embedding and its gate's weight (gate logits of a few units: sigmoids far from 0 and 1)."""
    ve_gate = randn(kv_heads, gate_channels, seed=seed + 2) / gate_channels**0.5
    return dict(
        x0=randn(*x.shape, seed=seed), scales=(0.9, 0.2), ve=randn(3, 1, kv_heads * d, seed=seed + 1), ve_gate=ve_gate
    )


@pytest.mark.parametrize(
    "heads,kv_heads,qk_scale,window,windowed", [(4, 2, 1.0, None, False), (2, 2, 1.2, 10, False), (4, 2, 1.2, 10, True)]
)
def test_decode_block_is_its_ops_one_after_another(heads, kv_heads, qk_scale, window, windowed):
    """The C++ block chains the same kernels as the ops: bitwise their result one after another
    (the reference backend, each op on its cpp backend), the cache written the same; and within
    float32 rounding of the same block computed from float64 ops. windowed: the windowed family's
    per-layer blend with x0 and gated value embedding, bitwise too without the gate (its sigmoid is
    std::exp's, not torch's), within float32 rounding with it."""
    x, weights, cos, sin, cache, rows, positions = block_case(heads, kv_heads)
    parts = windowed_parts(x, kv_heads) if windowed else {}
    packed = [pack_linear(w, backend="cpp") for w in weights]

    def run(cache, backend, **kw):
        return decode_block(
            x, *packed, cos, sin, cache, rows, positions, heads, qk_scale=qk_scale, window=window, **kw, backend=backend
        )

    blend = {k: v for k, v in parts.items() if k in ("x0", "scales")}
    fused_cache, ops_cache = cache.clone(), cache.clone()
    fused, ops_one_by_one = run(fused_cache, "cpp", **blend), run(ops_cache, "reference", **blend)
    assert fused.shape == x.shape and torch.equal(fused, ops_one_by_one) and torch.equal(fused_cache, ops_cache)
    fused_cache, ops_cache, f64_cache = cache.clone(), cache.clone(), cache.double()
    fused, ops_one_by_one = run(fused_cache, "cpp", **parts), run(ops_cache, "reference", **parts)
    f64 = decode_block(  # float64: every op's auto choice is its reference backend
        x.double(), *[pack_linear(w.double()) for w in weights], cos.double(), sin.double(), f64_cache,
        rows, positions, heads, qk_scale=qk_scale, window=window,
        **{k: v.double() if torch.is_tensor(v) else v for k, v in parts.items()},
    )  # fmt: skip
    for got in (fused, ops_one_by_one):
        assert (got.double() - f64).abs().max() < 1e-5
    for got in (fused_cache, ops_cache):
        assert (got.double() - f64_cache).abs().max() < 1e-5
    if windowed:  # each part changes the block: none is ignored
        for without in ("x0", "ve"):
            less = {k: v for k, v in parts.items() if not k.startswith(without)}
            assert (run(cache.clone(), "cpp", **less) - f64).abs().max() > 1e-3, without


def test_decode_block_keeps_a_nan_from_the_mlp_as_its_ops_do():
    """A NaN out of the MLP's first product stays NaN through relu-then-square (F.relu(NaN) is NaN),
    so the block's output is NaN where the ops' is."""
    x, weights, cos, sin, cache, rows, positions = block_case()
    weights[2][5, 7] = float("nan")  # hidden unit 5 is NaN for every row
    packed = [pack_linear(w, backend="cpp") for w in weights]
    out = {
        backend: decode_block(x, *packed, cos, sin, cache.clone(), rows, positions, 4, backend=backend)
        for backend in ("cpp", "reference")
    }
    assert out["reference"].isnan().all()  # unit 5 reaches every output through the MLP's last product
    assert torch.equal(out["cpp"].isnan(), out["reference"].isnan())


def test_decode_block_rows_do_not_depend_on_the_batch_and_refuses_bad_input():
    x, weights, cos, sin, cache, rows, positions = block_case()
    packed = [pack_linear(w, backend="cpp") for w in weights]
    together = decode_block(x, *packed, cos, sin, cache.clone(), rows, positions, 4)
    for b in range(3):
        one = slice(b, b + 1)
        alone = decode_block(x[one], *packed, cos[one], sin[one], cache.clone(), rows[one], positions[one], 4)
        assert torch.equal(together[b], alone[0]), b
    raw = [p.packed for p in packed]
    with pytest.raises(RuntimeError, match=r"qkv must be pack_linear_weight's"):
        ops.decode_block(x, raw[1], *raw[1:], cos, sin, cache, rows, positions, 4, None, 1.0, 0.25)
    with pytest.raises(RuntimeError, match=r"decode_block: positions\[1\] = 40 is outside"):
        ops.decode_block(x, *raw, cos, sin, cache, rows, torch.tensor([0, 40, 2]), 4, None, 1.0, 0.25)
    with pytest.raises(ValueError, match="packed float32 weights"):
        decode_block(
            x,
            *[pack_linear(w, backend="reference") for w in weights],
            cos,
            sin,
            cache,
            rows,
            positions,
            4,
            backend="cpp",
        )
    parts = windowed_parts(x, 2)
    windowed = (parts["x0"], *parts["scales"], parts["ve"], parts["ve_gate"])
    base = (x, *raw, cos, sin, cache, rows, positions, 4, None, 1.0, 0.25)
    with pytest.raises(RuntimeError, match=r"x0 must be float32 \[3, 1, 64\], got Float \[3, 1, 32\]"):
        ops.decode_block(*base, randn(3, 1, 32))
    with pytest.raises(RuntimeError, match=r"ve must be float32 \[3, 1, 32\], got BFloat16"):
        ops.decode_block(*base, *windowed[:3], parts["ve"].bfloat16(), parts["ve_gate"])
    with pytest.raises(RuntimeError, match=r"ve_gate must be float32 \[2, G <= 64\], got Float \[3, 12\]"):
        ops.decode_block(*base, *windowed[:4], randn(3, 12))
    with pytest.raises(RuntimeError, match="ve and ve_gate come together"):
        ops.decode_block(*base, *windowed[:4])
    torch.library.opcheck(ops.decode_block.default, (x, *raw, cos, sin, cache, rows, positions, 4, 10, 1.2, 0.25))
    torch.library.opcheck(
        ops.decode_block.default, (x, *raw, cos, sin, cache, rows, positions, 4, 10, 1.2, 0.25, *windowed)
    )


# -- rms_norm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 64), (4096, 32), (7,)])
def test_rms_norm_matches_float64_and_f_rms_norm(shape):
    x = randn(*shape, seed=6) * 3
    y = rms_norm(x, backend="cpp")
    ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps).sqrt()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y.double() - ref).abs().max() < 1e-6
    torch.testing.assert_close(y, F.rms_norm(x, (x.size(-1),)))
    assert torch.equal(rms_norm(x, backend="reference"), F.rms_norm(x, (x.size(-1),)))


def test_rms_norm_rows_do_not_depend_on_the_batch_and_refuses_what_it_cannot_take():
    x = randn(4096, 64, seed=7)  # enough rows for both threads
    together = rms_norm(x, backend="cpp")
    assert all(torch.equal(together[i], rms_norm(x[i : i + 1], backend="cpp")[0]) for i in (0, 2047, 4095))
    w = x[:2].clone().requires_grad_()
    with pytest.raises(ValueError, match="requiring grad"):
        rms_norm(w, backend="cpp")
    assert rms_norm(w).requires_grad  # auto: the reference backend, with autograd
    with pytest.raises(ValueError, match="float32"):
        rms_norm(x.bfloat16(), backend="cpp")
    torch.library.opcheck(ops.rms_norm.default, (randn(3, 5, 8), 1e-6))


# -- softcap ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4096), (8, 1, 4096), (3, 77), (5,)])
def test_softcap_matches_float64(shape):
    """cap * tanh(x / cap) on logits from ~0 (the polynomial branch of the tanh) to far past the
    cap (the saturated one), and +-inf; within a few float32 roundings of the cap."""
    x = randn(*shape, seed=8) * 40
    x.view(-1)[:3] = torch.tensor([1e-3, float("inf"), -float("inf")])[: x.numel()]
    y = softcap(x, 15.0, backend="cpp")
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y.double() - 15.0 * torch.tanh(x.double() / 15.0)).abs().max() < 4e-6  # 15 x ~2^-22
    assert torch.equal(softcap(x, 15.0, backend="reference"), 15.0 * torch.tanh(x / 15.0))


def test_softcap_rows_do_not_depend_on_the_batch_and_refuses_what_it_cannot_take():
    x = randn(64, 4096, seed=9) * 20  # 256K values: both threads
    together = softcap(x, 15.0, backend="cpp")
    assert all(torch.equal(together[i], softcap(x[i : i + 1], 15.0, backend="cpp")[0]) for i in (0, 31, 63))
    w = x[:2].clone().requires_grad_()
    with pytest.raises(ValueError, match="requiring grad"):
        softcap(w, 15.0, backend="cpp")
    assert softcap(w, 15.0).requires_grad  # auto: the reference backend, with autograd
    with pytest.raises(ValueError, match="float32"):
        softcap(x.bfloat16(), 15.0, backend="cpp")
    with pytest.raises(RuntimeError, match="cap must be > 0"):
        ops.softcap(x, 0.0)
    torch.library.opcheck(ops.softcap.default, (randn(3, 5, 8), 15.0))


# -- smear_decode -----------------------------------------------------------------------------------


def smear_float64(x, previous, rows, w, lam):
    gate = lam.double() * torch.sigmoid(x.double()[..., : w.size(1)] @ w.double().T)
    return x.double() + gate * previous.double()[rows][:, None]


def test_smear_decode_matches_float64_and_keeps_each_rows_embedding():
    x, previous = randn(3, 1, 64, seed=10), randn(5, 64, seed=11)
    rows, w, lam = torch.tensor([4, 0, 2]), randn(1, 24, seed=12) * 0.2, torch.tensor([0.7])
    expected = smear_float64(x, previous, rows, w, lam)
    kept = previous.clone()
    kept[rows] = x[:, 0]  # each row's slot then holds its embedding; the other slots are untouched
    for backend in ("cpp", "reference"):
        p = previous.clone()
        y = smear_decode(x, p, rows, w, lam, backend=backend)
        assert y.shape == x.shape and (y.double() - expected).abs().max() < 2e-6, backend
        assert torch.equal(p, kept), backend


def test_smear_decode_rows_of_one_slot_mix_in_the_row_before():
    """A prompt's tokens as rows of one slot (slot 3, three rows from its first position, which
    starts from a zero embedding): each mixes in the row before it, and the slot keeps the last."""
    x, previous = randn(5, 1, 64, seed=16), randn(5, 64, seed=17)
    previous[3] = 0.0
    rows, w, lam = torch.tensor([1, 3, 3, 3, 4]), randn(1, 24, seed=18) * 0.2, torch.tensor([0.7])
    before = torch.stack([previous[1], previous[3], x[1, 0], x[2, 0], previous[4]])
    expected = smear_float64(x, before, torch.arange(5), w, lam)
    kept = previous.clone()
    kept[[1, 3, 4]] = x[[0, 3, 4], 0]
    for backend in ("cpp", "reference"):
        p = previous.clone()
        y = smear_decode(x, p, rows, w, lam, backend=backend)
        assert (y.double() - expected).abs().max() < 2e-6 and torch.equal(p, kept), backend


def test_smear_decode_rows_do_not_depend_on_the_batch_and_refuses_bad_input():
    x, previous = randn(8, 1, 64, seed=13), randn(8, 64, seed=14)
    rows, w, lam = torch.arange(8).flip(0), randn(1, 24, seed=15), torch.tensor([0.5])
    together = smear_decode(x, previous.clone(), rows, w, lam, backend="cpp")
    for i in (0, 5, 7):
        alone = smear_decode(x[i : i + 1], previous.clone(), rows[i : i + 1], w, lam, backend="cpp")
        assert torch.equal(together[i], alone[0])
    with pytest.raises(RuntimeError, match=r"rows\[0\] = 8 is not a slot in \[0, 8\)"):
        ops.smear_decode(x[:1], previous, torch.tensor([8]), w, lam)
    with pytest.raises(RuntimeError, match="previous must be contiguous float32"):
        ops.smear_decode(x, previous.double(), rows, w, lam)
    with pytest.raises(ValueError, match="float32"):
        smear_decode(x.bfloat16(), previous, rows, w, lam, backend="cpp")
    torch.library.opcheck(ops.smear_decode.default, (x, previous.clone(), rows, w, lam))


# -- the engine's decode steps ----------------------------------------------------------------------

tok = byte_tokenizer()
CONFIG = GPTConfig(sequence_len=96, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


@pytest.fixture
def model():
    return random_model(CONFIG, seed=5).eval()


def packs_seen(model, run) -> list[bool]:
    """Per forward inside run(): whether its products (the lm_head's among them) ran through packed weights."""
    seen, real = [], decode.packed_linears

    def recorded(model, rows):
        packs = seen[-1] = real(model, rows)
        return packs

    hook = model.register_forward_pre_hook(lambda module, args: seen.append(None))
    decode.packed_linears = recorded
    try:
        run()
    finally:
        hook.remove()
        decode.packed_linears = real
    return [packs is not None for packs in seen]


def generate(model, prompt, n=6) -> list[int]:
    engine = BatchEngine(model, tok, slots=2)
    [row] = engine.add(Request(prompt, n, use_tools=False))
    while engine.active:
        engine.step()
    return row.tokens


def greedy_by_full_forwards(model, prompt, n=6) -> list[int]:
    """Greedy tokens from forwards over the whole sequence: no cache, no packs."""
    tokens = []
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([prompt + tokens]))[0, -1].argmax()))
    return tokens


def test_decode_steps_run_packed_and_follow_weight_updates(model):
    prompt = tok.encode("hello there", prepend="<|bos|>")
    seen = packs_seen(model, lambda: generate(model, prompt))
    assert seen == [True] * 6  # every decode step packed, and the prefill of a prompt of a few tokens
    # in-place ops on the parameters themselves: the next decode must see them
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
        model.transformer.h[0].mlp.c_fc.weight.add_(0.5)
    assert generate(model, prompt) == greedy_by_full_forwards(model, prompt)
    # our optimizers write through p.data and mark the parameters updated: their steps must be
    # seen too, driven as the training loop drives them (optim.step: clipping) or one by one
    optimizers = model.setup_optimizers(unembedding_lr=0.5, matrix_lr=0.5)
    drivers = [lambda: optim.step(optimizers, grad_clip=1.0), lambda: [opt.step() for opt in optimizers]]
    for drive in drivers:
        before = generate(model, prompt)
        ids = torch.tensor([prompt + before])
        model(ids[:, :-1], targets=ids[:, 1:]).backward()
        drive()
        model.zero_grad(set_to_none=True)
        after = generate(model, prompt)
        assert after == greedy_by_full_forwards(model, prompt) and after != before
    # under bf16 autocast (a CPU whose bf16 is fast) the stock bf16 matmuls run instead
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packs_seen(model, lambda: generate(model, prompt)) == [False] * 6


def test_a_rows_decode_logits_do_not_depend_on_the_rows_beside_it(model):
    """Three prompts of different lengths prefilled into slots 0, 2, 5; one decode step of all three
    and one of each alone give bitwise the same logits for every row."""
    prompts = {
        0: tok.encode("a", prepend="<|bos|>"),
        2: tok.encode("a longer prompt here", prepend="<|bos|>"),
        5: tok.encode("medium one", prepend="<|bos|>"),
    }
    cache = SlotCache(CONFIG.n_layer, slots=6, max_len=CONFIG.sequence_len)
    with torch.inference_mode():
        for slot, ids in prompts.items():
            model(torch.tensor([ids]), kv_cache=SlotPrefill(cache, slot))

        def step(slots):
            batch = SlotBatch(cache, slots, [len(prompts[s]) for s in slots], model.get_device())
            return model(torch.tensor([[7] for _ in slots]), kv_cache=batch)[:, -1]  # through the packs

        together = step([0, 2, 5])
        for i, slot in enumerate([0, 2, 5]):
            assert torch.equal(together[i], step([slot])[0]), slot


def test_a_decode_step_through_whole_blocks_is_bitwise_the_step_op_by_op(model, monkeypatch):
    """The gpt family decodes each block as one op (decode_block): the tokens and every step's logits
    are bitwise those of the same engine with the block's ops one after another, and the block op
    is what ran."""
    prompt = tok.encode("hello there", prepend="<|bos|>")

    def run(kernels):
        monkeypatch.setenv(registry.ENV_VAR, kernels)
        calls = []
        monkeypatch.setattr(torch.ops.nanochat_fast, "decode_block", counting(ops.decode_block, calls))
        engine = BatchEngine(model, tok, slots=2)
        [row] = engine.add(Request(prompt, 6, use_tools=False))
        logits = []
        hook = model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
        try:
            while engine.active:
                engine.step()
        finally:
            hook.remove()
        return row.tokens, logits, len(calls)

    fused, one_by_one = run("auto"), run("decode_block=reference")
    assert fused[2] == 6 * CONFIG.n_layer and one_by_one[2] == 0  # the prompt's rows, then 5 decode steps
    assert fused[0] == one_by_one[0] and all(torch.equal(a, b) for a, b in zip(fused[1], one_by_one[1]))


def counting(op, calls):
    def run(*args):
        calls.append(1)
        return op(*args)

    return run
