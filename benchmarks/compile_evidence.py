"""The evidence behind the compile policy (nanochat_fast/train/model_setup.py), run by hand:

    .venv/bin/python benchmarks/compile_evidence.py [--depths 4 8] [--seq-lens 256 512] [--rounds 3]
        [--modes default max-autotune-no-cudagraphs] [--cache-dir DIR] [--skip-steps] [--skip-eval]

1. The training step (base_train's model, optimizers, dtype and train_step with every default but
   --no-compile, as bench_train_step.build_ours builds them; 8 rows per step) eager vs
   torch.compile(dynamic=False), and other modes: tokens/s (median of interleaved rounds) and the
   one-time compile seconds (dynamo's compile timer over the first step). Compiles are cold: each
   configuration gets an empty inductor cache directory; with --cache-dir they share DIR, and a
   second run with the same DIR shows warm compiles (inductor's FX graph cache).
2. Evaluation and sampling next to a compiled training model: how many graphs each compiles
   (dynamo's counters), whether the training graph is compiled again afterwards, and evaluation
   cost through the compiled model vs the plain module.
Prints markdown. Uses the default corpus under NANOCHAT_FAST_HOME, else synthetic documents.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train_step as steps  # noqa: E402

from nanochat_fast.core import paths  # noqa: E402
from nanochat_fast.evals.task_runner import evaluate_bpb  # noqa: E402
from nanochat_fast.model.decode import SlotCache, SlotPrefill  # noqa: E402
from nanochat_fast.train.model_setup import CompileWatch  # noqa: E402


def corpus():
    """(tokens_root, dataset, description) like the benchmarks' fixture."""
    import bench_pack_rows

    class Factory:
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))

    return bench_pack_rows.corpus.__wrapped__(Factory())


def interleave(variants: dict, rounds: int) -> dict:
    """Run each variant once per round, rotating who goes first; returns each variant's median
    process CPU seconds per step. With one thread that is the step's time on an idle core, a
    measure that neighbours on a shared machine disturb much less than wall time."""
    names, cpu = list(variants), {name: [] for name in variants}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.process_time()
            variants[name]()
            cpu[name].append(time.process_time() - t0)
    return {name: statistics.median(ts) for name, ts in cpu.items()}


def step_table(data, depths, seq_lens, modes, rounds, cache_dir):
    print(
        "| depth | T | variant | tokens/s | speed-up | tokens/CPU-s | speed-up (CPU) | compile s | graphs |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    for depth in depths:
        for seq_len in seq_lens:
            with steps.cold_compiles(cache_dir):
                step_rows(data, depth, seq_len, modes, rounds)


def step_rows(data, depth, seq_len, modes, rounds):
    """The rows of one depth and row length: eager and each compile mode."""
    variants, watches = {}, {}
    variants["eager"] = steps.build_ours(depth, data, "--no-compile", seq_len=seq_len)
    for mode in modes:
        kwargs = dict(dynamic=False) if mode == "default" else dict(dynamic=False, mode=mode)
        variants[f"compiled, {mode}"] = steps.build_ours(
            depth, data, "--no-compile", seq_len=seq_len, compile_kwargs=kwargs
        )
    for name, v in variants.items():
        with CompileWatch() as watches[name]:
            v()
        v.phases.clear()
    cpu = interleave(variants, rounds)
    eager_s, tokens = variants["eager"].median(), steps.B * seq_len
    for name, v in variants.items():
        w = watches[name]
        print(
            f"| {depth} | {seq_len} | {name} | {tokens / v.median():,.0f} | {eager_s / v.median():.2f} | "
            f"{tokens / cpu[name]:,.0f} | {cpu['eager'] / cpu[name]:.2f} | {w.seconds if w.graphs else 0:.0f} | "
            f"{w.graphs} |",
            flush=True,
        )
        v.loader.close()


def timed(fn):
    with CompileWatch() as watch:
        t0 = time.process_time()
        fn()
    watch.cpu_seconds = time.process_time() - t0
    return watch


def eval_and_sampling(data, depth=4, seq_len=256, eval_batches=8):
    """A compiled training model (our defaults + --compile), then evaluation and sampling the way
    a loop could do them; graphs compiled and seconds for each."""
    v = steps.build_ours(depth, data, "--compile", seq_len=seq_len)
    compiled, plain = v.observed.step_model, v.model
    val = [next(v.loader) for _ in range(eval_batches)]
    token_bytes = torch.ones(steps.VOCAB, dtype=torch.int64)
    ctx = v.autocast_ctx

    def evaluate(model, batches):
        def run():
            model.eval()
            evaluate_bpb(model, batches, token_bytes, ctx)
            model.train()

        return run

    def sample_with_cache(model, n):
        """Greedy decoding through model.forward with a KV cache: a new length at every token."""

        def run():
            with torch.no_grad():
                cache = SlotPrefill(SlotCache(plain.config.n_layer, 1, 8 + n), 0)
                ids = val[0][0][:1, :8]
                for _ in range(n):
                    logits = model(ids, kv_cache=cache)
                    ids = logits[:, -1:].argmax(-1)

        return run

    rows = [
        ("training step 1 (compiles)", timed(v)),
        ("training step 2", timed(v)),
        ("eval through the compiled model, 1st", timed(evaluate(compiled, val))),
        ("eval through the compiled model, 2nd", timed(evaluate(compiled, val))),
        ("training step after eval", timed(v)),
        ("eval through the plain module, 1st", timed(evaluate(plain, val))),
        ("eval through the plain module, 2nd", timed(evaluate(plain, val))),
        (
            "eval through the compiled model, short last batch",
            timed(evaluate(compiled, val[:1] + [(x[:3], y[:3]) for x, y in val[:1]])),
        ),
        ("sampling: plain module's generate(), 16 tokens", timed(lambda: list(plain.generate([1, 2, 3], 16)))),
        (
            "sampling: generate() reached through the compiled wrapper",
            timed(lambda: list(compiled.generate([1, 2, 3], 16))),
        ),
        ("sampling: compiled forward with a KV cache, 12 tokens", timed(sample_with_cache(compiled, 12))),
        ("training step after sampling", timed(v)),
    ]
    print(
        f"\nDepth {depth}, T={seq_len}, eval = {eval_batches} batches of {steps.B}x{seq_len}; compiled with "
        f"dynamic=False; recompile limit {torch._dynamo.config.recompile_limit}\n"
    )
    print("| what | graphs compiled | wall s | CPU s | compile s (dynamo) |\n|---|---:|---:|---:|---:|")
    for what, w in rows:
        spent = f"{w.compile_seconds:.1f}" if w.compile_seconds is not None else "?"
        print(f"| {what} | {w.graphs} | {w.wall_seconds:.2f} | {w.cpu_seconds:.2f} | {spent} |", flush=True)
    v.loader.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=[4, 8], help="model depths of the step table")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512], help="row lengths T of the step table")
    p.add_argument("--modes", nargs="+", default=["default"], help="torch.compile modes to compare with eager")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (medians)")
    p.add_argument(
        "--cache-dir",
        help="inductor cache directory shared by every configuration (default: an empty "
        "temporary one each: cold compiles); run twice with one DIR for warm compiles",
    )
    p.add_argument("--skip-steps", action="store_true", help="leave out the step table")
    p.add_argument("--skip-eval", action="store_true", help="leave out evaluation and sampling")
    args = p.parse_args(argv)
    data = corpus()
    print(f"{steps.machine_line()}; torch {torch.__version__}; data: {data[2]}; home {paths.home()}\n")
    if not args.skip_steps:
        step_table(data, args.depths, args.seq_lens, args.modes, args.rounds, args.cache_dir)
    if not args.skip_eval:
        with steps.cold_compiles(args.cache_dir):
            eval_and_sampling(data)


if __name__ == "__main__":
    main()
