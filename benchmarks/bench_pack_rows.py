"""Packing training rows from pre-tokenized documents, B=32 rows of T=2048 (+1) tokens.

Variants, all fed the same documents:
  deque (seed)           nanochat's mid_train packer as in the seeds: token_buffer.extend(doc),
                         then scratch[i] = token_buffer.popleft() per token (no BOS alignment)
  deque (list)           nanochat's base loader's faster form of it: a list of popleft() -> torch.tensor
  python best-fit        the plain-Python best-fit packer (RowPackerReference) over a 1000-document buffer
  cpp pack_rows          the compiled op on a fixed 1000-document buffer (the packing alone)
  cpp RowPacker          the loader's packing step: pack from its buffer, then refill it from the shards
Each variant packs 8 consecutive batches per timed call (the steady state of a loader). The loader
comparison times 16 batches per variant: TokenRowLoader.next() with and without its prefetch
thread, against the op. The waste test packs three epochs of the corpus at T=512 and T=2048.

Documents: the default corpus (tokens/base under NANOCHAT_FAST_HOME, from `make demo` or
prepare_data + tok_train) when it is there, else synthetic documents with a similar length spread.

    cd /work/main && .venv/bin/python -m pytest benchmarks/bench_pack_rows.py --benchmark-json=/tmp/pack.json -p no:cacheprovider
"""
import collections
import itertools

import numpy as np
import pytest
import torch

from harness import compare
from nanochat_fast import paths
from nanochat_fast.dataloader import DocStream, RowStream, TokenRowLoader
from nanochat_fast.dataset import TokenShards, write_token_shard
from nanochat_fast.kernels import pack_rows

B, T = 32, 2048
BUFFER = 1000
BATCHES = 8
LOADER_BATCHES = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokens_root, dataset name, description)."""
    if (paths.tokens_dir("base") / "train").is_dir():
        shards = TokenShards("base", "train")
        return paths.home() / "tokens", "base", f"default corpus ({shards.n_docs:,} documents, {shards.n_tokens:,} tokens)"
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.4, 0.6, 6000), 16, 3000).astype(int)  # ~ the default corpus' spread
    bos = 8191
    docs = [np.concatenate([[bos], rng.integers(0, bos, n - 1)]) for n in lengths]
    meta = {"tokenizer": "synthetic", "bos_id": bos, "vocab_size": 8192, "kind": "text"}
    write_token_shard(root / "synthetic" / "train", "shard_00000", docs, None, np.uint16, meta)
    return root, "synthetic", f"synthetic documents ({len(docs):,}, {int(lengths.sum()):,} tokens; no default corpus found)"


def doc_arrays(root, dataset):
    shards = TokenShards(dataset, "train", root)
    docs = [tokens[a:b].astype(np.int32) for tokens, offsets in zip(shards.tokens, shards.offsets)
            for a, b in zip(offsets[:-1], offsets[1:])]
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
    stream = RowStream(DocStream(shards, with_mask=False), B, T + 1, BUFFER, shards.bos_id, backend)
    out = torch.empty(B, T + 1, dtype=torch.int64)
    return lambda: stream.pack(out, 0)


def op_packer(docs, bos):
    buffer = docs[:BUFFER]
    tokens = torch.from_numpy(np.concatenate(buffer))
    offsets = torch.from_numpy(np.cumsum([0] + [len(d) for d in buffer]).astype(np.int64))
    out = torch.empty(B, T + 1, dtype=torch.int64)
    return lambda: pack_rows(tokens, offsets, out, bos)


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
        "cpp RowPacker": stream_packer(root, dataset, "cpp"),
    }
    variants = {name: (lambda f=f: [f() for _ in range(BATCHES)]) for name, f in packers.items()}
    medians = compare(benchmark, op="pack_rows", shape_set=f"{BATCHES} batches of B={B}, T={T}, {what}",
                      variants=variants, baseline="deque (list)", rounds=5, warmup_rounds=1)
    speedup = medians["deque (list)"] / medians["cpp pack_rows"]
    benchmark.extra_info["notes"] = (
        "; ".join(f"{name}: {rate(s, BATCHES)}" for name, s in medians.items())
        + f"; cpp pack_rows is {speedup:,.0f}x deque (list), "
        f"{medians['deque (seed)'] / medians['cpp pack_rows']:,.0f}x deque (seed)")
    print("\n" + benchmark.extra_info["notes"])


def test_loader_keeps_up(benchmark, corpus):
    root, dataset, what = corpus
    docs, bos = doc_arrays(root, dataset)
    op = op_packer(docs, bos)
    loader = TokenRowLoader(dataset=dataset, tokens_root=root, device_batch_size=B, seq_len=T, buffer_docs=BUFFER)
    inline = TokenRowLoader(dataset=dataset, tokens_root=root, device_batch_size=B, seq_len=T, buffer_docs=BUFFER,
                            prefetch=False)
    try:
        variants = {
            "cpp pack_rows": lambda: [op() for _ in range(LOADER_BATCHES)],
            "loader (prefetch thread)": lambda: [next(loader) for _ in range(LOADER_BATCHES)],
            "loader (no prefetch)": lambda: [next(inline) for _ in range(LOADER_BATCHES)],
        }
        medians = compare(benchmark, op="pack_rows", shape_set=f"{LOADER_BATCHES} batches of B={B}, T={T}, {what}",
                          variants=variants, baseline="cpp pack_rows", rounds=9, warmup_rounds=1)
    finally:
        loader.close()
        inline.close()
    benchmark.extra_info["notes"] = (
        "; ".join(f"{name}: {rate(s, LOADER_BATCHES)}" for name, s in medians.items())
        + f"; the loader (next() -> inputs, targets) runs at "
        f"{medians['cpp pack_rows'] / medians['loader (prefetch thread)']:.2f}x the op's rate")
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
            with TokenRowLoader(dataset=dataset, tokens_root=root, device_batch_size=B, seq_len=seq_len,
                                buffer_docs=BUFFER, prefetch=False) as loader:
                while loader.epoch_progress < 3:
                    next(loader)
                waste[seq_len] = loader.cropped_fraction
        return run
    compare(benchmark, op="pack_rows", shape_set=f"3 epochs, B={B}, {what}",
            variants={"loader T=512": epochs(512), "loader T=2048": epochs(2048)},
            baseline="loader T=2048", rounds=3, warmup_rounds=0)
    literal = {t: literal_op_waste(docs, bos, t + 1) for t in (512, 2048)}
    benchmark.extra_info["notes"] = (
        "token waste (cropped fraction of the tokens taken from documents) of best-fit packing: "
        + ", ".join(f"T={t}: {waste[t]:.1%} (loader), {literal[t]:.1%} (op on a refilled buffer)" for t in (512, 2048))
        + "; the concatenating deque packer crops nothing but its rows do not start at documents")
    print("\n" + benchmark.extra_info["notes"])
