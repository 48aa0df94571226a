"""Generation with the calculator tool and in batches: a scripted model calls the tool and the
output is forced in and generation goes on; batched samples equal one-at-a-time generation at
temperature 0; rows that end leave the batch without disturbing the others."""

import torch
from support.stub_models import ScriptedModel, byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)
from support.tiny_gpt import generate_without_cache, random_model

from nanochat_fast.model import generation
from nanochat_fast.model.gpt import GPTConfig

tok = byte_tokenizer()
SP = tok.encode_special
END = SP("<|assistant_end|>")


def chars(text):
    return tok.encode(text)


def tool_script(expr: str, after: str, output_len: int):
    """python call, `output_len` positions the tool fills (anything here is overridden), then `after`."""
    return [SP("<|python_start|>"), *chars(expr), SP("<|python_end|>"), *[0] * output_len, *chars(after), END]


def test_tool_call_output_is_forced_and_generation_continues():
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tok.render_for_completion({"messages": messages})
    model = ScriptedModel(tok, tool_script("6*7", " so 42", output_len=4))  # <|output_start|> 4 2 <|output_end|>
    [sample] = generation.generate_batch(model, tok, prompt, max_tokens=40)
    expected = [
        SP("<|python_start|>"),
        *chars("6*7"),
        SP("<|python_end|>"),
        SP("<|output_start|>"),
        *chars("42"),
        SP("<|output_end|>"),
        *chars(" so 42"),
    ]
    assert sample.ids == expected and sample.finished
    assert sample.forced == [False] * 5 + [True] * 4 + [False] * 6, "only the tool's tokens are forced"
    assert sample.text == "<<6*7=42>> so 42"
    # the same through assistant_reply (the chat path): streamed pieces add up to the reply
    pieces = []
    reply = generation.assistant_reply(model, tok, messages, max_tokens=40, on_text=pieces.append)
    assert reply == "<<6*7=42>> so 42" == "".join(pieces)


def test_refused_expression_gets_no_output():
    prompt = tok.render_for_completion({"messages": [{"role": "user", "content": "hi"}]})
    model = ScriptedModel(tok, tool_script("__import__('os')", "ok", output_len=0))
    [sample] = generation.generate_batch(model, tok, prompt, max_tokens=40)
    assert SP("<|output_start|>") not in sample.ids and not any(sample.forced)
    assert sample.text == "<<__import__('os')=ok"
    [plain] = generation.generate_batch(model, tok, prompt, max_tokens=40, use_tools=False)
    assert plain.ids == sample.ids


def test_should_stop_and_max_tokens():
    prompt = tok.render_for_completion({"messages": [{"role": "user", "content": "hi"}]})
    model = ScriptedModel(tok, chars("abcdefghij") + [END])
    [cut] = generation.generate_batch(model, tok, prompt, max_tokens=4)
    assert cut.text == "abcd" and not cut.finished
    calls = []
    reply = generation.assistant_reply(
        model, tok, [{"role": "user", "content": "hi"}], 40, should_stop=lambda: calls.append(1) or len(calls) > 3
    )
    assert reply == "abc"


def tiny_gpt(seed=0):
    cfg = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return random_model(cfg, seed=seed).eval()


def test_batched_generation_equals_one_at_a_time_at_temperature_zero():
    model = tiny_gpt()
    prompt = tok.encode("The capital of France is", prepend="<|bos|>")
    reference = generate_without_cache(model, prompt, 24, temperature=0.0)  # one sequence, its own loop
    reference = reference[: reference.index(END)] if END in reference else reference
    samples = generation.generate_batch(
        model, tok, prompt, num_samples=3, max_tokens=24, temperature=0.0, use_tools=False
    )
    assert len(reference) > 5 and len(set(reference)) > 1
    assert [s.ids for s in samples] == [reference] * 3
    [single] = generation.generate_batch(model, tok, prompt, num_samples=1, max_tokens=24, use_tools=False)
    assert single.ids == reference


def test_one_sample_matches_gpt_generate_when_sampling():
    """Same seed, same sampling rule: one row of generate_batch is GPT.generate's sequence."""
    model = tiny_gpt(seed=1)
    prompt = tok.encode("Once upon a time", prepend="<|bos|>")
    reference = list(model.generate(prompt, 20, temperature=0.9, top_k=20, seed=5))
    [sample] = generation.generate_batch(model, tok, prompt, 1, 20, temperature=0.9, top_k=20, seed=5, use_tools=False)
    assert sample.ids == reference[: len(sample.ids)] and (sample.finished or len(sample.ids) == 20)


class EndBias(torch.nn.Module):
    """A real model made to end its reply often, so rows finish at different steps."""

    def __init__(self, model, bias):
        super().__init__()
        self.model, self.config, self.bias = model, model.config, bias

    def get_device(self):
        return self.model.get_device()

    def forward(self, idx, kv_cache=None):
        logits = self.model(idx, kv_cache=kv_cache).clone()
        logits[..., END] = logits.max(-1).values + self.bias
        return logits


def test_rows_leave_the_batch_and_the_rest_stay_consistent():
    """Every sampled token must be among the top_k of a full recomputation (no cache) over that row's
    own history: a row that read another row's cache after the batch shrank would fail this."""
    model = EndBias(tiny_gpt(seed=2), bias=-0.6)
    prompt = tok.encode("Hello there", prepend="<|bos|>")
    samples = generation.generate_batch(
        model, tok, prompt, num_samples=6, max_tokens=16, temperature=1.0, top_k=3, seed=0, use_tools=False
    )
    lengths = {len(s.ids) for s in samples}
    assert len(lengths) > 1 and any(s.finished for s in samples), "rows should end at different steps"
    with torch.no_grad():
        for s in samples:
            ids = prompt + s.ids + ([END] if s.finished else [])
            logits = model(torch.tensor([ids]))[0]
            for pos in range(len(prompt), len(ids)):
                top = logits[pos - 1].topk(3).indices.tolist()
                assert ids[pos] in top


def test_fit_context_keeps_bos_and_the_end():
    ids = [256] + list(range(100))
    cropped, budget = generation.fit_context(ids, max_tokens=500, sequence_len=64, bos_id=256)
    assert budget == 32 and len(cropped) == 32 and cropped[0] == 256 and cropped[-1] == 99
    assert generation.fit_context(ids[:10], 8, 64, 256) == (ids[:10], 8)


def test_decode_reply_and_stream_write_tool_calls_readably():
    ids = (
        chars("x ")
        + [SP("<|python_start|>")]
        + chars("2+2")
        + [SP("<|python_end|>"), SP("<|output_start|>")]
        + chars("4")
        + [SP("<|output_end|>")]
        + chars(" café")
    )
    assert generation.decode_reply(tok, ids) == "x <<2+2=4>> café"
    stream = generation.TextStream(tok)
    assert "".join(stream.push(i) for i in ids) == "x <<2+2=4>> café" == stream.text()


def test_streams_release_what_decoding_the_whole_text_would():
    """TextStream decodes only the ids since its last piece; the pieces are the ones decoding the
    whole text at every token would release (held while it ends in a partial character), for any
    bytes, broken UTF-8 and special tokens included. A reply's stream adds nothing for the end tokens."""
    import random

    rng = random.Random(0)
    alphabet = list(range(256)) + list(chars("é東🙂")) * 8 + [SP("<|python_start|>"), SP("<|output_end|>")]
    for _ in range(200):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 30))]
        stream, sent, want = generation.TextStream(tok), 0, []
        for n in range(1, len(ids) + 1):  # the whole text at every token
            text = generation.decode_reply(tok, ids[:n])
            want.append("" if text.endswith("\ufffd") else text[sent:])
            sent = sent if text.endswith("\ufffd") else len(text)
        assert [stream.push(i) for i in ids] == want, ids
        assert stream.text() == generation.decode_reply(tok, ids)
    reply = generation.TextStream(tok, generation.stop_tokens(tok))
    assert [reply.push(i) for i in chars("ok") + [END, tok.get_bos_token_id()]] == ["o", "k", "", ""]
    assert reply.text() == "ok"
