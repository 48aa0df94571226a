"""
`make cuda-build-check`: the whole extension built with CUDA, nvcc included, against a CUDA build of
torch, on a machine that need not have a GPU; then checked through the module that was built.

    cd COPY && VENV/bin/python benchmarks/cuda_build_check.py

  1. `NANOCHAT_FAST_FORCE_CUDA=1 python setup.py build_ext --inplace`, from scratch, with no
     TORCH_CUDA_ARCH_LIST (an inherited one is dropped): the build a GPU-less image makes, setup.py
     choosing the GPU targets itself. Its output goes to build/cuda-build.log; its time is printed.
  2. nanochat_fast._C, imported from this tree in a fresh process, says with_cuda.
  3. The architectures compiled into it (cuobjdump --list-elf, Triton's bundled cuobjdump).
  4. `python -m nanochat_fast.kernels --json`: every op with a kernel in csrc/cuda has its cpp
     backend available on CUDA.

The build is in place, so run it in a copy of the tree (the Makefile stages one) with the venv whose
torch it is checked against; the CPU .venv's _C.so is never touched. MAX_JOBS caps parallel compiles.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "build" / "cuda-build.log"


def fail(msg: str):
    sys.exit(f"cuda-build-check: {msg}")


def in_tree(*args: str) -> str:
    """stdout of this venv's python run in the tree, with the tree first on the path: nanochat_fast is
    this copy, whichever one the venv has installed."""
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
    )
    if out.returncode != 0:
        fail(f"python {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def build() -> float:
    """A full build (nothing reused from an earlier one); returns its seconds."""
    for old in [ROOT / "nanochat_fast" / "_C.so", *ROOT.glob("build/temp.*"), *ROOT.glob("build/lib.*")]:
        subprocess.run(["rm", "-rf", str(old)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    env["NANOCHAT_FAST_FORCE_CUDA"] = "1"
    LOG.parent.mkdir(exist_ok=True)
    print(f"building with CUDA (MAX_JOBS={env.get('MAX_JOBS', 'unset: ninja decides')}), log in {LOG} ...", flush=True)
    t0 = time.perf_counter()
    with open(LOG, "w") as log:
        done = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        fail("the CUDA build failed:\n" + "\n".join(LOG.read_text().strip().splitlines()[-15:]))
    return seconds


def main() -> int:
    seconds = build()
    print(f"CUDA build time: {seconds // 60:.0f}m{seconds % 60:02.0f}s ({seconds:.0f} s)")

    code = "import torch, nanochat_fast._C as C; print(C.__file__, C.with_cuda, torch.__version__)"
    where, with_cuda, torch_version = in_tree("-c", code).split()
    if Path(where).resolve() != (ROOT / "nanochat_fast" / "_C.so").resolve():
        fail(f"imported {where}, not this tree's nanochat_fast/_C.so")
    if with_cuda != "True":
        fail(f"{where} was built without CUDA (with_cuda={with_cuda})")
    print(f"nanochat_fast._C: {where}: with_cuda=True (torch {torch_version})")

    import triton  # its wheel ships cuobjdump, which the CUDA toolkit on a build machine may lack

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    listed = subprocess.run([str(cuobjdump), "--list-elf", where], capture_output=True, text=True)
    archs = sorted(set(re.findall(r"\bsm_\d+a?\b", listed.stdout)), key=lambda a: int(re.sub(r"\D", "", a)))
    print(f"GPU code compiled into it: {', '.join(archs) or listed.stderr.strip() or 'none listed'}")

    table = json.loads(in_tree("-m", "nanochat_fast.kernels", "--json"))
    cpp_on_cuda = {op: e["backends"]["cpp"]["cuda"] for op, e in table["ops"].items() if "cpp" in e["backends"]}
    available = [op for op, why_not in cpp_on_cuda.items() if why_not is None]
    wrong = [
        f"{op}/cpp on cuda: {why_not}"
        for op, why_not in cpp_on_cuda.items()
        if why_not is not None and "no CUDA kernel in csrc/cuda" not in why_not
    ]
    if wrong or not available:
        fail("python -m nanochat_fast.kernels: " + ("; ".join(wrong) or "no cpp backend on cuda"))
    print("python -m nanochat_fast.kernels, on cuda:")
    for op, entry in table["ops"].items():
        backends = [name for name, per_device in entry["backends"].items() if per_device["cuda"] is None]
        print(f"  {op:<22} available: {', '.join(backends):<28} uses: {entry['selected']['cuda']}")
    print(f"cuda-build-check: ok (CUDA build in {seconds:.0f} s, cpp on cuda for {', '.join(available)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
