"""
The chat web server's routes (FastAPI):

    GET  /                    the chat page (static/index.html)
    GET  /static/<file>       the page's own CSS, JS and icon; nothing else on disk is reachable
    GET  /health              {"status": "ok", model, replicas, device, defaults, limits}
    GET  /stats               slots (total, in use, per replica), queue length, request counts,
                              tokens/s, time to first token, truncated prompts (web/stats.py)
    POST /chat/completions    the assistant's reply as server-sent events:
                              data: {"token": str} ... then data: {"done": true}

Safe by default: the body is read with a size cap (413) and a time limit (408, Settings.body_timeout:
a client that stalls mid-upload does not hold a connection) before it is parsed, validated strictly
(400 with a one-line reason), JSON only (415: a cross-site form cannot post it without a CORS
preflight, and no CORS headers are ever sent), and the Host header must name the loopback
when the server listens there (a DNS-rebinding page cannot talk to it).
"""

import asyncio
import json
import logging
import random
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from .pool import Job, QueueFull, ReplicaPool
from .schema import Limits, greedy_below_min, parse_request

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


@dataclass(frozen=True)
class Settings:
    model_name: str  # shown by the page and /health
    temperature: float = 0.8  # defaults for requests that do not say
    top_k: int = 50  # 0: no top-k
    request_timeout: float = 120.0  # seconds from arrival to the last token, queueing included
    body_timeout: float = 10.0  # seconds for the request body to arrive in full (else 408)
    limits: Limits = Limits()
    allowed_hosts: tuple = tuple(LOOPBACK_HOSTS)  # ("*",) when listening beyond the loopback


def static_files() -> dict:
    """URL path -> (bytes, media type), read once: requests never touch the file system."""
    files = {"/": ((STATIC_DIR / "index.html").read_bytes(), MEDIA_TYPES[".html"])}
    for path in sorted(STATIC_DIR.iterdir()):
        if path.suffix in MEDIA_TYPES and path.name != "index.html":
            files[f"/static/{path.name}"] = (path.read_bytes(), MEDIA_TYPES[path.suffix])
    return files


def error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


class Upload:
    """How much of a request body has arrived, for the log line when it stops short."""

    def __init__(self, request: Request):
        self.declared = request.headers.get("content-length")
        self.received = 0

    def __str__(self):
        of = f"of {self.declared} " if self.declared is not None else ""
        return f"{self.received} {of}bytes"


async def read_body(request: Request, max_bytes: int, upload: Upload) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed max_bytes: from
    Content-Length before reading anything, else while it streams in (chunked uploads).
    Raises ClientDisconnect when the client goes away before the body's end."""
    too_large = HTTPException(413, f"request body larger than {max_bytes} bytes")
    declared = upload.declared
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise too_large
    chunks = []
    async for chunk in request.stream():
        upload.received += len(chunk)
        if upload.received > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body_in_time(request: Request, max_bytes: int, timeout: float) -> bytes | Response:
    """The body (read_body), or the response to give when it does not arrive: a 408 after
    `timeout` seconds, or nothing anyone will read when the client left. One log line each."""
    upload = Upload(request)
    try:
        async with asyncio.timeout(timeout):
            return await read_body(request, max_bytes, upload)
    except TimeoutError:
        log.warning("request body not received within %g s (%s arrived): answered 408", timeout, upload)
        return error(408, f"the request body did not arrive within {timeout:g} s", headers={"Connection": "close"})
    except ClientDisconnect:
        log.warning("client went away during its upload (%s)", upload)
        return Response(status_code=400)  # the connection is gone: nobody reads this


async def reply_events(job: Job, pool: ReplicaPool, arrived: float, timeout: float):
    """The SSE stream of one job. Ending it early (client gone, server stopping) stops the job.

    The request timeout is one timer per request that drops a "timeout" event into the job's
    queue, rather than a wait_for around every event (a task and a timer per token: with many
    replies streaming, the event loop's own work per token is what competes with the replicas
    for the GIL)."""
    loop = asyncio.get_running_loop()
    timer = loop.call_at(loop.time() + arrived + timeout - time.monotonic(), job.events.put_nowait, ("timeout", None))
    kind = None
    try:
        while kind != "done":
            kind, value = await job.events.get()
            # pieces that arrived together go out in one write
            batch = [(kind, value)]
            while kind not in ("done", "timeout") and not job.events.empty():
                kind, value = job.events.get_nowait()
                batch.append((kind, value))
            if kind == "timeout":
                pool.cancel(job, "timeout")
                message = f"the reply was cut off by the server's request timeout ({timeout:g} s)"
                batch[-1:] = [("error", message), ("done", None)]
            yield "".join(sse({"done": True}) if k == "done" else sse({k: v}) for k, v in batch)
            if kind == "timeout":
                return
    finally:
        timer.cancel()
        if kind not in ("done", "timeout"):
            pool.cancel(job, "client")


def create_app(pool: ReplicaPool, settings: Settings) -> FastAPI:
    limits = settings.limits
    files = static_files()

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
        return error(exc.status_code, message, headers=getattr(exc, "headers", None))

    def serve_file(body: bytes, media_type: str):
        async def handler():
            return Response(body, media_type=media_type, headers=PAGE_HEADERS)

        return handler

    # one route per file: any other path, every /../ or %2e%2e spelling included, is a 404
    for url, (body, media_type) in files.items():
        app.add_api_route(url, serve_file(body, media_type), methods=["GET"], include_in_schema=False)

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
        body = await read_body_in_time(request, limits.max_body_bytes, settings.body_timeout)
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

    return app
