"""
What a run prints and leaves behind besides checkpoints, all written by rank 0: the summary before
its first step, the step's log line (on a tqdm bar in a terminal), metrics.jsonl (one JSON object
per logged event), loss.png and report.md (results, timing, hardware, precision and why, kernels,
model, every setting).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from .. import hardware as hw
from ..core import paths
from ..core.progress import progress_bar
from .tracking import tracked_metrics


class Progress:
    """A tqdm bar in a terminal, plain lines otherwise (logs, CI, torchrun); printed if enabled (rank 0)."""

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


def describe_step(row: dict, extra: dict, run, eta_seconds: float | None) -> tuple[str, str]:
    """The step's log line and progress-bar postfix, its row's mfu set. The peak (one process's;
    None: MFU n/a) is named once in the run's summary, not on every line."""
    tok_per_sec, peak = row["tok_per_sec"], run.peak
    if peak is not None:
        row["mfu"] = hw.mfu(run.flops_per_token, tok_per_sec, peak, run.world_size)
    mfu_text = hw.mfu_text(run.flops_per_token, tok_per_sec, peak, run.world_size, against=False)
    total = f"/{run.horizon.num_iterations}" if run.horizon.num_iterations else ""
    eta = ""
    if eta_seconds is not None:
        s = int(eta_seconds)
        eta = f" | eta {s // 3600}h{(s % 3600) // 60:02d}m" if s >= 3600 else f" | eta {s // 60}m{s % 60:02d}s"
    shown = "".join(f" | {k.replace('_', ' ')} {v:.4g}" for k, v in extra.items())
    line = (
        f"step {row['step']:05d}{total} | loss {row['loss']:.4f}{shown} | lrm {row['lrm']:.3f} | "
        f"dt {row['dt'] * 1000:.0f}ms | tok/s {tok_per_sec:,.0f} | {mfu_text}{eta}"
    )
    if torch.cuda.is_initialized():  # this process's GPU: what a larger batch or model has left to grow into
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return line, f"loss {row['loss']:.3f}{shown.replace(' | ', ' ')} tok/s {tok_per_sec:,.0f}"


class MetricsLog:
    """Append-only JSONL log; on resume from step k, the rows the interrupted run logged after step k
    are dropped: the file describes exactly one history."""

    def __init__(self, path: Path, resume_step: int | None = None, trackers=()):
        self.path = Path(path)
        self.trackers = list(trackers)  # tracking.open_trackers' (wandb, TensorBoard): each row goes there too
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [row for row in self.rows() if row.get("step", 0) <= resume_step]
            paths.write_durably(self.path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))

    def log(self, **row):
        row.setdefault("time", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        metrics = tracked_metrics(row) if self.trackers else {}
        if metrics:
            for tracker in self.trackers:
                tracker.log(int(row.get("step", 0)), metrics)

    def close(self):
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict], out_png: Path, title: str):
    """train loss, val bpb and tokens/s against step, in one figure."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    val = [(r["step"], r["val_bpb"]) for r in rows if r.get("kind") == "eval"]
    speed = [(r["step"], r["tok_per_sec"]) for r in rows if r.get("kind") == "train" and r.get("tok_per_sec")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax1.plot(*zip(*train), label="train loss (nats)", lw=1)
    if val:
        ax1.plot(*zip(*val), "o-", label="val bits per byte", lw=1.5)
    ax1.set_xlabel("step")
    ax1.legend()
    ax1.grid(alpha=0.3)
    if speed:
        ax2.plot(*zip(*speed), lw=1, color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens / s (all ranks)")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    paths.replace_atomically(Path(out_png), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


def hardware() -> str:
    desc = f"{hw.cpu_model()}, {os.cpu_count()} CPU cores"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    elif torch.backends.mps.is_available():
        desc += ", Apple MPS"
    return desc


def device_summary(dev) -> dict:
    """What a run computes on, for its meta.json (the report card's cost: core-hours or GPU-hours)."""
    return {
        "type": dev.device.type,
        "processes": dev.world_size,
        "threads_per_process": torch.get_num_threads(),
        "hardware": hardware(),
    }


def write_report(path: Path, title: str, sections: dict):
    """report.md: a title, then a section per entry of `sections` (name -> a dict shown as a table, or text)."""
    lines = [
        f"# {title}",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')} by nanochat_fast; torch {torch.__version__}.",
        "",
    ]
    for name, body in sections.items():
        if isinstance(body, dict):
            body = "\n".join(["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in body.items()])
        lines += [f"## {name}", "", str(body), ""]
    paths.write_durably(Path(path), lambda f: f.write("\n".join(lines).encode()))


def summary(run, config, extra: dict) -> str:
    """What a run prints before its first step: where it writes, the model, the batch, the stage's lines."""
    per_rank = run.data.train.device_batch_size * run.data.train.seq_len
    lines = [
        f"run dir: {run.run_dir}",
        f"model: n_layer={config.n_layer} n_embd={config.n_embd} n_head={config.n_head} "
        f"n_kv_head={config.n_kv_head} vocab={config.vocab_size} seq_len={config.sequence_len}",
        f"parameters: {sum(p.numel() for p in run.orig_model.parameters()):,} | "
        f"FLOPs per token: {run.flops_per_token:.3e}",
        f"tokens per micro-batch per rank: {run.data.train.device_batch_size} x {run.data.train.seq_len} = "
        f"{per_rank:,} | {run.grad_accum_steps} gradient accumulation step(s) per optimizer step",
    ]
    return "\n".join(lines + [f"{k}: {v}" for k, v in extra.items()])


def finish_report(run, metrics: MetricsLog, title: str, wall_start: float, sections: dict):
    """loss.png, report.md (the stage's `sections` after the common ones) and the closing lines (rank 0)."""
    rows = metrics.rows()
    train_rows = [r for r in rows if r.get("kind") == "train"]
    speeds = sorted(r["tok_per_sec"] for r in train_rows)
    state = run.state
    results = {
        "steps": state.step,
        "tokens seen": f"{state.tokens_seen:,}",
        "final train loss (smoothed)": f"{train_rows[-1]['smooth_loss']:.4f}" if train_rows else "n/a",
        "val bpb at start": f"{state.first_val_bpb:.4f}" if state.first_val_bpb is not None else "n/a",
        "val bpb at end": f"{state.last_val_bpb:.4f}" if state.last_val_bpb is not None else "n/a",
        **{f"{k} (last eval)": f"{v:.4f}" for k, v in state.last_evals.items()},
        "median tokens/s": f"{speeds[len(speeds) // 2]:,.0f}" if speeds else "n/a",
        "skipped non-finite steps": state.nonfinite_skipped,
        "last checkpoint": str(run.last_checkpoint),
    }
    mfus = [r["mfu"] for r in train_rows if r.get("mfu") is not None]
    results["median MFU"] = f"{sorted(mfus)[len(mfus) // 2]:.1f}% (of {run.peak.describe()})" if mfus else "n/a"
    timing = {
        "training time (steps only)": f"{state.train_time:.1f} s",
        "torch.compile (one-time, not in the steps)": f"{state.compile_time:.1f} s" if run.compiled else "not compiled",
        "wall time of this invocation": f"{time.time() - wall_start:.1f} s",
    }
    dev = run.dev
    device = {"processes": run.world_size, "device": str(dev.device), "precision": dev.precision.describe()}
    plot(rows, run.run_dir / "loss.png", title)
    write_report(
        run.run_dir / "report.md",
        title,
        {
            "Results": results,
            "Timing": timing,
            "Hardware": f"{hardware()}; {run.world_size} process(es).",
            "Device and precision": device,
            "Kernels (backend per op on this device)": dev.kernels,
            "Model": run.meta["model_config"],
            **sections,
        },
    )
    print(
        f"val bpb: {results['val bpb at start']} at start -> {results['val bpb at end']} at step {state.step}; "
        f"median {results['median tokens/s']} tokens/s",
        flush=True,
    )
    print(f"report: {run.run_dir / 'report.md'}", flush=True)
