"""
Which dtype computes faster here, decided by timing both at the shapes that will run.

A CPU's flags do not tell: CPUs with AVX512-BF16 have run bf16 matmuls both at half their fp32
rate and faster than fp32, and AVX2 CPUs emulate bf16 (docs/measurements.md#bf16-on-cpus). So on a
CPU, `--dtype auto` and `--ns-dtype auto` come from `measure(work)`: the cache
(NANOCHAT_FAST_HOME/hardware/dtype_timings.json, keyed by machine and by what is timed), else the
work itself in each dtype in interleaved rounds (the fastest round of each), else matmuls at its
largest shapes with fewer rows, else (where the probe has bf16 DECIDED_SLOWDOWN times slower) fp32
alone, else the machine's matmul probe (peak.py). The timing keeps within a budget (MAX_SECONDS,
RUN_FRACTION of the run), and bf16 wins only when at least BF16_MIN_SPEEDUP times faster. Each rule
and its reason: docs/measurements.md#dtype-timing.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..core.distributed import rank0_decides
from ..core.errors import UserError
from .cache import STALE_AFTER_DAYS, MeasurementCache, age_days, machine_busy
from .machine import machine_key, rng_untouched, synchronize
from .peak import DTYPES, measured_peaks

BF16_MIN_SPEEDUP = 1.1
# bf16 this many times slower than fp32 by the probe (emulated, AVX2: ~80x) cannot win at any shape: the
# choice is made, and timing fp32 alone is enough to record it
DECIDED_SLOWDOWN = 10.0
MAX_SECONDS = 30.0
RUN_FRACTION = 0.05
ROUNDS, MIN_ROUNDS = 5, 3
MIN_ROWS = 16  # the fallback's matmuls never shrink below this many rows
MATMUL_MIN_SECONDS = 0.5  # the fallback may take this long even in a run too short for 5% to allow it
CACHE = MeasurementCache(
    "dtype_timings.json",
    version=1,
    valid=lambda e: (
        isinstance(e.get("seconds"), dict)
        and all(isinstance(e["seconds"].get(d), (int, float)) and e["seconds"][d] > 0 for d in DTYPES)
    ),
)
clock = time.perf_counter  # the tests inject a clock


class TuningError(UserError):
    """Nothing could be timed within the budget (python -m nanochat_fast.hardware --tune)."""


@dataclass(frozen=True)
class Timing:
    seconds: dict  # dtype name -> seconds of one call (the fastest round)
    what: str  # what was timed, in words
    rounds: int
    source: str = "measured"  # "measured" | "cached" | "probe"

    @property
    def speedup(self) -> float:
        """bf16's rate over fp32's (0.5: bf16 takes twice as long)."""
        return self.seconds["fp32"] / self.seconds["bf16"]

    @property
    def winner(self) -> str:
        return "bf16" if self.speedup >= BF16_MIN_SPEEDUP else "fp32"

    def describe(self) -> str:
        cached = ", cached" if self.source == "cached" else ""
        return f"bf16 {self.speedup:.2f}x fp32 at {self.what}{cached}"


@dataclass
class Work:
    """Something to time in each dtype. `make()` builds the calls (it may allocate, so it runs only
    when the work fits the budget): {"fp32": call, "bf16": call}, each a zero-argument function."""

    kind: str  # "model" | "newton_schulz": for the cache and --tune
    spec: dict  # its shapes, as JSON: the cache key, and --tune's recipe
    what: str  # in words, for the log
    flops: float  # of one call: predicts its time before it is made
    make: Callable[[], dict]
    matmuls: list = field(default_factory=list)  # (M, K, N) of its largest products: the fallback
    run_calls: int | None = None  # calls the run will make (the budget); None: unknown


_MEASURERS: dict[str, Callable] = {}


def register(kind: str, build: Callable):
    """build(spec, device) -> Work: how --tune re-times a cached entry of `kind`."""
    _MEASURERS[kind] = build


def probe_timing(device) -> Timing:
    """The machine's square-matmul probe as a Timing: the last resort, and the choice for a
    newton_schulz call made without a shape-specific measurement."""
    rates = measured_peaks(device)
    return Timing({d: 1.0 / rates[d] for d in DTYPES}, "square matmuls (this machine's probe)", 0, "probe")


def cache_key(work: Work, device) -> str:
    return f"{machine_key(device)} | {work.kind} | {json.dumps(work.spec, sort_keys=True)}"


def measure(
    work: Work, device, max_seconds: float = MAX_SECONDS, remeasure: bool = False, strict: bool = False
) -> Timing:
    """The Timing of `work` on `device` (docs/measurements.md#dtype-timing). strict: TuningError when nothing fits
    the budget, instead of the machine probe."""
    device = torch.device(device)
    key = cache_key(work, device)
    rates = measured_peaks(device)
    budget, matmul_budget = budgets(work, rates, max_seconds)
    cached = None if remeasure else CACHE.get(key)
    if cached and age_days(cached) > STALE_AFTER_DAYS:
        cached = None
    if cached and (cached.get("level") == "work" or not _fits(_predict(work.flops, rates), budget)):
        return Timing(cached["seconds"], cached["what"], cached["rounds"], "cached")
    with rng_untouched(device):  # the timed calls' random inputs leave the run's stream alone
        timing, level = _time_work(work, device, rates, budget), "work"
        if timing is None:
            timing, level = _time_matmuls(work, device, rates, matmul_budget), "matmuls"
        if timing is None:
            timing, level = _time_fp32_alone(work, device, rates, matmul_budget), "decided"
    if timing is None:
        if strict:
            raise TuningError(too_slow(work, rates, max_seconds))
        return probe_timing(device)
    if not machine_busy():
        CACHE.put(key, {**asdict(timing), "level": level, "kind": work.kind, "spec": work.spec})
    return timing


def budgets(work: Work, rates: dict, max_seconds: float) -> tuple[float, float]:
    """(seconds the work may take, seconds its matmuls may take as the fallback)."""
    budget = max_seconds
    if work.run_calls:
        budget = min(budget, RUN_FRACTION * work.run_calls * work.flops / rates["fp32"])
    return budget, max(budget, min(max_seconds, MATMUL_MIN_SECONDS))


def check_fits(work: Work, rates: dict, max_seconds: float):
    """TuningError unless the work or its matmuls are predicted to fit max_seconds at `rates`
    (--tune checks every work before it measures or writes anything)."""
    budget, matmul_budget = budgets(work, rates, max_seconds)
    if _fits(_predict(work.flops, rates), budget) or _matmul_rows(work, rates, matmul_budget) is not None:
        return
    if not (_decided(rates) and _fits(_fp32_alone(work.flops, rates), matmul_budget)):
        raise TuningError(too_slow(work, rates, max_seconds))


def too_slow(work: Work, rates: dict, max_seconds: float) -> str:
    fp32, bf16 = (work.flops / rates[d] for d in ("fp32", "bf16"))
    return (
        f"no timing of {work.what} fits the budget of {max_seconds:g} s on this machine (one call takes "
        f"~{fp32:.3g} s in fp32 and ~{bf16:.3g} s in bf16, and {1 + MIN_ROUNDS} of each are needed, or of its "
        f"matmuls at {MIN_ROWS} rows); give a larger --budget"
    )


def _predict(flops: float, rates: dict) -> dict:
    return {d: flops / rates[d] for d in DTYPES}


def _fits(predicted: dict, budget: float) -> bool:
    """A warm-up and MIN_ROUNDS timed calls of every candidate fit the budget."""
    return (1 + MIN_ROUNDS) * sum(predicted.values()) <= budget


def _time_work(work: Work, device, rates: dict, budget: float) -> Timing | None:
    predicted = _predict(work.flops, rates)
    if not _fits(predicted, budget):
        return None
    timed = time_interleaved(work.make(), predicted, budget, device, run_calls=work.run_calls)
    return None if timed is None else Timing(timed[0], work.what, timed[1])


def _matmul_flops(work: Work, rows: int) -> float:
    return sum(2 * min(rows, m) * k * n for m, k, n in work.matmuls)


def _matmul_rows(work: Work, rates: dict, budget: float) -> int | None:
    """The most rows (at most 4096, halving from there) at which the work's matmuls fit the budget."""
    rows = min(4096, max((m for m, _, _ in work.matmuls), default=0))
    while rows >= MIN_ROWS and not _fits(_predict(_matmul_flops(work, rows), rates), budget):
        rows //= 2
    return rows if rows >= MIN_ROWS else None


def _decided(rates: dict) -> bool:
    """The probe has bf16 so much slower than fp32 that no shape can turn it round."""
    return rates["fp32"] >= DECIDED_SLOWDOWN * rates["bf16"]


def _fp32_alone(flops: float, rates: dict) -> dict:
    return {"fp32": flops / rates["fp32"]}


def _time_fp32_alone(work: Work, device, rates: dict, budget: float) -> Timing | None:
    """Where bf16 is decided slower (the probe: DECIDED_SLOWDOWN times or more) and neither the work nor its
    matmuls fit the budget in both dtypes: the work in fp32 alone, bf16's time predicted from it at the
    probe's ratio. Timing the emulated bf16 would only confirm a choice made by a wide margin."""
    if not _decided(rates) or not _fits(_fp32_alone(work.flops, rates), budget):
        return None
    calls = work.make()
    timed = time_interleaved({"fp32": calls["fp32"]}, _fp32_alone(work.flops, rates), budget, device)
    if timed is None:
        return None
    slowdown = rates["fp32"] / rates["bf16"]
    seconds = {"fp32": timed[0]["fp32"], "bf16": timed[0]["fp32"] * slowdown}
    return Timing(seconds, f"{work.what}; bf16 not timed: {slowdown:.0f}x slower by this machine's probe", timed[1])


def _time_matmuls(work: Work, device, rates: dict, budget: float) -> Timing | None:
    """Matmuls at the work's largest shapes, with as many rows as fit."""
    rows = _matmul_rows(work, rates, budget)
    if rows is None:
        return None
    calls = {d: _matmul_call(work.matmuls, rows, device, dtype) for d, dtype in DTYPES.items()}
    timed = time_interleaved(calls, _predict(_matmul_flops(work, rows), rates), budget, device)
    shapes = ", ".join(f"{min(rows, m)}x{k}x{n}" for m, k, n in work.matmuls)
    return None if timed is None else Timing(timed[0], f"the matmuls of {work.what} ({shapes})", timed[1])


def _matmul_call(matmuls, rows: int, device, dtype):
    pairs = [
        (torch.randn(min(rows, m), k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype))
        for m, k, n in matmuls
    ]

    def call():
        for a, b in pairs:
            torch.mm(a, b)

    return call


def time_interleaved(calls: dict, predicted: dict, budget: float, device, run_calls: int | None = None):
    """(fastest seconds per name, rounds) of `calls` timed in interleaved rounds after one warm-up
    each, or None when the warm-ups show that MIN_ROUNDS rounds would not fit `budget`. With
    run_calls, the budget also shrinks to RUN_FRACTION of the run as fp32's real time shows. The
    first call is fp32's: its time rescales every prediction to what this work really does."""

    def timed(call) -> float:
        t0 = clock()
        call()
        synchronize(device)
        return clock() - t0

    def shrink(budget, fp32_seconds):
        return min(budget, RUN_FRACTION * run_calls * fp32_seconds) if run_calls else budget

    start = clock()
    predicted = dict(predicted)
    for i, (name, call) in enumerate(calls.items()):
        took = timed(call)  # the warm-up: kernels chosen, memory touched; an upper bound on a call
        if i == 0:
            predicted = {d: p * took / predicted[name] for d, p in predicted.items()}
            budget = shrink(budget, took)
        predicted[name] = took
        if MIN_ROUNDS * sum(predicted.values()) > budget:
            return None
    times = {name: [] for name in calls}
    for r in range(ROUNDS):
        if r >= MIN_ROUNDS and clock() - start + sum(predicted.values()) > budget:
            break
        for name, call in calls.items():
            times[name].append(timed(call))
            predicted[name] = times[name][-1]
        budget = shrink(budget, times[next(iter(calls))][-1])
    return {name: min(ts) for name, ts in times.items()}, len(times[next(iter(times))])


def measure_everywhere(work: Work, device, **kwargs) -> Timing:
    """measure() on rank 0, the same Timing on every rank: one decision for the whole run (the
    other ranks wait rather than time the same thing against each other)."""
    return rank0_decides(lambda: measure(work, device, **kwargs))


def cached_entries(device) -> list[dict]:
    """The timings cached for this machine (python -m nanochat_fast.hardware lists them)."""
    prefix = machine_key(device) + " | "
    return [e for k, e in CACHE.entries().items() if k.startswith(prefix)]


def cached_works(device) -> list[Work]:
    """The work of every timing cached for this machine, rebuilt to be timed again (--tune)."""
    return [_MEASURERS[e["kind"]](e["spec"], device) for e in cached_entries(device) if e.get("kind") in _MEASURERS]
