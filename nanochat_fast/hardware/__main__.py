"""What this machine gives a training process: threads per process, the peak matmul rates (MFU is
quoted against the best of them), the memory bandwidth (MBU is quoted against it), and the
fp32-vs-bf16 timings cached for the shapes runs have used here. --tune measures the peaks, the
bandwidth and every cached timing again; with --depth (and the batch flags) it also times that
model (the vocabulary of the tokenizer trained here, else 65,536) and its Muon matrices, as
base_train would.
"""

import torch

from ..core import cli, paths, threads
from ..model import generation_dtype  # noqa: F401  (these register how --tune re-times their work)
from ..optim import muon  # noqa: F401
from ..train import model_setup
from ..train.env_vars import check_environment
from . import peak, precision
from .cache import age_days


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.hardware", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument(
        "--tune", action="store_true", help="measure the peaks, the bandwidth and the cached dtype timings again"
    )
    p.add_argument(
        "--budget",
        type=cli.non_negative_float,
        default=precision.MAX_SECONDS,
        help="seconds each timing may take (--tune)",
    )
    p.add_argument("--depth", type=cli.positive_int, default=None, help="also time this model (--tune)")
    p.add_argument("--max-seq-len", type=cli.positive_int, default=2048, help="with --depth: tokens per row")
    p.add_argument("--device-batch-size", type=cli.positive_int, default=32, help="with --depth: rows per micro-step")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    print(f"threads: {threads.configure_threads().describe()}")
    rates = peak.measured_peaks(args.device, remeasure=args.tune, store=not args.tune)
    works = []
    if args.tune:  # every timing planned, and checked against the budget, before anything is written
        if args.depth:  # with the vocabulary of the tokenizer trained here, else nanochat's default of 65,536
            from ..data.tokenizer import RANKS_FILE, get_tokenizer

            vocab = get_tokenizer().get_vocab_size() if (paths.tokenizer_dir() / RANKS_FILE).is_file() else 65536
            works += model_setup.tuning_works(args.depth, vocab, args.max_seq_len, args.device_batch_size, args.device)
        works += precision.cached_works(args.device)
        for work in works:
            precision.check_fits(work, rates, args.budget)
        peak.CACHE.store(peak.machine_key(args.device), rates)
    print(f"device: {peak.device_name(args.device)}")
    print(
        f"peak: {peak.peak_flops(args.device).describe()} (probe of {rates['probe_seconds']} s on "
        f"{rates['measured']}; {peak.CACHE.path})"
    )
    bandwidth = peak.memory_bandwidth(args.device, remeasure=args.tune)
    if bandwidth.source == "datasheet":  # not probed
        print(f"bandwidth: {bandwidth.describe()}")
    else:
        e = peak.measured_bandwidth(args.device)
        print(
            f"bandwidth: {bandwidth.describe()} (probe of {e['probe_seconds']} s reading "
            f"{e['buffer_bytes'] / 2**20:.0f} MiB on {e['measured']}; {peak.BANDWIDTH_CACHE.path})"
        )
    for work in works:
        show("timed", precision.measure(work, args.device, args.budget, remeasure=True, strict=True))
    cached = precision.cached_entries(args.device)
    if not args.tune:
        for e in cached:
            show(f"cached {age_days(e):.0f} days ago", precision.Timing(e["seconds"], e["what"], e["rounds"]))
    if not works and not cached:
        print("no dtype timings cached here yet: a training run times its own shapes (or --tune --depth N)")
    print(f"dtype timings: {precision.CACHE.path}")
    return 0


def show(how: str, timing: precision.Timing):
    print(f"{how}: {timing.describe()} -> {timing.winner}")


if __name__ == "__main__":
    cli.run(main)
