"""Attention by query blocks (model/block_attention.py), what the windowed model runs on a CPU over a
sequence's own keys: in float64 the function SDPA computes under the window mask, gradients included; in
bf16 as close to float64 as SDPA's own bf16; chosen only where it should be; and the model's loss and
gradients the same as through SDPA."""

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from nanochat_fast.model import block_attention as blocks
from nanochat_fast.model import windowed_gpt
from nanochat_fast.model.block_attention import window_mask
from nanochat_fast.model.gpt import config_from_depth
from nanochat_fast.model.windowed_gpt import WindowedGPT, WindowedGPTConfig


def qkv(heads, kv_heads, T, D=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, T, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, T, D, generator=gen, dtype=dtype) for _ in "kv")
    return q, k, v


def sdpa(q, k, v, window):
    pos = torch.arange(q.size(2))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=window_mask(pos, pos, window), enable_gqa=q.size(1) != k.size(1)
    )


@pytest.mark.parametrize(
    "heads, kv_heads, T, window",
    [(4, 4, 512, 128), (4, 2, 512, 512), (6, 2, 300, 128), (2, 1, 384, 64), (2, 2, 7, 128), (2, 2, 1, 3)],
)
@pytest.mark.parametrize("one_batch", [False, True])  # a short layer's blocks looped, or as one batch
def test_equals_sdpa_under_the_window_mask_in_float64(heads, kv_heads, T, window, one_batch):
    q, k, v = (t.requires_grad_() for t in qkv(heads, kv_heads, T))
    want, got = sdpa(q, k, v, window), blocks.block_attention(q, k, v, window, one_batch)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window, one_batch", [(512, False), (128, False), (128, True)])
def test_bf16_within_twice_sdpas_own_bf16_error(window, one_batch):
    """The scores are rounded to bf16 before the fp32 softmax (flash keeps them fp32), and the backward starts
    from the bf16 probabilities: measured up to 2x SDPA's largest error against float64 on the output and
    1.25x on the gradients; more than 2x would be a different computation."""
    q, k, v = qkv(4, 4, 512, D=128, seed=2)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def output_and_grads(fn, inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        out = fn(*inputs, window) if fn is sdpa else fn(*inputs, window, one_batch)
        return [out, *torch.autograd.grad(out, inputs, grad.to(out.dtype))]

    want = output_and_grads(sdpa, (q, k, v))
    low = [t.bfloat16() for t in (q, k, v)]
    for name, ours, theirs, exact in zip(
        ("out", "dq", "dk", "dv"), output_and_grads(blocks.block_attention, low), output_and_grads(sdpa, low), want
    ):
        ours, theirs = ((t.double() - exact).abs().max().item() for t in (ours, theirs))
        assert ours <= 2 * theirs, (name, ours, theirs)


def test_one_batch_by_default_only_under_torch_compile_and_where_the_window_divides_t(monkeypatch):
    calls = []
    monkeypatch.setattr(blocks.BlockAttention, "apply", lambda *args: calls.append(args[-1]))
    q, k, v = qkv(2, 2, 512)
    blocks.block_attention(q, k, v, 128)  # eager: the loop
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    blocks.block_attention(q, k, v, 128)
    blocks.block_attention(q, k, v, 512)  # a full causal layer: two blocks, looped
    blocks.block_attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], 128)  # 128 does not divide 300
    assert calls == [False, True, False, False]


def test_compiled_the_one_batch_equals_sdpa_in_float64():
    """What torch.compile makes of the batch (the default there), forward and backward."""
    q, k, v = (t.requires_grad_() for t in qkv(2, 1, 256))
    compiled = torch.compile(blocks.block_attention, fullgraph=True)
    want, got = sdpa(q, k, v, 128), compiled(q, k, v, 128)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_runs_only_on_a_cpu_over_the_sequences_own_keys_and_under_the_memory_cap():
    q, k, _ = qkv(4, 4, 512, dtype=torch.bfloat16)
    assert blocks.use_blocks(q, k, 128) and blocks.use_blocks(q, k, 512)
    cached = torch.cat([k, k], dim=2)  # a chunk after a cached prefix
    assert not blocks.use_blocks(q, cached, 512)
    assert not blocks.use_blocks(q.to("meta"), k.to("meta"), 512)
    # nanochat's depth 20 at T = 2048: ~0.5 GiB of bf16 probabilities a layer, so SDPA (flash) keeps the memory down
    big = torch.empty(8, 10, 2048, 128, dtype=torch.bfloat16)
    assert blocks.scores_bytes(big, 2048) > blocks.SCORES_BYTES and not blocks.use_blocks(big, big, 2048)
    # the count, 2 bytes each: a full causal layer in two blocks of 256 sees 256 + 512 keys; a short one's 4 blocks
    # run as one batch, each seeing 2 x 128 keys (block 0's first 128 masked)
    assert blocks.scores_bytes(q, 512) == 2 * 2 * 4 * 256 * (256 + 512)
    assert blocks.in_one_batch(512, 128) and not blocks.in_one_batch(512, 512) and not blocks.in_one_batch(300, 128)
    assert blocks.scores_bytes(q, 128) == 2 * 2 * 4 * 4 * 128 * 256
    # a last block shorter than the others counts its own queries: T 300 by 128 leaves 44 queries that
    # see 172 keys; T 301 in halves of 151 and 150
    assert blocks.scores_bytes(q[:, :, :300], 128) == 2 * 2 * 4 * (128 * 128 + 128 * 256 + 44 * 172)
    assert blocks.scores_bytes(q[:, :, :301], 512) == 2 * 2 * 4 * (151 * 151 + 150 * 301)


def test_the_windowed_model_computes_the_same_loss_and_gradients_as_through_sdpa(monkeypatch):
    torch.manual_seed(0)
    config = WindowedGPTConfig(**asdict(config_from_depth(2, 512, 256)), window_pattern="SL")
    assert min(config.window_sizes()) < 256 - 1  # a short layer and a long one
    model = WindowedGPT(config)
    model.init_weights()
    x, y = torch.randint(512, (2, 256)), torch.randint(512, (2, 256))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with monkeypatch.context() as m:
        m.setattr(windowed_gpt, "use_blocks", lambda *a: False)
        want_loss, want_grads = loss_and_grads()
    calls = []
    monkeypatch.setattr(windowed_gpt, "block_attention", lambda *a: calls.append(1) or blocks.block_attention(*a))
    got_loss, got_grads = loss_and_grads()
    assert len(calls) == config.n_layer
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
