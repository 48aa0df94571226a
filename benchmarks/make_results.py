"""Write this CPU's section of benchmarks/RESULTS.md from the pytest-benchmark JSON written by `make bench`
(the other CPUs' sections are kept: results_sections.py)."""

import json
import platform
import sys
from pathlib import Path

import prep_scale
import torch
from compiled_table import section_from_file
from results_sections import cpu_kind, demote, merge

from nanochat_fast.core.paths import replace_atomically
from nanochat_fast.hardware import cpu_bf16_support, cpu_model, format_rate, measured_peaks
from nanochat_fast.hardware.machine import cpuinfo
from nanochat_fast.train.run_report import hardware

# the /proc/cpuinfo flags that say whether a CPU has bf16 arithmetic (x86: AVX512-BF16, AMX; Arm: BF16)
BF16_FLAGS = {"x86_64": ("avx512_bf16", "amx_bf16", "amx_tile"), "aarch64": ("bf16",)}


def cpu_line() -> str:
    """Which kind of CPU the numbers come from: model (family/model: a name like "AMD EPYC" covers
    several generations), its bf16 flags, and bf16's measured matmul rate against fp32's, the
    fact that decides the dtypes here (hardware/precision.py): flags alone do not."""
    info = cpuinfo()
    name = cpu_model()
    ident = f" (family {info['cpu family']}, model {info['model']})" if "cpu family" in info else ""
    flags = set((info.get("flags") or info.get("Features") or "").split())
    wanted = BF16_FLAGS.get(platform.machine(), ())
    bf16_flags = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted) if flags else "flags unknown"
    native = cpu_bf16_support()
    rates = measured_peaks("cpu")
    when = f", probed {rates['measured']}" if rates.get("measured") else ""
    peaks = f"fp32 {format_rate(rates['fp32'])}, bf16 {format_rate(rates['bf16'])}"
    return (
        f"{name}{ident}, ISA {torch.backends.cpu.get_cpu_capability()}; bf16 flags: {bf16_flags} "
        f"({f'native bf16: {native}' if native else 'bf16 emulated'}); matmul peak measured here at "
        f"{torch.get_num_threads()} threads: {peaks} = bf16 {rates['bf16'] / rates['fp32']:.2f}x fp32{when}"
    )


def machine() -> str:
    return f"{hardware()}; torch {torch.__version__}, Python {platform.python_version()}"


def inference_sweep_section(data: dict) -> list[str]:
    """RESULTS.md's "Inference sweep": bench_infer.py's infer_bench figures, one row per batch size."""
    found = [
        b["extra_info"]["inference_sweep"] for b in data["benchmarks"] if "inference_sweep" in b.get("extra_info", {})
    ]
    if not found:
        return []
    r = found[0]
    cfg = r["model_config"]
    lines = [
        f"## Inference sweep ({r['device']}, {r['dtype']})",
        "",
        "| batch | dtype | prefill tok/s | decode tok/s | per-token latency (ms) | TTFT median (ms) "
        "| peak memory (MiB) | MBU | MFU |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["sweep"]:
        lines.append(
            f"| {row['batch_size']} | {row.get('dtype', r['dtype'])} | {row['prefill_tok_per_s']:,.0f} | "
            f"{row['decode_tok_per_s']:,.1f} | "
            f"{row['per_token_latency_s'] * 1e3:.2f} | {row['ttft_median_s'] * 1e3:.1f} | "
            f"{row['peak_memory_bytes'] / 2**20:,.1f} | {row['mbu_percent']:.1f}% | "
            f"{row['mfu_percent']:.2f}% |"
        )
    bandwidth, peak = r["bandwidth"], r["peak_flops"]
    lines += [
        "",
        f"*`{r['command']}`: depth-{cfg['n_layer']} model (n_embd {cfg['n_embd']}, {cfg['n_head']} heads, "
        f"vocab {cfg['vocab_size']}), random weights, {r['params']:,} parameters; per batch size B, B requests "
        f"of {r['prompt_tokens']} random prompt tokens and {r['decode_tokens']} greedy tokens each (no stop "
        f"tokens, no tools) through one BatchEngine, {r['threads']} thread(s); per batch size the fastest "
        f"decode of {r['sweeps']} sweeps (a neighbour only ever adds time). Decode tok/s = B x "
        f"{r['decode_tokens'] - 1} decode steps / their time; TTFT: all B prefills run in the engine's first "
        f"step. MBU = bytes per decode step x steps/s / {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s "
        f"({bandwidth['source']} memory bandwidth), bytes per step = {r['product_weights']:,} weights of the "
        f"products (all but the embeddings) x the row's dtype size + B x ({r['lookup_values_per_row']:,} "
        f"embedding values looked up + KV bytes per position ({r['kv_bytes_per_position']:,} in {r['kv_dtype']}) "
        f"x {r['mean_keys_read']:g} (mean keys read per layer)); dtype auto: each batch size timed on its own mix "
        f"(model/generation_dtype.py); MFU against the {peak['dtype']} peak "
        f"{peak['flops_per_s'] / 1e9:.0f} GFLOP/s ({peak['source']}). Peak memory: {r['peak_memory_source']}.*",
        "",
    ]
    return lines


def lost_node_lines(path: Path) -> list[str]:
    """The lost-node soak's figures (soak_lost_node.py), one line per recorded soak."""
    if not path.exists():
        return []
    lines = [
        "Lost node (`python benchmarks/soak_lost_node.py --runs=N --record=NAME`): two torchrun agents, one "
        "process each, `--nnodes=1:2 --max-restarts=3`; node 1 killed (SIGKILL) at step 7; a run passes when "
        "node 0 finishes, every step logged once, its losses after the resume those of one process resumed from "
        "the same checkpoint, nothing half-written left.",
        "",
    ]
    for name, f in json.loads(path.read_text()).items():
        lines.append(
            f"- {name}: {f['passed']} of {f['runs']} runs passed, median {f['median_seconds']:.0f} s a run, longest "
            f"{f['max_seconds']:.0f} s ({f.get('label', '')}; {f['machine']})"
        )
    return lines + [""]


def soak_section(path: Path) -> list[str]:
    """RESULTS.md's "Distributed soak": soak_distributed.py's figures, one row per recorded soak."""
    if not path.exists():
        return []
    lines = [
        "## Distributed soak",
        "",
        "2 processes, gloo, beside a busy neighbour, on "
        + ", ".join(sorted({f["machine"] for f in json.loads(path.read_text()).values() if f.get("machine")}))
        + ".",
        "",
        "| soak | what | sharding | runs | exit codes | abort lines | failed runs | seconds |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for name, f in json.loads(path.read_text()).items():
        codes = ", ".join(f"{n} x {code}" for code, n in sorted(f["exit_codes"].items()))
        label = f.get("label", "")
        if f.get("seed_failures"):
            label += f" (its seed run, before the soak, failed first: exit {', '.join(map(str, f['seed_failures']))})"
        lines.append(
            f"| {name} | {label} | {f.get('sharding', 'zero2')} | {f['runs']} | {codes} | "
            f"{f['abort_lines']} | {f['failed_runs']} | "
            f"{f'{seconds:.0f}' if (seconds := f.get('seconds')) else '—'} |"
        )
    lines += [
        "",
        "*`python benchmarks/soak_distributed.py --runs=N --record=NAME [--sharding=fsdp]`: each run resumes a tiny "
        "base_train from its step-3 checkpoint under torchrun (2 processes, gloo), evaluates and saves at step 6 and "
        "ends, while a "
        'process of two matmul threads loads both cores; abort lines = "terminate called" in the output. On a '
        "machine shared with other jobs.*",
        "",
    ]
    lines += lost_node_lines(path.with_name("soak_lost_node.json"))
    return lines


def hashing_section(path: Path) -> list[str]:
    """RESULTS.md's "Checkpoint save with digests": checkpoint_save_hashing.py's interleaved saves."""
    if not path.exists():
        return []
    f = json.loads(path.read_text())
    rows = [
        f"| {name} | {f['median_s'][name]:.2f} | {', '.join(f'{t:.1f}' for t in times)} |"
        for name, times in f["seconds"].items()
    ]
    return [
        "## Checkpoint save with digests",
        "",
        f"Depth {f['depth']}, {f['bytes_per_save'] / 1e9:.2f} GB per save, on {f.get('machine', 'an unrecorded CPU')}.",
        "",
        "| save | median (s) | each save (s) |",
        "|---|---:|---|",
        *rows,
        "",
        f"*`python benchmarks/checkpoint_save_hashing.py --depth={f['depth']} --rounds={f['rounds']}`: "
        "checkpoints.save_checkpoint (model.pt, the optimizer state, meta.json, COMPLETE; every file fsynced), "
        "with every file's sha256 computed while it is written (on a side thread that runs on through the fsync; "
        "large writes start their way to disk at once, in both variants) and with a pass-through instead, in "
        f"interleaved rounds; hashed / not hashed = {f['ratio']:.3f}. The disk's speed varies by tens of percent "
        "from one save to the next.*",
        "",
    ]


def main(json_path="benchmarks/results.json", out_path="benchmarks/RESULTS.md"):
    data = json.loads(Path(json_path).read_text())
    if not data.get("benchmarks"):  # a run that collected or ran nothing must not replace the figures
        sys.exit(f"{json_path} holds no benchmark: RESULTS.md left as it is (see the pytest run's errors)")
    lines = [
        f"Machine: {machine()}  ",
        f"CPU: {cpu_line()}  ",
        f"Date: {data.get('datetime', '?')[:19]}  ",
        "Produced by `make bench` (pytest-benchmark; variants timed in interleaved rounds, medians; "
        "ratio = median / median of the baseline, lower is faster; rounds = timed rounds per variant, "
        "cut to each benchmark's time budget, at least 3).",
        "",
    ]
    by_op, tables = {}, []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "variants" in info:
            by_op.setdefault(info["op"], []).append(info)
        if isinstance(info.get("table"), dict):  # a benchmark that reports its own columns (bench_chat_web.py)
            tables.append(info["table"])
    for op, infos in by_op.items():
        lines += [
            f"## {op}",
            "",
            "| shape set | variant | median (ms) | ratio to baseline | rounds |",
            "|---|---|---:|---:|---:|",
        ]
        for info in infos:
            rounds = info.get("rounds", "")
            for name, v in info["variants"].items():
                tag = " (baseline)" if name == info["baseline"] else ""
                lines.append(
                    f"| {info['shape_set']} | {name}{tag} | {v['median_s'] * 1e3:.3f} | "
                    f"{v['ratio_to_baseline']:.3f} | {rounds} |"
                )
            for name, reason in info.get("skipped", {}).items():
                lines.append(f"| {info['shape_set']} | {name} | — | — | 0 ({reason}) |")
            if info.get("notes"):
                lines.append(f"| | *{info['notes']}* | | | |")
        lines.append("")
        for info in infos:  # a variant benchmark's own markdown lines, e.g. the step breakdown
            if isinstance(info.get("table"), list):
                lines += info["table"]
    for t in tables:
        lines += [f"## {t['title']}", "", "| " + " | ".join(t["columns"]) + " |", "|---" * len(t["columns"]) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in t["rows"]] + ["", f"*{t['notes']}*", ""]
        if t.get("targets"):  # figures from the same run against what they should reach
            lines += ["| figure | measured | target | met |", "|---|---:|---|---|"]
            lines += ["| " + " | ".join(row) + " |" for row in t["targets"]] + [""]
    lines += inference_sweep_section(data)  # bench_infer.py
    # sections regenerated from their own JSON, beside the CPUs' (each names what ran it): compiled, not run
    # (compiled_table.py), the preparation at scale (make bench-prepare), the distributed soak
    # (soak_distributed.py) and the checkpoint save with digests (checkpoint_save_hashing.py)
    here = Path(out_path).parent
    own = [section_from_file(here / "compiled.json"), prep_scale.section_from_file(here / "prep_scale.json")]
    own += [soak_section(here / "soak.json"), hashing_section(here / "checkpoint_hashing.json")]
    out = Path(out_path)
    kind = cpu_kind(cpuinfo(), cpu_bf16_support(), torch.backends.cpu.get_cpu_capability())
    text = merge(
        out.read_text() if out.exists() else "",
        kind,
        demote(lines),
        replace={sec[0]: sec[1:] for sec in own if sec},
    )
    replace_atomically(out, lambda tmp: tmp.write_text(text))
    print(f"wrote the section '{kind}' of {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
