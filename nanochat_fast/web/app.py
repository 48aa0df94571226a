"""
The chat web server's routes (FastAPI) and what a request may contain: GET / (the page, static/), GET
/health, GET /stats (pool.py), POST /chat/completions -> the reply as server-sent events, data: {"token":
str} ... then data: {"done": true}. Safe by default: the body is read with a size cap (413) and a time
limit (408), JSON only (415: a cross-site form cannot post it), validated strictly (400, one line), no CORS
headers ever, and the Host header must name the loopback when the server listens there (DNS rebinding).
"""

import asyncio
import json
import logging
import random
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from .pool import Job, QueueFull, ReplicaPool

log = logging.getLogger("nanochat_fast.chat_web")

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# the page loads nothing but its own files and talks to nothing but this server
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]
MAX_TEMPERATURE = 2.0  # only flattens: logits / 2 lie in [-7.5, 7.5]
# Temperatures below this are greedy (accepted, served as 0): softcapped fp32 logits over T are finite only
# for T >= 15 / 3.4e38, and at 1e-6 a logit 1e-4 below the top keeps under exp(-100) of its odds. web/
# imports nothing of the package: model/batch_engine.MIN_TEMPERATURE is a copy (a test checks they agree).
MIN_TEMPERATURE = 1e-6
MAX_TOP_K = 200  # 0 means no top-k filtering (the whole vocabulary)


@dataclass(frozen=True)
class Limits:  # bounds on one request
    max_tokens: int = 512  # the server's --max-new-tokens
    max_messages: int = 500
    max_message_chars: int = 8000
    max_total_chars: int = 32000
    # JSON of max_total_chars characters: up to 4 bytes each in UTF-8, plus the keys around them
    max_body_bytes: int = 160 * 1024


@dataclass(frozen=True)
class Settings:
    model_name: str  # shown by the page and /health
    model_id: str = "nanochat"  # the model's id in the OpenAI API (chat_web: the run's name)
    context_len: int = 0  # the model's positions: a completion's prompt and max_tokens must fit in them
    temperature: float = 0.8  # defaults for requests that do not say
    top_k: int = 50  # 0: no top-k
    request_timeout: float = 120.0  # seconds from arrival to the last token, queueing included
    body_timeout: float = 10.0  # seconds for the request body to arrive in full (else 408)
    limits: Limits = Limits()
    allowed_hosts: tuple = tuple(LOOPBACK_HOSTS)  # ("*",) when listening beyond the loopback


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    """{"messages": [{"role", "content"}, ...], "temperature"?, "top_k"?, "max_tokens"?}: strict types (a
    number in quotes is not a number), unknown keys refused (a misspelt "top-k" would be ignored)."""

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
    return 0.0 if temperature < MIN_TEMPERATURE else temperature


def parse_request(body: bytes, limits: Limits) -> ChatRequest:
    """The request in `body`, or ValueError with one line: the first problem, as 'where: what'."""
    try:
        return ChatRequest.model_validate_json(body, context={"limits": limits})
    except ValidationError as e:
        raise ValueError(first_problem(e)[0]) from None


def first_problem(e: ValidationError) -> tuple[str, str]:
    """(one line naming the first problem, and how many more; where it is, as 'messages.0.role')."""
    errors = e.errors(include_url=False, include_input=False)
    where, what = ".".join(str(part) for part in errors[0]["loc"]), errors[0]["msg"].removeprefix("Value error, ")
    text = what if errors[0]["type"] == "value_error" else f"{where or 'body'}: {what}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return " ".join(text.split()), where


def error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


async def read_body(request: Request, max_bytes: int, timeout: float, error=error) -> bytes | Response:
    """The body, refused (413) as soon as it is known to exceed max_bytes; or the response when it does not
    arrive: a 408 after `timeout` seconds (made by `error`), or nothing anyone will read when the client left."""
    declared, received, chunks = request.headers.get("content-length"), 0, []
    too_large = HTTPException(413, f"request body larger than {max_bytes} bytes")

    def arrived() -> str:  # for the log line when the body stops short
        return f"{received} {f'of {declared} ' if declared is not None else ''}bytes"

    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise too_large
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                received += len(chunk)
                if received > max_bytes:
                    raise too_large
                chunks.append(chunk)
        return b"".join(chunks)
    except TimeoutError:
        log.warning("request body not received within %g s (%s arrived): answered 408", timeout, arrived())
        return error(408, f"the request body did not arrive within {timeout:g} s", headers={"Connection": "close"})
    except ClientDisconnect:
        log.warning("client went away during its upload (%s)", arrived())
        return Response(status_code=400)  # the connection is gone: nobody reads this


async def job_batches(job: Job, pool: ReplicaPool, arrived: float, timeout: float):
    """A job's events, those that arrived together as one list, the last ending with ("done", None); a
    timeout ends them with ("error", why) first. Ending early (client gone, server stopping) stops the job.
    The timeout is one timer dropping a "timeout" event into the job's queue, not a task and a timer per token."""
    loop = asyncio.get_running_loop()
    timer = loop.call_at(loop.time() + arrived + timeout - time.monotonic(), job.events.put_nowait, ("timeout", None))
    kind = None
    try:
        while kind not in ("done", "timeout"):
            kind, value = await job.events.get()
            batch = [(kind, value)]  # pieces that arrived together go out in one write
            while kind not in ("done", "timeout") and not job.events.empty():
                kind, value = job.events.get_nowait()
                batch.append((kind, value))
            if kind == "timeout":
                pool.cancel(job, "timeout")
                message = f"the reply was cut off by the server's request timeout ({timeout:g} s)"
                batch[-1:] = [("error", message), ("done", None)]
            yield batch
    finally:
        timer.cancel()
        if kind not in ("done", "timeout"):
            pool.cancel(job, "client")


async def reply_events(job: Job, pool: ReplicaPool, arrived: float, timeout: float):
    """The SSE stream of one job."""
    async for batch in job_batches(job, pool, arrived, timeout):
        yield "".join(sse({"done": True}) if k == "done" else sse({k: v}) for k, v in batch)


def create_app(pool: ReplicaPool, settings: Settings, tokenizer=None) -> FastAPI:
    """The app; with the model's tokenizer, the OpenAI API too (openai_api.py)."""
    from .openai_api import openai_error, openai_routes  # it reads requests with this module's helpers

    limits = settings.limits

    @asynccontextmanager
    async def lifespan(app):
        yield
        pool.close()

    app = FastAPI(title="nanochat_fast chat", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    if "*" not in settings.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # 404, 405, 413: the same {"error": ...} shape as a 400
        message = "not found" if exc.status_code == 404 else exc.detail
        shape = openai_error if request.url.path.startswith("/v1/") else error
        return shape(exc.status_code, message, headers=getattr(exc, "headers", None))

    def serve_file(body: bytes, media_type: str):
        async def handler():
            return Response(body, media_type=media_type, headers=PAGE_HEADERS)

        return handler

    # one route per file, read once: any other path, every /../ or %2e%2e spelling included, is a 404
    assets = [p for p in sorted(STATIC_DIR.iterdir()) if p.suffix in MEDIA_TYPES and p.name != "index.html"]
    files = {"/": STATIC_DIR / "index.html"} | {f"/static/{p.name}": p for p in assets}
    for url, path in files.items():
        handler = serve_file(path.read_bytes(), MEDIA_TYPES[path.suffix])
        app.add_api_route(url, handler, methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": settings.model_name,
            "replicas": len(pool.replicas),
            "devices": [r.device for r in pool.replicas],
            "defaults": {"temperature": settings.temperature, "top_k": settings.top_k, "max_tokens": limits.max_tokens},
            "limits": asdict(limits),
        }

    @app.get("/stats")
    async def stats():
        return pool.stats()

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.monotonic()
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return error(415, "the body must be JSON: send the header Content-Type: application/json")
        body = await read_body(request, limits.max_body_bytes, settings.body_timeout)
        if isinstance(body, Response):
            return body
        try:
            req = parse_request(body, limits)
        except ValueError as e:
            return error(400, str(e))
        job = Job(
            messages=[m.model_dump() for m in req.messages],
            max_tokens=req.max_tokens or limits.max_tokens,
            temperature=greedy_below_min(settings.temperature if req.temperature is None else req.temperature),
            top_k=(settings.top_k if req.top_k is None else req.top_k) or None,
            seed=random.getrandbits(31),
        )
        try:
            pool.submit(job)
        except QueueFull as e:
            return error(503, str(e), headers={"Retry-After": str(e.retry_after)})
        return StreamingResponse(
            reply_events(job, pool, arrived, settings.request_timeout),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    if tokenizer is not None:
        app.include_router(openai_routes(pool, settings, tokenizer))
    return app
