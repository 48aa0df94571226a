"""
Optional experiment tracking: every row rank 0 logs to metrics.jsonl also goes to wandb (--wandb=
PROJECT; WANDB_MODE=offline keeps it local) and/or TensorBoard event files in the run folder
(--tensorboard), under nanochat's metric names. Without either flag nothing is made or imported; a
missing package is a one-line UserError naming the extra, raised while the flags are checked.
"""

import importlib.util
import math
from pathlib import Path

from ..core.errors import UserError

TRAIN_NAMES = {
    "smooth_loss": "train/loss",  # nanochat logs the debiased smoothed loss under it
    "loss": "train/raw_loss",
    "lrm": "train/lrm",
    "dt": "train/dt",
    "tok_per_sec": "train/tok_per_sec",
    "mfu": "train/mfu",  # percent, as nanochat's
    "grad_norm": "train/grad_norm",
    "tokens_seen": "total_training_tokens",
    "reward": "reward",
    "seq_len": "sequence_length",
}
EVAL_NAMES = {"val_bpb": "val/bpb"}  # a stage's own evaluations (chat_rl's pass@k) keep their names
PACKAGES = {  # what: (module, pip extra, flag)
    "wandb": ("wandb", "wandb", "--wandb"),
    "tensorboard": ("tensorboard", "tensorboard", "--tensorboard"),
}


def require(what: str):
    """UserError unless the package behind --wandb / --tensorboard is installed."""
    module, extra, flag = PACKAGES[what]
    if importlib.util.find_spec(module) is None:
        raise UserError(f'{flag} needs the {module} package: pip install "nanochat_fast[{extra}]"')


def tracked_metrics(row: dict) -> dict:
    """A metrics.jsonl row's numbers under nanochat's names ({} for other kinds of rows)."""
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


def open_trackers(run_config, run_name: str, run_dir: Path, config: dict) -> list:
    """The trackers run_config asks for (--wandb, --tensorboard; RunConfig checked their packages)."""
    trackers = []
    if run_config.wandb:
        trackers.append(WandbTracker(run_config.wandb, run_name, run_dir, config))
    if run_config.tensorboard:
        trackers.append(TensorBoardTracker(run_dir))
    return trackers
