"""
Chat with a trained model in the browser: a page served by FastAPI + uvicorn, replies streamed
token by token (server-sent events), one model replica per GPU (one on CPU) fed from a bounded queue.

    python -m nanochat_fast.scripts.chat_web                      # newest sft (else mid) run, http://127.0.0.1:8000/
    python -m nanochat_fast.scripts.chat_web --run=demo_mid --port=8080 --temperature=0.6
    python -m nanochat_fast.scripts.chat_web --port=0             # any free port (printed)

It listens on 127.0.0.1 (this machine only) unless --host says otherwise; there is no login, so
any other address lets everyone who can reach it use the model. Needs the web extra:
pip install -e ".[web]". API: GET /health, GET /stats, POST /chat/completions (see nanochat_fast/web/app.py).
"""
import argparse
import ipaddress
import logging
import math
import socket
import sys
import time

import torch

from ..core import cli
from ..core.distributed import compute_init
from ..core.errors import UserError
from ..data.tokenizer import get_tokenizer
from ..model import generation, loading
from ..train import run_dirs
from ..train.environment import check_environment


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_web", description=__doc__)
    p.add_argument("--run", type=cli.run_ref, default="",
                   help="run name or directory (default: the newest sft run, else the newest mid run)")
    p.add_argument("--step", type=cli.non_negative_int, default=None,
                   help="checkpoint step (default: the newest complete one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (anything but the loopback exposes the model to the network)")
    p.add_argument("--port", type=cli.non_negative_int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--workers", type=cli.positive_int, default=None,
                   help="model replicas (default: one per visible GPU, one on CPU or MPS)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=512,
                   help="longest reply in tokens, and the most a request may ask for (capped at half the model's context)")
    p.add_argument("--temperature", type=cli.non_negative_float, default=0.8,
                   help="default sampling temperature (0 = greedy, as is anything below 1e-6)")
    p.add_argument("--top-k", type=cli.non_negative_int, default=50, help="default top-k (0 = the whole vocabulary)")
    p.add_argument("--queue-size", type=cli.non_negative_int, default=16,
                   help="requests that may wait for a busy replica; more get HTTP 503 with Retry-After")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a request may take from arrival to its last token (waiting included)")
    p.add_argument("--body-timeout", type=float, default=10.0,
                   help="seconds a request's body may take to arrive in full; a slower upload gets HTTP 408")
    p.add_argument("--device-type", default="", choices=["", "cpu", "cuda", "mps"], help="'' = autodetect")
    # test hook, hidden from --help: sleep this long before every token (a slow model, for stop/queue tests)
    p.add_argument("--test-token-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def remote_host_warning(host: str) -> str | None:
    """The warning line for a --host that is not the loopback, else None."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"warning: --host {host} lets other machines reach this server; it has no authentication, so "
            "anyone who can connect can use the model (leave --host out to listen on 127.0.0.1 only)")


def check_ranges(args):
    """Flags whose range the request validation also enforces (the page sends these defaults back)."""
    from ..web.schema import MAX_TEMPERATURE, MAX_TOP_K
    if not 0 < args.request_timeout < math.inf:
        raise UserError(f"--request-timeout must be > 0 seconds (and finite), got {args.request_timeout}")
    if not 0 < args.body_timeout < math.inf:
        raise UserError(f"--body-timeout must be > 0 seconds (and finite), got {args.body_timeout}")
    if args.temperature > MAX_TEMPERATURE:
        raise UserError(f"--temperature must be at most {MAX_TEMPERATURE}, got {args.temperature}")
    if args.top_k > MAX_TOP_K:
        raise UserError(f"--top-k must be at most {MAX_TOP_K} (0: the whole vocabulary), got {args.top_k}")


def check_web_dependencies():
    """A UserError saying how to install FastAPI and uvicorn when either is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"chat_web needs FastAPI and uvicorn ({e.name} is not installed): "
                        "pip install -e \".[web]\" (or pip install fastapi uvicorn)") from None


def replica_devices(device: torch.device, workers: int | None) -> list[torch.device]:
    """One device per replica: a GPU each on CUDA, the one device otherwise."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        workers = workers or count
        if workers > count:
            raise UserError(f"--workers {workers}: only {count} GPU(s) are visible (one replica per GPU)")
        return [torch.device("cuda", i) for i in range(workers)]
    return [device] * (workers or 1)


def load_replicas(args, devices, tokenizer, Replica):
    """The model once per device. The one place chat_web finds and loads a checkpoint."""
    run_dir = run_dirs.run_dir_of(args.run, ("sft", "mid"))
    replicas, name = [], None
    for device in devices:
        model, ckpt, meta = loading.load_model(run_dir, args.step, device, tokenizer)
        replicas.append(Replica(model=model, tokenizer=tokenizer, device=str(device)))
        name = f"{run_dir.name} step {meta['step']} ({meta['phase']})"
        if meta["phase"] == "base" and len(replicas) == 1:
            print(f"note: {ckpt} is a {meta['phase']} (not fine-tuned) checkpoint: it has not learned to chat",
                  file=sys.stderr)
    return replicas, name


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so a taken port fails at once."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}): pick another --port "
                        "(--port=0 takes any free one) or --host") from None


def slowed(generate, delay: float):
    """`generate` with a pause before every token (the --test-token-delay hook)."""
    def run(*args, should_stop, **kwargs):
        return generate(*args, should_stop=lambda: time.sleep(delay) or should_stop(), **kwargs)
    return run


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    warning = remote_host_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_web_dependencies()
    check_ranges(args)
    import uvicorn

    from ..web import app as web_app, pool as web_pool, schema as web_schema

    device = compute_init(args.device_type)[-1]
    devices = replica_devices(device, args.workers)
    tokenizer = get_tokenizer()
    sock = listen(args.host, args.port)
    try:
        replicas, name = load_replicas(args, devices, tokenizer, web_pool.Replica)
        generate = generation.assistant_reply
        if args.test_token_delay > 0:
            generate = slowed(generate, args.test_token_delay)
        pool = web_pool.ReplicaPool(replicas, generate, queue_limit=args.queue_size)
        settings = web_app.Settings(
            model_name=name, temperature=args.temperature, top_k=args.top_k, request_timeout=args.request_timeout,
            body_timeout=args.body_timeout,
            limits=web_schema.Limits(max_tokens=args.max_new_tokens),
            allowed_hosts=("*",) if warning else (*web_app.LOOPBACK_HOSTS, args.host))
        app = web_app.create_app(pool, settings)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"chat_web: {name} on {len(replicas)} replica(s) ({', '.join(map(str, devices))}), "
              f"queue {args.queue_size}; open http://{url_host}:{port}/", flush=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    cli.run(main)
