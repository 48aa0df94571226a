"""The batch engine: conversations decoded in one shared batch, joining and leaving at different
steps, get exactly the tokens each gets decoded alone (temperature 0, fp32); the alone decode is
checked against full forwards without any cache; slots come back; bad requests are refused."""

import pytest
import torch
from support.stub_models import byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)
from support.tiny_gpt import random_model

from nanochat_fast.model import batch_engine
from nanochat_fast.model.batch_engine import BatchEngine, DecodeRow, EngineFull, Request
from nanochat_fast.model.decode import SlotBatch, SlotPrefill
from nanochat_fast.model.gpt import GPTConfig

tok = byte_tokenizer()
SP = tok.encode_special
CONFIG = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
TRIGGER = tok.encode("?")[0]
TOOL_CALL = [SP("<|python_start|>"), *tok.encode("6*7"), SP("<|python_end|>")]
TOOL_OUTPUT = [SP("<|output_start|>"), *tok.encode("42"), SP("<|output_end|>")]
END = SP("<|assistant_end|>")
SCRIPT = dict(enumerate(TOOL_CALL)) | {16: END}  # token offset after the prompt -> token written


class CallsTheCalculator(torch.nn.Module):
    """The tiny GPT, except that a row whose prompt ends with "?" writes SCRIPT: first TOOL_CALL,
    then (the tool forcing TOOL_OUTPUT in) the GPT carries on by itself from what it was fed, until
    <|assistant_end|> 16 tokens in. Rows are told apart by their cache slots, learnt at their
    prefill (a new prompt in a slot resets it): a SlotPrefill, or a slot batch's rows from position 0."""

    prompts_as_decode_rows = True

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.rotary_seq_len = model, model.config, model.rotary_seq_len
        self.script_at = {}  # slot -> position of its script's first token

    def get_device(self):
        return self.model.get_device()

    def forward(self, idx, kv_cache):
        logits = self.model(idx, kv_cache=kv_cache)
        if isinstance(kv_cache, SlotPrefill):  # prompts, right-padded when several
            slots = kv_cache.slots
            positions = [n - 1 for n in kv_cache.lengths or [idx.size(1)] * len(slots)]
            for b, (slot, last) in enumerate(zip(slots, positions)):
                self.script_at.pop(slot, None)
                if idx[b, last] == TRIGGER:
                    self.script_at[slot] = last + 1
        else:  # rows in (slot, position) order; a prompt's from position 0, its last the slot's last
            rows = list(zip(kv_cache.slots.tolist(), kv_cache.get_pos().tolist(), idx[:, 0].tolist()))
            started = {slot for slot, pos, _ in rows if pos == 0}
            prompts = {slot: (pos, token) for slot, pos, token in rows if slot in started}  # the last row wins
            for slot, (last, token) in prompts.items():
                self.script_at.pop(slot, None)
                if token == TRIGGER:
                    self.script_at[slot] = last + 1
            picked = range(len(rows)) if kv_cache.logits_of is None else kv_cache.logits_of.tolist()
            slots, positions = [rows[i][0] for i in picked], [rows[i][1] for i in picked]
        for b, (slot, pos) in enumerate(zip(slots, positions)):
            offset = pos + 1 - self.script_at.get(slot, 10**9)  # of the token these logits predict
            if offset in SCRIPT:
                logits[b, -1, SCRIPT[offset]] = 100.0  # a prefill's logits: each row's last position
        return logits


@pytest.fixture(scope="module")
def model():
    return CallsTheCalculator(random_model(CONFIG, seed=4).eval())


def prompt(text: str) -> list[int]:
    return tok.encode(text, prepend="<|bos|>")


def decode_alone(model, request: Request, copies: int = 1) -> list[tuple[list[int], list[bool], str]]:
    """Each copy's (tokens, forced, reason), the request alone in an engine of its own."""
    engine = BatchEngine(model, tok, slots=copies)
    rows = engine.add(request, copies)
    forced = {row: [] for row in rows}
    while engine.active:
        for t in engine.step():
            forced[t.row].append(t.forced)
    return [(row.tokens, forced[row], row.reason) for row in rows]


REQUESTS = {  # name -> (request, copies, step it joins at)
    "long": (
        Request(
            prompt("A much longer prompt than the others, so that its rows sit far ahead of theirs in the cache"),
            max_tokens=30,
        ),
        1,
        0,
    ),
    "cancelled": (Request(prompt("cut short after a few tokens"), max_tokens=40), 1, 0),
    "bos only": (Request([tok.get_bos_token_id()], max_tokens=45), 1, 0),
    "calculator": (Request(prompt("What is 6 times 7?"), max_tokens=25), 1, 2),
    "copies": (Request(prompt("two"), max_tokens=20), 2, 9),  # after the cancel: a used slot again
    "sampled": (Request(prompt("Once upon"), max_tokens=20, temperature=0.8, top_k=20, seed=3), 2, 12),
}
CANCEL_AT = 6


def decode_together(model):
    """All of REQUESTS in one engine: joining at their steps, "cancelled" cancelled at CANCEL_AT.
    Returns each name's rows, their forced flags, the steps at which rows sat in slots with a gap
    between them, and the engine."""
    engine = BatchEngine(model, tok, slots=7)
    rows, forced, gaps = {}, {}, []
    step = 0
    while step == 0 or engine.active or any(at >= step for _, _, at in REQUESTS.values()):
        for name, (request, copies, at) in REQUESTS.items():
            if at == step:
                rows[name] = engine.add(request, copies)
        if step == CANCEL_AT:
            [row] = rows["cancelled"]
            engine.cancel(row)
            assert row.done and row.reason == "cancelled" and len(row.tokens) == CANCEL_AT
        slots = sorted(row.slot for row in engine.active)
        if slots and slots[-1] - slots[0] + 1 > len(slots):
            gaps.append(step)
        for t in engine.step():
            assert not t.row.done or t.last
            forced.setdefault(t.row, []).append(t.forced)
            if t.last:
                assert t.row.slot in engine._free and t.row not in engine.active
        step += 1
    return rows, forced, gaps, engine


@pytest.mark.parametrize("as_rows", [0, 256], ids=["prompts apart", "prompts as rows"])
def test_a_shared_batch_gives_each_conversation_its_tokens_alone(model, as_rows, monkeypatch):
    """Prompts in forwards of their own, or as rows of the decode steps (each way against the same
    way alone)."""
    monkeypatch.setattr(batch_engine, "PROMPT_AS_ROWS", as_rows)
    rows, forced, gaps, engine = decode_together(model)
    assert gaps, "some steps should run rows in slots with free ones between them"
    lengths = {name: len(rs[0].tokens) for name, rs in rows.items()}
    assert len(set(lengths.values())) > 2, lengths  # rows leave at different steps
    for name, (request, copies, _) in REQUESTS.items():
        alone = decode_alone(model, request, copies)
        if name == "cancelled":
            [row] = rows[name]
            assert row.tokens == alone[0][0][:CANCEL_AT]
            continue
        together = [(row.tokens, forced[row], row.reason) for row in rows[name]]
        assert together == alone, name
    # the calculator row called the tool, had its answer forced in, went on by itself, and stopped
    [calc] = rows["calculator"]
    assert calc.tokens[:9] == TOOL_CALL + TOOL_OUTPUT and len(calc.tokens) == 17 and calc.tokens[-1] == END
    assert forced[calc] == [False] * 5 + [True] * 4 + [False] * 8 and calc.reason == "stop"
    # copies: greedy copies agree; sampled copies differ, each seeded seed + copy
    assert rows["copies"][0].tokens == rows["copies"][1].tokens
    sampled = [row.tokens for row in rows["sampled"]]
    assert sampled[0] != sampled[1]
    request = REQUESTS["sampled"][0]
    second = Request(request.prompt, request.max_tokens, request.temperature, request.top_k, request.seed + 1)
    assert decode_alone(model, second)[0][0] == sampled[1]
    # everything ended: every slot is free again
    assert engine.free_slots == engine.slots == 7 and engine.active == [] and engine.step() == []


def test_a_steps_prompts_run_as_rows_while_they_are_few_tokens(model, monkeypatch):
    """The prompts a step admits run in its one forward, a row per token beside the decoding rows,
    while they are at most PROMPT_AS_ROWS tokens in all; more in one forward of their own after it,
    right-padded to the longest (each row's tokens equal to alone:
    test_a_shared_batch_gives_each_conversation_its_tokens_alone)."""
    views = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: views.append(kw["kv_cache"]), with_kwargs=True)
    monkeypatch.setattr(batch_engine, "PROMPT_AS_ROWS", 30)
    try:
        engine = BatchEngine(model, tok, slots=5)
        short = [prompt("a"), prompt("mid size")]
        for p in short:
            engine.add(Request(p, 4))
        engine.step()
        [view] = views
        assert isinstance(view, SlotBatch) and view.slots.tolist() == [0] * len(short[0]) + [1] * len(short[1])
        assert view.get_pos().tolist() == [*range(len(short[0])), *range(len(short[1]))]
        assert view.logits_of.tolist() == [len(short[0]) - 1, len(short[0]) + len(short[1]) - 1]
        engine.add(Request(prompt("late"), 3))
        engine.step()  # beside the two decoding rows
        assert isinstance(views[1], SlotBatch) and views[1].slots.tolist() == [0, 1] + [2] * len(prompt("late"))
        long = [prompt("a longer prompt"), prompt("and one longer still")]  # 37 tokens
        for p in long:
            engine.add(Request(p, 3))
        engine.step()  # the decode step, then the two prompts together
        assert [type(v).__name__ for v in views[2:]] == ["SlotBatch", "SlotPrefill"]
        assert views[3].slots == [3, 4] and views[3].lengths == [len(p) for p in long]
    finally:
        hook.remove()


def test_the_alone_decode_is_the_argmax_of_full_forwards(model):
    """Independent of any cache: each greedy token is the argmax of a forward over the whole
    sequence so far (prompt + the tokens before it)."""
    for request in (REQUESTS["long"][0], REQUESTS["bos only"][0]):
        [(tokens, _, _)] = decode_alone(model.model, Request(request.prompt, 8))
        with torch.no_grad():
            for i, token in enumerate(tokens):
                logits = model.model(torch.tensor([request.prompt + tokens[:i]]))[0, -1]
                assert token == int(logits.argmax())


def test_full_engine_cancel_and_max_tokens(model):
    engine = BatchEngine(model, tok, slots=2, max_len=64)
    assert engine.free_slots == 2 and engine.active == []
    a, b = engine.add(Request(prompt("hi"), 5), copies=2)
    with pytest.raises(EngineFull):
        engine.add(Request(prompt("x"), 5))
    first = engine.step()
    assert [t.row for t in first] == [a, b]
    engine.cancel(a)
    assert engine.free_slots == 1 and engine.active == [b] and a.reason == "cancelled"
    engine.cancel(a)  # a row already done: nothing to do
    [c] = engine.add(Request(prompt("x"), 3))
    assert c.slot == a.slot
    while engine.active:
        assert a not in {t.row for t in engine.step()}
    assert len(a.tokens) == 1 and b.reason in ("max_tokens", "stop") and len(c.tokens) <= 3
    [empty] = engine.add(Request(prompt("nothing"), 0))
    assert empty.done and empty.reason == "max_tokens" and empty.slot is None and engine.free_slots == 2
    with pytest.raises(ValueError, match="not one of this engine's"):
        BatchEngine(model, tok, slots=1).cancel(DecodeRow(Request([1], 1), 0))


def test_bad_requests_are_refused_in_one_line(model):
    engine = BatchEngine(model, tok, slots=2, max_len=32)
    bad = {
        "prompt must be a non-empty list": Request([], 4),
        r"prompt token ids must be in \[0, ": Request([1, CONFIG.vocab_size], 4),
        "max_tokens must be an int >= 0": Request([1, 2], -1),
        r"prompt \(30\) \+ max_tokens \(3\) exceeds the engine's max_len \(32\)": Request([1] * 30, 3),
        "temperature must be a finite number >= 0": Request([1], 4, temperature=-0.5),
        "top_k must be None or an int >= 1": Request([1], 4, top_k=0),
        r"top_p must be None or a number in \(0, 1\]": Request([1], 4, temperature=1.0, top_p=0.0),
    }
    for message, request in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.add(request)
    with pytest.raises(ValueError, match=r"copies must be an int in \[1, 2\]"):
        engine.add(Request([1], 4), copies=3)
    with pytest.raises(ValueError, match="max_len .* exceeds the model's"):
        BatchEngine(model, tok, slots=1, max_len=model.rotary_seq_len + 1)
    with pytest.raises(ValueError, match="slots must be a positive int"):
        BatchEngine(model, tok, slots=0)
    with pytest.raises(ValueError, match="use_tools needs the tokenizer's tool tokens"):
        BatchEngine(model, None, slots=1).add(Request([1], 4))  # GPT.generate's engine: no tokenizer
    assert engine.free_slots == 2 and engine.active == []


def test_a_score_is_the_log_softmax_of_a_full_forward_and_leaves_the_rows_decoding_as_they_were():
    model, ids = random_model(CONFIG, seed=4).eval(), prompt("Once upon a time")
    alone = BatchEngine(model, tok, slots=2, max_len=64)
    [row] = alone.add(Request(prompt("far away"), 12))
    while alone.active:
        alone.step()
    engine = BatchEngine(model, tok, slots=2, max_len=64)
    [scored_beside] = engine.add(Request(prompt("far away"), 12))
    engine.step()
    chosen, best_ids, best = engine.score(ids, 3)
    while engine.active:
        engine.step()
    assert scored_beside.tokens == row.tokens  # the score's forward touched no slot
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).double()[0, :-1], dim=-1)  # float64
    want = reference.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(chosen, dtype=torch.float64), want, rtol=0, atol=1e-5)
    top, top_ids = reference.topk(3, dim=-1)
    assert best_ids == top_ids.tolist() and torch.allclose(torch.tensor(best, dtype=torch.float64), top, atol=1e-5)
    with pytest.raises(ValueError, match=r"top must be an int in \[0, 20\]"):
        engine.score(ids, 21)
    with pytest.raises(ValueError, match=r"prompt \(65\) \+ max_tokens \(0\) exceeds the engine's max_len \(64\)"):
        engine.score([1] * 65, 1)


def test_top_p_samples_the_fewest_likeliest_tokens_holding_it_in_their_proportions():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    p = torch.softmax(logits.double() / 0.8, dim=-1)[0]
    order = p.argsort(descending=True).tolist()
    nucleus, mass = [], 0.0
    for t in order:  # float64, one token at a time, until the mass reaches 0.9
        nucleus.append(t)
        mass += p[t].item()
        if mass >= 0.9:
            break
    draws = batch_engine.sample_next(logits.expand(40_000, -1), 0.8, None, torch.Generator().manual_seed(0), 0.9)
    counts = torch.bincount(draws[:, 0], minlength=6).double() / 40_000
    assert set(torch.nonzero(counts)[:, 0].tolist()) == set(nucleus) and len(nucleus) < 6
    want = torch.zeros(6, dtype=torch.float64)
    want[nucleus] = p[nucleus] / p[nucleus].sum()
    assert torch.allclose(counts, want, atol=0.01)
    assert batch_engine.sample_next(logits, 0.0, None, None, 0.1).item() == 5  # greedy ignores it


def test_kv_bytes_is_the_storage_it_allocates(model):
    engine = BatchEngine(model, tok, slots=3, max_len=40)
    engine.add(Request(prompt("size"), 2))
    engine.step()
    kv = engine.cache.kv
    assert kv.shape == (CONFIG.n_layer, 2, 3, CONFIG.n_kv_head, 40, CONFIG.head_dim)
    assert BatchEngine.kv_bytes(CONFIG, 3, 40) == kv.nbytes == kv.numel() * 4
    assert BatchEngine.kv_bytes(CONFIG, 3, 40, torch.bfloat16) == kv.nbytes // 2


def test_a_slot_batch_takes_rows_in_slot_and_position_order():
    from nanochat_fast.model.decode import SlotCache

    cache = SlotCache(CONFIG.n_layer, slots=4, max_len=16)
    for slots, positions, reason in (
        ([2, 1], [3, 3], r"increasing \(slot, position\) order"),
        ([1, 1], [4, 3], r"increasing \(slot, position\) order"),
        ([1, 1], [3, 3], r"increasing \(slot, position\) order"),
        ([1, 2], [3], "one position each"),
        ([1, 2], [3, -1], "positions are >= 0"),
    ):
        with pytest.raises(ValueError, match=reason):
            SlotBatch(cache, slots, positions, "cpu")
    assert SlotBatch(cache, [0, 3], [1, 5], "cpu").length == 6
    # a prompt's rows from position 0 start their slot afresh: the smear's previous embedding is zero
    cache.embeddings = torch.ones(4, 8)
    batch = SlotBatch(cache, [0, 2, 2, 2], [7, 0, 1, 2], "cpu", logits_of=[0, 3])
    assert cache.embeddings[2].eq(0).all() and cache.embeddings[[0, 1, 3]].eq(1).all()
    x = torch.arange(4.0)[:, None, None]
    assert batch.logit_positions(x).flatten().tolist() == [0.0, 3.0]
