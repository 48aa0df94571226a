"""
Train the BPE tokenizer on prepared text, then pre-tokenize every prepared dataset.

    python -m nanochat_fast.scripts.prepare_data    # first: the text shards
    python -m nanochat_fast.scripts.tok_train       # this: tokenizer/ + tokens/<dataset>/

Trains with rustbpe (GPT-4-style split pattern, the special tokens <|bos|>, <|user_start|>, ...) on the train
split of --dataset (default: base, or the only prepared dataset when base is not), at most --max-chars characters
with each document cut to --doc-cap. Writes tokenizer/ (ranks, pattern, special tokens) and
tokenizer/token_bytes.pt (the UTF-8 length of each token, 0 for special tokens: losses are reported in bits per
byte with it). Retraining changes the tokenizer's fingerprint, and the token shards are then rebuilt.
"""

import time

from ..core import cli, paths
from ..core.errors import UserError
from ..data import documents, token_shards
from ..data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, save_token_bytes
from ..train import next_steps
from ..train.env_vars import check_environment


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.tok_train", description=__doc__)
    p.add_argument(
        "--vocab-size",
        type=cli.positive_int,
        default=8192,
        help=f"vocabulary size including the special tokens (>= {MIN_VOCAB_SIZE})",
    )
    p.add_argument(
        "--max-chars", type=cli.positive_int, default=2_000_000_000, help="train on at most this many characters"
    )
    p.add_argument(
        "--doc-cap",
        type=cli.non_negative_int,
        default=10_000,
        help="use at most this many characters per document (0: all)",
    )
    p.add_argument(
        "--dataset",
        type=cli.plain_name,
        default="",
        help="prepared dataset (under data/) to train on ('': base, or the only one prepared)",
    )
    p.add_argument("--no-tokenize", action="store_true", help="only train; do not tokenize the prepared datasets")
    token_shards.add_tokenizing_flags(p)
    return p


VAL_CHARS = 20_000_000  # the compression printed after training is measured on at most this much val text


def capped_texts(name: str, split: str, max_chars: int, doc_cap: int = 0, counter: dict | None = None):
    """The texts of a split, each cut to doc_cap, until max_chars in all (counted in counter["chars"])."""
    counter = counter if counter is not None else {"chars": 0}
    for text in documents.iter_texts(name, split, doc_cap):
        text = text[: max_chars - counter["chars"]]
        counter["chars"] += len(text)
        yield text
        if counter["chars"] >= max_chars:
            return


def training_dataset(name: str) -> str:
    """--dataset, or base, or the only prepared dataset; a UserError listing them otherwise."""
    prepared = documents.prepared_datasets()
    if name or "base" in prepared or not prepared:
        return name or "base"  # (read_dataset_manifest then says how to prepare a missing one)
    if len(prepared) == 1:
        return prepared[0]
    raise UserError(
        f"data/base is not prepared and several datasets are ({', '.join(prepared)}): pick the one "
        f"to train the tokenizer on, e.g. --dataset={prepared[0]}"
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    if args.vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + the special tokens), got {args.vocab_size}"
        )
    args.dataset = training_dataset(args.dataset)
    manifest = documents.read_dataset_manifest(args.dataset)  # a clear error when the text is not prepared yet
    counter, t0 = {"chars": 0}, time.time()
    texts = capped_texts(args.dataset, "train", args.max_chars, args.doc_cap, counter)
    tokenizer = Tokenizer.train(texts, args.vocab_size)
    train_s = time.time() - t0
    out = tokenizer.save(paths.tokenizer_dir())
    save_token_bytes(tokenizer, out)
    print(
        f"trained a {tokenizer.get_vocab_size():,}-token tokenizer on {counter['chars']:,} characters of "
        f"data/{args.dataset} in {train_s:.1f}s -> {out} (fingerprint {tokenizer.fingerprint})"
    )
    if tokenizer.get_vocab_size() < args.vocab_size:
        print(
            f"note: the text supplies fewer merges than --vocab-size={args.vocab_size} asks for; "
            "the vocabulary is smaller"
        )

    val = list(capped_texts(args.dataset, "val", VAL_CHARS))  # a published set's val shard is ~250M characters
    n_chars = sum(map(len, val))
    n_tokens = sum(map(len, tokenizer.encode(val, num_threads=args.num_threads)))
    if n_tokens:
        print(
            f"val compression: {n_chars / n_tokens:.2f} characters per token "
            f"({n_chars:,} characters -> {n_tokens:,} tokens)"
        )

    if not args.no_tokenize:
        for name in documents.prepared_datasets():
            totals = token_shards.tokenize_dataset(
                name, tokenizer, num_threads=args.num_threads, memory_mb=args.max_memory_mb
            )
            print(f"tokens/{name}: {totals['docs']:,} documents, {totals['tokens']:,} tokens")
            if name == args.dataset:
                trained_on = totals["tokens"]
        next_steps.after_tokens(args.dataset, manifest["kind"], trained_on)
    return 0


if __name__ == "__main__":
    cli.run(main)
