"""
Mid-train a base model on conversations: the chat special tokens (<|user_start|>, ...) and the
turn-taking format, with the loss only on the assistant's tokens. Ends after one epoch of the
conversation mixture (or --num-iterations steps).

    python -m nanochat_fast.scripts.mid_train --device-batch-size=8 --total-batch-size=8192
    python -m nanochat_fast.scripts.mid_train --base-run=base_d4 --extra-conversations=my_chats.jsonl

--extra-conversations takes JSONL lines {"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}, mixed into the stream. The loss of a step is the
sum over supervised tokens divided by their count over the whole step on all processes, so masked
targets weigh the same on 1 or N processes.
"""
import json
from pathlib import Path

from .. import checkpoint, cli, generation, runs
from ..cli import UserError
from ..common import compute_cleanup, compute_init, print0
from ..dataloader import ConversationRowLoader
from ..gpt import GPT
from ..runs import add_loop_args, add_optim_args, add_run_args
from ..tokenizer import get_token_bytes, get_tokenizer

SAMPLE_QUESTIONS = ["Hello! How are you?", "What is 7 plus 5?", "Who wrote Hamlet?"]


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.mid_train", description=__doc__)
    g = p.add_argument_group("starting point")
    g.add_argument("--base-run", default="", help="base run to start from (default: the newest base run)")
    g.add_argument("--base-step", type=int, default=None, help="checkpoint step of the base run (default: newest)")
    g = p.add_argument_group("data and batch")
    g.add_argument("--dataset", default="chat", help="conversation dataset under NANOCHAT_FAST_HOME/tokens/")
    g.add_argument("--extra-conversations", default="", metavar="FILE.jsonl", help="more conversations to mix in")
    g.add_argument("--max-seq-len", type=cli.positive_int, default=None, help="context length (default: the base model's)")
    g.add_argument("--device-batch-size", type=cli.positive_int, default=32, help="rows per micro-step per process")
    g.add_argument("--total-batch-size", type=cli.positive_int, default=524288, help="tokens per optimizer step, all processes")
    g.add_argument("--num-iterations", type=int, default=-1, help="optimizer steps (-1: one epoch of the mixture)")
    add_optim_args(p)
    add_loop_args(p, eval_every=150, sample_every=-1)
    add_run_args(p)
    return p


def read_conversations(path: str) -> list[dict]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--extra-conversations {path}: no such file")
    conversations = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            conv = json.loads(line)
            messages = conv["messages"]
            ok = isinstance(messages, list) and messages and all(
                m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str) for m in messages)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise UserError(f"--extra-conversations {path} line {n}: expected "
                            '{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}')
        conversations.append(conv)
    if not conversations:
        raise UserError(f"--extra-conversations {path} holds no conversations")
    return conversations


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device_type, seed=args.seed,
                                                             deterministic=args.deterministic)
    loader = None
    try:
        extra = read_conversations(args.extra_conversations) if args.extra_conversations else None
        tokenizer = get_tokenizer()
        base_dir = runs.run_dir_of(args.base_run, "base")
        base_ckpt, base_meta, config = runs.open_checkpoint(base_dir, args.base_step, tokenizer)
        if base_meta.get("phase") != "base":
            raise UserError(f"--base-run {base_dir}: {base_ckpt} is a {base_meta.get('phase')} checkpoint, not a base one")
        args.max_seq_len = args.max_seq_len or config.sequence_len
        if args.max_seq_len > config.sequence_len:
            raise UserError(f"--max-seq-len {args.max_seq_len} is above the base model's sequence_len "
                            f"{config.sequence_len}; use at most {config.sequence_len}")
        grad_accum_steps = runs.grad_accum_steps(args, world_size)

        run_name = args.run or f"mid_{base_dir.name}"
        run_dir, ckpt, meta = runs.open_run_dir(args, run_name, rank, phase="mid", device=device)
        if ckpt is not None:
            runs.check_compatible(meta, ckpt, config, tokenizer)
        model_state = checkpoint.load_model_state(ckpt or base_ckpt, device)
        model, orig_model, optimizers = runs.build_model(GPT, config, device, args, model_state)
        token_bytes = get_token_bytes(device=device)

        loader = ConversationRowLoader(dataset=args.dataset, split="train", device_batch_size=args.device_batch_size,
                                       seq_len=args.max_seq_len, rank=rank, world_size=world_size, device=device,
                                       extra_conversations=extra, tokenizer=tokenizer)
        runs.check_shards(loader, tokenizer)
        num_iterations = args.num_iterations if args.num_iterations > 0 else None
        progress = (lambda step: step / num_iterations) if num_iterations else (lambda step: loader.epoch_progress)

        def val_batches():
            return runs.val_batches(ConversationRowLoader, dataset=args.dataset, eval_tokens=args.eval_tokens,
                                    device_batch_size=args.device_batch_size, seq_len=args.max_seq_len,
                                    rank=rank, world_size=world_size, device=device, tokenizer=tokenizer)

        def sample():
            return [f"{q} -> {generation.assistant_reply(orig_model, tokenizer, [{'role': 'user', 'content': q}], 32)}"
                    for q in SAMPLE_QUESTIONS]

        run = runs.make_run(
            args, model=model, orig_model=orig_model, optimizers=optimizers, loader=loader, val_batches=val_batches,
            token_bytes=token_bytes, run_dir=run_dir, grad_accum_steps=grad_accum_steps,
            tokens_per_step=args.total_batch_size, num_iterations=num_iterations, progress=progress,
            epoch_done=lambda: loader.epochs_done >= 1, sample=sample, config=config, tokenizer=tokenizer,
            phase="mid", device=device, rank=rank, world_size=world_size, argv=argv,
            extra_meta={"base_checkpoint": str(base_ckpt)})
        print0(runs.summary(run, config, orig_model, extra={
            "starting from": str(base_ckpt),
            "horizon": f"{num_iterations} steps" if num_iterations else "one epoch of the conversation mixture"}))
        return runs.train_and_report(run, ckpt, meta, title=f"mid-training: {run_name}")
    finally:
        if loader is not None:
            loader.close()
        compute_cleanup()


if __name__ == "__main__":
    cli.run(main)
