"""
The GPUs the kernels are compiled for without being present, and the check of a compiled kernel's
resources against them.

Per target: the per-block limits a launch fails on (shared memory, registers) and the peak rates
the roofline in benchmarks/RESULTS.md divides by. A kernel over a limit compiles fine and fails
only at launch ("too many resources requested") or silently runs slower (spills to local memory),
which is why these are checked at compile time, from `ptxas -v`:

    ptxas info    : Compiling entry function '_symmetric_xxt_kernel' for 'sm_90a'
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 110 registers, used 1 barriers, 400 bytes cmem[0]

The same report comes from Triton's bundled ptxas (for Triton's PTX) and from nvcc -Xptxas -v (for
csrc/cuda/*.cu), so one parser and one check serve both.
"""

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

KiB = 1024
MAX_REGS_PER_THREAD = 255  # every architecture since Kepler (CUDA C++ Programming Guide, "Compute Capabilities")
REGS_PER_SM = 65536  # 64K 32-bit registers per SM (and per block) on cc 8.0, 9.0, 10.0


@dataclass(frozen=True)
class GPU:
    """One compile target. Peak rates are the datasheet's dense (no sparsity) figures."""

    name: str
    cc: int  # compute capability, 90 for sm_90
    smem_per_block: int  # bytes: the opt-in maximum dynamic shared memory per block
    mem_bw: float  # bytes/s, HBM
    bf16_flops: float  # FLOP/s, dense bf16 tensor-core math with fp32 accumulation
    fp32_flops: float  # FLOP/s, fp32 FMA on the CUDA cores (no tensor cores, no TF32)

    @property
    def arch(self) -> str:
        return f"sm_{self.cc}"


# Shared memory per block: CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability" (163 KB on 8.0, 227 KB on 9.0 and 10.0). Rates:
#   A100 SXM4 80GB: NVIDIA A100 datasheet: 2,039 GB/s HBM2e, BF16 tensor 312 TFLOPS (624 sparse), FP32 19.5 TFLOPS.
#   H100 SXM5:      NVIDIA H100 datasheet: 3.35 TB/s HBM3, BF16 tensor 1,979 TFLOPS sparse = 989.5 dense,
#                   FP32 67 TFLOPS.
#   B200 (HGX B200, 1000 W): NVIDIA Blackwell datasheet: 8 TB/s HBM3e, BF16 tensor 4.5 PFLOPS sparse = 2.25
#                   dense, FP32 80 TFLOPS.
TARGETS = {
    "sm_80": GPU("A100 SXM", 80, 163 * KiB, 2.039e12, 312e12, 19.5e12),
    "sm_90": GPU("H100 SXM", 90, 227 * KiB, 3.35e12, 989.5e12, 67e12),
    "sm_100": GPU("B200", 100, 227 * KiB, 8.0e12, 2250e12, 80e12),
}


@dataclass(frozen=True)
class Usage:
    """What `ptxas -v` says about one compiled function."""

    function: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int = 0  # bytes of __shared__ arrays; Triton's shared memory is dynamic (metadata)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_v(text: str) -> list[Usage]:
    """Every entry function of a `ptxas -v` report, in order."""
    out, current, frame = [], None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and current is not None:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and current is not None:
            smem = _SMEM.search(m.group(2))
            out.append(Usage(current, int(m.group(1)), frame[1], frame[2], frame[0], int(smem.group(1)) if smem else 0))
            current = None
    return out


def check(usage: Usage, gpu: GPU, label: str, *, shared: int, threads: int | None, spills_ok: str = "") -> list[str]:
    """The limits `usage` breaks on `gpu`, one line each naming `label` (kernel and config) and the
    target; empty when it fits. `shared` is all the shared memory a block needs (static + dynamic),
    `threads` the block size when known (then the block's registers must fit in one SM's file)."""
    where = f"{label} on {gpu.arch} ({gpu.name})"
    problems = []
    if shared > gpu.smem_per_block:
        problems.append(f"{where}: shared memory {shared / KiB:.1f} KiB > {gpu.smem_per_block // KiB} KiB per block")
    if usage.registers > MAX_REGS_PER_THREAD:
        problems.append(f"{where}: {usage.registers} registers per thread > {MAX_REGS_PER_THREAD}")
    if threads and usage.registers * threads > REGS_PER_SM:
        problems.append(f"{where}: {usage.registers} registers x {threads} threads > {REGS_PER_SM} per block")
    if usage.spills and not spills_ok:
        problems.append(
            f"{where}: spills ({usage.spill_stores} B stored, {usage.spill_loads} B loaded) and "
            "its kernel-list entry gives no reason to accept them"
        )
    return problems


# ---------------------------------------------------------------------------------------------
# the ptxas binaries Triton ships


def _bundled_bin() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _release(ptxas: Path) -> tuple[int, int]:
    text = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def bundled_ptxas() -> tuple[tuple[Path, str], ...]:
    """(path, 'release X.Y') of every ptxas bundled with the installed Triton, newest first."""
    found = [(p, _release(p)) for p in sorted(_bundled_bin().glob("ptxas*")) if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no ptxas in {_bundled_bin()} (a Triton wheel for Linux x86_64/aarch64 ships one)")
    found.sort(key=lambda pv: pv[1], reverse=True)
    return tuple((p, f"release {v[0]}.{v[1]}") for p, v in found)


# ptxas options as Triton passes them (triton/backends/nvidia/compiler.py, make_cubin), so the
# registers reported are those of the code Triton would build with that ptxas.
TRITON_PTXAS_FLAGS = ("-lineinfo", "--regAllocOptLevel=2")


def ptxas_v(ptx: str, arch: str, workdir: Path) -> tuple[str, str]:
    """Assemble `ptx` for `arch` ('sm_90a') with the newest bundled ptxas that accepts its PTX
    version; returns (the -v report, which ptxas). Older ones are tried only when a newer one
    refuses the PTX (none of them does today: ptxas reads every older PTX version)."""
    src, out = workdir / "kernel.ptx", workdir / "kernel.cubin"
    src.write_text(ptx)
    errors = []
    for path, version in bundled_ptxas():
        result = subprocess.run(
            [str(path), *TRITON_PTXAS_FLAGS, "-v", f"--gpu-name={arch}", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
        )
        if result.returncode == 0:
            return result.stdout + result.stderr, f"{path.name} {version}"
        errors.append(f"{path.name} {version}: {result.stderr.strip().splitlines()[-1:]}")
    raise RuntimeError(f"no bundled ptxas assembles this PTX for {arch}: " + "; ".join(errors))


def cubin_registers(cubin: bytes, workdir: Path) -> int:
    """Registers per thread of the (single) function in `cubin`, read back with the cuobjdump
    Triton ships: the binary a GPU would load, assembled by the ptxas Triton picks for the arch."""
    path = workdir / "triton.cubin"
    path.write_bytes(cubin)
    text = subprocess.run(
        [str(_bundled_bin() / "cuobjdump"), "--dump-resource-usage", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(re.search(r"REG:(\d+)", text).group(1))


# ---------------------------------------------------------------------------------------------
# the CUDA C++ kernels (csrc/cuda/*.cu), compiled by nvcc

NVCC_FLAGS = ("-O3", "--use_fast_math", "-std=c++17")  # as setup.py builds them into the extension


def short_name(mangled: str) -> str:
    """'_ZN13nanochat_fast...18adamw_slice_kernelIfEEv...' -> 'adamw_slice_kernel<float>' (c++filt
    when it is installed; the mangled name otherwise)."""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return mangled
    if name.endswith(")"):  # drop the parameter list, then the namespaces
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return re.sub(r"^.*::", "", name)


def nvcc_usage(nvcc: str, cu: Path, arch: str, include: Path, workdir: Path) -> list[Usage]:
    """Compile `cu` for `arch` ('sm_80') with `-Xptxas -v`; the usage of each kernel it defines.
    Raises CalledProcessError (with nvcc's output) when it does not compile."""
    result = subprocess.run(
        [
            nvcc,
            "-c",
            f"-arch={arch}",
            *NVCC_FLAGS,
            "-Xptxas",
            "-v",
            f"-I{include}",
            str(cu),
            "-o",
            str(workdir / f"{cu.stem}.{arch}.o"),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
    return [
        Usage(short_name(u.function), u.registers, u.spill_stores, u.spill_loads, u.stack, u.static_smem)
        for u in parse_ptxas_v(result.stdout + result.stderr)
    ]
