"""
Our tokenizer as a Hugging Face tokenizer folder and back: tokenizer.json (a byte-level BPE of the
`tokenizers` library with our split pattern, ranks as ids and every special token), tokenizer_config.json
and chat_template.jinja, a Jinja template that renders a conversation as our chat format does.
Reading one back gives our Tokenizer, whose ids are checked against the `tokenizers` library's own.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..core.errors import UserError
from ..data.tokenizer import SPECIAL_TOKENS, Tokenizer
from .nanochat_tokenizer import SAMPLE_TEXT

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")  # what ends a reply (model/batch_engine.stop_tokens)

# render_conversation's format: <|bos|>, a system message folded into the first user message (two
# newlines between), user turns between <|user_start|>/<|user_end|>, assistant turns (a string or parts:
# text, a python call, its output) between <|assistant_start|>/<|assistant_end|>; the generation prompt
# is <|assistant_start|>, where the reply begins.
CHAT_TEMPLATE = """{%- set ns = namespace(system='') -%}
<|bos|>
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- if not loop.first -%}{{ raise_exception('a system message must come first') }}{%- endif -%}
{%- set ns.system = message['content'] + '\n\n' -%}
{%- elif message['role'] == 'user' -%}
<|user_start|>{{ ns.system + message['content'] }}<|user_end|>
{%- set ns.system = '' -%}
{%- elif message['role'] == 'assistant' -%}
<|assistant_start|>
{%- if message['content'] is string -%}{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{ part['text'] }}
{%- elif part['type'] == 'python' -%}<|python_start|>{{ part['text'] }}<|python_end|>
{%- elif part['type'] == 'python_output' -%}<|output_start|>{{ part['text'] }}<|output_end|>
{%- else -%}{{ raise_exception('unknown assistant content part type ' + part['type']) }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|assistant_end|>
{%- else -%}{{ raise_exception('roles are system, user and assistant, got ' + message['role']) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}
"""


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer writes tokens in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in BYTE_CHARS.items()}


def _text(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce tiktoken's rank order: each token made of the split whose pieces exist,
    ordered by the token's rank (tiktoken merges the adjacent pair whose result ranks lowest)."""
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    return [(_text(a), _text(b)) for *_, a, b in sorted(merges)]


def build(tokenizer: Tokenizer) -> HFTokenizer:
    """The `tokenizers` library's tokenizer with our ranks, split pattern and special tokens (same ids)."""
    ranks = tokenizer.enc._mergeable_ranks
    vocab = {_text(token): rank for token, rank in ranks.items()}
    hf = HFTokenizer(models.BPE(vocab, _merges(ranks), fuse_unk=False, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    hf.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in specials])
    return hf


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|assistant_end|>",
        "pad_token": "<|bos|>",  # nanochat pads with <|bos|> (its loss ignores those targets)
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


def write_files(tokenizer: Tokenizer, folder: Path, model_max_length: int):
    """tokenizer.json, tokenizer_config.json and chat_template.jinja into `folder` (a fresh folder)."""
    build(tokenizer).save(str(folder / TOKENIZER_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    (folder / TEMPLATE_FILE).write_text(CHAT_TEMPLATE)


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """bos, eos (the reply's end) and the stop tokens' ids, for config.json and generation_config.json."""
    sp = tokenizer.special_tokens
    return {"bos": sp["<|bos|>"], "eos": sp["<|assistant_end|>"], "stop": [sp[name] for name in STOP_TOKENS]}


def _split_pattern(pre_tokenizer: dict | None, path: Path) -> str:
    """The regex of a Sequence[Split(regex, isolated), ByteLevel(no regex)] pre-tokenizer, the only kind we read."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    kinds = [s.get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"] or steps[1].get("use_regex") or steps[1].get("add_prefix_space"):
        raise UserError(
            f"{path}: its pre-tokenizer is {kinds or (pre_tokenizer or {}).get('type')}, not a split pattern then "
            "bytes (the byte-level BPE nanochat_fast and nanochat use); this tokenizer cannot be imported"
        )
    pattern = steps[0].get("pattern") or {}
    if "Regex" not in pattern or steps[0].get("behavior") != "Isolated" or steps[0].get("invert"):
        raise UserError(f"{path}: its split step is not an isolating regex split; this tokenizer cannot be imported")
    return pattern["Regex"]


def read_tokenizer(folder: Path, vocab_size: int, sample: str = SAMPLE_TEXT) -> Tokenizer:
    """A folder's tokenizer.json as our Tokenizer: byte-level BPE, ids 0..N-1 its ranks, then exactly our
    special tokens; its ids on `sample` must equal ours (and `vocab_size` the model's)."""
    path = folder / TOKENIZER_FILE
    try:
        spec = json.loads(path.read_text())
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # OSError, JSONDecodeError, and the plain Exceptions tokenizers raises for bad files
        raise UserError(f"{path} is not a readable tokenizers file ({type(e).__name__}: {e})") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{path}: its model is {model.get('type')!r}, not a byte-level BPE; it cannot be imported")
    pattern = _split_pattern(spec.get("pre_tokenizer"), path)
    try:
        ranks = {bytes(CHAR_BYTES[c] for c in text): rank for text, rank in model["vocab"].items()}
    except KeyError:
        raise UserError(f"{path}: a vocabulary entry is not written in byte-level characters") from None
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
    want = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    if added != want:
        raise UserError(
            f"{path}: its special tokens are {added}, but nanochat_fast chats with exactly {want} (the ids right "
            "after the BPE ranks); this tokenizer does not render our chat format"
        )
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{path}: the vocabulary's ids are not 0..{len(ranks) - 1}; it is not a ranked BPE")
    try:
        tokenizer = Tokenizer(ranks, pattern, SPECIAL_TOKENS)
    except Exception as e:  # a pattern tiktoken cannot compile
        raise UserError(f"{path}: tiktoken cannot build this encoding ({type(e).__name__}: {e})") from None
    if tokenizer.get_vocab_size() != vocab_size:
        raise UserError(
            f"{path} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is {vocab_size}: "
            "the folder's tokenizer is not the model's"
        )
    ours, theirs = tokenizer.enc.encode(sample, allowed_special="all"), hf.encode(sample).ids
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise UserError(f"{path}: its merges give other ids than its ranks at token {first} of a sample text")
    return tokenizer
