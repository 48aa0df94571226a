"""
Where a training step's time goes, ours against nanochat@92d63d4's, op by op (torch.profiler): the windowed
model at --depth, pattern SL, T=512, 8 rows, bf16, both compiled, on the same random tokens.

    python benchmarks/profile_vs_nanochat.py --nanochat=DIR [--depth=4] [--reps=10] [--steps=2] [--top=30]

Both in one process (its checkout on sys.path, NANOCHAT_DTYPE=bfloat16), each model and its optimizers built
as its base_train builds them; --warmup steps each (the compile); then --reps steps timed by part
(forward+backward, optimizer), the two sides in turn so that load from elsewhere falls on both; then each
side's top ops by self CPU time over --steps profiled steps (a compiled region shows as its graphs' calls).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROWS, SEQ = 8, 512


def batches(vocab: int, n: int):
    gen = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(vocab, (ROWS, SEQ), generator=gen) for _ in range(2)) for _ in range(n)]


def ours(depth: int, vocab: int):
    """(forward+backward of a batch, the optimizer step), as base_train runs them (training_loop.train_step)."""
    from dataclasses import asdict

    from nanochat_fast import optim
    from nanochat_fast.hardware import precision
    from nanochat_fast.model.gpt import compile_model, config_from_depth
    from nanochat_fast.model.windowed_gpt import WindowedGPTConfig
    from nanochat_fast.train.model_setup import build_for_training

    config = WindowedGPTConfig(**asdict(config_from_depth(depth, vocab, SEQ)), window_pattern="SL")
    model, optimizers = build_for_training(config, "cpu", {})
    ns = next(o for o in optimizers if o.kind == "muon").resolve_ns_precision(warn=False)
    print(f"ours: Newton-Schulz in {ns.describe()}", flush=True)
    compiled = compile_model(model)

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


def interleaved(sides: dict, data: list, reps: int) -> dict:
    """{side: {part: [seconds per rep]}}: the sides' parts timed in turn, rep by rep, the order swapped
    every rep, so a busy neighbour (and who runs first) lands on both alike."""
    times = {side: {"forward+backward": [], "optimizer": []} for side in sides}
    for i in range(reps):
        x, y = data[i % len(data)]
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for side in order:
            forward_backward, step = sides[side]
            for part, fn in (("forward+backward", lambda: forward_backward(x, y)), ("optimizer", step)):
                t0 = time.perf_counter()
                fn()
                times[side][part].append(time.perf_counter() - t0)
    return times


def op_table(forward_backward, step, data, top: int) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data:
            with record_function("forward+backward"):
                forward_backward(x, y)
            with record_function("optimizer"):
                step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", type=Path, required=True, help="a nanochat checkout at 92d63d4")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (our tok_train's default)")
    p.add_argument("--warmup", type=int, default=3, help="steps per side before timing (the compile)")
    p.add_argument("--reps", type=int, default=10, help="interleaved timed steps per side")
    p.add_argument("--steps", type=int, default=2, help="profiled steps per side")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    os.environ["NANOCHAT_DTYPE"] = "bfloat16"  # read when nanochat.common is imported
    sys.path.insert(0, str(a.nanochat))
    sides = {"nanochat": nanochat(a.depth, a.vocab), "ours": ours(a.depth, a.vocab)}
    data = batches(a.vocab, 4)
    for forward_backward, step in sides.values():
        for i in range(a.warmup):
            forward_backward(*data[i % len(data)])
            step()
    times = interleaved(sides, data, a.reps)
    print(f"windowed, depth {a.depth}, bf16, compiled; ms per step, median of {a.reps} interleaved steps")
    print("| part | nanochat | ours | nanochat / ours |\n|---|---:|---:|---:|")
    medians = {side: {part: 1000 * statistics.median(t) for part, t in parts.items()} for side, parts in times.items()}
    for part in [*times["ours"], "total"]:
        n, o = (sum(m.values()) if part == "total" else m[part] for m in (medians["nanochat"], medians["ours"]))
        print(f"| {part} | {n:.1f} | {o:.1f} | {n / o:.2f}x |")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for side, (forward_backward, step) in sides.items():
        print(f"\n=== {side}: top ops by self CPU time over {a.steps} steps ===")
        print(op_table(forward_backward, step, data[: a.steps], a.top), flush=True)


if __name__ == "__main__":
    main()
