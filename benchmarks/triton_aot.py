"""
Ahead-of-time compile of every Triton kernel of the package, for GPUs that need not be present,
with each compiled variant's resources checked against its target (gpu_targets.py):

    python benchmarks/triton_aot.py [--targets sm_80,sm_90,sm_100] [--json PATH]

triton_kernel_list.KERNELS lists every kernel and its runtime signature. A variant is one kernel x
one config of its module's GPU_CONFIGS table x one dtype it accepts x one target, compiled on the
very kernel object the launcher calls, with the constexprs and options the launcher passes. Shared
memory comes from the compile's metadata; registers and spills from `ptxas -v`. A @triton.jit kernel
under nanochat_fast/kernels/ without an entry in the list fails `coverage()` (and so the tests).
How a variant is compiled and checked: docs/measurements.md#triton-ahead-of-time-compile.
"""

import argparse
import ast
import contextlib
import hashlib
import importlib
import io
import json
import multiprocessing
import os
import re
import resource
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from fnmatch import fnmatch
from pathlib import Path

import torch
import triton_kernel_list
from gpu_targets import GPU, TARGETS, Usage, bundled_ptxas, check, cubin_registers, parse_ptxas_v, ptxas_v
from triton_kernel_list import KERNELS

from nanochat_fast import kernels

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # launch options, not constexprs
KERNELS_DIR = Path(kernels.__file__).resolve().parent  # where coverage() looks for Triton kernels


def torch_dtype(name: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16 (the names of TRITON_DTYPES)."""
    return next(d for d, n in TRITON_DTYPES.items() if n == name)


# ---------------------------------------------------------------------------------------------
# coverage: every @triton.jit kernel of the package has an entry


def _is_triton_decorator(node) -> bool:
    node = node.func if isinstance(node, ast.Call) else node
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("jit", "autotune", "heuristics")


def discover(package_dir: Path = KERNELS_DIR, package: str = "nanochat_fast.kernels") -> set[tuple[str, str]]:
    """(module, name) of every Triton kernel in the sources under package_dir: a @triton.jit
    function that is launched somewhere (`fn[grid](...)`) or named *_kernel. Device helpers, jit
    functions only called from kernels, are not kernels. Read from source, not imported, so the
    answer does not depend on TRITON_INTERPRET."""
    jitted, launched = set(), set()
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        module = ".".join((package,) + tuple(p for p in parts if p != "__init__"))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_decorator, node.decorator_list)):
                jitted.add((module, node.name))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                value = node.func.value
                if isinstance(value, ast.Call) and value.args:  # launch(fn, x)[grid](...): the op's launch
                    value = value.args[0]
                launched.add(value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", None))
    return {(m, name) for m, name in jitted if name in launched or name.endswith("_kernel")}


def coverage(entries=None, found=None) -> list[str]:
    """One line per kernel without an entry and per entry without a kernel; empty when they match."""
    listed = {(e.module, e.kernel) for e in (KERNELS if entries is None else entries)}
    found = discover() if found is None else found
    where = f"{triton_kernel_list.__name__}.KERNELS"
    return [
        f"Triton kernel {m}.{k} has no entry in {where}: add one so it is compiled for every GPU target"
        for m, k in sorted(found - listed)
    ] + [
        f"{where} lists {m}.{k}, which is not a Triton kernel (renamed or removed?)" for m, k in sorted(listed - found)
    ]


# ---------------------------------------------------------------------------------------------
# variants and their compilation


def variants(entries=None, targets: dict[str, GPU] | None = None, dtypes=None) -> list[dict]:
    """The compile jobs: plain data (picklable), one per kernel x config x dtype x target."""
    jobs = []
    for entry in KERNELS if entries is None else entries:
        mod = importlib.import_module(entry.module)
        configs = entry.configs if isinstance(entry.configs, dict) else getattr(mod, entry.configs)
        for config, cfg in configs.items():
            for dtype in entry.dtypes:
                if dtypes is not None and dtype not in dtypes:
                    continue
                constexprs = dict(entry.launch(mod, cfg, dtype))
                options = {k: constexprs.pop(k) for k in OPTION_NAMES if k in constexprs}
                signature = {k: v.format(dtype=TRITON_DTYPES[dtype]) for k, v in entry.signature.items()}
                for target, gpu in (TARGETS if targets is None else targets).items():
                    where = f"{config}/{TRITON_DTYPES[dtype]}/{target}"
                    why = [reason for pattern, reason in entry.spills_ok.items() if fnmatch(where, pattern)]
                    jobs.append(
                        dict(
                            module=entry.module,
                            kernel=entry.kernel,
                            config=config,
                            config_values=cfg,
                            dtype=TRITON_DTYPES[dtype],
                            dtype_bytes=dtype.itemsize,
                            target=target,
                            cc=gpu.cc,
                            signature=signature,
                            constexprs=constexprs,
                            options=options,
                            spills_ok=" ".join(why),
                        )
                    )
    return jobs


def _triton_signature(fn, job) -> tuple[dict, dict]:
    """ASTSource's signature (every argument, constexprs marked) and attrs (divisibility hints)."""
    declared, constexprs = job["signature"], job["constexprs"]
    runtime_args = [a for a in fn.arg_names if a not in constexprs]
    if sorted(runtime_args) != sorted(declared):
        raise ValueError(
            f"the entry's signature lists {sorted(declared)} but the kernel's runtime arguments "
            f"are {sorted(runtime_args)}"
        )
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        ty, _, hint = ("constexpr" if name in constexprs else declared[name]).partition(":")
        signature[name] = ty
        if hint == "16":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas, cuobjdump)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def launcher_specialization(job: dict) -> list[tuple[dict, dict, dict]]:
    """(signature with hints, constexprs, num_warps/num_stages) that the Triton runtime would
    compile for each launch of the job's kernel by its entry's example, found without a GPU: the
    module's kernels are swapped for recorders while the example runs on CPU tensors, and each
    recorded call goes through the runtime's own binder (what JITFunction.run does first)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    mod = importlib.import_module(job["module"])
    entry = next(e for e in KERNELS if (e.module, e.kernel) == (job["module"], job["kernel"]))
    saved = {e.kernel: getattr(mod, e.kernel) for e in KERNELS if e.module == job["module"]}
    recorders = {name: _Recorder() for name in saved}
    try:
        for name, recorder in recorders.items():
            setattr(mod, name, recorder)
        entry.example(mod, job["config_values"], torch_dtype(job["dtype"]), torch.device("cpu"))
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)
    fn = saved[job["kernel"]]
    backend = make_backend(GPUTarget("cuda", job["cc"], 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    out = []
    for args, kwargs in recorders[job["kernel"]].launches:
        bound, specialization, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
        hinted = {i for (i,), a in attrs.items() if ["tt.divisibility", 16] in a}
        out.append(
            (
                {
                    name: ty + (":16" if i in hinted else "")
                    for i, (name, ty) in enumerate(signature.items())
                    if ty != "constexpr"
                },
                {fn.arg_names[path[0]]: v for path, v in constexprs.items()},
                dict(num_warps=options.num_warps, num_stages=options.num_stages),
            )
        )
    return out


def _launcher_mismatch(job: dict) -> str:
    """Empty when the entry describes exactly what its launcher's calls make the runtime compile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    opts = make_backend(GPUTarget("cuda", job["cc"], 32)).parse_options(job["options"])
    declared = (job["signature"], job["constexprs"], dict(num_warps=opts.num_warps, num_stages=opts.num_stages))
    seen = launcher_specialization(job)
    if not seen:
        return "its entry's example launched nothing"
    wrong = [s for s in seen if s != declared]
    return f"the launcher's call specialises as {wrong[0]}, the entry says {declared}" if wrong else ""


def compile_variant(job: dict) -> dict:
    """Compile one job for its target; returns the job with what the compile says (or `error`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # the runtime's default, said loudly
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    try:
        fn = getattr(importlib.import_module(job["module"]), job["kernel"])
        if not isinstance(fn, JITFunction):
            raise TypeError(
                f"{job['kernel']} is a {type(fn).__name__}, not a JITFunction (TRITON_INTERPRET=1 in this process?)"
            )
        signature, attrs = _triton_signature(fn, job)
        src = ASTSource(fn=fn, signature=signature, constexprs=job["constexprs"], attrs=attrs)
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints the `ptxas -v` report of its own cubin
        with contextlib.redirect_stdout(io.StringIO()) as triton_log:
            compiled = triton.compile(src, target=GPUTarget("cuda", job["cc"], 32), options=job["options"])
        arch = sm_arch_from_capability(job["cc"])
        ptx = compiled.asm["ptx"]
        newest, version = bundled_ptxas()[0]
        cached = not parse_ptxas_v(triton_log.getvalue())  # a cache hit runs no ptxas
        with tempfile.TemporaryDirectory() as tmp:
            if Path(get_ptxas(job["cc"]).path).resolve() == newest.resolve() and not cached:
                # Triton already ran the newest ptxas (sm_90 and up): its report, not a second run
                report, ptxas = triton_log.getvalue(), f"{newest.name} {version}"
            else:
                report, ptxas = ptxas_v(ptx, arch, Path(tmp))
            cubin_regs = cubin_registers(compiled.asm["cubin"], Path(tmp))
        usage = next(u for u in parse_ptxas_v(report) if u.function == compiled.metadata.name)
        mismatch = _launcher_mismatch(job)
    except Exception as e:  # reported as the variant's problem, with the others still compiled
        lines = [line for line in str(e).strip().splitlines() if line.strip()] or [""]
        return dict(
            job,
            error=f"{type(e).__name__}: {lines[0][:300]}",
            seconds=time.perf_counter() - t0,
            cpu_seconds=_cpu_seconds() - cpu0,
        )
    md = compiled.metadata
    return dict(
        job,
        arch=arch,
        shared=md.shared,
        num_warps=md.num_warps,
        num_stages=md.num_stages,
        registers=usage.registers,
        spill_stores=usage.spill_stores,
        spill_loads=usage.spill_loads,
        stack=usage.stack,
        cubin_registers=cubin_regs,
        ptxas=ptxas,
        launcher_mismatch=mismatch,
        cached=cached,
        ptx_version=re.search(r"^\.version (\S+)", ptx, re.M).group(1),
        ptx_sha256=hashlib.sha256(ptx.encode()).hexdigest(),
        seconds=time.perf_counter() - t0,
        cpu_seconds=_cpu_seconds() - cpu0,
    )


@contextlib.contextmanager
def _environment_for_workers(cache_dir: str):
    """Worker processes inherit os.environ when they start: no interpreter, a private cache."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def label(rec: dict) -> str:
    return f"{rec['kernel']} [{rec['config']}, {rec['dtype']}]"


def check_record(rec: dict, gpu: GPU) -> list[str]:
    if "error" in rec:
        return [f"{label(rec)} on {gpu.arch} ({gpu.name}): does not compile: {rec['error']}"]
    usage = Usage(rec["kernel"], rec["registers"], rec["spill_stores"], rec["spill_loads"], rec["stack"])
    problems = check(
        usage, gpu, label(rec), shared=rec["shared"], threads=32 * rec["num_warps"], spills_ok=rec["spills_ok"]
    )
    if rec["launcher_mismatch"]:
        problems.append(f"{label(rec)} on {gpu.arch}: {rec['launcher_mismatch']}")
    if rec["cubin_registers"] != rec["registers"]:  # Triton assembled its cubin with an older ptxas (sm_80)
        cubin = Usage(rec["kernel"], rec["cubin_registers"], 0, 0, 0)
        problems += [
            f"{p} (Triton's own cubin)" for p in check(cubin, gpu, label(rec), shared=0, threads=32 * rec["num_warps"])
        ]
    return problems


def compile_all(
    jobs: list[dict], targets: dict[str, GPU] | None = None, workers: int | None = None, cache_dir: str | None = None
) -> list[dict]:
    """Compile every job in parallel processes, each record with its `problems` (empty: fits).
    `cache_dir`: a Triton cache to reuse (default: a fresh one, so everything is compiled); its
    entries are keyed by the kernel's source, options and Triton version, so a hit is the same
    compile. `ptxas -v` runs on every variant either way."""
    targets = TARGETS if targets is None else targets
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with (
        tempfile.TemporaryDirectory(prefix="nanochat_fast_triton_aot_") as fresh,
        _environment_for_workers(cache_dir or fresh),
    ):
        # wide dtypes first: they take longest (bigger register allocation), so no worker idles at the end
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i]["dtype_bytes"])
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = dict(zip(order, pool.map(compile_variant, [jobs[i] for i in order])))
        records = [done[i] for i in range(len(jobs))]
    for rec in records:
        rec["problems"] = check_record(rec, targets[rec["target"]])
    return records


def summary(records: list[dict], seconds: float) -> str:
    kernels = len({r["kernel"] for r in records})
    targets = ", ".join(dict.fromkeys(r["target"] for r in records))
    problems = sum(len(r["problems"]) for r in records)
    verdict = "all within limits" if not problems else f"{problems} problem(s)"
    cpu = sum(r["cpu_seconds"] for r in records)
    cached = sum(bool(r.get("cached")) for r in records)
    return (
        f"compiled {len(records)} Triton variants ({kernels} kernels x configs x dtypes x {targets}"
        f"{f'; {cached} from the Triton cache' if cached else ''}) in {seconds:.0f} s ({cpu:.0f} CPU-seconds "
        f"in the compile processes): {verdict}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/triton_aot.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--json", default=None, help="also write every variant's record here")
    parser.add_argument("--workers", type=int, default=None, help="parallel compile processes (default: all cores)")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets.split(",") if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    targets = {t: TARGETS[t] for t in args.targets.split(",")}
    t0 = time.perf_counter()
    records = compile_all(variants(targets=targets), targets, args.workers)
    for r in records:
        status = "; ".join(r["problems"]) or "ok"
        if "error" in r:
            print(f"{label(r):<50} {r['target']:<7} {status}")
        else:
            print(
                f"{label(r):<50} {r['target']:<7} {r['registers']:>3} regs {r['shared'] / 1024:>6.1f} KiB smem "
                f"{r['spill_stores'] + r['spill_loads']:>4} B spills  {status}"
            )
    gaps = coverage()
    for line in gaps:
        print(line)
    print(summary(records, time.perf_counter() - t0))
    if args.json:
        tmp = Path(args.json).with_name(f".{Path(args.json).name}.tmp")
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, args.json)
    return 1 if gaps or any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
