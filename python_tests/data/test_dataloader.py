"""The row loaders: the global stream split over ranks, exact resume, conversation targets, the
prefetch thread's lifecycle, and clear errors for missing or broken token shards."""

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from nanochat_fast.core.cli import UserError
from nanochat_fast.data.dataloader import (
    MASK_SHIFT,
    ConversationRowLoader,
    DocStream,
    TokenRowLoader,
    make_row_stream,
)
from nanochat_fast.data.token_shards import TokenShards, write_token_shard
from nanochat_fast.kernels import registry

BOS = 0
N_DOCS = 90
needs_cpp = pytest.mark.skipif(registry.extension() is None, reason="the C++ extension is not built")


def doc_tokens(i, rng, max_len=40):
    """Document i: <|bos|> then its own token (i + 1) repeated, so any piece of it names it."""
    return [BOS] + [i + 1] * int(rng.integers(1, max_len))


def write_split(root, dataset, split, docs, masks=None, fingerprint="test", bos=BOS):
    """Token shards in the on-disk format, three shards of uneven size."""
    cuts = [0, len(docs) // 5, len(docs) // 2, len(docs)]
    meta = {"tokenizer": fingerprint, "bos_id": bos, "vocab_size": 1 << 12, "kind": "chat" if masks else "text"}
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        write_token_shard(
            root / dataset / split, f"shard_{k:05d}", docs[a:b], masks[a:b] if masks else None, np.uint16, meta
        )


@pytest.fixture(scope="module")
def tokens_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    docs = [doc_tokens(i, rng) for i in range(N_DOCS)]
    write_split(root, "toy", "train", docs)
    write_split(root, "toy", "val", docs[:12])
    write_split(root, "short", "train", [doc_tokens(i, rng, max_len=16) for i in range(N_DOCS)])
    return root


def loader(root, **kw):
    kw.setdefault("dataset", "toy")
    kw.setdefault("seq_len", 15)
    kw.setdefault("buffer_docs", 8)
    return TokenRowLoader(tokens_root=root, **kw)


def global_rows(loaders):
    """One micro-step of every rank, stacked in rank order: the global batch."""
    xs, ys = zip(*(next(dl) for dl in loaders))
    return torch.cat(xs), torch.cat(ys)


def consumed(state):
    """Stream positions consumed so far: read, and no longer waiting in the buffer."""
    return set(range(state["next_pos"])) - set(state["buffer"])


def segments(rows):
    """The document pieces in packed rows [B, T+1]: (doc id or None for a lone <|bos|>, length)."""
    out = []
    for row in rows.tolist():
        starts = [i for i, t in enumerate(row) if t == BOS] + [len(row)]
        assert starts[0] == 0, "a row starts with <|bos|>"
        for a, b in zip(starts, starts[1:]):
            body = row[a + 1 : b]
            assert len(set(body)) <= 1, "a piece is the start of one document"
            out.append((body[0] - 1 if body else None, b - a))
    return out


@pytest.mark.parametrize("dataset", ["toy", "short"])
def test_ranks_share_one_stream_and_cover_each_document_once(tokens_root, dataset):
    """Documents up to 40 tokens (most longer than a row of 16) and up to 16 (all fit a row)."""
    world, B = 3, 2
    ranks = [loader(tokens_root, dataset=dataset, device_batch_size=B, rank=r, world_size=world) for r in range(world)]
    single = loader(tokens_root, dataset=dataset, device_batch_size=B * world)
    seen, when = set(), {}
    for step in range(40):
        before = consumed(single.state_dict())
        x, y = global_rows(ranks)
        x1, y1 = next(single)
        assert torch.equal(x, x1) and torch.equal(y, y1), f"step {step}: N ranks x B rows != 1 rank x N*B rows"
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert all(r.state_dict() == single.state_dict() for r in ranks), "the state is the global cursor"
        # exactly the documents this step consumed appear in its rows, each once, whole unless cropped
        new = consumed(single.state_dict()) - before
        rows = torch.cat([x, y[:, -1:]], dim=1)
        pieces = segments(rows)
        assert len(pieces) == len(new), "one <|bos|> per consumed document"
        named = sorted(d for d, _ in pieces if d is not None)
        expected = sorted(p % N_DOCS for p in new)  # (a long document can linger into the next epoch)
        assert all(named.count(d) <= expected.count(d) for d in set(named))
        seen |= new
        when.update((p, step) for p in new)
    # best-fit reorders documents within the buffer, but none waits for long (due documents start
    # rows): each document was consumed once per epoch, copies in epoch order, none left behind
    assert single.epochs_done >= 2
    by_doc = {}
    for p in sorted(seen, key=lambda p: when[p]):  # in the order they were consumed
        by_doc.setdefault(p % N_DOCS, []).append(p // N_DOCS)
    assert sorted(by_doc) == list(range(N_DOCS))
    assert all(epochs == list(range(len(epochs))) for epochs in by_doc.values())
    assert all(len(epochs) >= single.epochs_done - 1 for epochs in by_doc.values())
    for dl in ranks + [single]:
        dl.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_resume_continues_with_the_exact_next_batch(tokens_root, prefetch):
    with loader(tokens_root, device_batch_size=3, prefetch=prefetch) as a:
        for _ in range(7):
            next(a)
        state = json.loads(json.dumps(a.state_dict()))  # it travels through meta.json
        expected = [next(a) for _ in range(9)]
    with loader(tokens_root, device_batch_size=3, prefetch=prefetch) as b:
        next(b)  # a used loader can be rewound too
        b.load_state_dict(state)
        got = [next(b) for _ in range(9)]
    for (x, y), (x2, y2) in zip(expected, got):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_resume_on_another_world_size(tokens_root, capsys):
    # saved by 2 ranks x 2 rows; resumed by 1 process x 4 rows: the same global rows, no warning
    ranks = [loader(tokens_root, device_batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        global_rows(ranks)
    state = ranks[0].state_dict()
    expected = [global_rows(ranks) for _ in range(4)]
    with loader(tokens_root, device_batch_size=4) as one:
        one.load_state_dict(state)
        for x, y in expected:
            x1, y1 = next(one)
            assert torch.equal(x, x1) and torch.equal(y, y1)
    assert "warning" not in capsys.readouterr().err
    # resumed with another global batch (3 rows): one warning line; nothing repeated or skipped
    with loader(tokens_root, device_batch_size=3) as other:
        other.load_state_dict(state)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "warning" in err and "none is repeated or skipped" in err
        done = consumed(state)
        for _ in range(6):
            x, y = next(other)
            now = consumed(other.state_dict())
            assert done <= now
            assert len(segments(torch.cat([x, y[:, -1:]], 1))) == len(now - done)
            done = now
    for dl in ranks:
        dl.close()


def test_reference_backend_gives_the_same_stream(tokens_root):
    with (
        loader(tokens_root, device_batch_size=2, backend="cpp") as a,
        loader(tokens_root, device_batch_size=2, backend="reference") as b,
    ):
        for _ in range(6):
            (x, y), (x2, y2) = next(a), next(b)
            assert torch.equal(x, x2) and torch.equal(y, y2)
        assert a.state_dict() == b.state_dict()


class RenderedConversations:
    """Stands in for the tokenizer: a conversation here is {"ids": [...], "mask": [...]} already."""

    fingerprint = "test"

    def render_conversation(self, conv):
        return [BOS] + conv["ids"], [0] + conv["mask"]


def chat_shards(root, n=50, seed=1):
    """Conversations whose supervised tokens are the odd ones."""
    rng = np.random.default_rng(seed)
    docs, masks = [], []
    for _ in range(n):
        body = rng.integers(1, 500, int(rng.integers(2, 30)))
        docs.append([BOS] + body.tolist())
        masks.append([0] + (body % 2).tolist())
    write_split(root, "talk", "train", docs, masks)


@needs_cpp
@pytest.mark.parametrize("prefetch", [True, False])
def test_compiled_stream_matches_its_python_twin(tmp_path, prefetch):
    """The compiled RowStream and the plain-Python one give the same batches and states: masked
    conversations with extra ones interleaved, as training pairs (CPU) and as rows (what CUDA gets),
    across epochs and a resume; the batches handed out stay intact while later ones are made."""
    chat_shards(tmp_path)
    extra = [{"ids": [600 + k] * (3 + 5 * k), "mask": [1] * (3 + 5 * k)} for k in range(4)]
    loaders = [
        ConversationRowLoader(
            dataset="talk",
            tokens_root=tmp_path,
            device_batch_size=2,
            seq_len=20,
            world_size=2,
            rank=1,
            buffer_docs=10,
            prefetch=prefetch,
            backend=backend,
            extra_conversations=extra,
            tokenizer=RenderedConversations(),
        )
        for backend in ("cpp", "reference")
    ]
    held = [], []  # every batch handed out, by the compiled loader and by the twin
    for step in range(30):
        if step == 12:
            state = loaders[1].state_dict()
        batches = [next(dl) for dl in loaders]
        for h, b in zip(held, batches):
            h.append(b)
        assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1]), f"step {step}"
        assert loaders[0].state_dict() == loaders[1].state_dict()
    assert loaders[0].epochs_done >= 1
    for dl in loaders:
        dl.load_state_dict(state)
        for _ in range(5):
            next(dl)
        dl.close()
    del loaders
    gc.collect()  # the compiled stream is gone; its batches live on, untouched by the later ones
    for (x, y), (x2, y2) in zip(*held):
        assert torch.equal(x, x2) and torch.equal(y, y2)

    shards = TokenShards("talk", "train", tmp_path)
    rendered = [RenderedConversations().render_conversation(c) for c in extra]
    streams = [
        make_row_stream(DocStream(shards, True, rendered), 3, 17, BOS, 6, MASK_SHIFT, backend)
        for backend in ("cpp", "reference")
    ]
    for step in range(20):
        (rows, state), (rows2, state2) = (s.next(1, 2, pairs=False) for s in streams)
        assert torch.equal(rows, rows2), f"step {step}"
        assert state[0] == state2[0] and torch.equal(state[1], state2[1]) and state[2:] == state2[2:]
        assert (rows >> MASK_SHIFT).max() == 1, "rows carry the supervised flags (split on the GPU)"


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_row_stream_refuses_bad_calls(tokens_root, backend):
    stream = make_row_stream(DocStream(TokenShards("toy", "train", tokens_root), False), 4, 16, BOS, 8, backend=backend)
    with pytest.raises(ValueError, match=r"rows \[3, 5\) are not within the batch of 4"):
        stream.next(3, 2, True)
    with pytest.raises(RuntimeError, match="not prefetching"):
        stream.get()
    with pytest.raises(ValueError, match="not in \\[0, next_pos"):
        stream.restore(10, [3, 12], 0, 0, 0)
    stream.start(2, 0, 4, True)
    with pytest.raises(RuntimeError, match="already prefetching"):
        stream.start(2, 0, 4, True)
    with pytest.raises(RuntimeError, match="not while prefetching"):
        stream.next(0, 4, True)
    (x, y), state = stream.get()
    assert x.shape == y.shape == (4, 15) and state[2] == 1
    stream.stop()
    stream.stop()  # idempotent
    assert not stream.prefetching


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_an_error_in_the_prefetch_thread_reaches_next(tmp_path, backend):
    """A bad document met while prefetching is raised by next(), after the batches made before it,
    and the thread is stopped."""
    rng = np.random.default_rng(3)
    docs = [doc_tokens(i, rng) for i in range(40)]
    docs[30][0] = 5  # document 30 does not start with <|bos|>
    write_split(tmp_path, "bad", "train", docs)
    with TokenRowLoader(
        dataset="bad", tokens_root=tmp_path, device_batch_size=2, seq_len=15, buffer_docs=4, backend=backend
    ) as dl:
        made = 0
        with pytest.raises(ValueError, match="document 30 starts with token 5, not bos_id=0"):
            for _ in range(100):
                next(dl)
                made += 1
        assert made > 3 and not dl._stream.prefetching


def test_val_split_from_the_start_and_reset(tokens_root):
    with loader(tokens_root, split="val", device_batch_size=2) as val:
        first = [next(val) for _ in range(3)]
        val.reset()
        again = [next(val) for _ in range(3)]
    with loader(tokens_root, split="val", device_batch_size=2) as fresh:
        state = fresh.state_dict()
        assert state["buffer"] == list(range(state["next_pos"])), "it reads the split from its start"
        new = [next(fresh) for _ in range(3)]
    for (x, _), (x2, _), (x3, _) in zip(first, again, new):
        assert torch.equal(x, x2) and torch.equal(x, x3)


def prefetch_threads() -> int:
    """Prefetch threads alive in this process: the Python twin's, and the compiled stream's, which
    Python does not see: the OS knows it by its name."""
    n = sum(t.name == "nanochat_fast-prefetch" for t in threading.enumerate())
    if os.path.isdir("/proc/self/task"):
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    n += f.read().strip() == "nanochat-rows"
            except OSError:  # it ended meanwhile
                pass
    return n


def prefetch_threads_settle_at(n: int) -> bool:
    """Whether the count comes to n. (A joined thread can still be listed by the OS for a moment:
    join returns once the thread is done with its memory, before the kernel has removed it.)"""
    deadline = time.monotonic() + 2
    while prefetch_threads() != n and time.monotonic() < deadline:
        time.sleep(0.001)
    return prefetch_threads() == n


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_close_stops_the_prefetch_thread(tokens_root, backend):
    gc.collect()
    counts = []
    for _ in range(50):  # (threads of earlier tests may still be on their way out)
        counts.append(prefetch_threads())
        time.sleep(0.002)
    before = min(counts)
    dl = loader(tokens_root, device_batch_size=2, backend=backend)
    next(dl)
    stream = dl._stream
    assert stream.prefetching
    if backend == "reference" or os.path.isdir("/proc/self/task"):
        assert prefetch_threads() == before + 1, "one prefetch thread per loader"
    dl.close()
    assert not stream.prefetching and prefetch_threads_settle_at(before), "close() joined the thread"
    with pytest.raises(RuntimeError, match="closed"):
        next(dl)
    with loader(tokens_root, device_batch_size=2, backend=backend) as m:
        next(m)
        stream = m._stream
    assert not stream.prefetching and prefetch_threads_settle_at(before)
    n = loader(tokens_root, device_batch_size=2, backend=backend)  # dropped without close(): collected, thread stopped
    stream = n._stream
    del n
    gc.collect()
    assert not stream.prefetching and prefetch_threads_settle_at(before)


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_prefetch_thread_does_not_block_process_exit(tokens_root, backend):
    code = textwrap.dedent(f"""
        from nanochat_fast.data.dataloader import TokenRowLoader
        dl = TokenRowLoader(dataset="toy", tokens_root={str(tokens_root)!r}, device_batch_size=2, seq_len=15,
                            buffer_docs=8, backend={backend!r})
        next(dl)
        print("done")
    """)  # exits with the thread running, never calling close()
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"OMP_NUM_THREADS": "1", **os.environ},
    )
    assert result.returncode == 0 and result.stdout.strip() == "done"
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


def test_conversation_targets_are_masked(tmp_path):
    """Tokens are odd when supervised: every target is either -1 over an even token or the token."""
    rng = np.random.default_rng(1)
    docs, masks = [], []
    for i in range(60):
        body = rng.integers(1, 500, int(rng.integers(2, 30)))
        docs.append([BOS] + body.tolist())
        masks.append([0] + (body % 2).tolist())
    write_split(tmp_path, "talk", "train", docs, masks)
    with ConversationRowLoader(
        dataset="talk", tokens_root=tmp_path, device_batch_size=3, seq_len=20, buffer_docs=10
    ) as conv:
        supervised = 0
        while conv.epochs_done < 1:
            x, y = next(conv)
            nxt = torch.cat([x[:, 1:], torch.full((3, 1), -2)], 1)  # the token each target stands for
            known = nxt != -2
            assert ((y == -1) | (y == nxt))[known].all()
            assert ((y == -1) == (nxt % 2 == 0))[known].all(), "target -1 exactly where the mask is 0"
            assert (x < (1 << 30)).all() and ((y == -1) | (y % 2 == 1)).all()
            supervised += int((y != -1).sum())
        assert supervised > 0 and conv.epochs_done == 1 and conv.epoch_progress >= 1.0


def test_extra_conversations_are_mixed_in_deterministically(tmp_path):
    from nanochat_fast.data.tokenizer import Tokenizer

    tok = Tokenizer.train(["hello there, how are you? " * 40, "fine thanks and you " * 40], 300)
    base = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(40)
    ]
    rendered = [tok.render_conversation(c) for c in base]
    write_split(
        tmp_path,
        "talk",
        "train",
        [r[0] for r in rendered],
        [r[1] for r in rendered],
        tok.fingerprint,
        tok.get_bos_token_id(),
    )
    extra = [{"messages": [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "zebra crossing"}]}]

    def batches(**kw):
        with ConversationRowLoader(
            dataset="talk", tokens_root=tmp_path, device_batch_size=2, seq_len=30, buffer_docs=6, tokenizer=tok, **kw
        ) as dl:
            out = []
            while dl.epochs_done < 1:
                out.append(next(dl))
            return out, dl.n_docs

    a, n_a = batches(extra_conversations=extra)
    b, _ = batches(extra_conversations=extra)
    plain, n_plain = batches()
    assert n_a == n_plain + 1
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(a, b))
    text = "".join(tok.decode([t for t in x.flatten().tolist()]) for x, _ in a)
    assert "zebra crossing" in text and "zebra crossing" not in "".join(
        tok.decode(x.flatten().tolist()) for x, _ in plain
    )
    with pytest.raises(ValueError, match=r"extra_conversations\[0\]"):
        ConversationRowLoader(
            dataset="talk",
            tokens_root=tmp_path,
            tokenizer=tok,
            extra_conversations=[{"messages": [{"role": "assistant", "content": "x"}]}],
        )


def test_bad_arguments_and_missing_or_broken_shards(tokens_root, tmp_path):
    for kw, name in (
        (dict(seq_len=-5), "seq_len"),
        (dict(device_batch_size=0), "device_batch_size"),
        (dict(rank=2, world_size=2), "rank"),
    ):
        with pytest.raises(ValueError, match=name):
            loader(tokens_root, **kw)
    with pytest.raises(UserError, match="no token shards in .*prepare_data"):
        TokenRowLoader(dataset="nothing", tokens_root=tmp_path)
    with pytest.raises(UserError, match="holds prose, not conversations"):
        ConversationRowLoader(dataset="toy", tokens_root=tokens_root)
    # a truncated token shard is named
    rng = np.random.default_rng(2)
    write_split(tmp_path, "broken", "train", [doc_tokens(i, rng) for i in range(20)])
    victim = tmp_path / "broken" / "train" / "shard_00001.tokens.npy"
    victim.write_bytes(victim.read_bytes()[:-6])
    with pytest.raises(UserError, match="shard_00001"):
        TokenRowLoader(dataset="broken", tokens_root=tmp_path)
    with pytest.raises(ValueError, match="n_docs"):
        with loader(tokens_root, device_batch_size=2) as dl:
            state = dl.state_dict()
            state["n_docs"] += 1
            dl.load_state_dict(state)
