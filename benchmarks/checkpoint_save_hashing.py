"""
What recording a checkpoint's digests costs a save: checkpoints.save_checkpoint of a depth-12 GPT
(nanochat's vocabulary, 2^16) timed with the digests hashed as the bytes are written (as shipped)
and with the hashing replaced by a pass-through, in interleaved rounds (ABAB...: a busy neighbour
lands on both), medians of --rounds saves each. Every save is fsynced (checkpoints/checkpoint.py); each checkpoint is
deleted before the next save. The optimizer state stands in as one fp32 copy of every parameter per
kind (Muon's momentum for matrices, AdamW's two moments for the rest), the size a real one has.

    python benchmarks/checkpoint_save_hashing.py --depth=12 --rounds=5 --out=benchmarks/checkpoint_hashing.json

RESULTS.md's "Checkpoint save with digests" section shows benchmarks/checkpoint_hashing.json (make_results.py).
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanochat_fast import checkpoints
from nanochat_fast.checkpoints import checkpoint
from nanochat_fast.hardware import cpu_model
from nanochat_fast.model.gpt import config_from_depth
from nanochat_fast.model.loading import new_model


class PassThrough(checkpoint.HashingFile):
    """The same writes, no hashing: the baseline."""

    def _queue(self, data, copied: int):
        pass


def states(depth: int):
    model = new_model(config_from_depth(depth, 65536, 2048), "cpu")
    model_state = {k: v.detach() for k, v in model.state_dict().items()}
    momentum = {k: torch.randn_like(v) for k, v in model_state.items() if v.ndim == 2 and "transformer.h" in k}
    moments = {k: torch.randn_like(v) for k, v in model_state.items() if k not in momentum}
    second = {k: torch.rand_like(v) for k, v in moments.items()}
    rank_state = {"optimizers": [{"momentum": momentum}, {"exp_avg": moments, "exp_avg_sq": second}], "rng": {}}
    return model_state, rank_state


def save_once(run_dir: Path, model_state, rank_state, hashing: bool) -> float:
    checkpoint.HashingFile, real = (checkpoint.HashingFile if hashing else PassThrough), checkpoint.HashingFile
    try:
        t0 = time.perf_counter()
        path = checkpoints.save_checkpoint(
            run_dir, 1, model_state=model_state, rank_state=rank_state, meta={"phase": "bench"}
        )
        seconds = time.perf_counter() - t0
    finally:
        checkpoint.HashingFile = real
    shutil.rmtree(path)
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="", help="where to save (default: a temporary folder)")
    p.add_argument("--out", default="", help="write the figures here as JSON")
    args = p.parse_args(argv)
    model_state, rank_state = states(args.depth)
    n_bytes = sum(t.numel() * t.element_size() for t in model_state.values())
    n_bytes += sum(t.numel() * 4 for opt in rank_state["optimizers"] for d in opt.values() for t in d.values())
    times = {"hashed": [], "not hashed": []}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        save_once(Path(tmp), model_state, rank_state, True)  # warm-up: page cache, allocator
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for hashing in order:
                times["hashed" if hashing else "not hashed"].append(
                    save_once(Path(tmp), model_state, rank_state, hashing)
                )
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["hashed"] / medians["not hashed"]
    figures = {
        "depth": args.depth,
        "bytes_per_save": n_bytes,
        "rounds": args.rounds,
        "seconds": times,
        "median_s": medians,
        "ratio": ratio,
        "threads": torch.get_num_threads(),
        "machine": f"{cpu_model()}, {torch.get_num_threads()} threads, shared",
    }
    print(
        f"depth {args.depth}, {n_bytes / 1e9:.2f} GB per save: median {medians['hashed']:.2f} s hashed, "
        f"{medians['not hashed']:.2f} s not hashed (x{ratio:.3f})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
