"""
torch.compile for training: whether to compile by default, and a context that says what was
compiled inside it and what that cost.

The default (default_compile): compile on CUDA and CPU unless the run is too short to win back the
one-time compile; MPS stays eager. Rule: compile when the run's compute at the device's peak (FLOPs
per token x tokens x steps / peak) is at least MIN_RUN_SECONDS_AT_PEAK, which keeps smoke runs and
the test suite's tiny models eager. Evaluation and sampling go through the plain module
(orig_model), never the compiled one, so they cause no recompiles. The measurements behind the
rule, and what recompiles would cost: docs/measurements.md#compile-policy.

    with CompileWatch() as watch:
        loss = compiled_model(x, y)
    print(watch.describe())   # "1 graph(s) compiled in 23.4 s"
"""

import time

# about where the per-step saving pays back a cold compile: docs/measurements.md#compile-policy
MIN_RUN_SECONDS_AT_PEAK = 100.0


def default_compile(
    device_type: str, run_flops: float | None = None, peak_flops: float | None = None
) -> tuple[bool, str]:
    """--compile's default and the reason (for the log and the run report). run_flops: the run's
    training FLOPs (estimate_flops() x tokens per step x steps; None when the horizon is unknown);
    peak_flops: the peak of all processes (hardware.peak_flops x world size)."""
    if device_type not in ("cuda", "cpu"):
        return False, f"eager on {device_type} (compiling was not measured faster there)"
    if run_flops is not None and peak_flops:
        at_peak = run_flops / peak_flops
        if at_peak < MIN_RUN_SECONDS_AT_PEAK:
            return False, (
                f"eager: a short run (~{at_peak:.0f} s of compute at peak) would not win back a "
                "one-time compile of ~45 s"
            )
    return True, f"compiled on {device_type}: measured faster per step; the one-time compile is timed apart"


def _counters():
    from torch._dynamo.utils import counters

    return counters


def _dynamo_compile_seconds() -> float | None:
    """Seconds dynamo has spent compiling in this process (its own timer), if it exposes one."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return calculate_time_spent().get("total_wall_time")
    except (ImportError, AttributeError):
        return None


class CompileWatch:
    """Counts the graphs torch.compile builds inside the block (each recompile is one more) and
    the time spent: dynamo's own compile timer where it has one, and the block's wall time."""

    def __enter__(self):
        self._graphs0 = _counters()["stats"]["unique_graphs"]
        self._compile0 = _dynamo_compile_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_seconds = time.perf_counter() - self._t0
        self.graphs = _counters()["stats"]["unique_graphs"] - self._graphs0
        end = _dynamo_compile_seconds()
        self.compile_seconds = end - self._compile0 if end is not None and self._compile0 is not None else None
        return False

    @property
    def seconds(self) -> float:
        """Compile seconds: dynamo's timer, or (where torch has none) the block's wall time."""
        return self.compile_seconds if self.compile_seconds is not None else self.wall_seconds

    def describe(self) -> str:
        return f"{self.graphs} graph(s) compiled in {self.seconds:.1f} s" if self.graphs else "nothing compiled"
