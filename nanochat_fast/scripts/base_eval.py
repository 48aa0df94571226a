"""
Evaluate a trained checkpoint: validation bits per byte, and a few sample completions.

    python -m nanochat_fast.scripts.base_eval                      # newest base run, newest checkpoint
    python -m nanochat_fast.scripts.base_eval --run=base_d4 --step=200 --eval-tokens=65536
    torchrun --nproc_per_node=8 -m nanochat_fast.scripts.base_eval -- --run=base_d20

Bits per byte (bpb) is the next-token loss in bits divided by the UTF-8 bytes of the predicted
tokens, so it compares models with different tokenizers. The val split of the run's dataset is
used (a mid-trained checkpoint is measured on the conversations, assistant tokens only).
"""

from .. import cli, generation, runs
from ..common import compute_cleanup, compute_init, print0
from ..dataloader import ConversationRowLoader, TokenRowLoader
from ..gpt import GPT
from ..tokenizer import get_token_bytes, get_tokenizer
from ..training import evaluate_bpb
from .base_train import DEFAULT_PROMPTS


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.base_eval", description=__doc__)
    p.add_argument("--run", default="", help="run name or directory (default: the newest base run)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--dataset", default="", help="dataset to evaluate on (default: the one the run trained on)")
    p.add_argument("--eval-tokens", type=cli.positive_int, default=20 * 2048 * 8, help="validation tokens")
    p.add_argument("--device-batch-size", type=cli.positive_int, default=8, help="rows per forward pass per process")
    p.add_argument("--samples", type=cli.non_negative_int, default=len(DEFAULT_PROMPTS), help="completions to print")
    p.add_argument("--max-tokens", type=cli.positive_int, default=24, help="tokens per completion")
    p.add_argument("--device-type", default="", choices=["", "cpu", "cuda", "mps"], help="'' = autodetect")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device_type)
    try:
        tokenizer = get_tokenizer()
        run_dir = runs.run_dir_of(args.run, "base")
        model, ckpt, meta = runs.load_model(run_dir, args.step, device, tokenizer, GPT)
        seq_len = model.config.sequence_len
        chat = meta["phase"] == "mid"
        dataset = args.dataset or meta["args"].get("dataset") or ("chat" if chat else "base")
        Loader = ConversationRowLoader if chat else TokenRowLoader
        extra = {"tokenizer": tokenizer} if chat else {}
        batches = runs.val_batches(Loader, dataset=dataset, eval_tokens=args.eval_tokens,
                                   device_batch_size=args.device_batch_size, seq_len=seq_len, rank=rank,
                                   world_size=world_size, device=device, **extra)
        bpb = evaluate_bpb(model, batches, get_token_bytes(device=device), runs.autocast_context(device))
        print0(f"checkpoint: {ckpt}")
        print0(f"val bpb ({dataset} val split, up to {args.eval_tokens:,} tokens): {bpb:.4f}")
        if rank == 0:
            for prompt in DEFAULT_PROMPTS[:args.samples]:
                print(f"  {prompt!r} -> {generation.complete(model, tokenizer, prompt, args.max_tokens)!r}")
        return 0
    finally:
        compute_cleanup()


if __name__ == "__main__":
    cli.run(main)
