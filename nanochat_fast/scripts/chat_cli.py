"""
Chat with a fine-tuned (or mid-trained) model in the terminal (KV-cached generation).

    python -m nanochat_fast.scripts.chat_cli                       # newest sft run, else newest mid run
    python -m nanochat_fast.scripts.chat_cli --prompt="What is 2 plus 3?"
    python -m nanochat_fast.scripts.chat_cli --run=mid_base_d4 --temperature=0.8 --top-k=40

Interactive commands: 'clear' starts a new conversation, 'quit' (or Ctrl-D) leaves.
"""

import sys
from functools import partial

from .. import checkpoints
from ..core import cli
from ..core.distributed import torn_down
from ..data.tokenizer import get_tokenizer
from ..model import generation, generation_dtype, loading
from ..train.env_vars import check_environment
from ..train.training_config import DeviceConfig


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_cli", description=__doc__)
    cli.add_checkpoint_flags(p, newest="the newest sft run, else the newest mid run")
    p.add_argument("--prompt", default="", help="answer this one message and exit")
    p.add_argument("--temperature", type=cli.non_negative_float, default=0.6, help="0 = greedy")
    p.add_argument("--top-k", type=cli.positive_int, default=50, help="sample among the k likeliest tokens")
    p.add_argument(
        "--max-tokens",
        type=cli.positive_int,
        default=256,
        help="longest reply, in tokens (at most half the model's context)",
    )
    p.add_argument("--seed", type=cli.random_seed, default=42, help="sampling seed")
    DeviceConfig.add_flags(p)
    return p


def reply(model, tokenizer, messages, args, dev) -> str:
    """The assistant's next message (in the run's compute dtype), streamed to stdout."""
    print("Assistant: ", end="")
    sampling = (args.max_tokens, args.temperature, args.top_k, args.seed)
    with dev.autocast():
        text = generation.assistant_reply(
            model, tokenizer, messages, *sampling, on_text=partial(print, end="", flush=True)
        )
    print()
    return text


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    with torn_down():
        return chat(args, DeviceConfig.from_args(args).init())


def chat(args, dev) -> int:
    tokenizer = get_tokenizer()
    run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid"))
    model, ckpt, meta = loading.load_model(run_dir, args.step, dev.device, tokenizer)
    if meta["phase"] == "base":
        print(f"note: {ckpt} is a base (not mid-trained) checkpoint: it has not learned to chat", file=sys.stderr)
    # one reply at a time: on a CPU, auto times that mix in fp32 and bf16 (model/generation_dtype.py)
    mix = generation_dtype.chat_mix(model.config, 1, args.max_tokens)
    dev = generation_dtype.for_generation(dev, args.dtype, model, mix)
    if args.prompt:
        reply(model, tokenizer, [{"role": "user", "content": args.prompt}], args, dev)
        return 0
    print(f"chatting with {ckpt} ('clear' to restart, 'quit' or Ctrl-D to leave)")
    messages = []
    while True:
        try:
            text = input("\nYou: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text in ("quit", "exit"):
            return 0
        if text == "clear":
            messages = []
        elif text:
            messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": reply(model, tokenizer, messages, args, dev)})


if __name__ == "__main__":
    cli.run(main)
