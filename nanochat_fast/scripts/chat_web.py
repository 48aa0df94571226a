"""
Chat with a trained model in the browser: a page served by FastAPI + uvicorn, replies streamed token by
token (server-sent events), one model replica per GPU (one on CPU, stepped in a process of its own), each
decoding up to --slots replies at once in one continuous-batching engine, fed from a bounded queue.

    python -m nanochat_fast.scripts.chat_web                      # newest sft (else mid) run, http://127.0.0.1:8000/
    python -m nanochat_fast.scripts.chat_web --run=demo_mid --port=8080 --temperature=0.6
    python -m nanochat_fast.scripts.chat_web --port=0             # any free port (printed)
    python -m nanochat_fast.scripts.chat_web --slots=16 --kv-memory=2G

It listens on 127.0.0.1 (this machine only) unless --host says otherwise; there is no login, so
any other address lets everyone who can reach it use the model. Needs the web extra:
pip install -e ".[web]". API: GET /health, GET /stats, POST /chat/completions (see nanochat_fast/web/app.py),
and OpenAI's: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (nanochat_fast/web/openai_api.py).
"""

import argparse
import functools
import ipaddress
import logging
import math
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import checkpoints
from ..core import cli, threads
from ..core.distributed import compute_init, torn_down
from ..core.errors import UserError
from ..data.tokenizer import get_tokenizer
from ..hardware import precision
from ..model import decode, generation, generation_dtype, loading
from ..model.batch_engine import BatchEngine, Request
from ..train.env_vars import check_environment
from ..web.pool import Admission, Replica, ReplicaPool
from ..web.replica_process import CLOSE_SECONDS, ProcessEngine

# replies decoded together per replica when --slots is not given (docs/measurements.md#chat-server)
DEFAULT_SLOTS = {"cuda": 32, "cpu": 8, "mps": 8}
# the slots are counted at an fp32 KV cache: under bf16 (--dtype) the cache is half that, never more than --kv-memory
KV_DTYPE = torch.float32
# a lone request waits the admission gap before its prefill: beyond this it is a delay anyone notices
MAX_ADMISSION_GAP_MS = 100.0
# a burst whose arrivals never pause for the gap starts after this many gaps (web/pool.Admission.max_wait)
ADMISSION_MAX_WAIT_GAPS = 10


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.chat_web", description=__doc__)
    cli.add_checkpoint_flags(p, newest="the newest sft run, else the newest mid run")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (anything but the loopback exposes the model to the network)",
    )
    p.add_argument("--port", type=cli.non_negative_int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument(
        "--workers", type=cli.positive_int, help="model replicas (default: one per visible GPU, one on CPU or MPS)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=cli.positive_int,
        default=512,
        help="longest reply in tokens, and the most a request may ask for (capped at half the model's context)",
    )
    p.add_argument(
        "--temperature",
        type=cli.non_negative_float,
        default=0.8,
        help="default sampling temperature (0 = greedy, as is anything below 1e-6)",
    )
    p.add_argument("--top-k", type=cli.non_negative_int, default=50, help="default top-k (0 = the whole vocabulary)")
    p.add_argument(
        "--slots",
        type=cli.positive_int,
        help="replies each replica decodes together, one row of its batch and one slot of its KV cache "
        "each (default: 32 on CUDA, where a step reads the weights once for all rows, so 32 cost "
        "little more than one; 8 on CPU or MPS, where each row adds its own compute and more rows "
        "slow every reply)",
    )
    p.add_argument(
        "--kv-memory",
        type=cli.byte_size,
        help="most KV-cache memory per replica, e.g. 512M or 2G: it holds --slots replies at the "
        "model's full context and is allocated once, at start (default: what --slots need; "
        "with --slots left out, the slots shrink to what fits)",
    )
    p.add_argument(
        "--queue-size",
        type=cli.non_negative_int,
        default=16,
        help="requests that may wait for a free slot; more get HTTP 503 with Retry-After",
    )
    p.add_argument(
        "--admission-gap-ms",
        type=cli.non_negative_float,
        default=1.0,
        help="requests that arrive less than this apart start together, their prompts in one prefill, so "
        "a burst does not stall its first reply behind the others' prompts; a lone request waits this "
        f"long before its prefill, a burst at most {ADMISSION_MAX_WAIT_GAPS}x this (0: every request starts at the "
        "next step)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds a request may take from arrival to its last token (waiting included)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=10.0,
        help="seconds a request's body may take to arrive in full; a slower upload gets HTTP 408",
    )
    p.add_argument("--device-type", default="", choices=["", "cpu", "cuda", "mps"], help="'' = autodetect")
    p.add_argument(
        "--replica-process",
        action=argparse.BooleanOptionalAction,
        help="step each replica's engine in a process of its own, beside the server's (which parses "
        "requests and streams every token), instead of taking turns with it on one Python lock "
        "(default: on a CPU yes, elsewhere no)",
    )
    p.add_argument(
        "--dtype",
        type=cli.choice(*precision.CHOICES),
        default="auto",
        choices=list(precision.CHOICES),
        help="compute dtype of generation (auto: bf16 on CUDA sm80+; on a CPU the faster one, timed on the "
        "replica's own mix of prefills and decode steps at its slots and cached; fp32 on MPS)",
    )
    return p


def remote_host_warning(host: str) -> str | None:
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"warning: --host {host} lets other machines reach this server; it has no authentication, so "
        "anyone who can connect can use the model (leave --host out to listen on 127.0.0.1 only)"
    )


def check_web_dependencies():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"chat_web needs FastAPI and uvicorn ({e.name} is not installed): "
            'pip install -e ".[web]" (or pip install fastapi uvicorn)'
        ) from None


def check_ranges(args):
    """Flags whose range the request validation also enforces (the page sends these defaults back)."""
    from ..web.app import MAX_TEMPERATURE, MAX_TOP_K

    for flag, seconds in (("--request-timeout", args.request_timeout), ("--body-timeout", args.body_timeout)):
        if not 0 < seconds < math.inf:
            raise UserError(f"{flag} must be > 0 seconds (and finite), got {seconds}")
    if args.admission_gap_ms > MAX_ADMISSION_GAP_MS:
        raise UserError(
            f"--admission-gap-ms must be at most {MAX_ADMISSION_GAP_MS} (a burst waits {ADMISSION_MAX_WAIT_GAPS}x "
            f"it), got {args.admission_gap_ms}"
        )
    if args.temperature > MAX_TEMPERATURE:
        raise UserError(f"--temperature must be at most {MAX_TEMPERATURE}, got {args.temperature}")
    if args.top_k > MAX_TOP_K:
        raise UserError(f"--top-k must be at most {MAX_TOP_K} (0: the whole vocabulary), got {args.top_k}")


def replica_devices(device: torch.device, workers: int | None) -> list[torch.device]:
    """A GPU per replica on CUDA, the one device otherwise."""
    if device.type != "cuda":
        return [device] * (workers or 1)
    count = torch.cuda.device_count()
    workers = workers or count
    if workers > count:
        raise UserError(f"--workers {workers}: only {count} GPU(s) are visible (one replica per GPU)")
    return [torch.device("cuda", i) for i in range(workers)]


def kv_slots(args, config, device_type: str) -> int:
    """Slots per replica at the model's full context: --slots must fit --kv-memory, a default shrinks to fit."""
    per_slot = BatchEngine.kv_bytes(config, 1, config.sequence_len, KV_DTYPE)
    slots = args.slots or DEFAULT_SLOTS[device_type]
    if args.kv_memory is not None:
        fits, memory = args.kv_memory // per_slot, cli.format_bytes(args.kv_memory)
        each = f"{cli.format_bytes(per_slot)} per reply at the model's {config.sequence_len} positions"
        if fits < 1:
            raise UserError(f"--kv-memory {memory} cannot hold one slot: the KV cache needs {each}")
        if slots > fits and args.slots:
            raise UserError(
                f"--slots {slots} need {cli.format_bytes(slots * per_slot)} of KV cache ({each}), "
                f"more than --kv-memory {memory}: use --slots={fits} or a larger --kv-memory"
            )
        slots = min(slots, fits)
    return slots


def make_engine(model, tokenizer, slots: int, chosen: precision.Precision | None = None) -> BatchEngine:
    """An engine at the model's full context in `chosen` (None: fp32), warmed up by two tokens so a cache that
    does not fit fails before serving and the first request pays neither for the first calls nor for packing."""
    dtype = torch.float32 if chosen is None else chosen.dtype
    engine = BatchEngine(model, tokenizer, slots, max_len=model.config.sequence_len, dtype=dtype)
    engine.add(Request([tokenizer.get_bos_token_id()], max_tokens=2, use_tools=False))
    while engine.active:
        engine.step()
    return engine


def replica(engine, config, tokenizer, device: str) -> Replica:
    return Replica(
        engine, functools.partial(generation.reply_request, SimpleNamespace(config=config), tokenizer), device
    )


def build_replica(ckpt: Path, config, device: str, slots: int, args, chosen: precision.Precision | None):
    """A replica's engine and what the server reports of it, built in this process or its own (all this pickles);
    `chosen` None: --dtype decides on the replica's mix of short chat turns."""
    model = loading.restore_model(ckpt, config, torch.device(device))
    if chosen is None:
        mix = generation_dtype.chat_mix(config, slots, args.max_new_tokens)
        chosen = generation_dtype.choose(device, args.dtype, model, mix)
    engine = make_engine(model, get_tokenizer(), slots, chosen)
    memory = {"kv_bytes": engine.cache.kv.nbytes, "packed_bytes": decode.nbytes(engine.model)}
    return engine, {"slots": slots, "precision": chosen, **memory}


def close_processes(engines):
    for engine in engines:
        if isinstance(engine, ProcessEngine):
            engine.close()


@dataclass
class Loaded:
    replicas: list[Replica]
    name: str  # the run, its step and phase
    run: str  # the run's name: the model's id in the OpenAI API
    context_len: int  # the model's positions
    info: dict  # the first replica's build_replica info: slots, precision, KV cache and packed weights in bytes
    threads: int  # torch threads a replica steps with

    def close(self):
        close_processes(r.engine for r in self.replicas)


def load_replicas(args, devices, tokenizer) -> Loaded:
    """The model and its engine once per device, in a process of its own (--replica-process, else on a CPU:
    docs/measurements.md#chat-server) or in this one; the KV cache is checked before any weights load."""
    run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid"))
    ckpt, meta, config = loading.open_checkpoint(run_dir, args.step, tokenizer)
    slots = kv_slots(args, config, devices[0].type)
    if meta["phase"] == "base":
        print(f"note: {ckpt} is a base (not fine-tuned) checkpoint: it has not learned to chat", file=sys.stderr)
    own_process = devices[0].type == "cpu" if args.replica_process is None else args.replica_process
    threads = max(1, torch.get_num_threads() // len(devices)) if own_process else torch.get_num_threads()
    engines, infos = [], []
    try:
        for device in devices:  # one at a time: the first chooses the precision, the others take it
            chosen = infos[0]["precision"] if infos else None
            build = functools.partial(build_replica, ckpt, config, str(device), slots, args, chosen)
            if own_process:
                engine = ProcessEngine(build, threads, f"replica {device}")
                info = engine.info
            else:
                engine, info = build()
            engines.append(engine)
            infos.append(info)
    except BaseException:
        close_processes(engines)
        raise
    replicas = [replica(e, config, tokenizer, str(d)) for e, d in zip(engines, devices)]
    name = f"{run_dir.name} step {meta['step']} ({meta['phase']})"
    return Loaded(replicas, name, run_dir.name, config.sequence_len, infos[0], threads)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so a taken port fails at once."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): pick another --port "
            "(--port=0 takes any free one) or --host"
        ) from None


def server_threads(choice) -> int:
    """Threads of the CPU replicas: one fewer than training takes, for the event loop that streams every token
    (docs/measurements.md#chat-server), unless the user set OMP_NUM_THREADS."""
    return choice.threads if choice.by_user else max(1, choice.threads - 1)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    warning = remote_host_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_web_dependencies()
    check_ranges(args)
    with torn_down():
        return serve(args, compute_init(args.device_type)[-1], warning)


def serve(args, device, warning) -> int:
    import uvicorn

    from ..web import app as web_app

    if device.type == "cpu":
        torch.set_num_threads(server_threads(threads.thread_choice()))
    devices = replica_devices(device, args.workers)
    tokenizer = get_tokenizer()
    sock = listen(args.host, args.port)
    loaded = pool = None
    try:
        loaded = load_replicas(args, devices, tokenizer)
        gap = args.admission_gap_ms / 1e3
        admission = Admission(gap=gap, max_wait=ADMISSION_MAX_WAIT_GAPS * gap)
        pool = ReplicaPool(loaded.replicas, queue_limit=args.queue_size, admission=admission)
        settings = web_app.Settings(
            model_name=loaded.name,
            model_id=loaded.run,
            context_len=loaded.context_len,
            temperature=args.temperature,
            top_k=args.top_k,
            request_timeout=args.request_timeout,
            body_timeout=args.body_timeout,
            limits=web_app.Limits(max_tokens=args.max_new_tokens),
            allowed_hosts=("*",) if warning else (*web_app.LOOPBACK_HOSTS, args.host),
        )
        app = web_app.create_app(pool, settings, tokenizer)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        info, packed = loaded.info, loaded.info["packed_bytes"]
        own = ", each in a process of its own" if isinstance(loaded.replicas[0].engine, ProcessEngine) else ""
        print(
            f"chat_web: {loaded.name} on {len(devices)} replica(s) ({', '.join(map(str, devices))}{own}), "
            f"{info['slots']} slots each ({cli.format_bytes(info['kv_bytes'])} of KV cache"
            f"{f', {cli.format_bytes(packed)} of packed decode weights' if packed else ''}), "
            f"{loaded.threads} thread(s) each, {info['precision'].describe()}, "
            f"queue {args.queue_size}, admission gap {args.admission_gap_ms:g} ms; "
            f"open http://{url_host}:{port}/",
            flush=True,
        )
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sock.close()
        if pool is not None:  # the app closed it at shutdown; its workers end their steps in hand
            pool.close()
            pool.join(CLOSE_SECONDS)
        if loaded is not None:
            loaded.close()
    return 0


if __name__ == "__main__":
    cli.run(main)
