"""Causal self-attention of a training step on a CPU, forward + backward: torch's SDPA (its CPU flash kernel)
against attention by query blocks (model/block_attention.py: what the windowed model runs on a CPU).

Shapes: the windowed model's layers at depth 4 (2 heads) and depth 8 (4 heads), 8 rows of T = 512, head
dim 128, bf16 as the CPU's autocast runs them: a long layer (causal over all 512 keys) and a short one
(window 128). Variants:
    sdpa                    SDPA, for the short layer by chunks of queries (window_chunked_attention)
    blocks                  block_attention: per block of queries S = Q K^T in bf16, masked softmax in fp32,
                            P in bf16, P V; eager, and under torch.compile (mask and softmax fused)
    blocks, fp32 scores     the same with Q and K in fp32 for S (as the flash kernel keeps its scores), compiled
Every variant's output is checked against a float64 SDPA before timing; the largest error of each goes in
the table's notes.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from harness import compare

from nanochat_fast.model.block_attention import block_attention
from nanochat_fast.model.windowed_gpt import window_chunked_attention

ROWS, T, HEAD_DIM, SHORT_WINDOW = 8, 512, 128, 128
HEADS = {4: 2, 8: 4}
BUDGET_S = 45


def sdpa(q, k, v, window: int):
    if window >= q.size(2) - 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return window_chunked_attention(q, k, v, window, gqa=False)


def variants_for(window: int) -> dict:
    blocks = functools.partial(block_attention, window=window)

    def fp32_scores(q, k, v):
        return block_attention(q.float(), k.float(), v, window)

    return {
        "sdpa": functools.partial(sdpa, window=window),
        "blocks, eager": blocks,
        "blocks, compiled": torch.compile(blocks, dynamic=False),
        "blocks, fp32 scores, compiled": torch.compile(fp32_scores, dynamic=False),
    }


def largest_error(fn, window: int, heads: int) -> float:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, T, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    reference = sdpa(q, k, v, window)
    return (fn(q.bfloat16(), k.bfloat16(), v.bfloat16()).double() - reference).abs().max().item()


def forward_backward(fn, heads: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ROWS, heads, T, HEAD_DIM, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(ROWS, heads, T, HEAD_DIM, generator=gen).bfloat16()
    return lambda: fn(q, k, v).backward(grad)


@pytest.mark.parametrize("depth", sorted(HEADS))
@pytest.mark.parametrize("layer", ["long", "short"])
def test_attention_forward_backward(benchmark, depth, layer):
    window = T if layer == "long" else SHORT_WINDOW
    fns = variants_for(window)
    errors = {name: largest_error(fn, window, HEADS[depth]) for name, fn in fns.items()}
    compare(
        benchmark,
        op="causal attention, forward+backward (cpu, bf16)",
        baseline="sdpa",
        rounds=9,
        budget_s=BUDGET_S,
        shape_set=f"depth {depth}, {layer} layer: {ROWS} rows x {HEADS[depth]} heads x T {T} x {HEAD_DIM}"
        + (f", window {window}" if layer == "short" else ""),
        variants={name: forward_backward(fn, HEADS[depth]) for name, fn in fns.items()},
        notes="largest absolute error against float64 SDPA: "
        + ", ".join(f"{name} {err:.4f}" for name, err in errors.items()),
    )
