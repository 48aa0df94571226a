"""
Interleaved comparisons on top of pytest-benchmark.

Timing variants one after another lets a busy neighbour or a frequency change land on one of them
only. Here every round runs each variant once, in a rotating order, and we quote per-variant
medians. pytest-benchmark drives the rounds (JSON output with --benchmark-json); the per-variant
timings, the number of rounds that ran and the variants left out for time go into the test's
extra_info, from which make_results.py writes RESULTS.md. Slow variants are kept to a time budget:
plan_modes picks, per variant, the first way of timing it (a full step, a per-shape estimate)
whose rounds fit, from flop counts and this machine's measured matmul rate (matmul_gflops).

    def test_adamw_step(benchmark):
        compare(benchmark, op="adamw step", shape_set="depth-8 GPT (60M fp32, 50 tensors)",
                variants={"cpp": run_cpp, "torch fused": run_fused}, baseline="torch fused")
"""

import functools
import statistics
import time

import torch

# Every variant gets at least this many timed rounds; a test's rounds are cut to its time budget
# (never below this), so `make bench` stays bounded on slow machines (bf16 emulated on a CPU
# without native bf16 runs ~160x slower than fp32).
MIN_ROUNDS = 3


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=None)
def matmul_gflops(dtype: torch.dtype, device: str) -> float:
    """This machine's matmul rate in `dtype` (best of 3 batched products, sized to take ~10 ms
    even where bf16 is emulated): what the budget planning turns flop counts into seconds with."""
    n = 512 if dtype == torch.float32 or device != "cpu" else 128
    a = torch.randn(4, n, n, device=device).to(dtype)
    torch.bmm(a, a)
    best = float("inf")
    for _ in range(3):
        _sync()
        t0 = time.perf_counter()
        torch.bmm(a, a)
        _sync()
        best = min(best, time.perf_counter() - t0)
    return 4 * 2 * n**3 / best / 1e9


def plan_modes(costs: dict, budget_s: float, required: str | None = None) -> tuple[dict, dict]:
    """costs: variant -> {mode: estimated seconds per round} (modes in preference order, e.g.
    "full step" before "per shape"), variants in priority order. Each variant takes the first
    mode whose MIN_ROUNDS + 1 rounds fit in what is left of the budget; `required` takes its
    cheapest mode even when none fits, so the table is never empty. Returns ({variant: mode},
    {variant: reason it was not timed})."""
    modes, skipped = {}, {}
    left = budget_s
    for name, options in costs.items():
        for mode, seconds in options.items():
            if seconds * (MIN_ROUNDS + 1) <= left:
                modes[name] = mode
                left -= seconds * (MIN_ROUNDS + 1)
                break
        else:
            if name == required:
                modes[name] = min(options, key=options.get)
                left -= options[modes[name]] * (MIN_ROUNDS + 1)
                continue
            seconds = min(options.values())
            skipped[name] = (
                f"not timed: {MIN_ROUNDS + 1} rounds would take ~{seconds * (MIN_ROUNDS + 1):.0f} s "
                f"(budget left {left:.0f} s)"
            )
    return modes, skipped


def compare(
    benchmark,
    *,
    op: str,
    shape_set: str,
    variants: dict,
    baseline: str,
    rounds: int = 15,
    warmup_rounds: int = 2,
    notes: str = "",
    budget_s: float | None = None,
    skipped: dict | None = None,
):
    """Time `variants` (name -> zero-argument callable) in interleaved rounds; returns medians (s).

    A variant may return the seconds it stands for instead of its wall time (a per-shape estimate
    that times one matrix per shape and multiplies by the counts). With `budget_s`, the number of
    rounds is what fits in it after the warmup (at least MIN_ROUNDS, at most `rounds`). `skipped`
    (name -> reason) lists variants that were not timed; they appear in the results with the reason."""
    assert baseline in variants, baseline
    names = list(variants)
    times = {name: [] for name in names}
    wall = []
    counter = {"round": 0}

    def one_round():
        r = counter["round"]
        counter["round"] += 1
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        start = time.perf_counter()
        for name in order:
            _sync()
            t0 = time.perf_counter()
            stands_for = variants[name]()
            _sync()
            times[name].append(stands_for if isinstance(stands_for, float) else time.perf_counter() - t0)
        wall.append(time.perf_counter() - start)

    for _ in range(warmup_rounds):
        one_round()
    if budget_s is not None:
        per_round = wall[-1] if wall else 0.0
        left = budget_s - sum(wall)
        rounds = max(MIN_ROUNDS, min(rounds, int(left / per_round) if per_round > 0 else rounds))
    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=0, iterations=1)
    skip = warmup_rounds  # warmup rounds also append: drop them
    medians = {name: statistics.median(ts[skip:]) for name, ts in times.items()}
    benchmark.extra_info.update(
        {
            "op": op,
            "shape_set": shape_set,
            "baseline": baseline,
            "notes": notes,
            "rounds": rounds,
            "budget_s": budget_s,
            "skipped": skipped or {},
            "variants": {
                name: {
                    "median_s": medians[name],
                    "min_s": min(times[name][skip:]),
                    "ratio_to_baseline": medians[name] / medians[baseline],
                }
                for name in names
            },
        }
    )
    return medians
