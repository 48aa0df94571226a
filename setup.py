# Builds nanochat_fast._C: the CPU ops in csrc/*.cpp always, plus csrc/cuda/* when the
# installed torch has CUDA, nvcc is found and a GPU is visible (NANOCHAT_FAST_FORCE_CUDA=1 builds
# them without one, e.g. in a GPU-less docker build). Build against the installed torch:
#   pip install -e . --no-build-isolation
# NANOCHAT_FAST_NO_EXT=1 skips the extension; a failed compile only warns, because every op
# has a pure-PyTorch fallback and the package must stay installable without a compiler. A forced
# CUDA build is the exception: it was asked for, so it fails loudly (one line, non-zero exit)
# rather than install an extension without the CUDA kernels.
# torch's own build settings apply: TORCH_CUDA_ARCH_LIST, CUDA_HOME, MAX_JOBS (parallel compiles).
import glob
import os
import shutil
import sys

from setuptools import setup

FORCE_CUDA = os.environ.get("NANOCHAT_FAST_FORCE_CUDA") == "1"
# The GPUs a forced build compiles for when none is visible to ask (torch asks the visible GPUs and,
# finding none, fails with an IndexError): A100, H100, B200. CUDA 13 compiles for all three
# (it dropped sm_50 to sm_72); other GPUs need TORCH_CUDA_ARCH_LIST, e.g. "8.6" or "12.0".
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0;10.0"


def warn(msg):
    bar = "=" * 78
    print(f"\n{bar}\nnanochat_fast: {msg}\n{bar}\n", file=sys.stderr)


def fail(msg):
    """A forced CUDA build that cannot be done: one line and a non-zero exit."""
    sys.exit(f"nanochat_fast: NANOCHAT_FAST_FORCE_CUDA=1: {msg}")


def cuda_home(cpp_extension):
    """The CUDA toolkit to build with: CUDA_HOME or CUDA_PATH as given, else the first of torch's guess,
    the folder of the nvcc on PATH with links resolved, and /usr/local/cuda that holds nvcc and the
    CUDA headers. torch's guess is the folder above the nvcc on PATH, which is wrong when that nvcc
    is a wrapper script or a link (/usr/local/bin/nvcc running /usr/local/cuda/bin/nvcc: /usr/local)."""
    given = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if given:
        return given
    nvcc = shutil.which("nvcc")
    candidates = [
        cpp_extension.CUDA_HOME,
        nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        "/usr/local/cuda",
    ]
    for home in filter(None, candidates):
        if os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
            os.path.join(home, "include", "cuda_runtime_api.h")
        ):
            return home
    return None


def build_with_cuda(torch, cpp_extension) -> bool:
    """Whether to compile csrc/cuda too; on the way, points torch at the CUDA toolkit found and, for
    a forced build without a visible GPU, sets the architectures to compile for."""
    if not FORCE_CUDA:
        if not (torch.cuda.is_available() and torch.version.cuda is not None):
            return False
    elif torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a build without CUDA; install a CUDA build of torch")
    home = cuda_home(cpp_extension)
    if home is None:
        if FORCE_CUDA:
            fail(
                "no CUDA toolkit found (bin/nvcc and include/cuda_runtime_api.h above the nvcc on PATH or in "
                "/usr/local/cuda); install it or set CUDA_HOME"
            )
        return False
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = home  # torch reads its module global when compiling
    if FORCE_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
        print(
            f"nanochat_fast: no GPU visible: compiling the CUDA kernels for TORCH_CUDA_ARCH_LIST="
            f"{DEFAULT_CUDA_ARCH_LIST} (set it to choose others)",
            file=sys.stderr,
        )
    return True


def extension_setup():
    """Return (ext_modules, cmdclass) for the compiled ops, or ([], {}) when they are skipped."""
    if os.environ.get("NANOCHAT_FAST_NO_EXT") == "1":
        if FORCE_CUDA:
            fail("NANOCHAT_FAST_NO_EXT=1 skips the extension it asks for; unset one of them")
        warn("NANOCHAT_FAST_NO_EXT=1: skipping the C++/CUDA extension; ops use their PyTorch fallbacks.")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        if FORCE_CUDA:
            fail(
                "torch is not installed; install a CUDA build of torch first and build with "
                "`pip install -e . --no-build-isolation`"
            )
        warn(
            "torch is not installed, so the extension cannot be built. Install torch first and use "
            "`pip install -e . --no-build-isolation`; ops use their PyTorch fallbacks meanwhile."
        )
        return [], {}

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx_flags = ["-O3", "-fno-math-errno", "-fopenmp"]
    extra = dict(extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])
    if build_with_cuda(torch, cpp_extension):
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        extra["extra_compile_args"]["nvcc"] = ["-O3", "--use_fast_math", "-std=c++17"]
        extra["define_macros"] = [("NANOCHAT_FAST_WITH_CUDA", "1")]
        ext = cpp_extension.CUDAExtension("nanochat_fast._C", sources, **extra)
    else:
        ext = cpp_extension.CppExtension("nanochat_fast._C", sources, **extra)

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension, but a compile failure leaves a working (fallback-only) install,
        unless the CUDA build was forced."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # compiler missing or broken: keep the pure-PyTorch install
                first_line = (str(e).strip().splitlines() or [""])[0].rstrip(".")
                what = f"{type(e).__name__}: {first_line}"
                if FORCE_CUDA:
                    fail(f"building the CUDA extension failed ({what}; the compiler's output is above)")
                warn(
                    f"building the C++ extension failed ({what}). The package is "
                    "installed without it and runs on its PyTorch fallbacks; `python -m "
                    "nanochat_fast.kernels` shows which backends are available."
                )

    return [ext], {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = extension_setup()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
