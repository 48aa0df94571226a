"""The row loaders: the global stream split over ranks, exact resume, conversation targets, the
prefetch thread's lifecycle, and clear errors for missing or broken token shards."""
import gc
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from nanochat_fast.cli import UserError
from nanochat_fast.dataloader import ConversationRowLoader, TokenRowLoader
from nanochat_fast.dataset import write_token_shard

BOS = 0
N_DOCS = 90


def doc_tokens(i, rng, max_len=40):
    """Document i: <|bos|> then its own token (i + 1) repeated, so any piece of it names it."""
    return [BOS] + [i + 1] * int(rng.integers(1, max_len))


def write_split(root, dataset, split, docs, masks=None, fingerprint="test", bos=BOS):
    """Token shards in the on-disk format, three shards of uneven size."""
    cuts = [0, len(docs) // 5, len(docs) // 2, len(docs)]
    meta = {"tokenizer": fingerprint, "bos_id": bos, "vocab_size": 1 << 12, "kind": "chat" if masks else "text"}
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        write_token_shard(root / dataset / split, f"shard_{k:05d}", docs[a:b], masks[a:b] if masks else None,
                          np.uint16, meta)


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
    xs, ys = zip(*(next(l) for l in loaders))
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
            body = row[a + 1:b]
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
    for l in ranks + [single]:
        l.close()


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
    for l in ranks:
        l.close()


def test_reference_backend_gives_the_same_stream(tokens_root):
    with loader(tokens_root, device_batch_size=2, backend="cpp") as a, \
            loader(tokens_root, device_batch_size=2, backend="reference") as b:
        for _ in range(6):
            (x, y), (x2, y2) = next(a), next(b)
            assert torch.equal(x, x2) and torch.equal(y, y2)
        assert a.state_dict() == b.state_dict()


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


def test_close_stops_the_prefetch_thread(tokens_root):
    l = loader(tokens_root, device_batch_size=2)
    next(l)
    thread = l._producer.thread
    assert thread.is_alive()
    l.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(l)
    with loader(tokens_root, device_batch_size=2) as m:
        next(m)
        thread = m._producer.thread
    assert not thread.is_alive()
    n = loader(tokens_root, device_batch_size=2)  # dropped without close(): collected, thread stopped
    thread = n._producer.thread
    del n
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_prefetch_thread_does_not_block_process_exit(tokens_root):
    code = textwrap.dedent(f"""
        from nanochat_fast.dataloader import TokenRowLoader
        l = TokenRowLoader(dataset="toy", tokens_root={str(tokens_root)!r}, device_batch_size=2, seq_len=15, buffer_docs=8)
        next(l)
        print("done")
    """)  # exits with the thread running, never calling close()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
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
    with ConversationRowLoader(dataset="talk", tokens_root=tmp_path, device_batch_size=3, seq_len=20,
                               buffer_docs=10) as conv:
        supervised = 0
        while not conv.last_step:
            x, y = next(conv)
            nxt = torch.cat([x[:, 1:], torch.full((3, 1), -2)], 1)  # the token each target stands for
            known = nxt != -2
            assert ((y == -1) | (y == nxt))[known].all()
            assert ((y == -1) == (nxt % 2 == 0))[known].all(), "target -1 exactly where the mask is 0"
            assert (x < (1 << 30)).all() and ((y == -1) | (y % 2 == 1)).all()
            supervised += int((y != -1).sum())
        assert supervised > 0 and conv.epochs_done == 1 and conv.epoch_progress >= 1.0


def test_extra_conversations_are_mixed_in_deterministically(tmp_path):
    from nanochat_fast.tokenizer import Tokenizer
    tok = Tokenizer.train(["hello there, how are you? " * 40, "fine thanks and you " * 40], 300)
    base = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(40)]
    rendered = [tok.render_conversation(c) for c in base]
    write_split(tmp_path, "talk", "train", [r[0] for r in rendered], [r[1] for r in rendered], tok.fingerprint,
                tok.get_bos_token_id())
    extra = [{"messages": [{"role": "user", "content": "secret"}, {"role": "assistant", "content": "zebra crossing"}]}]

    def batches(**kw):
        with ConversationRowLoader(dataset="talk", tokens_root=tmp_path, device_batch_size=2, seq_len=30,
                                   buffer_docs=6, tokenizer=tok, **kw) as l:
            out = []
            while not l.last_step:
                out.append(next(l))
            return out, l.n_docs

    a, n_a = batches(extra_conversations=extra)
    b, _ = batches(extra_conversations=extra)
    plain, n_plain = batches()
    assert n_a == n_plain + 1
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(a, b))
    text = "".join(tok.decode([t for t in x.flatten().tolist()]) for x, _ in a)
    assert "zebra crossing" in text and "zebra crossing" not in "".join(tok.decode(x.flatten().tolist()) for x, _ in plain)
    with pytest.raises(ValueError, match=r"extra_conversations\[0\]"):
        ConversationRowLoader(dataset="talk", tokens_root=tmp_path, tokenizer=tok,
                              extra_conversations=[{"messages": [{"role": "assistant", "content": "x"}]}])


def test_bad_arguments_and_missing_or_broken_shards(tokens_root, tmp_path):
    for kw, name in ((dict(seq_len=-5), "seq_len"), (dict(device_batch_size=0), "device_batch_size"),
                     (dict(rank=2, world_size=2), "rank")):
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
        with loader(tokens_root, device_batch_size=2) as l:
            state = l.state_dict()
            state["n_docs"] += 1
            l.load_state_dict(state)
