"""
Pretrain a GPT on the prepared text corpus (the nanochat base_train, runnable anywhere).

    python -m nanochat_fast.scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 \\
        --total-batch-size=8192 --num-iterations=200
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.base_train -- --depth=20

Two loops, as in nanochat: each optimizer step accumulates gradients over
grad_accum_steps = total_batch_size // (device_batch_size * max_seq_len * world_size) micro-steps.
The horizon comes from --num-iterations, else --target-flops, else --target-param-data-ratio
(Chinchilla-style tokens:params). Outputs go to NANOCHAT_FAST_HOME/runs/<run>/ (or --out-dir):
checkpoints, metrics.jsonl, loss.png and report.md. Stop it any time with Ctrl-C or SIGTERM: it
finishes the step, saves, and says how to resume (--resume auto; bit for bit on one CPU process
with --deterministic).
"""

from ..core import cli
from ..train import next_steps
from ..train.stage import NewModel, Stage, complete_prompts, fixed_horizon, run_stage
from ..train.stage_data import TOKEN_ROWS
from ..train.training_config import DataConfig, HorizonConfig, ModelConfig, add_training_flags

DEFAULT_PROMPTS = ["The king said", "In the beginning", "To be, or not to be", "The whale"]

BASE = Stage(
    phase="base",
    title="base training",
    start=NewModel(),  # fresh weights from the depth dial
    data=TOKEN_ROWS,  # packed prose rows of --dataset (default: base), every token trained on
    horizon=fixed_horizon,  # --num-iterations | --target-flops | --target-param-data-ratio
    sample=complete_prompts(DEFAULT_PROMPTS),
    next_step=lambda run_dir: next_steps.command("base_eval", next_steps.run_flag(run_dir)),
    run_name=lambda cfg, start: f"base_{start.name}",
)


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.base_train", description=__doc__)
    ModelConfig.add_flags(p)
    DataConfig.add_flags(p, dataset="base")
    HorizonConfig.add_flags(p, target_param_data_ratio=20.0)
    add_training_flags(p, eval_every=250, sample_every=2000)
    return p


def main(argv=None) -> int:
    return run_stage(build_parser().parse_args(argv), BASE)


if __name__ == "__main__":
    cli.run(main)
