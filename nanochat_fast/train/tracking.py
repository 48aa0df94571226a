"""
Experiment tracking, optional: every row the run logs to metrics.jsonl also goes to wandb
(--wandb=PROJECT, `pip install "nanochat_fast[wandb]"`) and/or TensorBoard event files in the run
folder (--tensorboard, `pip install "nanochat_fast[tensorboard]"`), under nanochat's metric names:

    train rows   smooth_loss -> train/loss (nanochat logs the debiased smoothed loss under it),
                 loss -> train/raw_loss, lrm, dt, tok_per_sec, mfu (percent, as nanochat's) and
                 grad_norm -> train/<same name>, tokens_seen -> total_training_tokens; chat_rl's
                 reward -> reward, seq_len -> sequence_length
    eval rows    val_bpb -> val/bpb; a stage's own evaluations under their own names (chat_rl's
                 pass@k as nanochat's)

Off by default: with neither flag no tracker is made and neither package imported. Only rank 0 logs
(the trackers hang on MetricsLog, which only rank 0 has). A missing package is a one-line UserError
naming the extra, raised while the flags are checked. wandb's run name is --run, its config the
run's settings; WANDB_MODE=offline keeps it on this machine (the run folder's wandb/).
"""

import importlib.util
import math
from pathlib import Path

from ..core.errors import UserError

TRAIN_NAMES = {
    "smooth_loss": "train/loss",
    "loss": "train/raw_loss",
    "lrm": "train/lrm",
    "dt": "train/dt",
    "tok_per_sec": "train/tok_per_sec",
    "mfu": "train/mfu",
    "grad_norm": "train/grad_norm",
    "tokens_seen": "total_training_tokens",
    "reward": "reward",
    "seq_len": "sequence_length",
}
EVAL_NAMES = {"val_bpb": "val/bpb"}
PACKAGES = {"wandb": ("wandb", "wandb", "--wandb"), "tensorboard": ("tensorboard", "tensorboard", "--tensorboard")}


def require(what: str):
    """UserError unless the package behind --wandb / --tensorboard is installed."""
    module, extra, flag = PACKAGES[what]
    if importlib.util.find_spec(module) is None:
        raise UserError(f'{flag} needs the {module} package: pip install "nanochat_fast[{extra}]"')


def tracked_metrics(row: dict) -> dict:
    """A metrics.jsonl row's numbers under nanochat's names ({} for rows nanochat has no name for)."""
    kind = row.get("kind")
    if kind == "train":
        names = TRAIN_NAMES
    elif kind == "eval":
        names = {k: EVAL_NAMES.get(k, k) for k in row if k not in ("kind", "step", "time")}
    else:
        return {}
    return {
        names[k]: float(v)
        for k, v in row.items()
        if k in names and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbTracker:
    def __init__(self, project: str, run_name: str, run_dir: Path, config: dict):
        import wandb

        try:
            self.run = wandb.init(project=project, name=run_name, config=config, dir=str(run_dir))
        except Exception as e:  # no API key, no network, a bad setting: what wandb says, in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"--wandb: wandb could not start a run ({first}); run `wandb login`, or set "
                "WANDB_MODE=offline to keep the run on this machine"
            ) from None

    def log(self, step: int, metrics: dict):
        self.run.log({"step": step, **metrics}, step=step)

    def close(self):
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict):
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self):
        self.writer.close()


class Trackers:
    """The trackers a run asked for (possibly none): log(row) hands each a row's metrics."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, row: dict):
        metrics = tracked_metrics(row) if self.trackers else {}
        if metrics:
            for tracker in self.trackers:
                tracker.log(int(row.get("step", 0)), metrics)

    def close(self):
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def open_trackers(wandb_project: str, tensorboard: bool, run_name: str, run_dir: Path, config: dict) -> Trackers:
    trackers = []
    if wandb_project:
        require("wandb")
        trackers.append(WandbTracker(wandb_project, run_name, run_dir, config))
    if tensorboard:
        require("tensorboard")
        trackers.append(TensorBoardTracker(run_dir))
    return Trackers(trackers)
