"""Write benchmarks/RESULTS.md from the pytest-benchmark JSON written by `make bench`."""
import json
import platform
import sys
from pathlib import Path

import torch

from nanochat_fast import precision
from compiled_table import section_from_file
from nanochat_fast.report import hardware


def machine() -> str:
    bf16 = precision.cpu_bf16_support()
    cpu_bf16 = f"native bf16 ({bf16})" if bf16 else "no native bf16 (bf16 emulated)"
    return f"{hardware()}; CPU: {cpu_bf16}; torch {torch.__version__}, Python {platform.python_version()}"


def main(json_path="benchmarks/results.json", out_path="benchmarks/RESULTS.md"):
    data = json.loads(Path(json_path).read_text())
    lines = ["# Benchmark results", "",
             f"Machine: {machine()}  ",
             f"Date: {data.get('datetime', '?')[:19]}  ",
             "Produced by `make bench` (pytest-benchmark; variants timed in interleaved rounds, medians; "
             "ratio = median / median of the baseline, lower is faster; rounds = timed rounds per variant, "
             "cut to each benchmark's time budget, at least 3).", ""]
    by_op, tables = {}, []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "variants" in info:
            by_op.setdefault(info["op"], []).append(info)
        if isinstance(info.get("table"), dict):  # a benchmark that reports its own columns (bench_chat_web.py)
            tables.append(info["table"])
    for op, infos in by_op.items():
        lines += [f"## {op}", "", "| shape set | variant | median (ms) | ratio to baseline | rounds |",
                  "|---|---|---:|---:|---:|"]
        for info in infos:
            rounds = info.get("rounds", "")
            for name, v in info["variants"].items():
                tag = " (baseline)" if name == info["baseline"] else ""
                lines.append(f"| {info['shape_set']} | {name}{tag} | {v['median_s'] * 1e3:.3f} | "
                             f"{v['ratio_to_baseline']:.3f} | {rounds} |")
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
    lines += section_from_file(Path(out_path).with_name("compiled.json"))  # compiled, not run: compiled_table.py
    Path(out_path).write_text("\n".join(lines))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
