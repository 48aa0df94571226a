"""Write benchmarks/RESULTS.md from the pytest-benchmark JSON written by `make bench`."""
import json
import platform
import sys
from pathlib import Path

import torch

from nanochat_fast.report import hardware


def machine() -> str:
    return f"{hardware()}; torch {torch.__version__}, Python {platform.python_version()}"


def main(json_path="benchmarks/results.json", out_path="benchmarks/RESULTS.md"):
    data = json.loads(Path(json_path).read_text())
    lines = ["# Benchmark results", "",
             f"Machine: {machine()}  ",
             f"Date: {data.get('datetime', '?')[:19]}  ",
             "Produced by `make bench` (pytest-benchmark; variants timed in interleaved rounds, medians; "
             "ratio = median / median of the baseline, lower is faster).", ""]
    by_op = {}
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "variants" in info:
            by_op.setdefault(info["op"], []).append(info)
    for op, infos in by_op.items():
        lines += [f"## {op}", "", "| shape set | variant | median (ms) | ratio to baseline |", "|---|---|---:|---:|"]
        for info in infos:
            for name, v in info["variants"].items():
                tag = " (baseline)" if name == info["baseline"] else ""
                lines.append(f"| {info['shape_set']} | {name}{tag} | {v['median_s'] * 1e3:.3f} | {v['ratio_to_baseline']:.3f} |")
            if info.get("notes"):
                lines.append(f"| | *{info['notes']}* | | |")
        lines.append("")
        for info in infos:  # a benchmark's own table (markdown lines), e.g. the step breakdown
            lines += info.get("table", [])
    Path(out_path).write_text("\n".join(lines))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
