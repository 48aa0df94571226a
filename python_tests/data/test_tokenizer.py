"""The BPE tokenizer: training, round trips, special tokens, conversation rendering, save/load."""

import random

import pytest
import torch

from nanochat_fast.core.cli import UserError
from nanochat_fast.data.tokenizer import SPECIAL_TOKENS, Tokenizer, get_token_bytes, get_tokenizer, token_bytes_tensor

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hum "
    "numbers like 42 and 1234 appear, don't they? Überraschung: naïve café 東京 🙂"
).split()


@pytest.fixture(scope="module")
def corpus():
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "\n" for _ in range(400)]


@pytest.fixture(scope="module")
def tok(corpus):
    return Tokenizer.train(iter(corpus), vocab_size=300)


def test_trains_to_the_requested_size_and_round_trips(tok, corpus):
    assert tok.get_vocab_size() == 300
    text = "".join(corpus[:50]) + "unseen words: xylophone, ZEBRA 987654321 ☃ \t tabs\r\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < 0.8 * len(text.encode("utf-8")), "the merges compress the training text"
    assert all(0 <= i < tok.get_vocab_size() - len(SPECIAL_TOKENS) for i in ids), "ordinary text -> ordinary ids"


def test_batch_encode_prepend_append(tok, corpus):
    bos, end = tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")
    batch = tok.encode(corpus[:20], prepend="<|bos|>", append=end, num_threads=2)
    for text, ids in zip(corpus[:20], batch):
        assert ids == [bos] + tok.encode(text) + [end]
    with pytest.raises(ValueError, match="text must be"):
        tok.encode(123)


def test_special_tokens_are_single_ids(tok):
    ids = [tok.encode_special(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(tok.get_vocab_size() - len(SPECIAL_TOKENS), tok.get_vocab_size()))
    assert tok.get_bos_token_id() == tok.encode_special("<|bos|>")
    for name, i in zip(SPECIAL_TOKENS, ids):
        assert tok.decode([i]) == name
        assert i not in tok.encode(name), "typed text never turns into a special token"
    with pytest.raises(ValueError, match="unknown special token"):
        tok.encode_special("<|nope|>")


def test_render_conversation_masks_exactly_the_assistant(tok):
    conv = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4, of course."},
            {"role": "user", "content": "And 3 + 3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me compute: "},
                    {"type": "python", "text": "3 + 3"},
                    {"type": "python_output", "text": "6"},
                    {"type": "text", "text": "6."},
                ],
            },
        ]
    }
    ids, mask = tok.render_conversation(conv)
    sp = {name: tok.encode_special(name) for name in SPECIAL_TOKENS}
    e = tok.encode
    expected = (
        [sp["<|bos|>"], sp["<|user_start|>"]]
        + e("Be brief.\n\nWhat is 2 + 2?")
        + [sp["<|user_end|>"], sp["<|assistant_start|>"]]
        + e("4, of course.")
        + [sp["<|assistant_end|>"], sp["<|user_start|>"]]
        + e("And 3 + 3?")
        + [sp["<|user_end|>"], sp["<|assistant_start|>"]]
        + e("Let me compute: ")
        + [sp["<|python_start|>"]]
        + e("3 + 3")
        + [sp["<|python_end|>"], sp["<|output_start|>"]]
        + e("6")
        + [sp["<|output_end|>"]]
        + e("6.")
        + [sp["<|assistant_end|>"]]
    )
    assert ids == expected
    # the mask, derived independently: 1 inside an assistant turn (after <|assistant_start|>, up to
    # and including <|assistant_end|>), except the tool output block
    want, inside, output = [], False, False
    for i in ids:
        if i == sp["<|assistant_start|>"]:
            want.append(0)
            inside = True
            continue
        output = output or i == sp["<|output_start|>"]
        want.append(int(inside and not output))
        output = output and i != sp["<|output_end|>"]
        inside = inside and i != sp["<|assistant_end|>"]
    assert mask == want
    assert sum(mask) > 0 and len(mask) == len(ids)
    short_ids, short_mask = tok.render_conversation(conv, max_tokens=7)
    assert short_ids == ids[:7] and short_mask == mask[:7]


def test_render_for_completion(tok):
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    ids = tok.render_for_completion(conv)
    prompt = {"messages": conv["messages"][:1]}
    assert ids == tok.render_conversation(prompt)[0] + [tok.encode_special("<|assistant_start|>")]
    assert tok.render_for_completion(prompt) == ids
    assert conv["messages"][-1]["content"] == "hello", "the caller's conversation is not modified"


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty 'messages'"),
        ([{"role": "assistant", "content": "x"}], "message 0 must be from the user"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 must be from the assistant"),
        ([{"role": "system", "content": "s"}], "followed by a user message"),
    ],
)
def test_bad_conversations(tok, messages, message):
    with pytest.raises(ValueError, match=message):
        tok.render_conversation({"messages": messages})


def test_save_load_gives_identical_ids(tok, corpus, tmp_path):
    tok.save(tmp_path / "tok")
    again = Tokenizer.load(tmp_path / "tok")
    text = "".join(corpus[:30])
    assert again.encode(text) == tok.encode(text)
    assert again.special_tokens == tok.special_tokens and again.fingerprint == tok.fingerprint
    assert again.get_vocab_size() == tok.get_vocab_size()
    other = Tokenizer.train(iter(corpus), vocab_size=290)
    assert other.fingerprint != tok.fingerprint
    other.save(tmp_path / "tok")  # a retrained tokenizer in the same place is the one loaded
    assert Tokenizer.load(tmp_path / "tok").fingerprint == other.fingerprint
    (tmp_path / "tok" / "tokenizer.tiktoken").write_text("garbage\n")
    with pytest.raises(ValueError, match="retrain"):
        Tokenizer.load(tmp_path / "tok")


def test_token_byte_lengths(tok, corpus):
    lengths = token_bytes_tensor(tok).tolist()
    assert len(lengths) == tok.get_vocab_size()
    assert all(lengths[tok.encode_special(n)] == 0 for n in SPECIAL_TOKENS)
    text = corpus[3] + "café 東京"
    assert sum(lengths[i] for i in tok.encode(text)) == len(text.encode("utf-8"))


def test_vocab_size_too_small(corpus):
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(iter(corpus), vocab_size=100)


def test_get_tokenizer_says_how_to_make_one(nanochat_home):
    with pytest.raises(UserError, match="tok_train"):
        get_tokenizer()
    with pytest.raises(UserError, match="tok_train"):
        get_token_bytes()


def test_tok_train_script(nanochat_home, corpus, tmp_path, capsys):
    from nanochat_fast.scripts import prepare_data, tok_train

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n".join(corpus[:200]))
    assert prepare_data.main(["--input", str(folder), "--name", "base", "--doc-chars=500", "--val-every=5"]) == 0
    assert "tok_train" in capsys.readouterr().out
    assert tok_train.main(["--vocab-size=320", "--num-threads=1"]) == 0
    t = get_tokenizer()
    assert t.get_vocab_size() == 320
    token_bytes = get_token_bytes()
    assert token_bytes.dtype == torch.int32 and token_bytes.tolist() == token_bytes_tensor(t).tolist()
    assert (nanochat_home / "tokens" / "base" / "train").is_dir(), "tok_train tokenized the prepared data"
    with pytest.raises(SystemExit) as e:
        tok_train.main(["--vocab-size=-3"])
    assert e.value.code == 2
    with pytest.raises(UserError, match="vocab-size"):
        tok_train.main(["--vocab-size=200"])


def test_text_stream_never_releases_a_partial_character(tok):
    """Streaming token by token: a character split over several byte-level tokens comes out whole,
    once, and the pieces add up to the decoded text."""
    from nanochat_fast.model.generation import TextStream

    text = "naïve café 東京 🙂 and 🙂🙂"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split over tokens"
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == stream.text()
