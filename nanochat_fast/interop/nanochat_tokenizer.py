"""
nanochat's tokenizer folder: tokenizer.pkl (a pickled tiktoken.Encoding) and token_bytes.pt (int32
UTF-8 bytes per token, 0 for the special tokens). A pickle can run code as it loads, so an unpickler
admits only tiktoken.core.Encoding, and not even that is built: a stand-in keeps the state handed to
its __setstate__, checked field by field. Our Tokenizer is made of the same ranks, pattern and
special tokens, so its ids are nanochat's by construction; check_same_ids confirms it at import.
"""

import pickle
from pathlib import Path

import tiktoken
import torch

from .. import checkpoints
from ..core import paths
from ..core.errors import UserError
from ..data.tokenizer import SPECIAL_TOKENS, TOKEN_BYTES_FILE, Tokenizer, save_token_bytes, token_bytes_tensor

PICKLE_FILE = "tokenizer.pkl"
FOLDER = "tokenizer"  # the tokenizer's folder in a nanochat base directory (NANOCHAT_BASE_DIR)
FOLDER_FILES = "tokenizer.pkl, token_bytes.pt"  # what a tokenizer folder holds, for the import's --help
ENCODING_NAME = "rustbpe"

# A multilingual sample with every special token in it: what the round-trip check encodes.
SAMPLE_TEXT = (
    "<|bos|>Hello, world! The year 2025 had 365 days.\n"
    "<|user_start|>Grüße aus Köln – café, naïve, façade.<|user_end|>"
    "<|assistant_start|>日本語のテキストと中文文本。 Русский текст. Ελληνικά. العربية. हिन्दी.<|assistant_end|>"
    "<|python_start|>print(sum(range(10)))<|python_end|><|output_start|>45<|output_end|>"
    "   spaces\ttabs\r\nemoji 🙂🚀 and code: def f(x): return x**2\n"
)


class _EncodingState:
    """Stands in for tiktoken.core.Encoding while unpickling: keeps the state, runs nothing."""

    def __setstate__(self, state):
        self.state = state


class _RestrictedUnpickler(pickle.Unpickler):
    """Every class or function a pickle names goes through find_class: only Encoding is admitted
    (pickle.dump(encoding) names nothing else with protocols 2 to 5, which nanochat writes)."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        if (module, name) != ("tiktoken.core", "Encoding"):
            raise UserError(
                f"{self.path} refers to {module}.{name}: only a tiktoken encoding is read from a "
                "tokenizer.pkl (pickles can run code); give the tokenizer folder nanochat's tok_train wrote"
            )
        return _EncodingState


def read_encoding_state(path) -> dict:
    """{name, pat_str, mergeable_ranks, special_tokens} of a tokenizer.pkl, read safely, each field checked."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing: --tokenizer must be the folder holding nanochat's tokenizer.pkl")
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f, path).load()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}: {e})") from None
    state = getattr(obj, "state", None) if isinstance(obj, _EncodingState) else None
    if isinstance(state, str):
        raise UserError(f"{path} names tiktoken's built-in encoding {state!r}, not a trained nanochat tokenizer")
    fields = {"pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}
    ok = isinstance(state, dict) and all(isinstance(state.get(k), t) for k, t in fields.items())
    ok = ok and all(isinstance(k, bytes) and type(v) is int for k, v in state["mergeable_ranks"].items())
    ok = ok and all(isinstance(k, str) and type(v) is int for k, v in state["special_tokens"].items())
    if not ok:
        raise UserError(
            f"{path} holds a {type(obj).__name__}, not a tiktoken encoding (name, pat_str, "
            "mergeable_ranks, special_tokens)"
        )
    return state


def tokenizer_from_state(state: dict, path) -> Tokenizer:
    """Our Tokenizer with nanochat's ranks, pattern and special tokens (ids included)."""
    specials = state["special_tokens"]
    if set(specials) != set(SPECIAL_TOKENS):
        raise UserError(
            f"{path} has special tokens {sorted(specials)}; nanochat_fast chats with exactly {SPECIAL_TOKENS}"
        )
    order = sorted(specials, key=specials.get)
    offset = len(state["mergeable_ranks"])
    if [specials[name] for name in order] != list(range(offset, offset + len(order))):
        raise UserError(
            f"{path}: special token ids {sorted(specials.values())} do not follow the "
            f"{offset} merge ranks; this tokenizer was not written by nanochat"
        )
    try:
        return Tokenizer(dict(state["mergeable_ranks"]), state["pat_str"], order)
    except Exception as e:  # e.g. a split pattern tiktoken cannot compile, ranks with gaps
        raise UserError(f"{path}: tiktoken cannot build this encoding ({type(e).__name__}: {e})") from None


def encoding(pattern: str, ranks: dict, specials: dict) -> tiktoken.Encoding:
    """The tiktoken encoding nanochat's RustBPETokenizer makes of these."""
    return tiktoken.Encoding(ENCODING_NAME, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def check_same_ids(tokenizer: Tokenizer, state: dict, text: str = SAMPLE_TEXT) -> int:
    """How many tokens of `text` our tokenizer and nanochat's encoding of `state` both give (else UserError)."""
    reference = encoding(state["pat_str"], state["mergeable_ranks"], state["special_tokens"])
    theirs = reference.encode(text, allowed_special="all")
    ours = tokenizer.enc.encode(text, allowed_special="all")
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise UserError(
            f"the converted tokenizer disagrees with nanochat's at token {first} of the sample; not importing it"
        )
    return len(ours)


def read_tokenizer(directory: Path, vocab_size: int) -> tuple[Tokenizer, int, dict[int, int]]:
    """nanochat's tokenizer folder as our Tokenizer, checked (ids on the sample, vocab size, token_bytes.pt);
    the number of sample tokens compared; for a token_bytes.pt computed the old way (through str, before
    nanochat's 2026-07-03 fix), {token id: its byte count} where it differs from the true lengths."""
    state = read_encoding_state(directory / PICKLE_FILE)
    tokenizer = tokenizer_from_state(state, directory / PICKLE_FILE)
    n = check_same_ids(tokenizer, state)
    if tokenizer.get_vocab_size() != vocab_size:
        raise UserError(
            f"the tokenizer in {directory} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size "
            f"is {vocab_size}: give the tokenizer this model was trained with"
        )
    path = directory / TOKEN_BYTES_FILE
    if not path.is_file():
        return tokenizer, n, {}
    try:
        theirs = checkpoints.read_tensors(path)
    except Exception as e:
        raise UserError(
            f"{path} cannot be read as tensors ({type(e).__name__}); remove it or re-run nanochat's tok_train"
        ) from None
    if not isinstance(theirs, torch.Tensor) or theirs.shape != (vocab_size,) or theirs.is_floating_point():
        raise UserError(f"{path} is not an integer tensor of the tokenizer's {vocab_size} tokens")
    theirs, true = theirs.to(torch.int32), token_bytes_tensor(tokenizer)
    if torch.equal(theirs, true):
        return tokenizer, n, {}
    specials = set(tokenizer.special_tokens.values())  # the old way: bytes not UTF-8 alone count 3 (U+FFFD)
    old = [0 if i in specials else len(tokenizer.enc.decode([i], errors="replace").encode()) for i in range(vocab_size)]
    if not torch.equal(theirs, torch.tensor(old, dtype=torch.int32)):
        raise UserError(f"{path} does not match tokenizer.pkl's tokens; re-run nanochat's tok_train")
    return tokenizer, n, {i: int(theirs[i]) for i in (theirs != true).nonzero().flatten().tolist()}


def old_token_bytes_notice(directory: Path, differ: dict[int, int], vocab_size: int) -> str:
    """The one line an import prints for a token_bytes.pt computed the old way."""
    return (
        f"note: {directory / TOKEN_BYTES_FILE} was computed the old way (through str, before nanochat's fix "
        f"of 2026-07-03): {len(differ):,} of {vocab_size:,} tokens differ from tokenizer.pkl's byte lengths, "
        "which are used here; nanochat's own val bpb figures were computed with its file"
    )


def check_out_tokenizer(folder: Path, tokenizer: Tokenizer, overwrite: bool):
    """A tokenizer already in an export's folder (its checkpoints' own) must be this one, unless `overwrite`."""
    pkl = folder / PICKLE_FILE
    if not pkl.exists() or overwrite:
        return
    theirs = tokenizer_from_state(read_encoding_state(pkl), pkl)
    if theirs.fingerprint != tokenizer.fingerprint:
        raise UserError(f"{pkl} is another tokenizer; export into another --out, or pass --overwrite to replace it")


def write_tokenizer_files(tokenizer: Tokenizer, directory):
    """tokenizer.pkl and token_bytes.pt as nanochat writes them, each replaced atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    ranks = tokenizer.enc._mergeable_ranks
    enc = encoding(tokenizer.pattern, ranks, {name: len(ranks) + i for i, name in enumerate(specials)})
    paths.replace_atomically(directory / PICKLE_FILE, lambda tmp: tmp.write_bytes(pickle.dumps(enc)))
    save_token_bytes(tokenizer, directory)
