"""The backend choice: resolved once per (op, device type, setting) and then only looked up, a changed
NANOCHAT_FAST_KERNELS or TRITON_INTERPRET seen at once, the cpp backend available where torch's dispatcher
has the op's kernel, and the package importable without Triton."""

import subprocess
import sys

import pytest
import torch

from nanochat_fast.kernels import KernelUnavailableError, registry


def test_a_choice_is_resolved_once_and_follows_the_environment(monkeypatch):
    asked = []
    impl = registry.backends("softcap_cross_entropy")["torch"]
    counted = registry.Backend(impl.op, impl.name, impl.fn, lambda d: asked.append(d) or impl.why_not(d))
    monkeypatch.setitem(registry._OPS["softcap_cross_entropy"], "torch", counted)
    monkeypatch.setattr(registry, "_CHOSEN", {})
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "softcap_cross_entropy=torch")
    for _ in range(5):
        assert registry.select("softcap_cross_entropy", "cpu") is counted
    assert asked == ["cpu"]  # asked once, then looked up
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "softcap_cross_entropy=reference")
    assert registry.select("softcap_cross_entropy", "cpu").name == "reference"
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "softcap_cross_entropy=triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.select("softcap_cross_entropy", "cpu").name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="CPU tensors need TRITON_INTERPRET=1"):
        registry.select("softcap_cross_entropy", "cpu")


@pytest.mark.skipif(registry.extension() is None, reason="extension not built")
def test_cpp_runs_where_the_dispatcher_has_the_ops_kernel():
    for op in registry.ops():
        if "cpp" in registry.backends(op):
            has_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(f"nanochat_fast::{op}", "CPU")
            assert has_cpu and registry.cpp_why_not(op, "cpu") is None, op
            has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"nanochat_fast::{op}", "CUDA")
            assert (registry.cpp_why_not(op, "cuda") is None) == has_cuda, op
            assert registry.cpp_why_not(op, "mps") == "no compiled kernel for mps"
    assert registry.backends("pack_rows")["cpp"].why_not("cuda") is None  # packing runs on the host


def test_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # as if Triton were not installed
        "import torch\n"
        "from nanochat_fast.kernels import newton_schulz, registry, softcap_cross_entropy\n"
        "print(registry.backends('newton_schulz')['triton'].why_not('cuda'))\n"
        "print(newton_schulz(torch.randn(8, 16)).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["triton is not installed", "torch.Size([8, 16])"]
