"""
What the training loop prints while it trains: one line per step (describe_step, from the
StepRecord of what the step measured; the same step's metrics row comes with it), on a tqdm bar
when attached to a terminal, as plain lines otherwise (Progress).
"""

import sys
from dataclasses import dataclass, field

import torch

from .. import hardware
from ..core.progress import progress_bar


class Progress:
    """A tqdm bar when attached to a terminal, plain lines otherwise (logs, CI, torchrun). Only
    the enabled process (rank 0) prints."""

    def __init__(self, total: int | None, initial: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = progress_bar(total=total, initial=initial, unit="step")
        self.enabled = enabled

    def step(self, line: str, postfix: str):
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
        else:
            self.write(line)

    def write(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


@dataclass
class StepRecord:
    """What one finished step measured."""

    step: int  # steps done, this one included
    num_iterations: int | None  # the horizon in steps (None: until the data's epoch is done)
    loss: float
    grad_norm: float
    lrm: float  # the learning-rate multiplier of the schedule
    dt: float  # seconds, a compile inside the step left out
    tokens: int  # input tokens of the step on all ranks
    smooth_loss: float  # the debiased EMA of the loss
    eta_seconds: float | None
    tokens_seen: int
    extra: dict = field(default_factory=dict)  # the loader's own figures of the step (chat_rl: reward, ...)


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def describe_step(m: StepRecord, flops_per_token: float, peak: hardware.Peak | None, world_size: int):
    """The step's log line, progress-bar postfix and metrics row. `peak`: one process's (None:
    MFU n/a); the line leaves it out, the run's summary names it once."""
    tok_per_sec = m.tokens / m.dt
    mfu = hardware.mfu(flops_per_token, tok_per_sec, peak, world_size) if peak is not None else None
    mfu_text = hardware.mfu_text(flops_per_token, tok_per_sec, peak, world_size, against=False)
    total = f"/{m.num_iterations}" if m.num_iterations else ""
    eta = f" | eta {format_eta(m.eta_seconds)}" if m.eta_seconds is not None else ""
    extra = "".join(f" | {k.replace('_', ' ')} {v:.4g}" for k, v in m.extra.items())
    line = (
        f"step {m.step:05d}{total} | loss {m.loss:.4f}{extra} | lrm {m.lrm:.3f} | dt {m.dt * 1000:.0f}ms | "
        f"tok/s {tok_per_sec:,.0f} | {mfu_text}{eta}"
    )
    postfix = f"loss {m.loss:.3f}{extra.replace(' | ', ' ')} tok/s {tok_per_sec:,.0f}"
    row = dict(
        kind="train",
        step=m.step,
        loss=m.loss,
        smooth_loss=m.smooth_loss,
        lrm=m.lrm,
        grad_norm=m.grad_norm,
        dt=m.dt,
        tok_per_sec=tok_per_sec,
        mfu=mfu,
        tokens_seen=m.tokens_seen,
        **m.extra,
    )
    if torch.cuda.is_initialized():  # this process's GPU: what a larger batch or model has left to grow into
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return line, postfix, row
