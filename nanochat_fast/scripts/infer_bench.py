"""
Inference benchmark: what a model costs to serve, swept over the decode batch size.

    python -m nanochat_fast.scripts.infer_bench --depth=4                  # a random depth-4 model, no training
    python -m nanochat_fast.scripts.infer_bench --run=demo_sft --batch-sizes=1,4,16
    python -m nanochat_fast.scripts.infer_bench --depth=20 --prompt-tokens=512 | tail -1 | jq .sweep

For each batch size B, B requests of --prompt-tokens random tokens go through one batch engine as a server runs
them, each decoding exactly --decode-tokens tokens greedily; printed per B: prefill and decode tok/s, TTFT,
ms/token, peak memory, MBU and MFU. On a CPU, --dtype auto times each batch size's own mix (its prefills and
decode steps) in fp32 and bf16 and runs the faster (model/generation_dtype.py; cached for later runs). --depth
runs nanochat's init of that depth (of the gpt family, or --arch=windowed) with a byte-level stand-in tokenizer
(no trained tokenizer needed). The last line of stdout is one JSON document with every figure. How each figure is
measured and computed: docs/measurements.md#inference-benchmark.
"""

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

from .. import checkpoints
from ..core import cli
from ..core.errors import UserError
from ..core.progress import progress_bar
from ..data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, get_tokenizer
from ..hardware import peak as hw_peak
from ..hardware.machine import synchronize
from ..model import decode, generation_dtype, loading
from ..model.batch_engine import BatchEngine, Request
from ..model.gpt import config_from_depth
from ..train.training_config import ARCHES, DeviceConfig, evaluation_process, window_pattern

AUTO_MAX_BATCH_CUDA, AUTO_MAX_BATCH_ELSE = 256, 32  # the default sweep's last batch size (at most what fits)
# auto --kv-memory: this much of the GPU's free memory after the weights, else of the available RAM
AUTO_KV_FRACTION_CUDA, AUTO_KV_FRACTION_ELSE = 0.8, 0.5
WARMUP_TOKENS = 4


def batch_sizes(value: str) -> list[int] | None:
    """'1,4,16' -> [1, 4, 16]; 'auto' -> None (powers of two up to what fits)."""
    if value == "auto":
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected batch sizes separated by commas, e.g. 1,4,16, got {value!r}")
    sizes = [cli.positive_int(p) for p in parts]
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"each batch size once, got {value!r}")
    return sizes


def at_least_two(value) -> int:
    n = cli.positive_int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(
            f"must be >= 2 (the first token is the prefill's; decode speed needs a decode step), got {value}"
        )
    return n


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.infer_bench", description=__doc__)
    model = p.add_argument_group("model (one of --run and --depth)")
    model.add_argument("--run", type=cli.run_ref, help="a run's checkpoint: run name or directory")
    model.add_argument(
        "--step", type=cli.non_negative_int, help="checkpoint step of --run (None: the newest complete one)"
    )
    model.add_argument(
        "--depth",
        type=cli.positive_int,
        help="a randomly initialised model of this depth (the depth dial of base_train)",
    )
    model.add_argument("--max-seq-len", type=cli.positive_int, default=2048, help="context of the --depth model")
    model.add_argument(
        "--vocab-size",
        type=cli.positive_int,
        default=8192,
        help=f"vocabulary of the --depth model (>= {MIN_VOCAB_SIZE})",
    )
    model.add_argument(
        "--arch", choices=ARCHES, default="gpt", help="family of the --depth model (a --run's checkpoint has its own)"
    )
    model.add_argument(
        "--window-pattern", type=window_pattern, default="SSSL", help="windows of an --arch=windowed --depth model"
    )
    bench = p.add_argument_group("benchmark")
    bench.add_argument(
        "--batch-sizes",
        type=batch_sizes,
        default="auto",
        help=f"decode batch sizes, comma-separated (auto: 1, 2, 4, ... up to what fits --kv-memory, "
        f"at most {AUTO_MAX_BATCH_CUDA} on CUDA, {AUTO_MAX_BATCH_ELSE} elsewhere)",
    )
    bench.add_argument("--prompt-tokens", type=cli.positive_int, default=128, help="prompt length of every request")
    bench.add_argument("--decode-tokens", type=at_least_two, default=128, help="tokens every row generates")
    bench.add_argument(
        "--kv-memory",
        type=lambda value: None if value == "auto" else cli.byte_size(value),
        default="auto",
        help="most memory the KV cache may take: 2G, 512M, 1.5G or a number of bytes (auto: "
        "80%% of the GPU's free memory after the weights; half the available RAM elsewhere)",
    )
    bench.add_argument("--seed", type=cli.random_seed, default=42, help="seed of the random prompts (and --depth init)")
    DeviceConfig.add_flags(p)
    return p


def check_model_flags(args):
    """Exactly one of --run and --depth; each one's own flags only with it."""
    if (args.run is None) == (args.depth is None):
        raise UserError(
            "give --run=NAME (a run's checkpoint) or --depth=N (a random model)"
            + (", not both" if args.run is not None else "")
        )
    given = cli.explicit_flags(args)
    if args.run is not None and given & {"max_seq_len", "vocab_size", "arch", "window_pattern"}:
        raise UserError(
            "--max-seq-len, --vocab-size, --arch and --window-pattern shape a --depth model; a --run's checkpoint "
            "has its own"
        )
    if args.depth is not None and "step" in given:
        raise UserError("--step picks a checkpoint of --run; a --depth model has none")
    if args.depth is not None and args.vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"argument --vocab-size: must be >= {MIN_VOCAB_SIZE} (256 bytes + the special tokens), "
            f"got {args.vocab_size}"
        )


def open_model(args, device):
    """(model in eval mode, tokenizer, what it is for the JSON); the context checked before the weights load.
    A --depth model gets bytes 0-255 and the special tokens as its tokenizer: all the engine asks for."""
    if args.depth is None:
        tokenizer = get_tokenizer()
        run_dir = checkpoints.run_dir_of(args.run, ("sft", "mid", "base"))
        ckpt, meta, config = loading.open_checkpoint(run_dir, args.step, tokenizer)
        info = {
            "run": str(run_dir),
            "checkpoint": str(ckpt),
            "step": meta.get("step"),
            "phase": meta.get("phase"),
            "tokenizer": "the run's (NANOCHAT_FAST_HOME/tokenizer)",
        }
    else:
        config = config_from_depth(args.depth, args.vocab_size, args.max_seq_len)
        config = loading.family_config(config, args.arch, args.window_pattern)
        tokenizer = Tokenizer({bytes([i]): i for i in range(256)})
        info = {
            "depth": args.depth,
            "arch": args.arch,
            "init": f"random (nanochat's init, seed {args.seed})",
            "tokenizer": "byte-level stand-in (the engine looks up special tokens only)",
        }
    if args.prompt_tokens + args.decode_tokens > config.sequence_len:
        raise UserError(
            f"--prompt-tokens {args.prompt_tokens} + --decode-tokens {args.decode_tokens} = "
            f"{args.prompt_tokens + args.decode_tokens} is beyond the model's context of "
            f"{config.sequence_len} tokens; ask for fewer"
        )
    if args.depth is None:
        return loading.restore_model(ckpt, config, device), tokenizer, info
    torch.manual_seed(args.seed)
    return loading.new_model(config, device).eval(), tokenizer, info


def engine_for(model, tokenizer, slots: int, max_len: int) -> BatchEngine:
    """An engine whose rows always run to max_tokens: no stop tokens (and requests come with use_tools=False)."""
    engine = BatchEngine(model, tokenizer, slots, max_len)
    engine.stop = frozenset()
    return engine


def kv_dtype(model, tokenizer, dev) -> torch.dtype:
    """The dtype the cache takes under this run's autocast (that of the keys), from a one-token forward."""
    engine = engine_for(model, tokenizer, 1, 2)
    with dev.autocast():
        engine.add(Request([0], 1, use_tools=False))
        engine.step()
    return engine.cache.kv.dtype


def plan_sweep(args, config, dtype, device) -> tuple[list[int], int]:
    """(the batch sizes, the KV limit in bytes): each batch's cache within the limit, or a UserError."""
    limit = args.kv_memory
    if limit is None and device.type == "cuda":
        limit = int(torch.cuda.mem_get_info(device)[0] * AUTO_KV_FRACTION_CUDA)
    elif limit is None:
        try:
            meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
            available = int(meminfo["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        limit = int(available * AUTO_KV_FRACTION_ELSE)
    max_len = args.prompt_tokens + args.decode_tokens
    per_row = BatchEngine.kv_bytes(config, 1, max_len, dtype)
    fits = limit // per_row
    if args.batch_sizes is None:
        if fits < 1:
            raise UserError(
                f"one row's KV cache ({cli.format_bytes(per_row)}: {max_len} positions) does not fit "
                f"--kv-memory {cli.format_bytes(limit)}; give more --kv-memory or fewer tokens"
            )
        cap = min(fits, AUTO_MAX_BATCH_CUDA if device.type == "cuda" else AUTO_MAX_BATCH_ELSE)
        return [2**i for i in range(cap.bit_length())], limit
    for b in args.batch_sizes:
        if b > fits:
            raise UserError(
                f"--batch-sizes: batch {b} needs {cli.format_bytes(b * per_row)} of KV cache ({b} rows x "
                f"{max_len} positions), above --kv-memory {cli.format_bytes(limit)}; at most {fits} rows fit"
            )
    return args.batch_sizes, limit


def run_requests(engine, requests, device, bar=None) -> dict:
    """Run the requests to their end in `engine`: the clock readings, each row's tokens."""
    synchronize(device)
    t0 = time.perf_counter()
    rows = [row for r in requests for row in engine.add(r)]
    first, ttft = None, {}
    while engine.active:
        tokens = engine.step()
        synchronize(device)
        now = time.perf_counter()
        for t in tokens:
            ttft.setdefault(t.row, now - t0)
        if first is None:
            first = now
        elif bar is not None:
            bar.update(1)
    return {"t0": t0, "first": first, "end": time.perf_counter(), "rows": rows, "ttft": list(ttft.values())}


def costs(model, dtype, kv_dtype_, args) -> dict:
    """What a decode step reads and computes (docs/measurements.md#inference-benchmark): every weight of the
    products once, one row of each embedding (value embeddings too) per row, a short window's fewer keys."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    windows = getattr(model, "window_sizes", [cfg.sequence_len] * cfg.n_layer)
    keys = statistics.fmean(min(args.prompt_tokens + i, w + 1) for w in windows for i in range(1, args.decode_tokens))
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    products = params - sum(m.weight.numel() for m in embeddings)
    looked_up = sum(m.embedding_dim for m in embeddings)
    return {
        "params": params,
        "product_weights": products,
        "lookup_values_per_row": looked_up,
        "weight_bytes_per_step": products * dtype.itemsize,
        "lookup_bytes_per_row": looked_up * dtype.itemsize,
        "kv_bytes_per_position": BatchEngine.kv_bytes(cfg, 1, 1, kv_dtype_),
        "mean_context": args.prompt_tokens + args.decode_tokens / 2,  # mean over the decode steps of prompt + i
        "mean_keys_read": keys,
        "decode_flops_per_token": 2 * products + 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * keys,
    }


def measure(model, tokenizer, dev, args, batch: int, cost: dict, bandwidth, peak) -> dict:
    """One batch size's row: a warm-up run, then the timed one, of B random prompts."""
    device, steps = dev.device, args.decode_tokens - 1
    engine = engine_for(model, tokenizer, batch, args.prompt_tokens + args.decode_tokens)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt_tokens), generator=g).tolist()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with dev.autocast():
        run_requests(engine, [Request(p, min(WARMUP_TOKENS, args.decode_tokens), use_tools=False) for p in ids], device)
        with progress_bar(total=steps, desc=f"batch {batch}", leave=False, file=sys.stderr) as bar:
            run = run_requests(engine, [Request(p, args.decode_tokens, use_tools=False) for p in ids], device, bar)
    counts = {len(row.tokens) for row in run["rows"]}
    if counts != {args.decode_tokens} or any(row.reason != "max_tokens" for row in run["rows"]):
        raise RuntimeError(f"rows ended early: {sorted(counts)} tokens, asked for {args.decode_tokens}")
    kv_cache = engine.cache.kv.nbytes
    if device.type == "cuda":
        peak_memory = torch.cuda.max_memory_allocated(device)
    else:
        peak_memory = sum(p.numel() * p.element_size() for p in model.parameters()) + decode.nbytes(model) + kv_cache
    prefill_s, decode_s = run["first"] - run["t0"], run["end"] - run["first"]
    kv_read = batch * cost["kv_bytes_per_position"] * cost["mean_keys_read"]
    bytes_per_step = cost["weight_bytes_per_step"] + batch * cost["lookup_bytes_per_row"] + kv_read
    steps_per_s = steps / decode_s
    return {
        "batch_size": batch,
        "prefill_tok_per_s": batch * args.prompt_tokens / prefill_s,
        "decode_tok_per_s": batch * steps_per_s,
        "per_token_latency_s": decode_s / steps,
        "ttft_median_s": statistics.median(run["ttft"]),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "tokens_per_row": counts.pop(),
        "peak_memory_bytes": peak_memory,
        "kv_cache_bytes": kv_cache,
        "kv_read_bytes_per_step": kv_read,
        "bytes_per_step": bytes_per_step,
        "steps_per_s": steps_per_s,
        "mbu_percent": hw_peak.mbu(bytes_per_step, steps_per_s, bandwidth),
        "mfu_percent": hw_peak.mfu(cost["decode_flops_per_token"], batch * steps_per_s, peak),
    }


COLUMNS = [  # (header, width, the row's key, its text)
    ("batch", 6, "batch_size", "{:d}".format),
    ("dtype", 6, "dtype", str),
    ("prefill tok/s", 14, "prefill_tok_per_s", "{:,.0f}".format),
    ("decode tok/s", 13, "decode_tok_per_s", "{:,.1f}".format),
    ("ms/token", 9, "per_token_latency_s", lambda s: f"{s * 1e3:.2f}"),
    ("TTFT ms", 9, "ttft_median_s", lambda s: f"{s * 1e3:.2f}"),
    ("peak MiB", 9, "peak_memory_bytes", lambda n: f"{n / 2**20:,.1f}"),
    ("MBU %", 7, "mbu_percent", "{:.1f}".format),
    ("MFU %", 7, "mfu_percent", "{:.2f}".format),
]


def print_card(payload: dict, bandwidth, peak):
    info, cfg = payload["model"], payload["model_config"]
    if "run" in info:
        what = f"run {info['run']} step {info['step']}"
    else:
        what = f"depth {info['depth']} {info['arch']}, {info['init']}"
    print(
        f"model: {what} | {payload['params']:,} parameters | n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}, "
        f"heads {cfg['n_head']} (kv {cfg['n_kv_head']}), vocab {cfg['vocab_size']} | tokenizer: {info['tokenizer']}"
    )
    print(
        f"requests: {payload['prompt_tokens']} prompt tokens (random ids, seed {payload['seed']}) + "
        f"{payload['decode_tokens']} greedy tokens each, no stop tokens, no tools | KV cache {payload['kv_dtype']}, "
        f"limit {cli.format_bytes(payload['kv_memory_bytes'])}"
    )
    print(
        f"bytes per decode step = {payload['weight_bytes_per_step']:,} (the products' weights, {payload['dtype']}) "
        f"+ B x ({payload['lookup_bytes_per_row']:,} (embedding rows) + {payload['kv_bytes_per_position']:,} x "
        f"{payload['mean_keys_read']:g} (KV bytes per position x mean keys read)) | "
        f"MBU against the {bandwidth.describe()} | MFU against the {peak.describe()}"
    )
    print(f"peak memory: {payload['peak_memory_source']}")
    header = " ".join(name.rjust(width) for name, width, _, _ in COLUMNS)
    print(header + "\n" + "-" * len(header), flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_model_flags(args)
    with evaluation_process(args) as dev:
        if dev.world_size > 1:
            raise UserError("infer_bench measures one process: run it without torchrun")
        model, tokenizer, info = open_model(args, dev.device)
        per_batch = dev.device.type == "cpu" and args.dtype == "auto"  # each batch size's own timing decides
        dtype = torch.float32 if per_batch else kv_dtype(model, tokenizer, dev)  # fp32: the larger cache plans
        sizes, limit = plan_sweep(args, model.config, dtype, dev.device)
        bandwidth, peak = hw_peak.memory_bandwidth(dev.device), hw_peak.peak_flops(dev.device)
        cost = costs(model, dev.precision.dtype, dtype, args)
        payload = {
            "model": info,
            "model_config": asdict(model.config),
            "device": str(dev.device),
            "device_name": bandwidth.device,
            "dtype": "auto (measured per batch size)" if per_batch else dev.precision.name,
            "kv_dtype": "float32 (half that in a bf16 row)" if per_batch else str(dtype).split(".")[-1],
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "seed": args.seed,
            "kv_memory_bytes": limit,
            **cost,
            "bandwidth": {"bytes_per_s": bandwidth.bytes_per_s, "source": bandwidth.source},
            "peak_flops": {"flops_per_s": peak.flops, "dtype": peak.dtype, "source": peak.source},
            "peak_memory_source": "torch.cuda.max_memory_allocated"
            if dev.device.type == "cuda"
            else "computed: weights as stored + their packed copies for decode steps (when used) + the "
            "KV cache (activations not counted)",
            "threads": torch.get_num_threads(),
            "sweep": [],
        }
        print_card(payload, bandwidth, peak)
        for batch in sizes:
            mix = generation_dtype.GenerationMix(batch, args.prompt_tokens, args.decode_tokens)
            run_dev = generation_dtype.for_generation(dev, args.dtype, model, mix)
            row_cost = costs(model, run_dev.precision.dtype, kv_dtype(model, tokenizer, run_dev), args)
            row = measure(model, tokenizer, run_dev, args, batch, row_cost, bandwidth, peak)
            row.update(dtype=run_dev.precision.name, dtype_reason=run_dev.precision.reason)
            payload["sweep"].append(row)
            print(" ".join(text(row[key]).rjust(width) for _, width, key, text in COLUMNS), flush=True)
        print(json.dumps(payload))
        return 0


if __name__ == "__main__":
    cli.run(main)
