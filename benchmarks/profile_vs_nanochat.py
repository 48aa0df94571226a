"""
Where a training step's time goes, ours against nanochat@92d63d4's, op by op (torch.profiler): the windowed
model at --depth, pattern SL, T=512, 8 rows, bf16, both compiled, on the same random tokens.

    python benchmarks/profile_vs_nanochat.py --nanochat=DIR [--depth=4] [--steps=3] [--top=30]

Each side runs in a process of its own (nanochat reads NANOCHAT_DTYPE at import): the model and optimizers
built as its base_train builds them, --warmup steps (the compile), then --steps profiled. Printed per side:
ms per step by part (forward+backward, optimizer) and the top ops by self CPU time per step; a compiled
region shows as its Inductor kernels (cpp_fused_*: the fused element-wise ops, named by what they fuse).
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
ROWS, SEQ = 8, 512


def batches(vocab: int, n: int):
    gen = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(vocab, (ROWS, SEQ), generator=gen) for _ in range(2)) for _ in range(n)]


def ours(depth: int, vocab: int):
    """(forward+backward of a batch, the optimizer step), as base_train runs them (training_loop.train_step)."""
    from dataclasses import asdict

    from nanochat_fast import optim
    from nanochat_fast.hardware import precision
    from nanochat_fast.model.gpt import config_from_depth
    from nanochat_fast.model.windowed_gpt import WindowedGPTConfig
    from nanochat_fast.train.model_setup import build_for_training

    config = WindowedGPTConfig(**asdict(config_from_depth(depth, vocab, SEQ)), window_pattern="SL")
    model, optimizers = build_for_training(config, "cpu", {})
    next(o for o in optimizers if o.kind == "muon").resolve_ns_precision(warn=False)
    compiled = torch.compile(model, dynamic=False)

    def forward_backward(x, y):
        with precision.autocast("cpu", torch.bfloat16):
            loss = compiled(x, y, loss_reduction="sum")
        (loss / y.numel()).backward()

    def step():
        optim.step(optimizers, 0.0)  # the windowed preset: no clipping (the norm is still taken)
        model.zero_grad(set_to_none=True)

    return forward_backward, step


def nanochat(depth: int, vocab: int):
    """The same two parts as nanochat@92d63d4's base_train runs them (its checkout on sys.path)."""
    from nanochat.gpt import GPT, GPTConfig

    dim = -(-depth * 64 // 128) * 128
    heads = dim // 128
    config = GPTConfig(SEQ, vocab, n_layer=depth, n_head=heads, n_kv_head=heads, n_embd=dim, window_pattern="SL")
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = model.setup_optimizer()
    compiled = torch.compile(model, dynamic=False)

    def forward_backward(x, y):
        compiled(x, y).backward()

    def step():
        optimizer.step()
        model.zero_grad(set_to_none=True)

    return forward_backward, step


def profile_side(side: str, depth: int, vocab: int, warmup: int, steps: int, top: int):
    forward_backward, step = (ours if side == "ours" else nanochat)(depth, vocab)
    data = batches(vocab, warmup + steps)
    for x, y in data[:warmup]:
        forward_backward(x, y)
        step()
    parts = {"forward+backward": 0.0, "optimizer": 0.0}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data[warmup:]:
            for name, fn in (("forward+backward", lambda: forward_backward(x, y)), ("optimizer", step)):
                t0 = time.perf_counter()
                with record_function(name):
                    fn()
                parts[name] += time.perf_counter() - t0
    print(f"\n=== {side}, depth {depth}: ms per step (profiled, {steps} steps) ===")
    for name, seconds in parts.items():
        print(f"{name}: {1000 * seconds / steps:.1f}")
    print(f"total: {1000 * sum(parts.values()) / steps:.1f}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70)
    print(table, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", type=Path, required=True, help="a nanochat checkout at 92d63d4")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (our tok_train's default)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--pythonpath", default="", help="where nanochat's own dependencies are")
    p.add_argument("--side", choices=["ours", "nanochat"], help=argparse.SUPPRESS)  # one process per side
    a = p.parse_args()
    if a.side:
        return profile_side(a.side, a.depth, a.vocab, a.warmup, a.steps, a.top)
    for side in ("nanochat", "ours"):
        env = dict(os.environ, NANOCHAT_DTYPE="bfloat16")
        path = [str(a.nanochat), a.pythonpath] if side == "nanochat" else [str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        subprocess.run([sys.executable, __file__, *sys.argv[1:], f"--side={side}"], env=env, cwd=a.nanochat, check=True)


if __name__ == "__main__":
    main()
