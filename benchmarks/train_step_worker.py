"""One rank of bench_train_step.py's 2-process rows: the depth-D model built as base_train builds it
with --sharding=MODE (fp32, eager: the two modes compared on the same arithmetic), stepped by the
training loop's train_step on random tokens, one untimed step then ROUNDS timed ones. Rank 0 writes
the medians (whole step, forward, optimizer phase) and what each rank holds to OUT.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/train_step_worker.py \\
        --mode=fsdp --depth=4 --out=/tmp/fsdp.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step as steps  # noqa: E402

from nanochat_fast import optim  # noqa: E402
from nanochat_fast.core.distributed import all_reduce_sum, compute_cleanup  # noqa: E402
from nanochat_fast.train import model_setup, training_loop  # noqa: E402


def held_bytes(model, optimizers) -> int:
    """Parameters + gradients (this rank's shards under fsdp) + optimizer state held by this rank."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(o.state_nbytes() for o in optimizers)


def main(args):
    cfg = steps.training_config(
        args.depth, f"--sharding={args.mode}", "--dtype=fp32", "--ns-dtype=fp32", "--no-compile"
    )
    dev = cfg.device.init(seed=0)
    model, optimizers = model_setup.build_for_training(
        steps.model_config(cfg), dev.device, cfg.optim.optimizer_kwargs()
    )
    optimizers = model_setup.shard_for_training(model, optimizers, cfg.optim, dev)
    gen = torch.Generator().manual_seed(dev.rank)
    opt_times, step_times, fwd_times, held = [], [], [], 0
    real_step = optim.step

    class TimedForward:  # what train_step calls as the model: times the forward
        def __call__(self, *a, **k):
            t0 = time.perf_counter()
            out = model(*a, **k)
            fwd_times.append(time.perf_counter() - t0)
            return out

        def __getattr__(self, name):
            return getattr(model, name)

    def timed_step(opts, grad_clip):
        nonlocal held
        held = held_bytes(model, opts)  # gradients present: the step's high-water of what is held
        t0 = time.perf_counter()
        norm = real_step(opts, grad_clip)
        opt_times.append(time.perf_counter() - t0)
        return norm

    optim.step = timed_step
    for _ in range(1 + args.rounds):
        x = torch.randint(steps.VOCAB, (steps.B, steps.T), generator=gen)
        y = torch.randint(steps.VOCAB, (steps.B, steps.T), generator=gen)
        t0 = time.perf_counter()
        training_loop.train_step(TimedForward(), optimizers, [(x, y)], cfg.optim.grad_clip, dev.autocast())
        step_times.append(time.perf_counter() - t0)
    helds = all_reduce_sum(torch.tensor([held if r == dev.rank else 0 for r in range(dev.world_size)]))
    if dev.rank == 0:
        Path(args.out).write_text(
            json.dumps(
                dict(
                    mode=args.mode,
                    world_size=dev.world_size,
                    tokens_per_step=dev.world_size * steps.B * steps.T,
                    step_s=statistics.median(step_times[1:]),
                    optimizer_s=statistics.median(opt_times[1:]),
                    forward_s=statistics.median(fwd_times[1:]),
                    held_bytes=helds.tolist(),
                    rounds=args.rounds,
                )
            )
        )
    compute_cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["zero2", "fsdp"], required=True)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    main(parser.parse_args())
