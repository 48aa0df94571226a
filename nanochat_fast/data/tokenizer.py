"""
The BPE tokenizer, the nanochat way: trained with rustbpe (GPT-4-style pre-split), encoding through
tiktoken. Saved as plain files under tokenizer/: tokenizer.tiktoken (tiktoken's "base64(token) rank"
lines), tokenizer.json (split pattern, special tokens and their ids) and token_bytes.pt (int32 bytes
per token id, 0 for the special tokens: loss in bits per byte). Conversations are rendered with the
special tokens below; only what the assistant says (and its <|assistant_end|>) is supervised.
"""

import base64
import functools
import hashlib
import json
from pathlib import Path

import tiktoken

from ..core import paths
from ..core.errors import UserError

SPECIAL_TOKENS = [
    "<|bos|>",  # every document begins with it
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",  # the assistant calls the python tool
    "<|output_start|>",
    "<|output_end|>",  # the tool's output, written back into the conversation
]

# GPT-4's split pattern with numbers split into runs of at most 2 digits (not 3): with a small
# vocabulary, fewer number tokens leave room for words (nanochat's choice).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

RANKS_FILE = "tokenizer.tiktoken"
META_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.pt"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens


class Tokenizer:
    """BPE over bytes with nanochat's special tokens; a thin layer over a tiktoken.Encoding."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern=SPLIT_PATTERN, special_tokens=SPECIAL_TOKENS):
        offset = len(mergeable_ranks)
        self.special_tokens = {name: offset + i for i, name in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(
            name="nanochat_fast", pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens
        )
        self.pattern = pattern
        self.bos_token_id = self.special_tokens["<|bos|>"]

    @classmethod
    def train(cls, texts, vocab_size: int, pattern: str = SPLIT_PATTERN) -> "Tokenizer":
        """BPE trained on an iterator of strings; vocab_size counts the special tokens (a text too
        small or repetitive for that many merges gives a smaller vocabulary)."""
        if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 bytes + "
                f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}"
            )
        import rustbpe  # only training needs it

        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), pattern=pattern)
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        return cls(ranks, trainer.get_pattern())

    def save(self, directory) -> Path:
        """Write the ranks and the metadata; each file appears complete or not at all."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks)
        paths.replace_atomically(directory / RANKS_FILE, lambda tmp: tmp.write_text(lines))
        meta = {"pattern": self.pattern, "special_tokens": self.special_tokens, "vocab_size": self.get_vocab_size()}
        paths.write_json(directory / META_FILE, meta)
        return directory

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        directory = Path(directory)
        ranks_path, meta_path = directory / RANKS_FILE, directory / META_FILE
        for p in (ranks_path, meta_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p} is missing: train a tokenizer with `python -m nanochat_fast.scripts.tok_train`"
                )
        try:
            # tiktoken's format, parsed here: tiktoken.load.load_tiktoken_bpe caches files by path in
            # a temp dir, so it would keep returning the ranks of a tokenizer trained before
            ranks = {}
            for line in ranks_path.read_text().splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
            meta = json.loads(meta_path.read_text())
            specials = sorted(meta["special_tokens"], key=meta["special_tokens"].get)
            tok = cls(ranks, meta["pattern"], specials)
        except Exception as e:  # truncated or hand-edited files
            raise ValueError(
                f"cannot read the tokenizer in {directory} ({type(e).__name__}: {e}); "
                "retrain it with `python -m nanochat_fast.scripts.tok_train`"
            ) from e
        if tok.special_tokens != meta["special_tokens"]:
            raise ValueError(f"{meta_path}: special token ids do not follow the ranks; retrain the tokenizer")
        return tok

    @functools.cached_property  # the ranks never change; every checkpoint and loader reads it
    def fingerprint(self) -> str:
        """A hash of ranks, pattern and special tokens: token shards record which tokenizer made them."""
        h = hashlib.sha256(self.pattern.encode())
        for token, rank in sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(token + b"\0")
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        return h.hexdigest()[:16]

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode_special(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError:
            raise ValueError(f"unknown special token {name!r}; known: {', '.join(self.special_tokens)}") from None

    def _special_ids(self, token, arg) -> list[int]:
        if token is None or isinstance(token, int):
            return [] if token is None else [token]
        if isinstance(token, str):
            return [self.encode_special(token)]
        raise ValueError(f"{arg} must be a special token name or id, got {token!r}")

    def encode(self, text, prepend=None, append=None, num_threads: int = 8):
        """str -> list[int]; list[str] -> list[list[int]] (tiktoken's thread pool). Special-token
        strings inside the text are encoded as ordinary text, never as the special tokens."""
        pre, post = self._special_ids(prepend, "prepend"), self._special_ids(append, "append")
        if isinstance(text, str):
            return pre + self.enc.encode_ordinary(text) + post
        if isinstance(text, (list, tuple)):
            return [pre + ids + post for ids in self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)]
        raise ValueError(f"text must be a str or a list of str, got {type(text).__name__}")

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))

    def token_piece(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its name), maybe part of a UTF-8 character."""
        return self.enc.decode_single_token_bytes(token_id)

    @staticmethod
    def turns(conversation):
        """The user/assistant turns of a conversation, a system message merged into the first user one."""
        messages = conversation.get("messages") if isinstance(conversation, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError("conversation must be a dict with a non-empty 'messages' list")
        if messages[0].get("role") == "system":
            if len(messages) < 2 or messages[1].get("role") != "user":
                raise ValueError("conversation: a system message must be followed by a user message")
            merged = dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])
            messages = [merged] + messages[2:]
        for i, m in enumerate(messages):
            want = "user" if i % 2 == 0 else "assistant"
            if not isinstance(m, dict) or m.get("role") != want:
                got = m.get("role") if isinstance(m, dict) else type(m).__name__
                raise ValueError(
                    f"conversation: message {i} must be from the {want} (roles alternate, user first), got {got!r}"
                )
        return messages

    def render_conversation(self, conversation, max_tokens: int | None = None):
        """Token ids and a mask (1 on what the model learns to say: the assistant's text and its
        <|assistant_end|>), both lists of ints, truncated to max_tokens."""
        messages = self.turns(conversation)
        sp = self.special_tokens
        ids, mask = [sp["<|bos|>"]], [0]

        def add(tokens, value):
            ids.extend(tokens)
            mask.extend([value] * len(tokens))

        for m in messages:
            content = m.get("content")
            if m["role"] == "user":
                if not isinstance(content, str):
                    raise ValueError("conversation: user content must be a str")
                add([sp["<|user_start|>"]] + self.enc.encode_ordinary(content) + [sp["<|user_end|>"]], 0)
                continue
            add([sp["<|assistant_start|>"]], 0)
            if isinstance(content, str):
                add(self.enc.encode_ordinary(content), 1)
            elif isinstance(content, list):  # parts: text, a python tool call, and the tool's output
                for part in content:
                    kind, text = part.get("type"), part.get("text", "")
                    body = self.enc.encode_ordinary(text)
                    if kind == "text":
                        add(body, 1)
                    elif kind == "python":
                        add([sp["<|python_start|>"]] + body + [sp["<|python_end|>"]], 1)
                    elif kind == "python_output":  # comes from the tool, not the model: not supervised
                        add([sp["<|output_start|>"]] + body + [sp["<|output_end|>"]], 0)
                    else:
                        raise ValueError(f"conversation: unknown assistant content part type {kind!r}")
            else:
                raise ValueError("conversation: assistant content must be a str or a list of parts")
            add([sp["<|assistant_end|>"]], 1)
        if max_tokens is not None:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        return ids, mask

    def render_for_completion(self, conversation) -> list[int]:
        """The conversation without a trailing assistant message, then <|assistant_start|>."""
        messages = conversation.get("messages") if isinstance(conversation, dict) else None
        if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
            conversation = dict(conversation, messages=messages[:-1])
        messages = self.turns(conversation)
        if messages[-1]["role"] != "user":
            raise ValueError("render_for_completion: the conversation must end with a user message")
        ids, _ = self.render_conversation(conversation)
        return ids + [self.special_tokens["<|assistant_start|>"]]


def get_tokenizer(directory=None) -> Tokenizer:
    """The trained tokenizer under NANOCHAT_FAST_HOME (or `directory`); a UserError when missing."""
    directory = Path(directory) if directory is not None else paths.tokenizer_dir()
    if not (directory / RANKS_FILE).is_file():
        raise UserError(
            f"no tokenizer in {directory}: run `python -m nanochat_fast.scripts.tok_train` "
            "(after `python -m nanochat_fast.scripts.prepare_data`)"
        )
    try:
        return Tokenizer.load(directory)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def token_bytes_tensor(tokenizer: Tokenizer):
    """int32[vocab]: bytes per token id, 0 for the special tokens (they stand for no text), as
    token_bytes.pt holds them (ours and nanochat's alike)."""
    import torch

    specials, enc = set(tokenizer.special_tokens.values()), tokenizer.enc
    lengths = [0 if i in specials else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    return torch.tensor(lengths, dtype=torch.int32)


def save_token_bytes(tokenizer: Tokenizer, directory) -> Path:
    """Write directory/token_bytes.pt (token_bytes_tensor), replaced atomically."""
    import torch

    token_bytes, path = token_bytes_tensor(tokenizer), Path(directory) / TOKEN_BYTES_FILE
    paths.replace_atomically(path, lambda tmp: torch.save(token_bytes, tmp))
    return path


def get_token_bytes(device="cpu"):
    """int32[vocab] bytes per token (0 for special tokens), for bits-per-byte."""
    import torch

    path = paths.tokenizer_dir() / TOKEN_BYTES_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: run `python -m nanochat_fast.scripts.tok_train`")
    return torch.load(path, map_location=device, weights_only=True)
