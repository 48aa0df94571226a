"""
Reinforcement learning on GSM8K (or another task whose replies end in "#### N"), nanochat's last
stage: the model answers each question --num-samples times, a reply earns reward 1 when its number
after "####" is the reference answer (the extraction chat_eval scores GSM8K with), else 0, and the
model is pushed toward the replies that did better than its other replies to the same question.

    python -m nanochat_fast.scripts.chat_rl                              # newest sft run, GSM8K
    python -m nanochat_fast.scripts.chat_rl --source-run=sft_d20 --examples-per-step=16 --num-samples=16
    python -m nanochat_fast.scripts.chat_rl --task=last-digit            # a synthetic task a CPU can learn
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.chat_rl -- --source-run=sft_d20

Tasks (--task): GSM8K (the prepared data has no train split: it trains on the test questions that are not held
out, and says so), SpellingBee, and last-digit (synthetic). The method (nanochat's "GRPO", close to REINFORCE) and
what the log shows: docs/guide.md, "Reinforcement learning: chat_rl"; the objective: train/rollouts.py.
"""

import argparse

from ..core import cli
from ..evals import task_runner, tasks
from ..train import next_steps
from ..train.rollouts import Rollouts, Sampling, rl_horizon, split_examples
from ..train.stage import FromRun, Stage, answer_questions, run_stage
from ..train.training_config import DataConfig, OptimConfig, add_training_flags

LR_FRACTION = 0.05  # nanochat's chat_rl starts at 5% of the pretraining learning rates
START = FromRun("source_run", "source_step", phases=("sft", "mid"))  # a chat model: sft, else mid


def rl_task(value: str):
    if value.strip().lower() not in {name.lower() for name in tasks.RL_TASK_NAMES}:
        raise argparse.ArgumentTypeError(f"unknown RL task {value!r}; choose one of {', '.join(tasks.RL_TASK_NAMES)}")
    return tasks.get(value)


def at_least_two(value) -> int:
    n = cli.positive_int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (the advantage compares a question's samples), got {n}")
    return n


def positive_float(value) -> float:
    x = cli.non_negative_float(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (RL learns from the differences between samples), got {value}")
    return x


def pass_at_k_eval(args):
    """The stage's evaluation: pass@1..num_samples on the held-out questions, sampled as in training."""

    def make(cfg, tokenizer, dev):
        if args.eval_examples == 0:
            return lambda model: {}
        _, held_out, _ = split_examples(args.task, args.eval_examples)
        sampling = (args.num_samples, args.max_new_tokens, args.temperature, args.top_k)
        return lambda model: task_runner.evaluate_pass_at_k(
            model, tokenizer, args.task, held_out, dev.rank, dev.world_size, *sampling, seed=cfg.run.seed
        )

    return make


def stage(args) -> Stage:
    sampling = Sampling(args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.device_batch_size)
    return Stage(
        phase="rl",
        title="reinforcement learning",
        start=START,
        data=Rollouts(args.task, args.examples_per_step, sampling, args.eval_examples, args.num_epochs),
        horizon=rl_horizon,
        sample=lambda model, tokenizer: answer_questions(
            [ex["question"] for ex in args.task.load(max_examples=3)], args.max_new_tokens
        )(model, tokenizer),
        evals=(("rl", pass_at_k_eval(args)),),
        next_step=lambda run_dir: next_steps.after_rl(run_dir, args.task.name),
        run_name=lambda cfg, start: f"rl_{start.name}",
    )


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_rl", description=__doc__)
    START.add_flags(p)
    g = p.add_argument_group("task and sampling")
    g.add_argument("--task", type=rl_task, default="GSM8K", help=f"what to learn: {', '.join(tasks.RL_TASK_NAMES)}")
    g.add_argument(
        "--examples-per-step",
        type=cli.positive_int,
        default=16,
        help="questions per optimizer step, all processes (a multiple of the number of processes)",
    )
    g.add_argument("--num-samples", type=at_least_two, default=16, help="samples per question")
    g.add_argument(
        "--max-new-tokens",
        type=cli.positive_int,
        default=256,
        help="longest sample, in tokens (at most half the model's context)",
    )
    g.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature")
    g.add_argument("--top-k", type=cli.positive_int, default=50, help="sample among the k likeliest tokens")
    g.add_argument(
        "--device-batch-size",
        type=cli.positive_int,
        default=32,
        help="rows sampled together per process (whole questions, at least one: --num-samples rows "
        "each), and rows per batch of the val bpb pass",
    )
    DataConfig.add_flags(p, only={"max_seq_len"}, max_seq_len=None)
    g = p.add_argument_group("horizon")
    g.add_argument("--num-epochs", type=cli.positive_int, default=1, help="passes over the train questions")
    g.add_argument(
        "--num-iterations",
        type=cli.positive_or_unset_int,
        default=-1,
        help="optimizer steps (-1: --num-epochs passes over the train questions)",
    )
    p.add_argument_group("pass@k evaluation").add_argument(
        "--eval-examples",
        type=cli.non_negative_int,
        default=400,
        help="held-out questions scored pass@1..num_samples at every evaluation (0: none); GSM8K's come from its "
        "test split and are never trained on",
    )
    add_training_flags(p, eval_every=60, sample_every=-1, warmdown_ratio=1.0, **OptimConfig.scaled_lrs(LR_FRACTION))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_stage(args, stage(args))


if __name__ == "__main__":
    cli.run(main)
