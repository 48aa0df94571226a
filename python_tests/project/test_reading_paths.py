"""
ARCHITECTURE.md's "Reading paths": every listed file exists, each path has the count its heading
says and stays within its bound, and real runs go through no other module of the package: a Muon
step (traced, after the first step resolved its kernel), a checkpoint saved and resumed (traced),
a chat reply's decode steps (traced, with the C++ ops they run).
"""

import re
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.repo_paths import ROOT

PACKAGE = ROOT / "nanochat_fast"
TOP_LEVEL = ("csrc/", "benchmarks/", "python_tests/")
BOUNDS = {  # the most files each path may take
    "A Muon step": 4,
    "A checkpoint saved": 6,
    "One chat request": 12,
    "The dtype decider": 1,
    "Adding a kernel": 6,
}
EXAMPLE_KERNEL = "softcap_cross_entropy"  # a kernel added by the recipe: its NAME files exist
# what a call of an op asks the registry once its backend is resolved: the setting read, the choice looked up
# (no backend's availability checked again: registry._resolve is not among them)
REGISTRY_LOOKUPS = {"select", "select_for_inputs", "_choose", "requested", "parse_request", "triton_interpreting"}


def reading_paths() -> dict[str, tuple[int, list[str]]]:
    """heading -> (the count it states, the files its list names, in order)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Reading paths\n", 1)[1].split("\n## ", 1)[0]
    paths = {}
    for block in section.split("\n### ")[1:]:
        heading, body = block.split("\n", 1)
        title, count = re.fullmatch(r"(.+): (\d+) files?", heading).groups()
        paths[title] = (int(count), re.findall(r"^- `([^`]+)`", body, flags=re.M))
    return paths


def path_of(name: str, kernel: str = EXAMPLE_KERNEL) -> Path:
    name = name.replace("NAME", kernel)
    return ROOT / name if name.startswith(TOP_LEVEL) else PACKAGE / name


def files_of(title_start: str) -> list[str]:
    [files] = [files for title, (_, files) in reading_paths().items() if title.startswith(title_start)]
    return files


def test_every_path_is_listed_counted_and_within_its_bound():
    paths = reading_paths()
    assert sorted(title.split(",")[0].split(" (")[0] for title in paths) == sorted(BOUNDS)
    for title, (count, files) in paths.items():
        bound = next(b for start, b in BOUNDS.items() if title.startswith(start))
        assert len(files) == count <= bound, (title, files)
        assert len(set(files)) == len(files), title
        for name in files:
            assert path_of(name).is_file(), f"{title}: {name} does not exist"


def package_file(code) -> str | None:
    """`code`'s file relative to nanochat_fast/ (None outside the package)."""
    path = Path(code.co_filename)
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None


@contextmanager
def tracing(calls: defaultdict):
    """Record {package file: {function names}} of every Python call made while active."""

    def profile(frame, event, arg):
        name = package_file(frame.f_code) if event == "call" else None
        if name:
            calls[name].add(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def test_a_muon_step_runs_in_the_listed_files_with_its_kernel_resolved_once():
    from nanochat_fast import optim

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(64, 128))]
    muon = optim.Muon(params, lr=0.02, ns_dtype="fp32")

    def step():
        for p in params:
            p.grad = torch.randn_like(p)
        optim.step([muon], grad_clip=1.0)

    step()  # the first step resolves the backend
    calls = defaultdict(set)
    with tracing(calls):
        step()
    listed = set(files_of("A Muon step"))
    # the registry answers from what the first step resolved: a lookup, no backend checked again
    assert calls.pop("kernels/registry.py") <= REGISTRY_LOOKUPS
    assert set(calls) <= listed and {"optim/zero.py", "optim/muon.py", "kernels/newton_schulz.py"} <= set(calls)


def test_a_checkpoint_is_saved_and_resumed_in_the_listed_files(home, monkeypatch):
    """A run saves at its end, a second resumes from it: the save and every step of the resume
    (the run directory opened, the checkpoint verified and read, the state put back) run in the
    listed files, and in each of them. What a component puts in is its own state_dict: the loader's
    position and Muon's buffers."""
    from support.tiny_pipeline import TINY_LOOP, TINY_MODEL

    from nanochat_fast import checkpoints
    from nanochat_fast.scripts import base_train
    from nanochat_fast.train import stage, training_loop

    calls = defaultdict(set)
    component_state = {"data/dataloader.py", "optim/muon.py"}

    def traced(fn):
        def call(*args, **kwargs):
            with tracing(calls):
                return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(training_loop, "save", traced(training_loop.save))
    monkeypatch.setattr(stage, "restore", traced(stage.restore))
    monkeypatch.setattr(checkpoints, "open_run_dir", traced(checkpoints.open_run_dir))
    monkeypatch.setattr(checkpoints, "load_model_state", traced(checkpoints.load_model_state))
    args = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=256", "--eval-every=-1"]
    args += ["--no-compile", "--run=r"]
    assert base_train.main(args + ["--num-iterations=2"]) == 0
    assert base_train.main(args + ["--num-iterations=3", "--resume=auto"]) == 0
    assert "save_checkpoint" in calls["checkpoints/checkpoint.py"] and "restore" in calls["train/run_state.py"]
    assert set(calls) - component_state == set(files_of("A checkpoint saved")), dict(calls)


@pytest.mark.parametrize("arch", ["gpt", "windowed"])
def test_a_chat_replys_decode_steps_run_in_the_listed_files(tiny_home, arch):
    """The replica's side of a request (the server's side, app.py and pool.py, hands it over):
    reply_request, then the engine's steps until the reply ends, in the listed Python files, and
    C++ ops whose CPU kernels are in the listed C++ files; for both families."""
    from support.tiny_gpt import random_model
    from support.tiny_pipeline import home_env

    from nanochat_fast.data.tokenizer import get_tokenizer
    from nanochat_fast.kernels import registry
    from nanochat_fast.model import generation, loading
    from nanochat_fast.model.batch_engine import BatchEngine
    from nanochat_fast.model.gpt import GPTConfig

    if registry.extension() is None:
        pytest.skip("extension not built")
    with home_env(tiny_home):
        tokenizer = get_tokenizer()
    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2)
    if arch == "windowed":
        torch.manual_seed(0)
        model = loading.new_model(loading.family_config(config, "windowed", "SL"), "cpu").eval()
    else:
        model = random_model(config).eval()
    engine = BatchEngine(model, tokenizer, slots=2)

    class Job:
        messages, max_tokens, temperature, top_k, seed = [{"role": "user", "content": "hello"}], 6, 0.0, None, 1
        top_p = prompt = None

    def reply():
        request, decode, *_ = generation.reply_request(model, tokenizer, Job)
        engine.add(request)
        while engine.active:
            for token in engine.step():
                decode(token.token)

    reply()  # the first reply resolves the kernels and packs the weights
    calls = defaultdict(set)
    with torch.profiler.profile() as profiler, tracing(calls):
        reply()
    listed = files_of("One chat request")
    # the registry answers from what the first reply resolved: a lookup, no backend checked again
    assert calls.pop("kernels/registry.py", set()) <= REGISTRY_LOOKUPS
    assert set(calls) <= set(listed)
    ops = {e.name.split("::")[1] for e in profiler.events() if e.name.startswith("nanochat_fast::")}
    assert {"decode_block", "packed_linear", "rms_norm", "softcap"} <= ops
    assert ("smear_decode" in ops) == (arch == "windowed")
    cpp = {name for name in listed if name.startswith("csrc/")}
    for op in ops:
        [source] = [p for p in (ROOT / "csrc").glob("*_cpu.cpp") if f'm.impl("{op}"' in p.read_text()]
        assert source.relative_to(ROOT).as_posix() in cpp, op
