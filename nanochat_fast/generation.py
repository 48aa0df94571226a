"""
Text generation helpers on top of GPT.generate (KV-cached sampling): a plain continuation for base
models, and the assistant's next message of a conversation for chat models, streamed piece by
piece for chat_cli (and anything else that shows a reply as it is written).
"""
import torch


@torch.no_grad()
def complete(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """The greedy continuation of `prompt` (after <|bos|>), as text."""
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    return tokenizer.decode(list(model.generate(ids, max_tokens=max_tokens, temperature=0.0)))


class TextStream:
    """Token ids in, text pieces out. A character can span several tokens (UTF-8 bytes split by
    BPE); a piece is released only once the text decoded so far no longer ends in a partial
    character, so a streamed reply never shows a replacement character that the final text lacks."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)


@torch.no_grad()
def assistant_reply(model, tokenizer, messages: list[dict], max_tokens: int, temperature=0.0, top_k=None,
                    seed=42, on_text=None, should_stop=None) -> str:
    """The assistant's next message after `messages`, up to <|assistant_end|>.

    on_text(piece) sees the reply's text as it comes (for streaming); should_stop() is asked before
    every new token and ends the reply early when it returns True (a stop button, a client gone).
    Prompt + reply stay within the context the model was trained on: the reply gets at most half
    of it, a long conversation keeps its end."""
    ids = tokenizer.render_for_completion({"messages": messages})
    max_tokens = min(max_tokens, model.config.sequence_len // 2)
    room = model.config.sequence_len - max_tokens
    if len(ids) > room:
        ids = [tokenizer.get_bos_token_id()] + ids[-(room - 1):]
    stop = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    stream = TextStream(tokenizer)
    for tok in model.generate(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed):
        if tok in stop or (should_stop is not None and should_stop()):
            break
        piece = stream.push(tok)
        if piece and on_text is not None:
            on_text(piece)
    return stream.text()
