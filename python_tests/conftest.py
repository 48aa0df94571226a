"""Shared test setup: private compile caches, an isolated NANOCHAT_FAST_HOME, the `gpu` marker. What the
tests share lives in the support package (support/__init__.py)."""

import atexit
import os
import shutil
import tempfile

import pytest
import support  # noqa: F401,E402  (puts python_tests/ on PYTHONPATH for the processes the tests start)
import torch

# Without a GPU the Triton kernels run on CPU tensors in the interpreter. TRITON_INTERPRET must be set
# before anything imports triton.language (its own functions, tl.zeros and the like, are interpreted
# or not from then on), so here, for the whole session, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's cache defaults to a directory in /tmp shared by every user: keep ours private.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"nanochat_fast_inductor_{os.getuid()}")
)
# Nothing a test runs writes to the user's NANOCHAT_FAST_HOME (e.g. the hardware caches of an
# optimizer measuring its dtype); tests that need a prepared home set their own.
os.environ["NANOCHAT_FAST_HOME"] = tempfile.mkdtemp(prefix="nanochat_fast_test_home_")
# removed when the session ends, so a day of test runs leaves no homes behind in /tmp
atexit.register(shutil.rmtree, os.environ["NANOCHAT_FAST_HOME"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nanochat_home(tmp_path, monkeypatch):
    """A fresh NANOCHAT_FAST_HOME for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    """A prepared NANOCHAT_FAST_HOME (tiny corpus + conversations, 320-token tokenizer), built once."""
    from support.tiny_pipeline import build_tiny_home

    return build_tiny_home(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def home(tiny_home, tmp_path, monkeypatch):
    """A private copy of tiny_home, set as NANOCHAT_FAST_HOME for this test."""
    from support.tiny_pipeline import private_home

    return private_home(tiny_home, tmp_path / "home", monkeypatch)
