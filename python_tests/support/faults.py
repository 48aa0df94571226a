"""
Faults injected into a training run from outside the package, for the reliability tests: a
preemption (a real SIGTERM, the signal a scheduler sends), a NaN loss, or a stuck rank (SIGSTOP, as
a frozen node), at a chosen step; or every step made slower.

In-process, as context managers around a script's main():
    with preempt_at_step(6):
        base_train.main(argv)
As a process (run_script's `faults`, also under torchrun, one per rank):
    python python_tests/support/faults.py -- --preempt-at-step=6 base_train ARGS
    python -m torch.distributed.run ... python_tests/support/faults.py -- --nan-at-step=5 base_train ARGS
(`--`: torchrun would read the options after the script path as its own.)
Both wrap functions the training loop looks up at each step (train/training_loop.py), and restore them.
preempted_and_resumed: a run stopped that way and resumed ends where an uninterrupted one does.
"""

import argparse
import importlib
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from nanochat_fast.core import cli
from nanochat_fast.train import training_loop
from support.tiny_pipeline import last_model_state, train_rows


@contextmanager
def _replaced(name: str, wrap):
    real = getattr(training_loop, name)
    setattr(training_loop, name, wrap(real))
    try:
        yield
    finally:
        setattr(training_loop, name, real)


@contextmanager
def preempt_at_step(step: int):
    """SIGTERM to this process when the loop, at `step`, asks whether to stop (not at the step a
    run resumes from): the loop's own handler takes it, so it saves and exits 0 as under a scheduler."""

    def wrap(preemption_agreed):
        def agreed(s):
            if s.run.state.step == step > s.start_step:
                signal.raise_signal(signal.SIGTERM)  # the calling thread: handled before the check below
            return preemption_agreed(s)

        return agreed

    with _replaced("preemption_agreed", wrap):
        yield


@contextmanager
def stop_at_step(step: int, rank: int = 1):
    """SIGSTOP to this process when it is `rank` of torchrun's first attempt and the loop, at `step`,
    asks whether to stop: the other ranks then wait for it in that collective (a frozen node). A
    restarted attempt (TORCHELASTIC_RESTART_COUNT > 0) runs on."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    armed = first_attempt and os.environ.get("RANK") == str(rank)

    def wrap(preemption_agreed):
        def agreed(s):
            if armed and s.run.state.step == step:
                os.kill(os.getpid(), signal.SIGSTOP)
            return preemption_agreed(s)

        return agreed

    with _replaced("preemption_agreed", wrap):
        yield


@contextmanager
def slow_steps(seconds: float, world_size: int | None = None):
    """Every step `seconds` longer (a sleep where the loop asks whether to stop), or only while the job
    runs on `world_size` processes: a tiny run that lasts long enough for a test to act on it mid-run."""

    def wrap(preemption_agreed):
        def agreed(s):
            if world_size in (None, s.run.world_size):
                time.sleep(seconds)
            return preemption_agreed(s)

        return agreed

    with _replaced("preemption_agreed", wrap):
        yield


@contextmanager
def nan_loss_at_step(step: int):
    """The loss of every micro-batch of `step` times NaN, once (a one-off fault: a step skipped by
    --skip-nonfinite is retried cleanly)."""
    state = {"armed": False, "done": False}

    def wrap_step(optimizer_step):
        def step_once(s):
            state["armed"] = s.run.state.step == step and not state["done"]
            state["done"] = state["done"] or state["armed"]
            try:
                return optimizer_step(s)
            finally:
                state["armed"] = False

        return step_once

    def wrap_loss(micro_batch_loss):
        def loss(model, batch):
            value = micro_batch_loss(model, batch)
            return value * float("nan") if state["armed"] else value

        return loss

    with _replaced("optimizer_step", wrap_step), _replaced("micro_batch_loss", wrap_loss):
        yield


def preempted_and_resumed(main, args: list[str], runs: Path, step: int, capsys, while_stopped=None):
    """The training run main(args) to its end as run "full" in the folder `runs`, and as run "part"
    stopped by a SIGTERM at `step` and resumed with --resume=auto (while_stopped() in between): both
    end on the same weights, bit for bit. Returns the train rows of the two runs' metrics."""
    assert main(args + ["--run=full"]) == 0
    with preempt_at_step(step):
        assert main(args + ["--run=part"]) == 0
    assert f"stopped by SIGTERM at step {step}" in capsys.readouterr().out
    if while_stopped is not None:
        while_stopped()
    assert main(args + ["--run=part", "--resume=auto"]) == 0
    full, part = last_model_state(runs / "full"), last_model_state(runs / "part")
    assert all(torch.equal(full[k], part[k]) for k in full)
    return train_rows(runs / "full"), train_rows(runs / "part")


def main(argv: list[str]):
    p = argparse.ArgumentParser(prog="python_tests/support/faults.py", allow_abbrev=False)
    p.add_argument("--preempt-at-step", type=int)
    p.add_argument("--nan-at-step", type=int)
    p.add_argument("--stop-at-step", type=int, help="rank 1 of the first attempt stops itself (SIGSTOP) there")
    p.add_argument("--step-seconds", type=float, help="every step this much longer")
    p.add_argument("--slow-world-size", type=int, help="--step-seconds only on this many processes")
    p.add_argument("script", help="a module of nanochat_fast.scripts, e.g. base_train")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    script = importlib.import_module(f"nanochat_fast.scripts.{a.script}")
    with (
        preempt_at_step(a.preempt_at_step) if a.preempt_at_step is not None else nullcontext(),
        nan_loss_at_step(a.nan_at_step) if a.nan_at_step is not None else nullcontext(),
        stop_at_step(a.stop_at_step) if a.stop_at_step is not None else nullcontext(),
        slow_steps(a.step_seconds, a.slow_world_size) if a.step_seconds is not None else nullcontext(),
    ):
        cli.run(script.main, a.args)  # as `python -m` runs it: one line for a UserError, the exit code


if __name__ == "__main__":
    main(sys.argv[1:])
