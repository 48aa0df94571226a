"""benchmarks/bench_vs_nanochat.py refuses, in one line and exit 2 before any timing, a nanochat checkout at
another commit (git's HEAD, or the files' content where it is no git checkout) and one whose base_train
cannot import. Fake checkouts in tmp folders; nothing is trained."""

import subprocess
import sys

import pytest
from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vs_nanochat as bench  # noqa: E402

MODEL = "class GPT: pass\n"


def fake_checkout(root, base_train="import os\n"):
    (root / "scripts").mkdir(parents=True)
    (root / "nanochat").mkdir()
    (root / "scripts" / "base_train.py").write_text(base_train)
    (root / "nanochat" / "gpt.py").write_text(MODEL)
    return root


def git_commit(root) -> str:
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def no_timing(monkeypatch):
    """Any timed run fails the test: refusals come before timing."""

    def timed(*args, **kwargs):
        raise AssertionError("a run was timed")

    monkeypatch.setattr(bench, "timed", timed)


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench.cli.run(bench.main, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_a_git_checkout_at_another_commit_is_named_and_refused(tmp_path, capsys, no_timing):
    head = git_commit(fake_checkout(tmp_path / "nanochat"))
    err = refusal(capsys, [f"--nanochat={tmp_path / 'nanochat'}", f"--home={tmp_path}"])
    assert f"is nanochat@{head[:7]}, not 92d63d4" in err and "git -C" in err


def test_the_gpt_familys_checkout_is_checked_against_its_own_commit(tmp_path, capsys, no_timing, monkeypatch):
    windowed = fake_checkout(tmp_path / "windowed")
    monkeypatch.setitem(
        bench.CHECKOUTS, "windowed", bench.Checkout("0" * 40, bench.content_sha256(windowed), ("float32",))
    )
    monkeypatch.setattr(bench, "smoke_test", lambda *args: None)
    head = git_commit(fake_checkout(tmp_path / "gpt"))
    argv = [f"--nanochat={windowed}", f"--nanochat-gpt={tmp_path / 'gpt'}", f"--home={tmp_path}"]
    assert f"--nanochat-gpt={tmp_path / 'gpt'} is nanochat@{head[:7]}, not 92c6654" in refusal(capsys, argv)


def test_files_that_differ_from_the_commit_are_refused_without_git(tmp_path, capsys, no_timing):
    checkout = fake_checkout(tmp_path / "nanochat")
    err = refusal(capsys, [f"--nanochat={checkout}", f"--home={tmp_path}"])
    assert "is not a git checkout" in err and "differ from nanochat@92d63d4" in err


def test_a_folder_that_is_no_checkout_is_refused(tmp_path, capsys, no_timing):
    assert "not a nanochat checkout" in refusal(capsys, [f"--nanochat={tmp_path}", f"--home={tmp_path}"])


def test_a_checkout_whose_imports_fail_is_refused_before_timing(tmp_path, capsys, no_timing, monkeypatch):
    # the right files (the expected content hash is this fake's) but a dependency missing here
    checkout = fake_checkout(tmp_path / "nanochat", "import os\nimport no_such_dependency_here\n")
    monkeypatch.setitem(
        bench.CHECKOUTS, "windowed", bench.Checkout("0" * 40, bench.content_sha256(checkout), ("float32",))
    )
    err = refusal(capsys, [f"--nanochat={checkout}", f"--home={tmp_path}"])
    assert "cannot run here" in err and "No module named 'no_such_dependency_here'" in err and "--pythonpath" in err


def test_the_smoke_test_passes_where_the_imports_work(tmp_path):
    bench.smoke_test(fake_checkout(tmp_path / "nanochat", "import os\nfrom nanochat.gpt import GPT\n"), "--x", "")


def test_the_gpt_familys_flags_are_its_configurators():
    cmd = bench.nanochat_cmd("gpt", 8, 200)
    assert "--max_seq_len=512" in cmd and "--device_batch_size=8" in cmd and "--num_iterations=200" in cmd
    assert "--eval_every=201" in cmd and not any(f.startswith("--window") for f in cmd)
