"""
The "compiled, not run" section of benchmarks/RESULTS.md: every Triton kernel variant
(benchmarks/triton_aot.py) and every CUDA C++ kernel (csrc/cuda/*.cu, by nvcc) compiled
for A100, H100 and B200 on a machine without a GPU, with its registers, shared memory and spills,
and a roofline on paper for one representative call (docs/measurements.md#compiled-not-run).

    python benchmarks/compiled_table.py   # compiles everything, writes benchmarks/compiled.json and
                                          # this section of benchmarks/RESULTS.md

Other Triton versions (`make aot-compat`) are compiled in their own venv and put beside it, one
column per version in the "Triton versions" table; compiled.json keeps every version's run while
the kernel sources stay the same:

    OTHER_VENV/bin/python benchmarks/compiled_table.py --triton-only run.json   # that venv's Triton only
    python benchmarks/compiled_table.py --add run.json
"""

import argparse
import dataclasses
import datetime
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_targets import TARGETS, check, nvcc_usage
from results_sections import put_section

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Compiled, not run: A100, H100, B200"
# Shapes for the Newton-Schulz flop table: (stack, rows, cols), rows <= cols as the kernels see them.
NS_SHAPES = [
    (1, 768, 768),
    (1, 768, 3072),
    (1, 1024, 4096),
    (1, 1280, 1280),
    (1, 1280, 5120),
    (8, 768, 768),
    (12, 768, 3072),
]


def roofline(call: dict, target: str) -> tuple[float, float, str]:
    """(seconds at peak bandwidth, seconds at peak math rate, which binds) for one call."""
    gpu = TARGETS[target]
    t_mem = call["bytes"] / gpu.mem_bw
    t_math = call["flops"] / (gpu.bf16_flops if call["math"] == "bf16" else gpu.fp32_flops)
    return t_mem, t_math, "memory" if t_mem >= t_math else "math"


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME
    return shutil.which("nvcc") or (home and str(Path(home) / "bin" / "nvcc"))


def cuda_records(archs=("sm_80", "sm_90")) -> list[dict]:
    """nvcc -Xptxas -v of every csrc/cuda/*.cu kernel per arch ([] without nvcc)."""
    from triton_kernel_list import adamw_call

    calls = {
        "adamw_slice_kernel<float>": adamw_call(torch.float32),
        "adamw_slice_kernel<__nv_bfloat16>": adamw_call(torch.bfloat16),
    }
    nvcc, out = _nvcc(), []
    if not nvcc or not Path(nvcc).exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
            for arch in archs:
                for u in nvcc_usage(nvcc, cu, arch, ROOT / "csrc", Path(tmp)):
                    call = calls.get(u.function)
                    out.append(
                        dict(
                            dataclasses.asdict(u),
                            file=f"csrc/cuda/{cu.name}",
                            target=arch,
                            call=dataclasses.asdict(call) if call else None,
                            problems=check(u, TARGETS[arch], u.function, shared=u.static_smem, threads=None),
                        )
                    )
    return out


def kernel_sources() -> str:
    """sha256 of what decides a variant's record besides the Triton version: the kernels' modules, the
    kernel list, the compile and its checks. Records of two versions compare only at the same sources."""
    import gpu_targets
    import triton_aot
    import triton_kernel_list

    modules = {importlib.import_module(e.module) for e in triton_kernel_list.KERNELS}
    digest = hashlib.sha256()
    for module in sorted(modules | {gpu_targets, triton_aot, triton_kernel_list}, key=lambda m: m.__name__):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def triton_run(workers=None) -> dict:
    """Every Triton variant compiled by the installed Triton, each record with its call's cost, and
    what the run was: Triton version, the ptxas that reported, time, the kernel sources."""
    import triton
    import triton_aot
    import triton_kernel_list as kernel_list

    t0 = time.perf_counter()
    records = triton_aot.compile_all(triton_aot.variants(), workers=workers)
    seconds = time.perf_counter() - t0
    entries = {(e.module, e.kernel): e for e in kernel_list.KERNELS}
    for r in records:
        call = entries[r["module"], r["kernel"]].work(
            importlib.import_module(r["module"]), r["config_values"], triton_aot.torch_dtype(r["dtype"])
        )
        r["call"] = dataclasses.asdict(call)
    return dict(
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
        ptxas=sorted({r.get("ptxas", "") for r in records} - {""}),
        seconds=seconds,
        summary=triton_aot.summary(records, seconds),
        sources=kernel_sources(),
        records=records,
    )


def merge_runs(installed: dict, added=(), previous=()) -> list[dict]:
    """compiled.json's Triton runs: the installed Triton's first (the one the roofline table shows),
    then one per other version, an added run before the previous compiled.json's. A run of other
    kernel sources would compare other code: an added one is refused, a previous one dropped."""
    runs = {installed["triton"]: installed}
    for run in added:
        if run["triton"] in runs:
            raise ValueError(f"two runs of Triton {run['triton']}: add only other versions than the installed one")
        if run["sources"] != installed["sources"]:
            raise ValueError(
                f"the Triton {run['triton']} run of {run['date']} compiled other kernel sources than "
                "these: compile it again"
            )
        runs[run["triton"]] = run
    for run in previous:
        if run["triton"] in runs:
            continue
        if run["sources"] == installed["sources"]:
            runs[run["triton"]] = run
        else:
            print(
                f"dropped the Triton {run['triton']} records of {run['date']}: the kernels changed since "
                "(make aot-compat compiles them again)"
            )
    return list(runs.values())


def _variant(r: dict) -> tuple:
    return r["kernel"], r["config"], r["dtype"], r["target"]


def by_variant(runs: list[dict]) -> dict[tuple, list]:
    """(kernel, config, dtype, target) of every variant of any run -> its record in each run, in the
    runs' order (None where a run has no such variant)."""
    index = [{_variant(r): r for r in run["records"]} for run in runs]
    return {key: [i.get(key) for i in index] for run in runs for key in map(_variant, run["records"])}


def collect(workers=None, added=(), previous=()) -> dict:
    import triton_kernel_list as kernel_list

    runs = merge_runs(triton_run(workers), added, previous)
    ns = []
    for K, m, n in NS_SHAPES:
        plain = kernel_list.flop_counts(m, n, 128, K)["full_step"]
        ns.append(
            dict(
                shape=f"{K} x {m}x{n}" if K > 1 else f"{m}x{n}",
                plain=plain,
                **{f"tiles_{b}": kernel_list.flop_counts(m, n, b, K)["step"] for b in (128, 64)},
            )
        )
    adamw = [
        dict(
            dtype=name,
            bytes=kernel_list.adamw_bytes_per_param(d),
            flops=kernel_list.ADAMW_FLOPS_PER_PARAM,
            call=dataclasses.asdict(kernel_list.adamw_call(d)),
        )
        for d, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    ]
    nvcc = _nvcc()
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    return dict(
        date=datetime.date.today().isoformat(),
        nvcc=(re.findall(r"release [\d.]+", nvcc_version) or ["not found"])[0],
        triton_runs=runs,
        cuda_records=cuda_records(),
        ns_flops=ns,
        adamw=adamw,
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _resource_row(name, config, dtype, r, spill_marks) -> str:
    if "error" in r:
        return f"| {name} | {config} | {dtype} | {r['target']} | does not compile | | | | | | | | |"
    spills = r["spill_stores"] + r["spill_loads"]
    mark = ""
    if spills and r.get("spills_ok"):
        mark = spill_marks.setdefault(r["spills_ok"], f"[{len(spill_marks) + 1}]")
    call = r.get("call")
    cost = "| — | | | | | |"
    if call:
        t_mem, t_math, bound = roofline(call, r["target"])
        cost = (
            f"| {call['shape']} | {call['bytes'] / 1e6:,.1f} | {call['flops'] / 1e9:,.2f} | {_us(t_mem)} | "
            f"{_us(t_math)} | {bound} |"
        )
    shared = r["shared"] if "shared" in r else r["static_smem"]
    return (
        f"| {name} | {config} | {dtype} | {r['target']} | {r['registers']} | {shared / 1024:.1f} | "
        f"{spills:,}{mark} {cost}"
    )


def _usage_cells(r: dict | None) -> list[str]:
    """registers, shared memory (KiB), spills (B) of one variant under one Triton version."""
    if r is None:
        return ["not compiled", "", ""]
    if "error" in r:
        return ["does not compile", "", ""]
    return [str(r["registers"]), f"{r['shared'] / 1024:.1f}", f"{r['spill_stores'] + r['spill_loads']:,}"]


def _cubin_note(r: dict | None) -> str:
    # Triton's own cubin, assembled by the ptxas it picks for the target (an older one for sm_80 and
    # sm_90 in some versions), is what a GPU loads: its count where it differs from the newest ptxas's
    if r is None or "error" in r or r["cubin_registers"] == r["registers"]:
        return ""
    return f" (cubin {r['cubin_registers']})"


def versions_table(runs: list[dict]) -> list[str]:
    """Every variant's registers, shared memory and spills under each Triton version, side by side;
    a value that differs from the first version's in bold ([] with one version)."""
    if len(runs) < 2:
        return []
    names = [run["triton"] for run in runs]
    lines = [
        "",
        "### Triton versions",
        "",
        f"The same variants, from the same kernel sources, compiled by Triton {', '.join(names)} "
        "(`make aot-compat`), each checked against its target as above. Each version generates its own PTX "
        "and assembles it with the newest ptxas it ships, so registers and shared memory may differ; "
        f"**bold**: differs from {names[0]}; (cubin N): the cubin Triton itself builds, with the ptxas it picks "
        "for that target, has N registers (also checked).",
        "",
        "| Triton | compiled | ptxas | run |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {run['triton']} | {run['date']} | {', '.join(run['ptxas']) or '—'} | {run['summary']} |" for run in runs
    ]
    lines += [
        "",
        "| kernel | config | dtype | target | "
        + " | ".join(f"{what} {v}" for what in ("registers", "smem (KiB)", "spills (B)") for v in names)
        + " | over the limits with |",
        "|---|---|---|---|" + "---:|" * (3 * len(runs)) + "---|",
    ]
    for (kernel, config, dtype, target), records in by_variant(runs).items():
        cells = [_usage_cells(r) for r in records]
        columns = [[c[i] for c in cells] for i in range(3)]
        values = [f"**{v}**" if v and v != column[0] else v for column in columns for v in column]
        values[: len(records)] = [v + _cubin_note(r) for v, r in zip(values, records)]
        failing = [name for name, r in zip(names, records) if r is None or r["problems"]]
        lines.append(f"| {kernel} | {config} | {dtype} | {target} | {' | '.join(values)} | {', '.join(failing)} |")
    return lines


def section(data: dict) -> list[str]:
    """The markdown lines of the section."""
    installed, *others = data["triton_runs"]
    also = f' Also compiled by Triton {", ".join(run["triton"] for run in others)}: the table "Triton versions".'
    lines = [
        HEADING,
        "",
        f"Compiled {data['date']} on a machine without a GPU by `python benchmarks/compiled_table.py`: Triton "
        f"{installed['triton']} (registers and spills from `ptxas -v`, {', '.join(installed['ptxas'])}; shared "
        f"memory from Triton's compile metadata) and nvcc {data['nvcc']} (`-Xptxas -v`); {installed['summary']}. "
        "Every variant is checked against its target: shared memory per block, <= 255 registers per thread, "
        "registers x threads <= 64K, and no spills unless the kernel list says why (notes below the table)."
        f"{also if others else ''}",
        "",
        "Roofline on paper, per call: compulsory HBM bytes at the peak bandwidth vs flops at the peak math rate "
        "(bf16: tensor cores, fp32: CUDA cores); the longer binds. A lower bound: peak rates, no launch cost, "
        "perfect reuse on chip. The calls are a depth-12 GPT's at nanochat's 65,536-token vocabulary: AdamW "
        "over the embedding and lm_head (2 x 65,536 x 768 values), Newton-Schulz over Muon's stack of the 12 "
        "MLP input matrices (3072 x 768, transposed to 768 x 3072).",
        "",
        "| target | GPU | shared memory / block | HBM bandwidth | bf16 dense | fp32 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for arch, g in TARGETS.items():
        lines.append(
            f"| {arch} | {g.name} | {g.smem_per_block // 1024} KiB | {g.mem_bw / 1e12:g} TB/s | "
            f"{g.bf16_flops / 1e12:g} TFLOPS | {g.fp32_flops / 1e12:g} TFLOPS |"
        )
    head = (
        "| kernel | config | dtype | target | registers | smem (KiB) | spills (B) | call | MB | GFLOP | "
        "µs at peak BW | µs at peak math | bound |"
    )
    rule = "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"
    marks: dict = {}
    lines += ["", "### Triton kernels", "", head, rule]
    lines += [_resource_row(r["kernel"], r["config"], r["dtype"], r, marks) for r in installed["records"]]
    lines += [""] + [f"{mark} {reason}" for reason, mark in marks.items()]
    lines += versions_table(data["triton_runs"])
    if data["cuda_records"]:
        lines += ["", "### CUDA C++ kernels (nvcc)", "", head, rule]
        lines += [_resource_row(r["function"], r["file"], "", r, marks) for r in data["cuda_records"]]
    problems = problems_of(data)
    if problems:
        lines += ["", "**Over the limits:**", ""] + [f"- {p}" for p in problems]
    lines += [
        "",
        "### AdamW: bytes per parameter per step",
        "",
        "Reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq (state fp32). "
        f"Time per step at peak bandwidth for the call above ({data['adamw'][0]['call']['shape']}):",
        "",
        "| params | bytes / param | flops / param | flop / byte | " + " | ".join(TARGETS) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(TARGETS),
    ]
    for a in data["adamw"]:
        times = " | ".join(f"{roofline(a['call'], t)[0] * 1e3:.3f} ms" for t in TARGETS)
        lines.append(f"| {a['dtype']} | {a['bytes']} | {a['flops']} | {a['flops'] / a['bytes']:.2f} | {times} |")
    lines += [
        "",
        "Memory bound everywhere: the ridge points are "
        + ", ".join(f"{g.fp32_flops / g.mem_bw:.0f} fp32 flop/B on {g.name}" for g in TARGETS.values())
        + ".",
        "",
        "### Newton-Schulz: flops per step vs the plain product",
        "",
        "Plain: 4m²n + 2m³ (X Xᵀ, A², B X). Triton: tiles on/above the diagonal for X Xᵀ and bA + cA², "
        "padding of partial tiles included.",
        "",
        "| shape | plain GFLOP | Triton GFLOP, 128 tiles | plain / Triton | Triton GFLOP, 64 tiles | plain / Triton |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in data["ns_flops"]:
        lines.append(
            f"| {s['shape']} | {s['plain'] / 1e9:.2f} | {s['tiles_128'] / 1e9:.2f} | "
            f"{s['plain'] / s['tiles_128']:.2f}x | {s['tiles_64'] / 1e9:.2f} | {s['plain'] / s['tiles_64']:.2f}x |"
        )
    return lines + [""]


def section_from_file(path: Path) -> list[str]:
    """The section from a compiled.json ([] when there is none)."""
    return section(json.loads(Path(path).read_text())) if Path(path).exists() else []


def _write(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def problems_of(data: dict) -> list[str]:
    """Every variant over its target's limits (or not compiling), each Triton one naming its version."""
    triton = [
        f"Triton {run['triton']}: {p}" for run in data["triton_runs"] for r in run["records"] for p in r["problems"]
    ]
    return triton + [p for r in data["cuda_records"] for p in r["problems"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--triton-only",
        metavar="RUN_JSON",
        type=Path,
        help="compile the Triton variants with the installed Triton only and write that run here "
        "(for --add), not compiled.json or RESULTS.md",
    )
    parser.add_argument(
        "--add",
        metavar="RUN_JSON",
        type=Path,
        action="append",
        default=[],
        help="another Triton version's run (from --triton-only) to put beside the installed one's",
    )
    args = parser.parse_args(argv)
    if args.triton_only:
        run = triton_run()
        args.triton_only.parent.mkdir(parents=True, exist_ok=True)
        _write(args.triton_only, json.dumps(run, indent=1))
        problems = problems_of(dict(triton_runs=[run], cuda_records=[]))
        print("\n".join([f"Triton {run['triton']}: {run['summary']}"] + problems))
        print(f"wrote {args.triton_only}")
        return 1 if problems else 0
    missing = [str(path) for path in args.add if not path.exists()]
    if missing:
        parser.error(f"no run {', '.join(missing)} (did its compile stop early?)")
    out = Path(__file__).resolve().parent
    previous = json.loads((out / "compiled.json").read_text()) if (out / "compiled.json").exists() else {}
    data = collect(added=[json.loads(path.read_text()) for path in args.add], previous=previous.get("triton_runs", []))
    _write(out / "compiled.json", json.dumps(data, indent=1))
    put_section(out / "RESULTS.md", section(data))
    problems = problems_of(data)
    print("\n".join([f"Triton {run['triton']}: {run['summary']}" for run in data["triton_runs"]] + problems))
    print(f"wrote {out / 'compiled.json'} and the section '{HEADING[3:]}' of {out / 'RESULTS.md'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
