"""
chat_web's OpenAI API, beside its own protocol and through the same pool, admission and limits: POST
/v1/chat/completions (streamed or not), POST /v1/completions (a base model's text; logprobs with echo
score the prompt's own tokens), GET /v1/models, and the tokenizer routes lm-eval's remote tokenizer
reads (/tokenizer_info, /tokenize, /detokenize). What we cannot honour is a 400 naming it, OpenAI's shape.
"""

import asyncio
import json
import random
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .app import MAX_TEMPERATURE, MAX_TOP_K, ChatRequest, first_problem, greedy_below_min, job_batches, read_body
from .pool import Job, QueueFull

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_PROMPTS = 16  # prompts in one /v1/completions request, each a job of its own
MAX_LOGPROBS = 5  # OpenAI's limit on a completion's logprobs
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Parameters OpenAI defines that this server cannot honour, each with the values that ask for nothing
# (clients send some of them by default): any other value is a 400 naming it, never silently ignored.
NEUTRAL = {
    "n": [1],
    "best_of": [1],
    "presence_penalty": [0],
    "frequency_penalty": [0],
    "logit_bias": [{}],
    "response_format": [{"type": "text"}],
    "tools": [[]],
    "tool_choice": ["none"],
    "functions": [[]],
    "function_call": ["none"],
    "parallel_tool_calls": [False],
    "logprobs": [False],  # a chat request's; /v1/completions takes a number
    "top_logprobs": [0],
    "store": [False],
    "suffix": [""],
    "metadata": [{}],
}
UNSUPPORTED = "{key}: {value} is not supported by this server (only {neutral}); leave it out"


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Refused(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers

    def response(self):
        return openai_error(self.status, str(self), self.param, self.code, self.headers)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What both endpoints take; None is the server's default (chat_web's --temperature, --top-k)."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    max_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOPS or not all(stops):
            raise Refused(f"stop: at most {MAX_STOPS} non-empty strings, got {stops!r}", "stop")
        return stops


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


def parse(body: bytes, model: type[Sampling]) -> Sampling:
    """The request, or Refused naming the first problem: a parameter we cannot honour, then the body's shape."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused(f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise Refused(f"the body must be a JSON object, got {type(data).__name__}")
    for key, value in list(data.items()):
        if key in NEUTRAL and key not in model.model_fields:
            if value is not None and value not in NEUTRAL[key]:
                neutral = " or ".join(json.dumps(v) for v in NEUTRAL[key])
                raise Refused(UNSUPPORTED.format(key=key, value=json.dumps(value), neutral=neutral), key)
            del data[key]
        elif value is None and key != "model":  # an explicit null: the default
            del data[key]
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, where = first_problem(e)
        raise Refused(message, where or None) from None


def fold_system(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the tokenizer renders it: a first system (or developer) message folded into the
    first user message, as nanochat's SFT data does (data/tokenizer.Tokenizer.turns), text parts joined."""
    folded = [
        {"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
        for m in messages
    ]
    for i, m in enumerate(folded):
        if m["role"] in ("system", "developer") and i > 0:
            raise Refused(f"messages.{i}.role: a {m['role']} message may only come first", f"messages.{i}.role")
    if folded[0]["role"] in ("system", "developer"):
        if len(folded) < 2 or folded[1]["role"] != "user":
            raise Refused("messages.1.role: a system message must be followed by a user message", "messages.1.role")
        folded = [{"role": "user", "content": folded[0]["content"] + "\n\n" + folded[1]["content"]}] + folded[2:]
    return folded


class StopScan:
    """Text pieces in, text out up to the first stop string; what could be a stop string's start is held back."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.hit = stops, "", False

    def push(self, piece: str) -> str:
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[: min(found)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]


class Reply:
    """One job's text as it comes, cut at the stop strings (the job then stopped); error: why it failed."""

    def __init__(self, job: Job, stops: list[str]):
        self.job, self.scan, self.error = job, StopScan(stops), None

    async def pieces(self, pool, arrived: float, timeout: float):
        async for batch in job_batches(self.job, pool, arrived, timeout):
            for kind, value in batch:
                if kind == "token" and not self.scan.hit:
                    if text := self.scan.push(value):
                        yield text
                    if self.scan.hit:
                        pool.cancel(self.job, "stop")
                elif kind == "error":
                    self.error = value
        if self.scan.held and self.error is None:
            yield self.scan.held

    @property
    def finish_reason(self) -> str:
        return "stop" if self.scan.hit else self.job.finish_reason or "length"

    def usage(self) -> dict:
        prompt, completion = len(self.job.prompt_ids), len(self.job.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer, token_id: int) -> str:
    """A token as OpenAI lists it: its text, or "bytes:\\xNN..." where it is part of a UTF-8 character."""
    piece = tokenizer.token_piece(token_id)
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def logprobs_of(tokenizer, job: Job, first: int, silent: set[int], start: int) -> dict:
    """OpenAI's completion logprobs over job's tokens from index `first` (0: the prompt's too, the first one
    None): each token, its log-probability, the most likely tokens there, and where its text begins in the
    returned text (from `start`; the tokens at `silent` indices write none)."""
    ids = job.prompt_ids + job.token_ids
    chosen, best_ids, best = job.scores
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    written = b""
    for i in range(first, len(ids)):
        out["tokens"].append(token_text(tokenizer, ids[i]))
        out["text_offset"].append(start + len(written.decode("utf-8", "ignore")))
        if i not in silent:
            written += tokenizer.token_piece(ids[i])
        top = None if i == 0 else {token_text(tokenizer, t): lp for t, lp in zip(best_ids[i - 1], best[i - 1])}
        out["token_logprobs"].append(None if i == 0 else chosen[i - 1])
        out["top_logprobs"].append(top)
    return out


def openai_routes(pool, settings, tokenizer) -> APIRouter:
    limits, router = settings.limits, APIRouter()
    created = int(time.time())
    bos = tokenizer.get_bos_token_id()
    # MAX_PROMPTS prompts of a whole context each (lm-eval's batches) fit: a token id takes at most 8 bytes of
    # JSON ("65535, "), a token's text a few bytes, 16 leaving room for escapes
    completion_bytes = limits.max_body_bytes + MAX_PROMPTS * settings.context_len * 16

    async def read_parsed(request: Request, model: type[Strict], max_bytes: int = limits.max_body_bytes):
        """The body parsed as `model`, or the error Response of reading it (too large, too slow)."""
        body = await read_body(request, max_bytes, settings.body_timeout, openai_error)
        return body if isinstance(body, Response) else parse(body, model)

    async def read(request: Request, model: type[Sampling], max_bytes: int = limits.max_body_bytes) -> Sampling:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise Refused("the body must be JSON: send the header Content-Type: application/json", status=415)
        req = await read_parsed(request, model, max_bytes)
        if isinstance(req, Response):
            return req
        if req.model != settings.model_id:
            message = f"model {req.model!r}: this server serves {settings.model_id!r} (GET /v1/models)"
            raise Refused(message, "model", 404, "model_not_found")
        return req

    def job(req: Sampling, max_tokens: int, **what) -> Job:
        temperature = settings.temperature if req.temperature is None else req.temperature
        return Job(
            max_tokens=max_tokens,
            temperature=greedy_below_min(temperature),
            top_k=(settings.top_k if req.top_k is None else req.top_k) or None,
            top_p=req.top_p,
            seed=random.getrandbits(31) if req.seed is None else req.seed,
            **what,
        )

    def submit(jobs: list[Job]):
        for i, j in enumerate(jobs):
            try:
                pool.submit(j)
            except QueueFull as e:
                for submitted in jobs[:i]:
                    pool.cancel(submitted, "client")
                raise Refused(str(e), status=503, headers={"Retry-After": str(e.retry_after)}) from None

    def head(kind: str, prefix: str) -> dict:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": settings.model_id,
        }

    def answer(handler):
        async def route(request: Request):
            try:
                return await handler(request, time.monotonic())
            except Refused as e:
                return e.response()

        route.__name__ = handler.__name__
        return route

    @router.get("/v1/models")
    async def models():
        model = {"id": settings.model_id, "object": "model", "created": created, "owned_by": "nanochat_fast"}
        return {"object": "list", "data": [model]}

    @router.post("/v1/chat/completions")
    @answer
    async def chat_completions(request: Request, arrived: float):
        req = await read(request, ChatCompletionRequest)
        if isinstance(req, Response):
            return req
        stops, messages = req.stops(), fold_system(req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        try:  # the conversation and its limits as our own endpoint checks them
            ChatRequest.model_validate({"messages": messages, "max_tokens": max_tokens}, context={"limits": limits})
        except ValidationError as e:
            message, where = first_problem(e)
            raise Refused(message, where or None) from None
        reply = Reply(job(req, max_tokens or limits.max_tokens, messages=messages), stops)
        submit([reply.job])
        pieces = reply.pieces(pool, arrived, settings.request_timeout)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # as our own endpoint's stream
            return StreamingResponse(
                chat_chunks(reply, pieces, include_usage), media_type="text/event-stream", headers=headers
            )
        text = "".join([piece async for piece in pieces])
        if reply.error is not None:
            return openai_error(500, reply.error)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}
        return head("chat.completion", "chatcmpl") | {"choices": [choice], "usage": reply.usage()}

    async def chat_chunks(reply: Reply, pieces, include_usage: bool):
        base = head("chat.completion.chunk", "chatcmpl")

        def chunk(delta: dict, finish=None, **extra) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps(base | {'choices': [choice]} | extra, ensure_ascii=False)}\n\n"

        usage = {"usage": None} if include_usage else {}
        yield chunk({"role": "assistant", "content": ""}, **usage)
        async for piece in pieces:
            yield chunk({"content": piece}, **usage)
        if reply.error is not None:  # the openai client raises an APIError carrying it
            yield f"data: {json.dumps({'error': {'message': reply.error, 'type': 'server_error'}})}\n\n"
            return
        yield chunk({}, reply.finish_reason, **usage)
        if include_usage:
            yield f"data: {json.dumps(base | {'choices': [], 'usage': reply.usage()})}\n\n"
        yield "data: [DONE]\n\n"

    def prompts(req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, text) per prompt: a text starts a document (<|bos|> first); token ids are taken as given."""
        p = req.prompt
        many = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        given = p if many else [p]
        if not 1 <= len(given) <= MAX_PROMPTS:
            raise Refused(f"prompt: 1 to {MAX_PROMPTS} prompts per request, got {len(given)}", "prompt")
        out, vocab = [], tokenizer.get_vocab_size()
        for i, one in enumerate(given):
            where = f"prompt.{i}" if many else "prompt"
            ids = tokenizer.encode(one, prepend=bos) if isinstance(one, str) else list(one)
            if not ids or not all(0 <= t < vocab for t in ids):
                raise Refused(f"{where}: token ids must be a non-empty list in [0, {vocab})", where)
            if len(ids) + req.max_tokens > settings.context_len:
                raise Refused(
                    f"{where}: {len(ids)} tokens + max_tokens {req.max_tokens} exceed the model's context of "
                    f"{settings.context_len} tokens",
                    where,
                )
            out.append((ids, one if isinstance(one, str) else None))
        return out

    @router.post("/v1/completions")
    @answer
    async def completions(request: Request, arrived: float):
        req = await read(request, CompletionRequest, completion_bytes)
        if isinstance(req, Response):
            return req
        if req.stream:
            raise Refused("stream: /v1/completions answers in one response on this server; leave it out", "stream")
        if req.max_tokens is None:
            req.max_tokens = min(COMPLETION_MAX_TOKENS, limits.max_tokens)
        if req.max_tokens > limits.max_tokens:
            message = (
                f"max_tokens: at most {limits.max_tokens} on this server (its --max-new-tokens), got {req.max_tokens}"
            )
            raise Refused(message, "max_tokens")
        stops, given = req.stops(), prompts(req)
        if stops and req.logprobs is not None:  # the scores would list tokens generated past the stop string
            raise Refused("stop: not supported together with logprobs on this server; leave one out", "stop")
        replies = [
            Reply(job(req, req.max_tokens, messages=[], prompt=ids, logprobs=req.logprobs), stops) for ids, _ in given
        ]
        submit([r.job for r in replies])

        async def text_of(reply: Reply) -> str:
            return "".join([piece async for piece in reply.pieces(pool, arrived, settings.request_timeout)])

        texts = await asyncio.gather(*(text_of(r) for r in replies))
        choices, usage = [], dict.fromkeys(("prompt_tokens", "completion_tokens", "total_tokens"), 0)
        for index, (reply, text, (ids, prompt_text)) in enumerate(zip(replies, texts, given)):
            if reply.error is not None:
                return openai_error(500, reply.error)
            echoed = (tokenizer.decode(ids) if prompt_text is None else prompt_text) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                silent = {0} if prompt_text is not None else set()  # the <|bos|> put before a text writes none
                silent |= {len(ids) + k for k, t in enumerate(reply.job.token_ids) if t in reply.job.stop_ids}
                logprobs = logprobs_of(
                    tokenizer, reply.job, 0 if req.echo else len(ids), silent, 0 if req.echo else len(echoed)
                )
            choices.append(
                {"index": index, "text": echoed + text, "logprobs": logprobs, "finish_reason": reply.finish_reason}
            )
            usage = {k: usage[k] + v for k, v in reply.usage().items()}
        return head("text_completion", "cmpl") | {"choices": choices, "usage": usage}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        names = {"eos_token": "<|bos|>", "bos_token": "<|bos|>", "pad_token": None}  # documents are joined by <|bos|>
        return names | {"model_max_length": settings.context_len, "vocab_size": tokenizer.get_vocab_size()}

    class TokenizeRequest(Strict):
        prompt: str
        add_special_tokens: bool = False

    class DetokenizeRequest(Strict):
        tokens: list[int]

    @router.post("/tokenize")
    @answer
    async def tokenize(request: Request, arrived: float):
        req = await read_parsed(request, TokenizeRequest)
        if isinstance(req, Response):
            return req
        ids = tokenizer.encode(req.prompt, prepend=bos if req.add_special_tokens else None)
        return {"tokens": ids, "count": len(ids), "max_model_len": settings.context_len}

    @router.post("/detokenize")
    @answer
    async def detokenize(request: Request, arrived: float):
        req = await read_parsed(request, DetokenizeRequest)
        if isinstance(req, Response):
            return req
        if not all(0 <= t < tokenizer.get_vocab_size() for t in req.tokens):
            raise Refused(f"tokens: ids must be in [0, {tokenizer.get_vocab_size()})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return router
