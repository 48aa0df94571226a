"""Every Triton kernel compiled ahead of time, without a GPU, for sm_80, sm_90 and sm_100 (every config
of its GPU table x every dtype it accepts), each variant within its target's limits
(benchmarks/triton_aot.py, benchmarks/triton_kernel_list.py). Marked `aot`: `pytest -m aot` runs these
alone (~180 CPU-seconds of compiling in parallel processes; the fp32 variants take 3/4 of it).
On a GPU (marked `gpu`): the kernels the runtime compiles are the variants compiled here, bit for bit."""

import dataclasses
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import textwrap
import time

import pytest
import torch
from support.repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import triton_aot  # noqa: E402
from gpu_targets import GPU, TARGETS, bundled_ptxas  # noqa: E402
from triton_aot import compile_all, coverage, discover, variants  # noqa: E402
from triton_kernel_list import KERNELS, Entry, flop_counts  # noqa: E402

pytestmark = pytest.mark.aot
KiB = 1024
# Triton's cache for these tests, kept between runs like the torch.compile cache (conftest.py): a run
# after the first recompiles only the kernels whose source or config changed.
CACHE_DIR = os.path.join(tempfile.gettempdir(), f"nanochat_fast_triton_aot_{os.getuid()}")


def entry(kernel: str) -> Entry:
    return next(e for e in KERNELS if e.kernel == kernel)


# A test-only config whose operand buffers cannot fit: 4 stages x 2 operands x 128x128 bf16 = 256 KiB.
OVERSIZED = dataclasses.replace(
    entry("_symmetric_xxt_kernel"),
    configs={"oversized": dict(BLOCK=128, BLOCK_K=128, num_warps=8, num_stages=4, DOT_FP32=False)},
)


# A test-only entry whose signature misses a hint the launcher's call gives the runtime (M = 256 is
# divisible by 16): it describes a kernel the runtime never compiles.
_XXT = entry("_symmetric_xxt_kernel")
UNHINTED = dataclasses.replace(
    _XXT, signature={**_XXT.signature, "M": "i32"}, configs={"small": importlib.import_module(_XXT.module).GPU_SMALL}
)


@pytest.fixture(scope="session")
def compiled(request):
    """Every variant of the kernel list, plus the two test-only ones for sm_90, compiled once per session."""
    t0 = time.perf_counter()
    jobs = variants()
    h100 = {"sm_90": TARGETS["sm_90"]}
    extra = [variants([e], h100, dtypes=[torch.bfloat16])[0] for e in (OVERSIZED, UNHINTED)]
    records = compile_all(jobs + extra, cache_dir=CACHE_DIR)
    line = triton_aot.summary(records[: len(jobs)], time.perf_counter() - t0)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # shown in the `make test` output, not captured
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{line}")
    return records[: len(jobs)], dict(zip(("oversized", "unhinted"), records[len(jobs) :]))


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", [e.kernel for e in KERNELS])
def test_every_variant_compiles_within_limits(compiled, kernel, target):
    records = [r for r in compiled[0] if r["kernel"] == kernel and r["target"] == target]
    mod = importlib.import_module(entry(kernel).module)
    assert len(records) == len(mod.GPU_CONFIGS) * len(entry(kernel).dtypes)
    problems = [p for r in records for p in r["problems"]]
    assert not problems, "\n".join(problems)
    newest = bundled_ptxas()[0]
    for r in records:
        assert r["registers"] > 0 and r["cubin_registers"] > 0
        assert r["ptxas"] == f"{newest[0].name} {newest[1]}"  # the newest ptxas took Triton's PTX


@pytest.mark.parametrize("kernel", ["_symmetric_xxt_kernel", "_symmetric_poly_kernel", "_fused_update_kernel"])
def test_shared_memory_holds_the_pipelined_operand_tiles(compiled, kernel):
    """An independent lower bound for the metadata's shared memory: a tl.dot K loop software-
    pipelined over S stages keeps at least S-1 pairs of (BLOCK x BLOCK_K) operand tiles in flight."""
    for r in (r for r in compiled[0] if r["kernel"] == kernel):
        cfg = r["config_values"]
        tiles = 2 * cfg["BLOCK"] * cfg["BLOCK_K"] * r["dtype_bytes"]
        assert (cfg["num_stages"] - 1) * tiles <= r["shared"] <= cfg["num_stages"] * tiles + 64 * KiB, r


def test_oversized_config_is_rejected_naming_kernel_config_and_target(compiled):
    record = compiled[1]["oversized"]
    assert record["shared"] >= 256 * KiB
    [problem] = [p for p in record["problems"] if "shared memory" in p]
    assert problem.startswith("_symmetric_xxt_kernel [oversized, bf16] on sm_90 (H100 SXM): shared memory 256.0 KiB")
    assert "> 227 KiB per block" in problem


def test_a_signature_the_launcher_does_not_produce_is_rejected(compiled):
    """The kernel list's signature, constexprs and options must be what the launcher's own call
    makes the runtime compile (checked through Triton's binder, no GPU needed)."""
    [problem] = compiled[1]["unhinted"]["problems"]
    assert problem.startswith("_symmetric_xxt_kernel [small, bf16] on sm_90: the launcher's call specialises as")
    assert "'M': 'i32:16'" in problem


def test_every_kernel_has_an_entry():
    assert coverage() == []
    assert discover() == {(e.module, e.kernel) for e in KERNELS}


def test_flop_counts():
    f = flop_counts(768, 3072, block=128)  # 6 tile rows: 21 of the 36 tiles
    assert f["symmetric_xxt"] == 21 * 2 * 128 * 128 * 3072
    assert f["symmetric_poly"] == 21 * 2 * 128 * 128 * 768
    assert f["fused_update"] == f["full_update"] == 2 * 768 * 768 * 3072
    assert f["full_step"] == 4 * 768**2 * 3072 + 2 * 768**3
    assert f["full_step"] / f["step"] == pytest.approx(1.31, abs=0.01)  # 1.38 with no tile padding


@pytest.mark.parametrize("dropped", range(len(KERNELS)), ids=[e.kernel for e in KERNELS])
def test_a_dropped_entry_fails_coverage(dropped):
    e = KERNELS[dropped]
    [problem] = coverage(KERNELS[:dropped] + KERNELS[dropped + 1 :])
    assert problem.startswith(f"Triton kernel {e.module}.{e.kernel} has no entry")


def test_a_kernel_added_to_a_kernel_file_needs_an_entry(tmp_path):
    """A new launched @triton.jit function in a copy of the package is found; a device helper
    (jit, only called from kernels) is not a kernel."""
    pkg = tmp_path / "kernels"
    shutil.copytree(triton_aot.KERNELS_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    path = pkg / "newton_schulz_triton.py"
    path.write_text(
        path.read_text()
        + textwrap.dedent("""
        @triton.jit
        def _twice(x):
            return 2 * x


        @triton.jit
        def _scale(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, _twice(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


        def scale(x):
            _scale[(1,)](x, x.numel(), BLOCK=1024)
        """)
    )
    [problem] = coverage(found=discover(pkg))
    assert problem.startswith("Triton kernel nanochat_fast.kernels.newton_schulz_triton._scale has no entry")


# ---------------------------------------------------------------------------------------------
# on a GPU: what the runtime compiles is what was compiled ahead of time


def _runtime_key(fn, kernel) -> tuple:
    """(signature with divisibility hints, constexprs, num_warps, num_stages) of a kernel the
    runtime compiled, in the notation of the kernel list."""
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        ty = kernel.src.signature[name]
        if ty == "constexpr":
            constexprs[name] = kernel.src.constants[(i,)]
        else:
            hinted = ["tt.divisibility", 16] in kernel.src.attrs.get((i,), [])
            signature[name] = ty + (":16" if hinted else "")
    return _key(signature, constexprs, kernel.metadata.num_warps, kernel.metadata.num_stages)


def _key(signature, constexprs, num_warps, num_stages) -> tuple:
    return (
        tuple(sorted(signature.items())),
        tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
        num_warps,
        num_stages,
    )


@pytest.mark.gpu
def test_runtime_compiles_the_ahead_of_time_variants():
    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    props = torch.cuda.get_device_properties(device)
    target = f"sm_{10 * major + minor}"
    here = {target: GPU(props.name, 10 * major + minor, props.shared_memory_per_block_optin, 0.0, 0.0, 0.0)}
    aot = {}
    for r in compile_all(variants(targets=here), here):
        assert not r["problems"], r["problems"]
        aot[(r["kernel"],) + _key(r["signature"], r["constexprs"], r["num_warps"], r["num_stages"])] = r
    for e in KERNELS:
        mod = importlib.import_module(e.module)
        fn = getattr(mod, e.kernel)
        for caches in fn.device_caches.values():  # forget launches of earlier tests (other shapes)
            caches[0].clear()
            caches[1].clear()
        for cfg in mod.GPU_CONFIGS.values():
            for dtype in e.dtypes:
                e.example(mod, cfg, dtype, device)
        torch.cuda.synchronize()
        launched = [k for caches in fn.device_caches.values() for k in caches[0].values()]
        assert launched, f"{e.kernel}: its example launched nothing"
        for kernel in launched:
            key = (e.kernel,) + _runtime_key(fn, kernel)
            assert key in aot, f"{e.kernel}: the runtime compiled {key}, which the kernel list does not describe"
            r = aot[key]
            assert hashlib.sha256(kernel.asm["ptx"].encode()).hexdigest() == r["ptx_sha256"], key
            assert kernel.metadata.shared == r["shared"]
            kernel.run  # loads the binary: n_regs/n_spills come from the driver
            assert kernel.n_regs == r["cubin_registers"], key
            assert kernel.n_spills == 0 or r["spills_ok"], key
