"""
torch.compile for training: whether to compile by default, and a context that says what was
compiled inside it and what that cost.

Guards decide which compiled graph a call may reuse. The training step calls the model with grad
enabled, in train() mode, with loss_reduction="sum" and one input shape. Evaluation called through
the compiled model changes three guarded facts at once (grad mode, the modules' training flag,
loss_reduction) and compiles a second graph, at the cost of a full compile; each further input
shape (a short last batch; every length while sampling with a KV cache) compiles another with
dynamic=False, until torch._dynamo.config.recompile_limit (8) makes the rest run eagerly. The
training graph itself stays cached and is not recompiled after evaluation. So evaluation and
sampling go through the plain module (orig_model): no compile cost, no recompiles, and eager
evaluation is the cheaper choice unless a run evaluates very often (benchmarks/compile_evidence.py
measures both).

    with CompileWatch() as watch:
        loss = compiled_model(x, y)
    print(watch.describe())   # "1 graph(s) compiled in 23.4 s"
"""
import time

import torch


def default_compile(device_type: str) -> tuple[bool, str]:
    """--compile's default for a device type, with the reason (for the log and the run report).
    CUDA and CPU: compiled, where a whole training step measured faster compiled (numbers in
    benchmarks/compile_evidence.py's docstring); MPS: eager (inductor's MPS backend was not
    measured faster here)."""
    if device_type == "cuda":
        return True, "compiled on CUDA (fused kernels, fewer launches)"
    if device_type == "cpu":
        return True, "compiled on CPU (measured faster per step; the one-time compile is logged apart)"
    return False, f"eager on {device_type} (compiling was not measured faster there)"


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


def fail_on_recompile():
    """A context in which any recompile raises (torch.compiler.set_stance): for tests that check
    that evaluation and sampling leave the training graph alone."""
    return torch.compiler.set_stance("fail_on_recompile")
