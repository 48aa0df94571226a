"""
torch.compile for training: whether to compile by default (default_compile: CUDA and CPU, unless the
run is too short to win back the one-time compile; MPS stays eager), and CompileWatch, which says
what was compiled inside a block and what it cost. Evaluation and sampling use the plain module, so
they never recompile: docs/measurements.md#compile-policy.
"""

import time

# about where the per-step saving pays back a cold compile: docs/measurements.md#compile-policy
MIN_RUN_SECONDS_AT_PEAK = 100.0


def default_compile(
    device_type: str, run_flops: float | None = None, peak_flops: float | None = None
) -> tuple[bool, str]:
    """--compile's default and its reason. run_flops: the run's training FLOPs (None: the horizon is
    unknown); peak_flops: the peak of all processes."""
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


def _dynamo_compile_seconds() -> float | None:
    """Seconds dynamo has spent compiling in this process, if its timer is there."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return calculate_time_spent().get("total_wall_time")
    except (ImportError, AttributeError):
        return None


class CompileWatch:
    """The graphs torch.compile builds inside the block (a recompile is one more) and the seconds:
    dynamo's own timer, else the block's wall time."""

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._counters = counters
        self._graphs0 = counters["stats"]["unique_graphs"]
        self._compile0 = _dynamo_compile_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_seconds = time.perf_counter() - self._t0
        self.graphs = self._counters["stats"]["unique_graphs"] - self._graphs0
        end = _dynamo_compile_seconds()
        self.compile_seconds = end - self._compile0 if end is not None and self._compile0 is not None else None
        return False

    @property
    def seconds(self) -> float:
        return self.compile_seconds if self.compile_seconds is not None else self.wall_seconds

    def describe(self) -> str:
        return f"{self.graphs} graph(s) compiled in {self.seconds:.1f} s" if self.graphs else "nothing compiled"
