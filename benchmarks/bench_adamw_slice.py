"""AdamW step over the parameters of a depth-8 GPT: our C++ op vs torch.optim.AdamW.

depth 8 -> n_embd 512, 8 layers of (q, k, v, o: 512x512; MLP 2048x512, 512x2048) plus the
embedding and lm_head at vocab 32768: 58.7M fp32 values in 50 tensors, the shape of what one
rank updates in single-process training.
"""

import torch
from harness import compare

from nanochat_fast.kernels import adamw_slice_update

N_EMBD, N_LAYER, VOCAB = 512, 8, 32768
SHAPES = (
    [(VOCAB, N_EMBD)]
    + [s for _ in range(N_LAYER) for s in [(N_EMBD, N_EMBD)] * 4 + [(4 * N_EMBD, N_EMBD), (N_EMBD, 4 * N_EMBD)]]
    + [(VOCAB, N_EMBD)]
)
HP = dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
# what one step has to move with fp32 parameters and state: read p, g, m, v; write p, m, v
BYTES_PER_VALUE = 7 * 4


def make_params(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(device) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    return params


def ours(backend, device="cpu"):
    params = make_params(0, device)
    grads = [p.grad for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    state = {"step": 0}

    def step():
        state["step"] += 1
        adamw_slice_update(
            params, grads, m, v, state["step"], HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"], backend=backend
        )

    return step


def torch_adamw(device="cpu", **impl):
    opt = torch.optim.AdamW(make_params(0, device), **HP, **impl)
    return opt.step


def test_adamw_depth8_gpt(benchmark):
    n = sum(torch.Size(s).numel() for s in SHAPES)
    medians = compare(
        benchmark,
        op="AdamW step",
        baseline="torch fused",
        shape_set=f"depth-8 GPT: {n / 1e6:.1f}M fp32 values in {len(SHAPES)} tensors",
        variants={
            "cpp (ours)": ours("cpp"),
            "torch fused": torch_adamw(fused=True),
            "torch foreach": torch_adamw(foreach=True),
            "reference (per tensor)": ours("reference"),
        },
    )
    # both fused updates move the least a step can: their rate through memory is what differs
    moved = n * BYTES_PER_VALUE
    rates = ", ".join(f"{name} {moved / medians[name] / 1e9:.1f}" for name in ("cpp (ours)", "torch fused"))
    benchmark.extra_info["notes"] = (
        f"a step moves {moved / 1e9:.2f} GB (read p, g, m, v; write p, m, v: {BYTES_PER_VALUE} bytes a value); "
        f"GB/s: {rates}; {torch.get_num_threads()} thread(s)"
    )
