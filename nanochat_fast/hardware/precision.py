"""
The one decider of the dtypes the heavy arithmetic runs in: the model's (--dtype), Newton-Schulz's
(--ns-dtype) and generation's. Master weights, gradients and optimizer state are fp32 everywhere.
`choose` applies the rule (`decide`): CUDA sm80+ bf16, MPS fp32, a CPU the faster of fp32 and bf16
timed at the caller's own work (`measure`: cached per machine, within a budget, with fallbacks) and
bf16 only from BF16_MIN_SPEEDUP; never a CPU's flags (docs/measurements.md#bf16-on-cpus, #dtype-timing).
"""

import json
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from ..core.distributed import rank0_decides
from ..core.errors import UserError
from .cache import MeasurementCache, machine_busy
from .machine import cpu_bf16_support, machine_key, rng_untouched, synchronize
from .peak import DTYPES, measured_peaks

CHOICES = ("auto", "fp32", "bf16")
BF16_MIN_SPEEDUP = 1.1
# bf16 this many times slower than fp32 by the probe (emulated) cannot win at any shape: the choice is
# made, and timing fp32 alone is enough to record it
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


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype
    name: str  # "fp32" | "bf16"
    reason: str  # why, in words, for the log and the run report
    native: bool  # the device executes this dtype in hardware (False: emulated, slow)

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


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

    kind: str  # "model" | "newton_schulz" | "generation": for the cache and --tune
    spec: dict  # its shapes, as JSON: the cache key, and --tune's recipe
    what: str  # in words, for the log
    flops: float  # of one call: predicts its time before it is made
    make: Callable[[], dict]
    matmuls: list = field(default_factory=list)  # (M, K, N) of its largest products: the fallback
    run_calls: int | None = None  # calls the run will make (the budget); None: unknown


class TuningError(UserError):
    """Nothing could be timed within the budget (python -m nanochat_fast.hardware --tune)."""


def decide(
    device_type: str, requested: str = "auto", *, timing: Timing | None = None, cpu_bf16: str | None = None,
    cuda_capability: tuple[int, int] | None = None, what: str = "--dtype",
) -> Precision:  # fmt: skip
    """The pure rule: the device type and its facts -> Precision. A CPU's auto follows `timing`; `cpu_bf16`
    (the CPU's bf16 feature or None) only words an explicit bf16's reason; `what` names the flag."""
    if requested not in CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(CHOICES)}, got {requested!r}")
    if device_type == "cuda":
        native = cuda_capability is not None and cuda_capability >= (8, 0)
        where = f"CUDA sm{cuda_capability[0]}{cuda_capability[1]}" if cuda_capability else "CUDA"
        bf16_why = f"{where} has bf16 tensor cores" if native else f"{where} has no bf16 tensor cores (before sm80)"
    elif device_type == "cpu":
        native = cpu_bf16 is not None
        bf16_why = (
            f"this CPU has {cpu_bf16}" if native else "this CPU has no bf16 instructions (no AVX512-BF16/AMX): emulated"
        )
    elif device_type == "mps":
        native = False
        bf16_why = "MPS: not measured faster than fp32"
    else:
        raise ValueError(f"unknown device type {device_type!r}")
    if requested == "fp32":
        return Precision(torch.float32, "fp32", f"{what} fp32 asked for", True)
    if requested == "bf16":
        return Precision(torch.bfloat16, "bf16", f"asked for; {bf16_why}", native)
    if device_type == "cpu":
        if timing is None:
            raise ValueError("a CPU's auto dtype is decided by a timing: pass timing=")
        return Precision(DTYPES[timing.winner], timing.winner, f"measured here: {timing.describe()}", True)
    name = "bf16" if native else "fp32"
    return Precision(DTYPES[name], name, f"auto: {bf16_why}", True)


def choose(
    device, requested: str = "auto", *, what: str = "--dtype", warn: bool = True, work=None, max_seconds=MAX_SECONDS
) -> Precision:
    """decide() with this machine's facts. A CPU's auto times `work` (on rank 0 for every rank, so every rank
    calls this together), else takes the matmul probe. Emulated bf16 is allowed (slow): one warning line."""
    device = torch.device(device)
    timing = None
    if device.type == "cpu" and requested == "auto" and work is None:
        timing = probe_timing(device)
    elif device.type == "cpu" and requested == "auto":
        timing = rank0_decides(lambda: measure(work, device, max_seconds=max_seconds))
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    cpu_bf16 = cpu_bf16_support() if device.type == "cpu" else None
    choice = decide(device.type, requested, timing=timing, cpu_bf16=cpu_bf16, cuda_capability=capability, what=what)
    if warn and not choice.native:
        print(
            f"warning: {what} bf16 on {device.type}: {choice.reason.split('; ', 1)[-1]}; this will be slow "
            f"(use {what} auto)",
            file=sys.stderr,
            flush=True,
        )
    return choice


def autocast(device, precision: Precision | torch.dtype):
    """The autocast context for the forward pass: bf16 matmuls where chosen, a no-op for fp32."""
    dtype = precision if isinstance(precision, torch.dtype) else precision.dtype
    return nullcontext() if dtype == torch.float32 else torch.autocast(torch.device(device).type, dtype=dtype)


_MEASURERS: dict[str, Callable] = {}


def register(kind: str, build: Callable):
    """build(spec, device) -> Work: how --tune re-times a cached entry of `kind`."""
    _MEASURERS[kind] = build


def probe_timing(device) -> Timing:
    """The square-matmul probe as a Timing: the last resort, and the choice for a call made without a
    work of its own (a newton_schulz call's default dtype)."""
    rates = measured_peaks(device)
    return Timing({d: 1.0 / rates[d] for d in DTYPES}, "square matmuls (this machine's probe)", 0, "probe")


def cache_key(work: Work, device) -> str:
    return f"{machine_key(device)} | {work.kind} | {json.dumps(work.spec, sort_keys=True)}"


def measure(
    work: Work, device, max_seconds: float = MAX_SECONDS, remeasure: bool = False, strict: bool = False
) -> Timing:
    """The Timing of `work` on `device`: the cache, else the work, else its matmuls at fewer rows,
    else fp32 alone where the probe has decided, else the probe (strict: TuningError instead)."""
    device = torch.device(device)
    key = cache_key(work, device)
    rates = measured_peaks(device)
    budget, matmul_budget = budgets(work, rates, max_seconds)
    cached = None if remeasure else CACHE.get(key)
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
    """TuningError unless the work, its matmuls or (where decided) its fp32 call alone are predicted
    to fit max_seconds (--tune checks every work before it measures or writes anything)."""
    budget, matmul_budget = budgets(work, rates, max_seconds)
    if _fits(_predict(work.flops, rates), budget) or _matmul_rows(work, rates, matmul_budget) is not None:
        return
    if not (_decided(rates) and _fits({"fp32": work.flops / rates["fp32"]}, matmul_budget)):
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


def _decided(rates: dict) -> bool:
    """The probe has bf16 so much slower than fp32 that no shape can turn it round."""
    return rates["fp32"] >= DECIDED_SLOWDOWN * rates["bf16"]


def _time_work(work: Work, device, rates: dict, budget: float) -> Timing | None:
    predicted = _predict(work.flops, rates)
    if not _fits(predicted, budget):
        return None
    return time_interleaved(work.make(), predicted, budget, device, work.what, work.run_calls)


def _matmul_rows(work: Work, rates: dict, budget: float) -> int | None:
    """The most rows (at most 4096, halving from there) at which the work's matmuls fit the budget."""
    rows = min(4096, max((m for m, _, _ in work.matmuls), default=0))
    while rows >= MIN_ROWS and not _fits(_predict(_matmul_flops(work, rows), rates), budget):
        rows //= 2
    return rows if rows >= MIN_ROWS else None


def _matmul_flops(work: Work, rows: int) -> float:
    return sum(2 * min(rows, m) * k * n for m, k, n in work.matmuls)


def _time_matmuls(work: Work, device, rates: dict, budget: float) -> Timing | None:
    """Matmuls at the work's largest shapes, with as many rows as fit."""
    rows = _matmul_rows(work, rates, budget)
    if rows is None:
        return None
    calls = {d: _matmul_call(work.matmuls, rows, device, dtype) for d, dtype in DTYPES.items()}
    what = f"the matmuls of {work.what} ({', '.join(f'{min(rows, m)}x{k}x{n}' for m, k, n in work.matmuls)})"
    return time_interleaved(calls, _predict(_matmul_flops(work, rows), rates), budget, device, what)


def _matmul_call(matmuls, rows: int, device, dtype):
    pairs = [
        (torch.randn(min(rows, m), k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype))
        for m, k, n in matmuls
    ]
    return lambda: [torch.mm(a, b) for a, b in pairs]


def _time_fp32_alone(work: Work, device, rates: dict, budget: float) -> Timing | None:
    """Where bf16 is decided slower and neither the work nor its matmuls fit in both dtypes: the work
    in fp32 alone, bf16's time put at the probe's ratio (timing emulated bf16 would only confirm it)."""
    predicted = {"fp32": work.flops / rates["fp32"]}
    if not _decided(rates) or not _fits(predicted, budget):
        return None
    slowdown = rates["fp32"] / rates["bf16"]
    what = f"{work.what}; bf16 not timed: {slowdown:.0f}x slower by this machine's probe"
    timed = time_interleaved({"fp32": work.make()["fp32"]}, predicted, budget, device, what)
    if timed is None:
        return None
    return replace(timed, seconds={"fp32": timed.seconds["fp32"], "bf16": timed.seconds["fp32"] * slowdown})


def time_interleaved(calls: dict, predicted: dict, budget: float, device, what: str, run_calls: int | None = None):
    """The Timing of `calls` (the fastest of interleaved rounds after a warm-up each), or None where the warm-ups
    show MIN_ROUNDS rounds would not fit `budget` (with run_calls: RUN_FRACTION of the run, by fp32's time)."""

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
        if i == 0:  # fp32's: it rescales every prediction to what this work really does
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
    return Timing({name: min(ts) for name, ts in times.items()}, what, len(times[next(iter(times))]))


def cached_entries(device) -> list[dict]:
    """The timings cached for this machine (python -m nanochat_fast.hardware lists them)."""
    prefix = machine_key(device) + " | "
    return [e for k, e in CACHE.entries().items() if k.startswith(prefix)]


def cached_works(device) -> list[Work]:
    """The work of every timing cached for this machine, rebuilt to be timed again (--tune)."""
    return [_MEASURERS[e["kind"]](e["spec"], device) for e in cached_entries(device) if e.get("kind") in _MEASURERS]
