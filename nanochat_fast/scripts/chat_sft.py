"""
Supervised fine-tuning: teach a mid-trained (or base) model to answer, on conversations with the
loss only on the assistant's tokens, one conversation per row (padded, not packed), as nanochat's
chat_sft does. Ends after one epoch of the mixture (or --num-iterations steps).

    python -m nanochat_fast.scripts.chat_sft                          # newest mid run, else newest base run
    python -m nanochat_fast.scripts.chat_sft --source-run=mid_d20 --device-batch-size=4
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.chat_sft -- --source-run=mid_d20

The default mixture, from what is prepared here:
    chat                    the conversation dataset (--dataset, default chat: prepare_data --datasets=chat)
    ARC-Easy, ARC-Challenge their validation splits        (prepare_data --datasets=eval)
    MMLU                    its dev and validation splits
    GSM8K                   the eight worked examples of its few-shot pool, calculator calls included
    SpellingBee             600 words of its train split (none of them in its test split)
    --extra-conversations   your own, JSONL lines {"messages": [{"role": "user", "content": ...}, ...]}
Validation (val bpb) reads the conversation dataset's val split; without one, every 50th
conversation of the mixture is held out instead. The evaluated splits are never trained on.

A batch is --target-examples-per-step conversations (--device-batch-size per micro-step and
process, accumulated); the loss of a step is the sum over the assistant's tokens divided by their
count over the whole step on all processes. Learning rates default to nanochat's SFT (2% of the
pretraining rates) with a linear decay to zero (--warmdown-ratio=1). --chat-eval-examples scores
ARC-Easy and MMLU (letter logits) at every evaluation, as nanochat's SFT does.
"""
from pathlib import Path

from .. import cli, eval_data, evaluation, next_steps, tasks
from ..common import print0
from ..config import DataConfig, add_training_flags
from ..dataset import CHAT, TokenShards
from ..errors import UserError
from ..padded_conversations import PaddedConversations
from ..paths import tokens_dir
from ..stage import FromRun, Stage, answer_questions, one_epoch, run_stage
from ..training_data import VAL_EVERY, ConversationShards, Conversations
from .mid_train import SAMPLE_QUESTIONS

LR_FRACTION = 0.02  # nanochat's SFT trains at 2% of the pretraining learning rates
TASK_LIMITS = {"SpellingBee": 600}  # examples taken from a task's train split (None: all)
IN_TRAINING_EVAL_TASKS = ("ARC-Easy", "MMLU")  # categorical, so cheap enough to run at every eval


def prepared_conversation_shards(dataset: str, split: str, tokenizer) -> TokenShards:
    shards = TokenShards(dataset, split)
    if shards.kind != CHAT:
        raise UserError(f"dataset {dataset!r} holds prose, not conversations: pass a conversation dataset "
                        "(e.g. --dataset=chat)")
    if shards.fingerprint != tokenizer.fingerprint:
        raise UserError(f"the token shards in {shards.directory} were made with another tokenizer; re-tokenize with "
                        "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`")
    return shards


def task_conversations() -> tuple[list[tuple[str, list]], list[str]]:
    """[(name, conversations)] of every chat task's train splits that are prepared, and the names of
    the tasks left out because their data is not."""
    found, missing = [], []
    for task in tasks.CHAT_TASKS:
        if not task.train_splits:
            continue
        if eval_data.read_manifest(task.folder) is None:
            missing.append(task.name)
            continue
        for split in task.train_splits:
            examples = task.load(split, max_examples=TASK_LIMITS.get(task.name))
            found.append((f"{task.name} {split}", [task.conversation(ex) for ex in examples]))
    return found, missing


def sft_sources(args, cfg, tokenizer):
    """(train parts, val parts, dataset name, notes) of the mixture in the module docstring."""
    dataset = cfg.data.dataset or "chat"
    use_dataset = bool(cfg.data.dataset) or tokens_dir(dataset).is_dir()
    in_memory, notes = task_conversations()
    if notes:
        notes = [f"{', '.join(notes)} left out: no evaluation data (`python -m nanochat_fast.scripts.prepare_data "
                 "--datasets=eval` adds them)"]
    extra = args.extra_conversations
    if extra:
        in_memory.append((Path(str(extra)).name, list(extra)))
    if not use_dataset and not in_memory:
        raise UserError(f"nothing to fine-tune on: no conversation dataset ({tokens_dir(dataset)}) and no evaluation "
                        "data; prepare them with `python -m nanochat_fast.scripts.prepare_data --datasets=chat,eval`, "
                        "or bring your own conversations with --extra-conversations=FILE.jsonl")
    if use_dataset:
        train = [(dataset, prepared_conversation_shards(dataset, "train", tokenizer))]
        val = [(dataset, prepared_conversation_shards(dataset, "val", tokenizer))]
        train += [(name, ConversationShards(convs, tokenizer, name)) for name, convs in in_memory]
        return train, val, dataset, notes
    # no conversation dataset: every VAL_EVERY-th conversation of each source is held out for val bpb
    train, val = [], []
    for name, convs in in_memory:
        kept = [c for i, c in enumerate(convs) if i % VAL_EVERY]
        if kept:
            train.append((name, ConversationShards(kept, tokenizer, name)))
        val.append((name, ConversationShards(convs[::VAL_EVERY], tokenizer, f"{name} (val)")))
    if not train:
        raise UserError(f"--extra-conversations {extra} holds one conversation; training on it alone needs at least "
                        f"2 (every {VAL_EVERY}th, from the first, is held out for validation)")
    notes.append(f"no conversation dataset prepared: every {VAL_EVERY}th conversation is held out for val bpb")
    return train, val, "conversations:" + "+".join(name.split()[0] for name, _ in in_memory), notes


def chat_evals(max_examples: int):
    """The stage's in-training evaluations: accuracy on IN_TRAINING_EVAL_TASKS (at most
    max_examples each, the same examples every time), counted over every rank."""
    def make(cfg, tokenizer, dev):
        chosen = [tasks.get(name) for name in IN_TRAINING_EVAL_TASKS]
        missing = [t.name for t in chosen if eval_data.read_manifest(t.folder) is None]
        if max_examples == 0 or missing:
            if max_examples:
                print0(f"note: no in-training chat evaluation: no evaluation data for {', '.join(missing)} "
                       "(`python -m nanochat_fast.scripts.prepare_data --datasets=eval`)")
            return lambda model: {}
        loaded = [(task, task.load(max_examples=max_examples)) for task in chosen]

        def evaluate(model):
            return {f"{task.name.lower().replace('-', '_')}_acc": evaluation.chat_task(
                model, tokenizer, task, examples, dev.rank, dev.world_size,
                batch_size=2 * cfg.data.device_batch_size).accuracy for task, examples in loaded}
        return evaluate
    return make


def stage(args) -> Stage:
    """The SFT stage. Its batch (--target-examples-per-step) and its evaluations are its own flags,
    so the data object and the evaluations are made from them."""
    return Stage(
        phase="sft", title="supervised fine-tuning",
        start=FromRun("source_run", "source_step", phases=("mid", "base")),  # a mid run, else a base run
        data=PaddedConversations(args.target_examples_per_step, sft_sources),  # a conversation per row
        horizon=one_epoch,                  # one epoch of the mixture, or --num-iterations
        sample=answer_questions(SAMPLE_QUESTIONS),
        evals=(("chat", chat_evals(args.chat_eval_examples)),),
        next_step=next_steps.after_sft,
        run_name=lambda cfg, start: f"sft_{start.name}",
    )


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_sft", description=__doc__)
    g = p.add_argument_group("starting point")
    g.add_argument("--source-run", type=cli.run_ref, default="",
                   help="mid or base run (name or directory) to start from (default: the newest mid run, else the "
                        "newest base run)")
    g.add_argument("--source-step", type=cli.non_negative_int, default=None,
                   help="checkpoint step of the source run (default: newest)")
    g = DataConfig.add_flags(p, only={"dataset", "max_seq_len", "device_batch_size"}, max_seq_len=None,
                             device_batch_size=4)
    g.add_argument("--target-examples-per-step", type=cli.positive_int, default=32,
                   help="conversations per optimizer step, all processes (a multiple of device_batch_size x processes)")
    g.add_argument("--extra-conversations", type=Conversations, default=None, metavar="FILE.jsonl",
                   help="your own conversations, added to the mixture")
    p.add_argument_group("horizon").add_argument("--num-iterations", type=cli.positive_or_unset_int, default=-1,
                                                 help="optimizer steps (-1: one epoch of the mixture)")
    p.add_argument_group("chat evaluation").add_argument(
        "--chat-eval-examples", type=cli.non_negative_int, default=1024,
        help=f"examples of {' and '.join(IN_TRAINING_EVAL_TASKS)} scored at every evaluation (0: none)")
    # eager by default: padded rows change length every batch (PaddedConversations.varying_shapes)
    add_training_flags(p, eval_every=100, sample_every=-1, embedding_lr=0.2 * LR_FRACTION,
                       unembedding_lr=0.004 * LR_FRACTION, matrix_lr=0.02 * LR_FRACTION, warmdown_ratio=1.0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_stage(args, stage(args))


if __name__ == "__main__":
    cli.run(main)
