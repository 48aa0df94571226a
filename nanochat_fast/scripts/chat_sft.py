"""
Supervised fine-tuning: teach a mid-trained (or base) model to answer, on conversations with the
loss only on the assistant's tokens, one conversation per row (padded, not packed), as nanochat's
chat_sft does. Ends after one epoch of the mixture (or --num-iterations steps).

    python -m nanochat_fast.scripts.chat_sft                          # newest mid run, else newest base run
    python -m nanochat_fast.scripts.chat_sft --source-run=mid_d20 --device-batch-size=4
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.chat_sft -- --source-run=mid_d20

The mixture, from what is prepared here: the conversation dataset (--dataset), ARC-Easy's and ARC-Challenge's
validation splits, MMLU's dev and validation splits, GSM8K's eight worked examples, 600 SpellingBee train words
(prepare_data --datasets=eval) and your own --extra-conversations; the evaluated splits are never trained on. A
batch is --target-examples-per-step conversations; the learning rates default to 2% of pretraining's, decaying
linearly to zero. The mixture, validation and the loss in full: docs/guide.md, "After mid-training".
"""

from ..core import cli
from ..core.distributed import print0
from ..evals import prepared_benchmarks, task_runner, tasks
from ..train import next_steps
from ..train.stage import FromRun, Stage, answer_questions, one_epoch, run_stage
from ..train.stage_data import PaddedConversations, sft_sources
from ..train.training_config import DataConfig, OptimConfig, add_training_flags
from .mid_train import SAMPLE_QUESTIONS, add_conversation_flags

LR_FRACTION = 0.02  # nanochat's SFT trains at 2% of the pretraining learning rates
IN_TRAINING_EVAL_TASKS = ("ARC-Easy", "MMLU")  # categorical, so cheap enough to run at every eval
START = FromRun("source_run", "source_step", phases=("mid", "base"))  # a mid run, else a base run


def chat_evals(max_examples: int):
    """Accuracy on IN_TRAINING_EVAL_TASKS, at most max_examples each (the same every time), over every rank."""

    def make(cfg, tokenizer, dev):
        chosen = [tasks.get(name) for name in IN_TRAINING_EVAL_TASKS]
        missing = [t.name for t in chosen if prepared_benchmarks.read_task_manifest(t.folder) is None]
        if max_examples == 0 or missing:
            if max_examples:
                print0(
                    f"note: no in-training chat evaluation: no evaluation data for {', '.join(missing)} "
                    "(`python -m nanochat_fast.scripts.prepare_data --datasets=eval`)"
                )
            return lambda model: {}
        loaded = [(task, task.load(max_examples=max_examples)) for task in chosen]
        batch_size = 2 * cfg.data.device_batch_size
        return lambda model: {
            f"{task.name.lower().replace('-', '_')}_acc": task_runner.chat_task(
                model, tokenizer, task, examples, dev.rank, dev.world_size, batch_size=batch_size
            ).accuracy
            for task, examples in loaded
        }

    return make


def stage(args) -> Stage:
    """Made from the flags, unlike MID: the batch and the evaluations are chat_sft's own flags."""
    return Stage(
        phase="sft",
        title="supervised fine-tuning",
        start=START,
        data=PaddedConversations(args.target_examples_per_step, sft_sources),  # a conversation per row
        horizon=one_epoch,  # one epoch of the mixture, or --num-iterations
        sample=answer_questions(SAMPLE_QUESTIONS),
        evals=(("chat", chat_evals(args.chat_eval_examples)),),
        next_step=next_steps.after_sft,
        run_name=lambda cfg, start: f"sft_{start.name}",
    )


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_sft", description=__doc__)
    START.add_flags(p)
    g = DataConfig.add_flags(
        p, only={"dataset", "max_seq_len", "device_batch_size"}, max_seq_len=None, device_batch_size=4
    )
    g.add_argument(
        "--target-examples-per-step",
        type=cli.positive_int,
        default=32,
        help="conversations per optimizer step, all processes (a multiple of device_batch_size x processes)",
    )
    add_conversation_flags(p, g, "your own conversations, added to the mixture")
    p.add_argument_group("chat evaluation").add_argument(
        "--chat-eval-examples",
        type=cli.non_negative_int,
        default=1024,
        help=f"examples of {' and '.join(IN_TRAINING_EVAL_TASKS)} scored at every evaluation (0: none)",
    )
    # eager by default: padded rows change length every batch (PaddedConversations.varying_shapes)
    add_training_flags(p, eval_every=100, sample_every=-1, warmdown_ratio=1.0, **OptimConfig.scaled_lrs(LR_FRACTION))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_stage(args, stage(args))


if __name__ == "__main__":
    cli.run(main)
