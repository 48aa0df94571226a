"""base_train --arch=windowed on 2 gloo processes gives the losses of 1 process (fp32), under zero2
and under --sharding=fsdp, and a run stopped and resumed ends with the weights of one that was not."""

import shutil

import torch
from support.tiny_pipeline import FP32, TINY_MODEL, last_model_state, run_script, train_rows

ARGS = (
    TINY_MODEL
    + FP32
    + [
        "--arch=windowed",
        "--window-pattern=SL",
        "--eval-tokens=512",
        "--sample-every=-1",
        "--eval-every=-1",
        "--device-batch-size=4",
        "--total-batch-size=512",
        "--num-iterations=6",
        "--warmup-steps=2",
        "--no-compile",
    ]
)


def losses(run_dir):
    return torch.tensor([r["loss"] for r in train_rows(run_dir)], dtype=torch.float64)


def run(home, name, nproc=1, extra=(), faults=()):
    proc = run_script("base_train", ARGS + [f"--run={name}", *extra], home, nproc=nproc, timeout=600, faults=faults)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return home / "runs" / name


def test_two_processes_train_as_one_and_a_resume_is_exact(tiny_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(tiny_home, home)
    one = run(home, "one")
    reference = losses(one)
    assert len(reference) == 6 and reference[-1] < reference[0]
    for name, extra in (("zero2", ()), ("fsdp", ("--sharding=fsdp",))):
        two = losses(run(home, name, nproc=2, extra=extra))
        assert ((two - reference).abs() / reference).max() < 1e-5, (name, two, reference)
    # stopped by a SIGTERM at step 3 (its checkpoint), resumed: the weights of the run that went through
    run(home, "resumed", faults=["--preempt-at-step=3"])
    assert len(train_rows(home / "runs" / "resumed")) < 6
    run(home, "resumed", extra=("--resume=auto",))
    whole, resumed = last_model_state(one), last_model_state(home / "runs" / "resumed")
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k
