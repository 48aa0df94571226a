"""
Mid-train a base model on conversations: the chat special tokens (<|user_start|>, ...) and the
turn-taking format, with the loss only on the assistant's tokens. Ends after one epoch of the
conversation mixture (or --num-iterations steps).

    python -m nanochat_fast.scripts.mid_train --device-batch-size=16 --total-batch-size=8192
    python -m nanochat_fast.scripts.mid_train --device-batch-size=16 --total-batch-size=8192 \
        --extra-conversations=my_chats.jsonl

--extra-conversations takes JSONL lines {"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}, mixed into the conversation dataset (--dataset,
default chat); when no conversation dataset is prepared, the file alone is the training set (every
50th conversation held out for validation). The loss of a step is the sum over supervised tokens
divided by their count over the whole step on all processes, so masked targets weigh the same on
1 or N processes.
"""

from ..core import cli
from ..train import next_steps
from ..train.stage import FromRun, Stage, answer_questions, one_epoch, run_stage
from ..train.stage_data import CONVERSATION_ROWS, Conversations
from ..train.training_config import DataConfig, add_training_flags

SAMPLE_QUESTIONS = ["Hello! How are you?", "What is 7 plus 5?", "Who wrote Hamlet?"]

MID = Stage(
    phase="mid",
    title="mid-training",
    start=FromRun("base_run", "base_step", phases=("base",)),  # the weights of a base run's checkpoint
    data=CONVERSATION_ROWS,  # packed conversation rows, only the assistant's tokens trained on
    horizon=one_epoch,  # one epoch of the mixture, or --num-iterations
    sample=answer_questions(SAMPLE_QUESTIONS),
    next_step=next_steps.after_midtraining,  # chat_sft from this run
    run_name=lambda cfg, start: f"mid_{start.name}",
)


def add_conversation_flags(parser, data_group, extra_help: str):
    """--extra-conversations and the one-epoch horizon, as mid_train and chat_sft take them."""
    data_group.add_argument("--extra-conversations", type=Conversations, metavar="FILE.jsonl", help=extra_help)
    parser.add_argument_group("horizon").add_argument(
        "--num-iterations",
        type=cli.positive_or_unset_int,
        default=-1,
        help="optimizer steps (-1: one epoch of the mixture)",
    )


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.mid_train", description=__doc__)
    MID.start.add_flags(p)
    g = DataConfig.add_flags(p, dataset="", max_seq_len=None)
    add_conversation_flags(
        p, g, "your own conversations: mixed in, or the whole training set without a conversation dataset"
    )
    add_training_flags(p, eval_every=150, sample_every=-1)
    return p


def main(argv=None) -> int:
    return run_stage(build_parser().parse_args(argv), MID)


if __name__ == "__main__":
    cli.run(main)
