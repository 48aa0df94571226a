"""
What a chat request may contain, checked before it reaches a replica.

    {"messages": [{"role": "user"|"assistant", "content": str}, ...],
     "temperature"?: float, "top_k"?: int, "max_tokens"?: int}

temperature is in [0, 2]; 0 is greedy, and so is any temperature below MIN_TEMPERATURE (1e-6):
such a value is accepted and served as 0 (see greedy_below_min), never refused.

Types are strict (a number in quotes is not a number), unknown keys are refused (a misspelt
"top-k" would otherwise be silently ignored), and every violation becomes one line that says
which field is wrong and what it must be.
"""

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_TEMPERATURE = 2.0
# Temperatures below this are greedy. Sampling takes softmax(logits / T); the model's logits are
# fp32, softcapped to +-15 (model/gpt.py), so logits / T stays finite only for
# T >= 15 / 3.4028e38 = 4.41e-38 (bf16 has fp32's range: 4.43e-38). Below that the top logits
# become inf, softmax computes inf - inf = nan and sampling fails. 1e-6 is 32 orders of
# magnitude clear of that and already greedy in all but name: at T < 1e-6 a token whose logit is
# 1e-4 below the top one keeps less than exp(-100) of the top one's odds, so only logits tied to
# within 1e-4 (about 100 fp32 steps at 15, well under a bf16 matmul's rounding) could compete.
# The other end is harmless: T <= MAX_TEMPERATURE only flattens (logits / 2 lie in [-7.5, 7.5]).
# model/generation.py applies the same rule to library callers (web/ imports nothing of the
# package, so the number is written twice; test_chat_web_api checks that they agree).
MIN_TEMPERATURE = 1e-6
MAX_TOP_K = 200  # 0 means no top-k filtering (the whole vocabulary)


@dataclass(frozen=True)
class Limits:
    """Bounds on one request. max_tokens is the server's --max-new-tokens."""

    max_tokens: int = 512
    max_messages: int = 500
    max_message_chars: int = 8000
    max_total_chars: int = 32000
    # JSON of max_total_chars characters: up to 4 bytes each in UTF-8, plus the keys around them
    max_body_bytes: int = 160 * 1024


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    max_tokens: int | None = Field(default=None, ge=1)

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, t: float | None) -> float | None:
        return None if t is None else greedy_below_min(t)

    @model_validator(mode="after")
    def _conversation(self, info: ValidationInfo):
        limits: Limits = (info.context or {}).get("limits", Limits())
        messages = self.messages
        if len(messages) > limits.max_messages:
            raise ValueError(f"messages: at most {limits.max_messages} per request, got {len(messages)}")
        for i, m in enumerate(messages):
            want = "user" if i % 2 == 0 else "assistant"
            if m.role != want:
                raise ValueError(
                    f"messages.{i}.role: roles must alternate, starting with user (message {i} must be from the {want})"
                )
            if len(m.content) > limits.max_message_chars:
                raise ValueError(
                    f"messages.{i}.content: at most {limits.max_message_chars} characters, got {len(m.content)}"
                )
            if m.role == "user" and not m.content.strip():
                raise ValueError(f"messages.{i}.content: a user message must not be empty")
        if messages[-1].role != "user":
            raise ValueError("messages: the last message must be from the user (the reply is the assistant's)")
        total = sum(len(m.content) for m in messages)
        if total > limits.max_total_chars:
            raise ValueError(f"messages: at most {limits.max_total_chars} characters in all, got {total}")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            raise ValueError(
                f"max_tokens: at most {limits.max_tokens} on this server (its --max-new-tokens), got {self.max_tokens}"
            )
        return self


def greedy_below_min(temperature: float) -> float:
    """The temperature a replica samples at: 0 (greedy) below MIN_TEMPERATURE, else itself."""
    return 0.0 if temperature < MIN_TEMPERATURE else temperature


def parse_request(body: bytes, limits: Limits) -> ChatRequest:
    """The request in `body`, or ValueError with one line saying what is wrong."""
    try:
        return ChatRequest.model_validate_json(body, context={"limits": limits})
    except ValidationError as e:
        raise ValueError(one_line(e)) from None


def one_line(e: ValidationError) -> str:
    """The first problem pydantic found, as 'where: what' on one line."""
    errors = e.errors(include_url=False, include_input=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    what = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error":  # our own checks name the field themselves
        text = what
    else:
        text = f"{where or 'body'}: {what}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return " ".join(text.split())
