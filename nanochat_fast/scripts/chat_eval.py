"""
Evaluate a chat model on nanochat's chat benchmarks, offline (the data: `python -m
nanochat_fast.scripts.prepare_data --datasets=eval`).

    python -m nanochat_fast.scripts.chat_eval                          # newest sft run (else mid), every task
    python -m nanochat_fast.scripts.chat_eval --task=ARC-Easy,GSM8K --max-examples=100
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.chat_eval -- --run=sft_d20

ARC-Easy, ARC-Challenge and MMLU are scored by the answer letter with the largest logit right after
<|assistant_start|>; GSM8K and SpellingBee by the number after "####" in the reply (the calculator
tool runs); HumanEval by running the reply's program against the tests in a sandbox subprocess
(time, memory and network limits), never in this process. Replies are greedy by default; with
--num-samples=k a problem counts as solved when any of its k replies is right (pass@k). Each task
prints its accuracy, chance level and 95% (Wilson) interval; results go to the run's evals.json
for the report card. Under torchrun every process scores its share of the examples.
"""

import argparse
import sys
import time

from .. import checkpoints
from ..core import cli
from ..core.distributed import print0
from ..core.errors import UserError
from ..data.tokenizer import get_tokenizer
from ..evals import scoring, task_runner, tasks
from ..model import generation_dtype, loading
from ..train import next_steps
from ..train.training_config import DeviceConfig, evaluation_process


def task_list(value: str) -> list:
    try:
        return tasks.parse_names(value, tasks.CHAT_TASK_NAMES)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_eval", description=__doc__)
    cli.add_checkpoint_flags(p, newest="the newest sft run, else the newest mid run")
    p.add_argument(
        "--task",
        type=task_list,
        default="all",
        help=f"tasks, comma-separated, any case: {', '.join(tasks.CHAT_TASK_NAMES)}, or all",
    )
    p.add_argument(
        "--max-examples",
        type=cli.positive_int,
        help="at most this many examples per task, a fixed random sample (default: all)",
    )
    p.add_argument(
        "--num-samples",
        type=cli.positive_int,
        default=1,
        help="replies per generative problem; solved when any is right (pass@k)",
    )
    p.add_argument("--temperature", type=cli.non_negative_float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=cli.positive_int, default=50, help="sample among the k likeliest tokens")
    p.add_argument(
        "--max-new-tokens",
        type=cli.positive_int,
        default=256,
        help="longest reply, in tokens (at most half the model's context)",
    )
    p.add_argument(
        "--batch-size",
        type=cli.positive_int,
        default=8,
        help="prompts per forward pass of the categorical tasks, per process",
    )
    DeviceConfig.add_flags(p)
    return p


def chat_core(results: dict) -> float | None:
    """nanochat's ChatCORE of {task: TaskResult.as_dict()}: the mean over all six tasks of the accuracy
    centred by chance (0 at chance, 1 perfect); None unless every task was evaluated."""
    if set(results) != set(tasks.CHAT_TASK_NAMES):
        return None
    return sum(scoring.centered(r["accuracy"], r["chance"]) for r in results.values()) / len(results)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with evaluation_process(args) as dev:
        tokenizer = get_tokenizer()
        run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid"))
        # every task's data first: a missing set stops the run before the model is loaded
        loaded = [(task, task.load(max_examples=args.max_examples)) for task in args.task]
        model, ckpt, meta = loading.load_model(run_dir, args.step, dev.device, tokenizer)
        if meta["phase"] == "base":
            print0(f"note: {ckpt} is a base checkpoint: it has not learned to chat", file=sys.stderr)
        print0(f"checkpoint: {ckpt}")
        # a generative task samples num_samples replies to a prompt together: auto times that mix on a CPU
        mix = generation_dtype.chat_mix(model.config, args.num_samples, args.max_new_tokens)
        dev = generation_dtype.for_generation(dev, args.dtype, model, mix)
        print0(f"generation dtype: {dev.precision.describe()}")
        sampling = {k: getattr(args, k) for k in ("num_samples", "temperature", "top_k", "max_new_tokens")}
        settings = {"max_examples": args.max_examples, **sampling, "world_size": dev.world_size}
        options = dict(batch_size=args.batch_size, progress=True, settings=settings, **sampling)
        results, start = {}, time.time()
        for task, examples in loaded:
            with dev.autocast():
                result = task_runner.chat_task(model, tokenizer, task, examples, dev.rank, dev.world_size, **options)
            print0(result.line(), flush=True)
            results[task.name] = result.as_dict()
        core = chat_core(results)
        if core is not None:
            print0(f"ChatCORE (mean accuracy centred by chance, all six tasks): {core:.4f}")
        print0(f"evaluated {len(results)} task(s) in {time.time() - start:.1f} s on {dev.world_size} process(es)")
        if dev.rank == 0:
            print(f"results: {task_runner.record(run_dir, meta['step'], 'chat_eval', results)}")
            next_steps.show(next_steps.after_chat_eval())
        return 0


if __name__ == "__main__":
    cli.run(main)
