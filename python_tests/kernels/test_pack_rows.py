"""pack_rows: the compiled packer against the plain-Python definition, the rule's invariants, bad
input, the GIL, and the stateful RowPacker against its Python twin."""

import itertools
import random
import re
import sys
import threading
import time

import pytest
import torch

from nanochat_fast.kernels import pack_rows, registry
from nanochat_fast.kernels.pack_rows import RowPackerReference, make_row_packer, plan_reference

BOS = 7
needs_cpp = pytest.mark.skipif(registry.extension() is None, reason="the C++ extension is not built")


def make_docs(lengths, rng, bos=BOS):
    """Documents [bos, random tokens...] as (tokens int32, offsets int64)."""
    docs = [[bos] + [rng.randrange(100, 60000) for _ in range(n - 1)] for n in lengths]
    tokens = torch.tensor(list(itertools.chain.from_iterable(docs)), dtype=torch.int32)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)
    return tokens, offsets


def run(backend, tokens, offsets, B, T):
    out = torch.full((B, T + 1), -1, dtype=torch.int64)
    try:
        used, n_used, n_cropped = pack_rows(tokens, offsets, out, BOS, backend=backend)
    except ValueError as e:
        return str(e), out
    return (used, n_used, n_cropped), out


@needs_cpp
def test_cpp_matches_reference_on_random_documents():
    rng = random.Random(0)
    checked = 0
    for trial in range(120):
        T = rng.choice([1, 2, 7, 16, 63, 64, 65, 200])
        B = rng.randint(1, 6)
        lengths = [rng.randint(1, 3 * T + 2) for _ in range(rng.randint(1, 40))]  # some longer than a row
        tokens, offsets = make_docs(lengths, rng)
        got, out_cpp = run("cpp", tokens, offsets, B, T)
        want, out_ref = run("reference", tokens, offsets, B, T)
        if isinstance(want, str):  # ran out of documents: both say so
            assert isinstance(got, str) and "ran out" in got and "ran out" in want
            continue
        checked += 1
        used, n_used, n_cropped = got
        assert torch.equal(out_cpp, out_ref), f"trial {trial}: rows differ"
        assert torch.equal(used, want[0]) and (n_used, n_cropped) == want[1:]
        # the invariants, checked on the output itself
        assert (out_cpp[:, 0] == BOS).all(), "every row starts with <|bos|>"
        assert n_used == B * (T + 1)
        assert sum(n for n, u in zip(lengths, used.tolist()) if u) == n_used + n_cropped
        assert int((out_cpp == BOS).sum()) == int(used.sum()), "one <|bos|> per consumed document"
    assert checked > 80


def test_reference_follows_the_rule_by_hand():
    # row_len 10. Row 0: the largest that fits is 8 (doc 1), then 2 (doc 4: the first of the 2s).
    # Row 1: 2 (doc 5), then the 1s (docs 3 and 6, lowest index first); 12 and 15 never fit, so the
    # shortest of them (12, doc 0) is cropped to the 6 tokens left.
    placements, cropped = plan_reference([12, 8, 15, 1, 2, 2, 1], rows=2, row_len=10)
    assert placements == [(0, 1, 0, 8), (0, 4, 8, 2), (1, 5, 0, 2), (1, 3, 2, 1), (1, 6, 3, 1), (1, 0, 4, 6)]
    assert cropped == 12 - 6


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_bad_input_is_a_clear_error(backend):
    rng = random.Random(1)
    tokens, offsets = make_docs([5, 9, 3], rng)
    out = torch.zeros(2, 9, dtype=torch.int64)
    cases = [
        (dict(tokens=tokens.long()), "tokens must be a 1-D int32"),
        (dict(offsets=offsets.int()), "offsets must be a 1-D int64"),
        (dict(out=out.int()), "out must be a 2-D int64"),
        (dict(out=torch.zeros(2, 1, dtype=torch.int64)), "T+1 >= 2"),  # T = 0
        (dict(out=torch.zeros(9, 2, dtype=torch.int64).t()), "contiguous"),
        (dict(out=torch.zeros(2, 18, dtype=torch.int64)[:, ::2]), "contiguous"),
        (dict(bos_id=-1), "bos_id"),
        (dict(offsets=torch.tensor([0, 5, 9], dtype=torch.int64)), "end at tokens.numel()"),
        (dict(offsets=torch.tensor([0, 5, 5, 17], dtype=torch.int64)), "document 1 is empty"),
        (dict(bos_id=3), "starts with token 7, not bos_id=3"),
        (dict(out=torch.zeros(5, 9, dtype=torch.int64)), "ran out"),
    ]
    for change, message in cases:
        args = dict(tokens=tokens, offsets=offsets, out=out, bos_id=BOS)
        args.update(change)
        with pytest.raises(ValueError, match=re.escape(message)):
            pack_rows(args["tokens"], args["offsets"], args["out"], args["bos_id"], backend=backend)


@needs_cpp
def test_compiled_op_checks_its_own_input():
    """Called without the Python wrapper, the op still refuses bad input with a ValueError."""
    op = torch.ops.nanochat_fast.pack_rows
    tokens, offsets = make_docs([5, 9, 3], random.Random(2))
    with pytest.raises(ValueError, match="int32"):
        op(tokens.long(), offsets, torch.zeros(1, 9, dtype=torch.int64), BOS)
    with pytest.raises(ValueError, match="contiguous"):
        op(tokens, offsets, torch.zeros(9, 2, dtype=torch.int64).t(), BOS)
    with pytest.raises(ValueError, match="not bos_id"):
        op(tokens, offsets, torch.zeros(1, 9, dtype=torch.int64), 1)
    out = torch.full((4, 9), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="ran out"):
        op(tokens, offsets, out, BOS)
    assert (out == -1).all(), "a failed call leaves out untouched"


def _python_progress_during(call):
    """How often a spinning Python thread ran while `call` ran in this thread: it notes the time
    every 256 iterations, and we count the notes in the middle half of the call. Had the call held
    the GIL, the spinner could not run there at all (it can around the call's ends, where the
    interpreter hands the GIL over within a switch interval, made short here)."""
    stamps, stop = [], threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)

    def spin():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 256 == 0:
                stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    sys.setswitchinterval(interval)
    d = t1 - t0
    return sum(t0 + d / 4 < t < t1 - d / 4 for t in stamps), d


def tiny_documents(rows: int, row_len: int = 4):
    """(tokens, offsets) of ~3 documents of 1-3 tokens per row of `row_len`: many tiny rows make a
    call long without much memory."""
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (3 * rows,), generator=rng)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tokens = torch.randint(100, 1000, (int(offsets[-1]),), dtype=torch.int32, generator=rng)
    tokens[offsets[:-1]] = BOS
    return tokens, offsets


def long_call(make_call, rows=400_000, seconds=0.04, max_rows=3_200_000):
    """make_call(rows) -> a fresh zero-argument call; rows doubled until one such call lasts
    `seconds` on this machine (400,000 rows: ~0.06-0.16 s on a Zen 4), so that the middle half
    watched by _python_progress_during is long on any CPU. Time only sizes the work here: the test
    asserts nothing about it."""
    while True:
        start = time.perf_counter()
        make_call(rows)()
        if time.perf_counter() - start >= seconds or rows >= max_rows:
            return make_call(rows)
        rows *= 2


@needs_cpp
def test_gil_is_released():
    """A Python thread makes progress while a big pack runs: the op, RowPacker.pack and the
    loader's RowStream.next. Holding the GIL, each would leave the spinner no run in the middle
    half of the call."""
    row_len = 4

    def op(rows):
        tokens, offsets = tiny_documents(rows, row_len)
        out = torch.empty(rows, row_len, dtype=torch.int64)
        return lambda: pack_rows(tokens, offsets, out, BOS)

    def packer(rows):
        tokens, offsets = tiny_documents(rows, row_len)
        out = torch.empty(rows, row_len, dtype=torch.int64)
        packer = make_row_packer(row_len, BOS, backend="cpp")
        packer.add(tokens, offsets, 0)
        return lambda: packer.pack(out, rows, 0)

    def stream(rows):  # the loader's step (pack, refill from the documents, state), as training calls it
        tokens, offsets = tiny_documents(rows, row_len)
        stream = registry.extension().RowStream([(tokens, offsets, None)], rows, row_len, BOS, 1000, 4)
        return lambda: stream.next(0, rows, True)

    for name, make_call in (("the pack_rows op", op), ("RowPacker.pack", packer), ("RowStream.next", stream)):
        during, elapsed = _python_progress_during(long_call(make_call))
        assert during > 3, f"{name} held the GIL: a Python thread ran {during} times in {elapsed * 1e3:.0f} ms"


@needs_cpp
def test_row_packer_matches_its_python_twin():
    rng = random.Random(3)
    row_len = 12
    cpp, ref = make_row_packer(row_len, BOS, backend="cpp"), RowPackerReference(row_len, BOS)
    next_id = 0
    for step in range(60):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(0, 9))]
        tokens, offsets = (
            make_docs(lengths, rng)
            if lengths
            else (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
        )
        dtype = rng.choice([torch.int32, torch.uint16])
        mask = torch.tensor([rng.random() < 0.5 for _ in range(len(tokens))], dtype=torch.uint8)
        with_mask = rng.random() < 0.5
        for p in (cpp, ref):
            p.add(tokens.to(dtype), offsets, next_id, mask if with_mask else None, 30 if with_mask else -1)
        next_id += len(lengths)
        assert torch.equal(cpp.ids(), ref.ids()) and torch.equal(cpp.lengths(), ref.lengths())
        assert (cpp.num_docs, cpp.mass) == (ref.num_docs, ref.mass)
        total = rng.randint(1, 4)
        first = rng.randint(0, total - 1)
        n = rng.randint(1, total - first)
        due_before = rng.choice([-(1 << 63), next_id - 30, next_id - 10])
        split = rng.random() < 0.5  # write (inputs, targets) with the mask bit, or plain rows
        width = row_len - split
        outs = [torch.full((n, width), -1, dtype=torch.int64) for _ in range(4)]
        results = []
        for p, out, targets in zip((cpp, ref), outs[:2], outs[2:]):
            try:
                if split:
                    results.append(p.pack(out, total, first, due_before, targets, 30))
                else:
                    results.append(p.pack(out, total, first, due_before))
            except ValueError as e:  # both must run out of documents at the same call, and only that
                if "ran out" not in str(e):
                    raise
                results.append("ran out")
        assert results[0] == results[1], f"step {step}: {results}"
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
        assert torch.equal(cpp.ids(), ref.ids())


@needs_cpp
def test_row_packer_is_the_op_on_documents_cut_to_a_row():
    """pack(out, total_rows, first_row) writes exactly rows first_row.. of what the op packs from
    the same documents cut to row_len tokens; the cut-off tails of used documents count as cropped."""
    rng = random.Random(4)
    row_len = 21
    lengths = [rng.randint(1, 50) for _ in range(80)]
    tokens, offsets = make_docs(lengths, rng)
    cut = [tokens[int(o) : int(o) + min(n, row_len)] for o, n in zip(offsets, lengths)]
    cut_offsets = torch.tensor([0] + list(itertools.accumulate(len(c) for c in cut)), dtype=torch.int64)
    full = torch.empty(6, row_len, dtype=torch.int64)
    used, _, cropped = pack_rows(torch.cat(cut), cut_offsets, full, BOS, backend="cpp")
    for packer in (make_row_packer(row_len, BOS, backend="cpp"), RowPackerReference(row_len, BOS)):
        packer.add(tokens, offsets, 1000)
        part = torch.empty(2, row_len, dtype=torch.int64)
        n_docs, n_placed, n_cropped = packer.pack(part, 6, 3)
        assert torch.equal(part, full[3:5])
        assert n_docs == int(used.sum()) and n_placed == 6 * row_len
        assert n_cropped == cropped + sum(n - row_len for n, u in zip(lengths, used.tolist()) if u and n > row_len)
        left = set((packer.ids() - 1000).tolist())
        assert left == set(torch.nonzero(~used).flatten().tolist()), "the used documents left the buffer"


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
def test_due_documents_start_rows(backend):
    """Documents best-fit never picks (7 tokens, while pairs of 8s keep filling rows of 16) start
    the rows once they are due, oldest first."""
    rng = random.Random(6)
    packer = make_row_packer(16, BOS, backend=backend)
    sevens, offsets = make_docs([7, 7], rng)
    packer.add(sevens, offsets, 0)
    next_id = 2
    out = torch.empty(1, 16, dtype=torch.int64)
    for _ in range(5):
        tokens, offsets = make_docs([8, 8], rng)
        packer.add(tokens, offsets, next_id)
        next_id += 2
        packer.pack(out, 1, 0)
        assert {0, 1} <= set(packer.ids().tolist()), "without due documents, the 7s wait"
    tokens, offsets = make_docs([8, 8, 8, 8], rng)
    packer.add(tokens, offsets, next_id)
    rows = torch.empty(2, 16, dtype=torch.int64)
    packer.pack(rows, 2, 0, due_before=2)  # ids 0 and 1 are due
    assert rows[0, :7].tolist() == sevens[:7].tolist() and rows[1, :7].tolist() == sevens[7:].tolist()
    assert not {0, 1} & set(packer.ids().tolist())


@pytest.mark.parametrize("backend", [pytest.param("cpp", marks=needs_cpp), "reference"])
@pytest.mark.parametrize("mask_bit", [-1, 30])
def test_row_packer_writes_training_pairs(backend, mask_bit):
    """pack(inputs, ..., targets=...) == the rows split as row[:-1], row[1:]; with mask_bit, the
    flag bit is dropped from tokens and unflagged targets are -1."""
    rng = random.Random(7)
    row_len = 13
    lengths = [rng.randint(1, 30) for _ in range(60)]
    tokens, offsets = make_docs(lengths, rng)
    if mask_bit >= 0:
        flags = torch.tensor([rng.random() < 0.5 for _ in range(len(tokens))], dtype=torch.int32)
        flags[offsets[:-1]] = 0  # <|bos|> itself carries no flag
        tokens = tokens | (flags << mask_bit)
    a, b = make_row_packer(row_len, BOS, backend=backend), make_row_packer(row_len, BOS, backend=backend)
    a.add(tokens, offsets, 0)
    b.add(tokens, offsets, 0)
    for _ in range(3):
        rows = torch.empty(3, row_len, dtype=torch.int64)
        inputs, targets = torch.empty(3, row_len - 1, dtype=torch.int64), torch.empty(3, row_len - 1, dtype=torch.int64)
        assert a.pack(rows, 5, 1, 7) == b.pack(inputs, 5, 1, 7, targets, mask_bit)
        if mask_bit < 0:
            assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])
        else:
            plain = rows & ((1 << mask_bit) - 1)
            assert torch.equal(inputs, plain[:, :-1])
            assert torch.equal(targets, torch.where(rows[:, 1:] >> mask_bit == 1, plain[:, 1:], -1))
            assert (targets == -1).any() and (targets >= 0).any()


@needs_cpp
def test_row_packer_reads_the_documents_where_they_are():
    """The compiled packer keeps a reference to the tensors added, not a copy: a temporary added,
    dropped and its memory reused by others still packs as the twin (which copies) does."""
    rng = random.Random(5)
    cpp, ref = make_row_packer(10, BOS, backend="cpp"), RowPackerReference(10, BOS)
    for k in range(4):
        tokens, offsets = make_docs([rng.randint(1, 14) for _ in range(6)], rng)
        for p in (cpp, ref):
            p.add(tokens.to(torch.uint16), offsets, 6 * k)  # a temporary, gone after the call
    del tokens
    noise = [torch.randint(0, 1 << 15, (n,), dtype=torch.int16) for n in range(1, 400)]  # reuses freed memory
    outs = [torch.empty(3, 10, dtype=torch.int64) for _ in range(2)]
    assert cpp.pack(outs[0], 3, 0) == ref.pack(outs[1], 3, 0)
    assert torch.equal(outs[0], outs[1]) and len(noise) == 399


def test_row_packer_bad_input():
    with pytest.raises(ValueError, match="row_len"):
        RowPackerReference(0, BOS)
    if registry.extension() is not None:
        with pytest.raises(ValueError, match="row_len"):
            make_row_packer(-3, BOS, backend="cpp")
        p = make_row_packer(8, BOS, backend="cpp")
        with pytest.raises(ValueError, match="int32, uint16 or uint32"):
            p.add(torch.zeros(3, dtype=torch.float32), torch.tensor([0, 3]), 0)
        with pytest.raises(ValueError, match="not bos_id"):
            p.add(torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0, 3]), 0)
        assert p.num_docs == 0, "a rejected add adds nothing"


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "pack_rows=reference")
    assert registry.select("pack_rows", "cpu").name == "reference"
    assert isinstance(make_row_packer(8, BOS), RowPackerReference)
    monkeypatch.delenv("NANOCHAT_FAST_KERNELS")
    expected = "cpp" if registry.extension() is not None else "reference"
    assert registry.select("pack_rows", "cpu").name == expected


@needs_cpp
def test_fake_kernel_and_schema():
    tokens, offsets = make_docs([5, 9, 3, 4], random.Random(5))
    out = torch.zeros(2, 6, dtype=torch.int64)
    torch.library.opcheck(
        torch.ops.nanochat_fast.pack_rows.default,
        (tokens, offsets, out, BOS),
        test_utils=("test_schema", "test_faketensor"),
    )
