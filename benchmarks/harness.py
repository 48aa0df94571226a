"""
Interleaved comparisons on top of pytest-benchmark.

Timing variants one after another lets a busy neighbour or a frequency change land on one of them
only. Here every round runs each variant once, in a rotating order, and we quote per-variant
medians. pytest-benchmark drives the rounds (warmup, JSON output with --benchmark-json); the
per-variant timings go into the test's extra_info, from which make_results.py writes RESULTS.md.

    def test_adamw_step(benchmark):
        compare(benchmark, op="adamw step", shape_set="depth-8 GPT (60M fp32, 50 tensors)",
                variants={"cpp": run_cpp, "torch fused": run_fused}, baseline="torch fused")
"""
import statistics
import time

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare(benchmark, *, op: str, shape_set: str, variants: dict, baseline: str, rounds: int = 15,
            warmup_rounds: int = 2, notes: str = ""):
    """Time `variants` (name -> zero-argument callable) in interleaved rounds; returns medians (s)."""
    assert baseline in variants, baseline
    names = list(variants)
    times = {name: [] for name in names}
    counter = {"round": 0}

    def one_round():
        r = counter["round"]
        counter["round"] += 1
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            _sync()
            t0 = time.perf_counter()
            variants[name]()
            _sync()
            times[name].append(time.perf_counter() - t0)

    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    skip = warmup_rounds  # warmup rounds also append: drop them
    medians = {name: statistics.median(ts[skip:]) for name, ts in times.items()}
    benchmark.extra_info.update({
        "op": op, "shape_set": shape_set, "baseline": baseline, "notes": notes, "rounds": rounds,
        "variants": {name: {"median_s": medians[name],
                            "min_s": min(times[name][skip:]),
                            "ratio_to_baseline": medians[name] / medians[baseline]} for name in names},
    })
    return medians
