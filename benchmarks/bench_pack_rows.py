"""Packing training rows from pre-tokenized documents, B=32 rows of T=2048 (+1) tokens.

Variants, all fed the same documents: the seeds' deque packer (no BOS alignment) and its faster list
form, the loader's step in plain Python (best fit), the compiled pack_rows op alone and the compiled
RowStream (pack and refill). A loader comparison times TokenRowLoader.next() with and without its
prefetch thread against the op; the waste test packs three epochs of the corpus at T=512 and T=2048.
What each variant is and why the loader comparison is set up as it is:
docs/measurements.md#benchmark-packing.

Documents: the default corpus (tokens/base under NANOCHAT_FAST_HOME, from `make demo` or
prepare_data + tok_train) when it is there, else synthetic documents with a similar length spread.

    .venv/bin/python -m pytest benchmarks/bench_pack_rows.py --benchmark-json=/tmp/pack.json -p no:cacheprovider
"""

import collections
import itertools

import numpy as np
import pytest
import torch
from harness import compare

from nanochat_fast.core import paths
from nanochat_fast.data.dataloader import DocStream, TokenRowLoader, make_row_stream
from nanochat_fast.data.token_shards import TokenShards, write_token_shard
from nanochat_fast.kernels import pack_rows

B, T = 32, 2048
BUFFER = 1000
BATCHES = 8
LOADER_BATCHES = 64
HELD = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokens_root, dataset name, description)."""
    if (paths.tokens_dir("base") / "train").is_dir():
        shards = TokenShards("base", "train")
        return (
            paths.home() / "tokens",
            "base",
            f"default corpus ({shards.n_docs:,} documents, {shards.n_tokens:,} tokens)",
        )
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.4, 0.6, 6000), 16, 3000).astype(int)  # ~ the default corpus' spread
    bos = 8191
    docs = [np.concatenate([[bos], rng.integers(0, bos, n - 1)]) for n in lengths]
    meta = {"tokenizer": "synthetic", "bos_id": bos, "vocab_size": 8192, "kind": "text"}
    write_token_shard(root / "synthetic" / "train", "shard_00000", docs, None, np.uint16, meta)
    return (
        root,
        "synthetic",
        f"synthetic documents ({len(docs):,}, {int(lengths.sum()):,} tokens; no default corpus found)",
    )


def doc_arrays(root, dataset):
    shards = TokenShards(dataset, "train", root)
    docs = [
        tokens[a:b].astype(np.int32)
        for tokens, offsets in zip(shards.tokens, shards.offsets)
        for a, b in zip(offsets[:-1], offsets[1:])
    ]
    return docs, shards.bos_id


def deque_packer(docs, per_token):
    """The seeds' packer: a token deque, `needed` tokens popped per batch (documents as lists)."""
    lists = itertools.cycle([d.tolist() for d in docs])
    token_buffer = collections.deque()
    needed = B * T + 1
    scratch = torch.empty(needed, dtype=torch.int64)

    def step():
        nonlocal scratch
        while len(token_buffer) < needed:
            token_buffer.extend(next(lists))
        if per_token:
            for i in range(needed):
                scratch[i] = token_buffer.popleft()
        else:
            scratch = torch.tensor([token_buffer.popleft() for _ in range(needed)], dtype=torch.int64)
        return scratch[:-1].view(B, T), scratch[1:].view(B, T)

    return step


def stream_packer(root, dataset, backend):
    shards = TokenShards(dataset, "train", root)
    stream = make_row_stream(DocStream(shards, with_mask=False), B, T + 1, shards.bos_id, BUFFER, backend=backend)
    return lambda: stream.next(0, B, pairs=False)


def op_packer(docs, bos):
    buffer = docs[:BUFFER]
    tokens = torch.from_numpy(np.concatenate(buffer))
    offsets = torch.from_numpy(np.cumsum([0] + [len(d) for d in buffer]).astype(np.int64))
    out = torch.empty(B, T + 1, dtype=torch.int64)
    return lambda: pack_rows(tokens, offsets, out, bos)


def one_at_a_time(take, n):
    """Take n batches, each released before the next (as a training loop does with its micro-batches)."""

    def run():
        for _ in range(n):
            take()

    return run


def rate(seconds, batches=1):
    return f"{batches * B * T / seconds / 1e6:,.0f} M tokens/s"


def test_pack_rows_throughput(benchmark, corpus):
    root, dataset, what = corpus
    docs, bos = doc_arrays(root, dataset)
    packers = {
        "deque (seed)": deque_packer(docs, per_token=True),
        "deque (list)": deque_packer(docs, per_token=False),
        "python best-fit": stream_packer(root, dataset, "reference"),
        "cpp pack_rows": op_packer(docs, bos),
        "cpp RowStream": stream_packer(root, dataset, "cpp"),
    }
    variants = {name: one_at_a_time(f, BATCHES) for name, f in packers.items()}
    medians = compare(
        benchmark,
        op="pack_rows",
        shape_set=f"{BATCHES} batches of B={B}, T={T}, {what}",
        variants=variants,
        baseline="deque (list)",
        rounds=5,
        warmup_rounds=1,
    )
    speedup = medians["deque (list)"] / medians["cpp pack_rows"]
    benchmark.extra_info["notes"] = (
        "; ".join(f"{name}: {rate(s, BATCHES)}" for name, s in medians.items())
        + f"; cpp pack_rows is {speedup:,.0f}x deque (list), "
        f"{medians['deque (seed)'] / medians['cpp pack_rows']:,.0f}x deque (seed)"
    )
    print("\n" + benchmark.extra_info["notes"])


def test_loader_keeps_up(benchmark, corpus):
    root, dataset, what = corpus
    docs, bos = doc_arrays(root, dataset)
    op = op_packer(docs, bos)
    outs = [torch.empty(B, T + 1, dtype=torch.int64) for _ in range(HELD)]
    buffer = docs[:BUFFER]
    tokens = torch.from_numpy(np.concatenate(buffer))
    offsets = torch.from_numpy(np.cumsum([0] + [len(d) for d in buffer]).astype(np.int64))

    def make(**kw):
        return TokenRowLoader(
            dataset=dataset, tokens_root=root, device_batch_size=B, seq_len=T, buffer_docs=BUFFER, **kw
        )

    loader, inline, held = make(), make(prefetch=False), make()

    def in_groups(take_group):  # a group of HELD batches is released together, as a step's micro-batches are
        def run():
            for _ in range(LOADER_BATCHES // HELD):
                take_group()

        return run

    shards = TokenShards(dataset, "train", root)
    rows = make_row_stream(DocStream(shards, with_mask=False), B, T + 1, shards.bos_id, BUFFER)
    rows.start(2, 0, B, pairs=False)

    try:
        variants = {
            "cpp pack_rows": one_at_a_time(op, LOADER_BATCHES),
            "loader (prefetch thread)": one_at_a_time(lambda: next(loader), LOADER_BATCHES),
            "loader (no prefetch)": one_at_a_time(lambda: next(inline), LOADER_BATCHES),
            "loader rows (prefetch thread)": one_at_a_time(rows.get, LOADER_BATCHES),
            f"cpp pack_rows, {HELD} held": in_groups(lambda: [pack_rows(tokens, offsets, out, bos) for out in outs]),
            f"loader, {HELD} held": in_groups(lambda: [next(held) for _ in range(HELD)]),
        }
        medians = compare(
            benchmark,
            op="pack_rows",
            shape_set=f"{LOADER_BATCHES} batches of B={B}, T={T}, {what}",
            variants=variants,
            baseline="cpp pack_rows",
            rounds=21,
            warmup_rounds=2,
        )
    finally:
        for each in (loader, inline, held):
            each.close()
        rows.stop()

    def ratio(name, baseline="cpp pack_rows"):  # rate of `name` / rate of `baseline`
        return f"{medians[baseline] / medians[name]:.2f}x"

    benchmark.extra_info["notes"] = (
        "; ".join(f"{name}: {rate(s, LOADER_BATCHES)}" for name, s in medians.items())
        + f"; packing the op's B x (T+1) rows (for a GPU), the loader runs at {ratio('loader rows (prefetch thread)')} "
        f"the op's rate; delivering next() -> (inputs, targets) on the CPU (twice the bytes) at "
        f"{ratio('loader (prefetch thread)')} with its prefetch thread, {ratio('loader (no prefetch)')} without; "
        f"with {HELD} batches held at {ratio(f'loader, {HELD} held', f'cpp pack_rows, {HELD} held')} the op "
        f"writing {HELD} buffers"
    )
    print("\n" + benchmark.extra_info["notes"])


def literal_op_waste(docs, bos, row_len, epochs=3):
    """The spec's usage of the op: a 1000-document buffer, used documents replaced by fresh ones."""
    stream = itertools.cycle(docs)
    buffer = [next(stream) for _ in range(BUFFER)]
    out = torch.empty(B, row_len, dtype=torch.int64)
    used_tokens = cropped_tokens = 0
    for _ in range(int(epochs * sum(map(len, docs)) / (B * row_len))):
        tokens = torch.from_numpy(np.concatenate(buffer))
        offsets = torch.from_numpy(np.cumsum([0] + [len(d) for d in buffer]).astype(np.int64))
        used, n_used, n_cropped = pack_rows(tokens, offsets, out, bos)
        used_tokens, cropped_tokens = used_tokens + n_used, cropped_tokens + n_cropped
        buffer = [next(stream) if u else d for d, u in zip(buffer, used.tolist())]
    return cropped_tokens / (used_tokens + cropped_tokens)


def test_token_waste(benchmark, corpus):
    root, dataset, what = corpus
    docs, bos = doc_arrays(root, dataset)
    waste = {}

    def epochs(seq_len):
        def run():
            with TokenRowLoader(
                dataset=dataset,
                tokens_root=root,
                device_batch_size=B,
                seq_len=seq_len,
                buffer_docs=BUFFER,
                prefetch=False,
            ) as loader:
                while loader.epoch_progress < 3:
                    next(loader)
                waste[seq_len] = loader.cropped_fraction

        return run

    compare(
        benchmark,
        op="pack_rows",
        shape_set=f"3 epochs, B={B}, {what}",
        variants={"loader T=512": epochs(512), "loader T=2048": epochs(2048)},
        baseline="loader T=2048",
        rounds=3,
        warmup_rounds=0,
    )
    literal = {t: literal_op_waste(docs, bos, t + 1) for t in (512, 2048)}
    benchmark.extra_info["notes"] = (
        "token waste (cropped fraction of the tokens taken from documents) of best-fit packing: "
        + ", ".join(f"T={t}: {waste[t]:.1%} (loader), {literal[t]:.1%} (op on a refilled buffer)" for t in (512, 2048))
        + "; the concatenating deque packer crops nothing but its rows do not start at documents"
    )
    print("\n" + benchmark.extra_info["notes"])
