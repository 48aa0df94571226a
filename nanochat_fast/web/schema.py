"""
What a chat request may contain, checked before it reaches a replica.

    {"messages": [{"role": "user"|"assistant", "content": str}, ...],
     "temperature"?: float, "top_k"?: int, "max_tokens"?: int}

Types are strict (a number in quotes is not a number), unknown keys are refused (a misspelt
"top-k" would otherwise be silently ignored), and every violation becomes one line that says
which field is wrong and what it must be.
"""
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

MAX_TEMPERATURE = 2.0
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

    @model_validator(mode="after")
    def _conversation(self, info: ValidationInfo):
        limits: Limits = (info.context or {}).get("limits", Limits())
        messages = self.messages
        if len(messages) > limits.max_messages:
            raise ValueError(f"messages: at most {limits.max_messages} per request, got {len(messages)}")
        for i, m in enumerate(messages):
            want = "user" if i % 2 == 0 else "assistant"
            if m.role != want:
                raise ValueError(f"messages.{i}.role: roles must alternate, starting with user "
                                 f"(message {i} must be from the {want})")
            if len(m.content) > limits.max_message_chars:
                raise ValueError(f"messages.{i}.content: at most {limits.max_message_chars} characters, "
                                 f"got {len(m.content)}")
            if m.role == "user" and not m.content.strip():
                raise ValueError(f"messages.{i}.content: a user message must not be empty")
        if messages[-1].role != "user":
            raise ValueError("messages: the last message must be from the user (the reply is the assistant's)")
        total = sum(len(m.content) for m in messages)
        if total > limits.max_total_chars:
            raise ValueError(f"messages: at most {limits.max_total_chars} characters in all, got {total}")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            raise ValueError(f"max_tokens: at most {limits.max_tokens} on this server (its --max-new-tokens), "
                             f"got {self.max_tokens}")
        return self


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
