"""
What a run leaves behind besides checkpoints: metrics.jsonl (one JSON object per logged event),
loss.png (train/val loss and tokens/s) and report.md (config, hardware, backends, results, timing).
Only rank 0 writes these.
"""
import json
import os
import platform
import time
from pathlib import Path

import torch

from .checkpoint import _write_bytes


class MetricsLog:
    """Append-only JSONL log. On resume from step k, rows logged after step k by the run that was
    interrupted are dropped, so the file describes exactly one history."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            _write_bytes(self.path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))
        elif resume_step is None:
            self.path.unlink(missing_ok=True)

    def log(self, **row):
        row.setdefault("time", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

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
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_png)


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} CPU cores"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    elif torch.backends.mps.is_available():
        desc += ", Apple MPS"
    return desc


def _table(d: dict) -> list[str]:
    return ["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in d.items()]


def write_report(path: Path, *, title: str, args: dict, model_config: dict, backends: dict,
                 results: dict, timing: dict, world_size: int):
    lines = [f"# {title}", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M:%S')} by nanochat_fast; torch {torch.__version__}.", "",
             "## Hardware", "", f"{hardware()}; {world_size} process(es).", "",
             "## Results", "", *_table(results), "",
             "## Timing", "", *_table(timing), "",
             "## Kernels (backend per op on this device)", "", *_table(backends), "",
             "## Model", "", *_table(model_config), "",
             "## Arguments", "", *_table(args), ""]
    _write_bytes(Path(path), lambda f: f.write("\n".join(lines).encode()))
