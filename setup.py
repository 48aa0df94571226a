# Builds nanochat_fast._C: the CPU ops in csrc/*.cpp always, plus csrc/cuda/* when the
# installed torch has CUDA, nvcc is found and a GPU is visible (NANOCHAT_FAST_FORCE_CUDA=1 builds
# them without one, e.g. in a GPU-less docker build). Build against the installed torch:
#   pip install -e . --no-build-isolation
# NANOCHAT_FAST_NO_EXT=1 skips the extension; a failed compile only warns, because every op
# has a pure-PyTorch fallback and the package must stay installable without a compiler.
import glob
import os
import sys

from setuptools import setup

def warn(msg):
    bar = "=" * 78
    print(f"\n{bar}\nnanochat_fast: {msg}\n{bar}\n", file=sys.stderr)


def extension_setup():
    """Return (ext_modules, cmdclass) for the compiled ops, or ([], {}) when they are skipped."""
    if os.environ.get("NANOCHAT_FAST_NO_EXT") == "1":
        warn("NANOCHAT_FAST_NO_EXT=1: skipping the C++/CUDA extension; ops use their PyTorch fallbacks.")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        warn("torch is not installed, so the extension cannot be built. Install torch first and use "
             "`pip install -e . --no-build-isolation`; ops use their PyTorch fallbacks meanwhile.")
        return [], {}

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx_flags = ["-O3", "-fno-math-errno", "-fopenmp"]
    extra = dict(extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])
    with_cuda = torch.cuda.is_available() or os.environ.get("NANOCHAT_FAST_FORCE_CUDA") == "1"
    with_cuda = with_cuda and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if with_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        extra["extra_compile_args"]["nvcc"] = ["-O3", "--use_fast_math", "-std=c++17"]
        extra["define_macros"] = [("NANOCHAT_FAST_WITH_CUDA", "1")]
        ext = cpp_extension.CUDAExtension("nanochat_fast._C", sources, **extra)
    else:
        ext = cpp_extension.CppExtension("nanochat_fast._C", sources, **extra)

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension, but a compile failure leaves a working (fallback-only) install."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # compiler missing or broken: keep the pure-PyTorch install
                warn(f"building the C++ extension failed ({type(e).__name__}: {e}). The package is "
                     "installed without it and runs on its PyTorch fallbacks; `python -m "
                     "nanochat_fast.kernels` shows which backends are available.")

    return [ext], {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = extension_setup()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
