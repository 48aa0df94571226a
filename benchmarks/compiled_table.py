"""
The "compiled, not run" section of benchmarks/RESULTS.md: every Triton kernel variant
(nanochat_fast/kernels/triton_aot.py) and every CUDA C++ kernel (csrc/cuda/*.cu, by nvcc) compiled
for A100, H100 and B200 on a machine without a GPU, with its registers, shared memory and spills,
and a roofline on paper for one representative call: its compulsory HBM bytes and its flops give
the time at the target's peak memory bandwidth and at its peak math rate (bf16 tensor cores for
bf16, fp32 CUDA cores for fp32); the longer of the two binds. Peak figures and their datasheets:
nanochat_fast/kernels/gpu_targets.py.

    python benchmarks/compiled_table.py   # compiles everything, writes benchmarks/compiled.json and
                                          # this section of benchmarks/RESULTS.md

make_results.py appends the same section (from compiled.json) whenever `make bench` rewrites RESULTS.md.
"""
import dataclasses
import datetime
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

from nanochat_fast.kernels.gpu_targets import TARGETS, check, nvcc_usage

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Compiled, not run: A100, H100, B200"
# Shapes for the Newton-Schulz flop table: (stack, rows, cols), rows <= cols as the kernels see them.
NS_SHAPES = [(1, 768, 768), (1, 768, 3072), (1, 1024, 4096), (1, 1280, 1280), (1, 1280, 5120), (8, 768, 768),
             (12, 768, 3072)]


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
    from nanochat_fast.kernels.triton_kernel_list import adamw_call
    calls = {"adamw_slice_kernel<float>": adamw_call(torch.float32),
             "adamw_slice_kernel<__nv_bfloat16>": adamw_call(torch.bfloat16)}
    nvcc, out = _nvcc(), []
    if not nvcc or not Path(nvcc).exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
            for arch in archs:
                for u in nvcc_usage(nvcc, cu, arch, ROOT / "csrc", Path(tmp)):
                    call = calls.get(u.function)
                    out.append(dict(dataclasses.asdict(u), file=f"csrc/cuda/{cu.name}", target=arch,
                                    call=dataclasses.asdict(call) if call else None,
                                    problems=check(u, TARGETS[arch], u.function, shared=u.static_smem, threads=None)))
    return out


def collect(workers=None) -> dict:
    from nanochat_fast.kernels import newton_schulz_triton as nst
    from nanochat_fast.kernels import triton_aot
    from nanochat_fast.kernels import triton_kernel_list as kernel_list
    t0 = time.perf_counter()
    records = triton_aot.compile_all(triton_aot.variants(), workers=workers)
    seconds = time.perf_counter() - t0
    entries = {(e.module, e.kernel): e for e in kernel_list.KERNELS}
    for r in records:
        call = entries[r["module"], r["kernel"]].work(importlib.import_module(r["module"]), r["config_values"],
                                                      triton_aot.torch_dtype(r["dtype"]))
        r["call"] = dataclasses.asdict(call)
    ns = []
    for K, m, n in NS_SHAPES:
        plain = nst.flop_counts(m, n, 128, K)["full_step"]
        ns.append(dict(shape=f"{K} x {m}x{n}" if K > 1 else f"{m}x{n}", plain=plain,
                       **{f"tiles_{b}": nst.flop_counts(m, n, b, K)["step"] for b in (128, 64)}))
    adamw = [dict(dtype=name, bytes=kernel_list.adamw_bytes_per_param(d), flops=kernel_list.ADAMW_FLOPS_PER_PARAM,
                  call=dataclasses.asdict(kernel_list.adamw_call(d)))
             for d, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))]
    import triton
    nvcc = _nvcc()
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    return dict(date=datetime.date.today().isoformat(), triton=triton.__version__,
                ptxas=sorted({r.get("ptxas", "") for r in records} - {""}),
                nvcc=(re.findall(r"release [\d.]+", nvcc_version) or ["not found"])[0],
                summary=triton_aot.summary(records, seconds), triton_records=records, cuda_records=cuda_records(),
                ns_flops=ns, adamw=adamw)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _resource_row(name, config, dtype, r, spill_marks) -> str:
    spills = r["spill_stores"] + r["spill_loads"]
    mark = ""
    if spills and r.get("spills_ok"):
        mark = spill_marks.setdefault(r["spills_ok"], f"[{len(spill_marks) + 1}]")
    call = r.get("call")
    cost = "| — | | | | | |"
    if call:
        t_mem, t_math, bound = roofline(call, r["target"])
        cost = (f"| {call['shape']} | {call['bytes'] / 1e6:,.1f} | {call['flops'] / 1e9:,.2f} | {_us(t_mem)} | "
                f"{_us(t_math)} | {bound} |")
    shared = r["shared"] if "shared" in r else r["static_smem"]
    return (f"| {name} | {config} | {dtype} | {r['target']} | {r['registers']} | {shared / 1024:.1f} | "
            f"{spills:,}{mark} {cost}")


def section(data: dict) -> list[str]:
    """The markdown lines of the section."""
    lines = [HEADING, "",
             f"Compiled {data['date']} on a machine without a GPU by `python benchmarks/compiled_table.py`: Triton "
             f"{data['triton']} (registers and spills from `ptxas -v`, {', '.join(data['ptxas'])}; shared memory from "
             f"Triton's compile metadata) and nvcc {data['nvcc']} (`-Xptxas -v`); {data['summary']}. Every variant is "
             "checked against its target: shared memory per block, <= 255 registers per thread, registers x threads "
             "<= 64K, and no spills unless the kernel list says why (notes below the table).", "",
             "Roofline on paper, per call: compulsory HBM bytes at the peak bandwidth vs flops at the peak math rate "
             "(bf16: tensor cores, fp32: CUDA cores); the longer binds. A lower bound: peak rates, no launch cost, "
             "perfect reuse on chip. The calls are a depth-12 GPT's at nanochat's 65,536-token vocabulary: AdamW "
             "over the embedding and lm_head (2 x 65,536 x 768 values), Newton-Schulz over Muon's stack of the 12 "
             "MLP input matrices (3072 x 768, transposed to 768 x 3072).", "",
             "| target | GPU | shared memory / block | HBM bandwidth | bf16 dense | fp32 |", "|---|---|---:|---:|---:|---:|"]
    for arch, g in TARGETS.items():
        lines.append(f"| {arch} | {g.name} | {g.smem_per_block // 1024} KiB | {g.mem_bw / 1e12:g} TB/s | "
                     f"{g.bf16_flops / 1e12:g} TFLOPS | {g.fp32_flops / 1e12:g} TFLOPS |")
    head = ("| kernel | config | dtype | target | registers | smem (KiB) | spills (B) | call | MB | GFLOP | "
            "µs at peak BW | µs at peak math | bound |")
    rule = "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"
    marks: dict = {}
    lines += ["", "### Triton kernels", "", head, rule]
    lines += [_resource_row(r["kernel"], r["config"], r["dtype"], r, marks) for r in data["triton_records"]]
    lines += [""] + [f"{mark} {reason}" for reason, mark in marks.items()]
    if data["cuda_records"]:
        lines += ["", "### CUDA C++ kernels (nvcc)", "", head, rule]
        lines += [_resource_row(r["function"], r["file"], "", r, marks) for r in data["cuda_records"]]
    problems = [p for r in data["triton_records"] + data["cuda_records"] for p in r["problems"]]
    if problems:
        lines += ["", "**Over the limits:**", ""] + [f"- {p}" for p in problems]
    lines += ["", "### AdamW: bytes per parameter per step", "",
              "Reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq (state fp32). "
              f"Time per step at peak bandwidth for the call above ({data['adamw'][0]['call']['shape']}):", "",
              "| params | bytes / param | flops / param | flop / byte | " + " | ".join(TARGETS) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(TARGETS)]
    for a in data["adamw"]:
        times = " | ".join(f"{roofline(a['call'], t)[0] * 1e3:.3f} ms" for t in TARGETS)
        lines.append(f"| {a['dtype']} | {a['bytes']} | {a['flops']} | {a['flops'] / a['bytes']:.2f} | {times} |")
    lines += ["", "Memory bound everywhere: the ridge points are " +
              ", ".join(f"{g.fp32_flops / g.mem_bw:.0f} fp32 flop/B on {g.name}" for g in TARGETS.values()) + ".",
              "", "### Newton-Schulz: flops per step vs the plain product", "",
              "Plain: 4m²n + 2m³ (X Xᵀ, A², B X). Triton: tiles on/above the diagonal for X Xᵀ and bA + cA², "
              "padding of partial tiles included.", "",
              "| shape | plain GFLOP | Triton GFLOP, 128 tiles | plain / Triton | Triton GFLOP, 64 tiles | plain / Triton |",
              "|---|---:|---:|---:|---:|---:|"]
    for s in data["ns_flops"]:
        lines.append(f"| {s['shape']} | {s['plain'] / 1e9:.2f} | {s['tiles_128'] / 1e9:.2f} | "
                     f"{s['plain'] / s['tiles_128']:.2f}x | {s['tiles_64'] / 1e9:.2f} | {s['plain'] / s['tiles_64']:.2f}x |")
    return lines + [""]


def section_from_file(path: Path) -> list[str]:
    """The section from a compiled.json ([] when there is none)."""
    return section(json.loads(Path(path).read_text())) if Path(path).exists() else []


def _write(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_section(results_md: Path, lines: list[str]):
    """Put the section into RESULTS.md in place of its previous version (or at the end)."""
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    start = text.find(HEADING)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    else:
        end = text.find("\n## ", start + len(HEADING))
        text = text[:start] + "\n".join(lines) + (text[end + 1:] if end >= 0 else "")
    _write(results_md, text)


def main(argv=None) -> int:
    out = Path(__file__).resolve().parent
    data = collect()
    _write(out / "compiled.json", json.dumps(data, indent=1))
    replace_section(out / "RESULTS.md", section(data))
    print(data["summary"])
    print(f"wrote {out / 'compiled.json'} and the section '{HEADING[3:]}' of {out / 'RESULTS.md'}")
    return 1 if any(r["problems"] for r in data["triton_records"] + data["cuda_records"]) else 0


if __name__ == "__main__":
    sys.exit(main())
