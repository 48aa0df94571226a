"""
The GPU check's report (gpu_check.py): OUT/RESULTS-cuda.md, OUT/results-cuda.json with every figure, and
OUT/logs.tar.gz with every step's log, all three rewritten after each step (each file replaced whole).
Each step's figures are read from what it left on disk: gpu_measure.py's JSON, a training run's
metrics.jsonl, infer_bench's last line, pytest's JUnit XML; a step stopped at its cap leaves part of them.
"""

import json
import os
import statistics
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

WARMUP_STEPS = 10  # compilation lands in the first steps of a run; its medians skip them


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_figures(metrics: Path, train_tokens: int | None) -> dict | None:
    """Median tokens/s and MFU of a run's steps after the warmup, its loss and peak memory."""
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        return dict(steps=0)
    timed = [r for r in train if r["step"] >= WARMUP_STEPS] or train
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    peaks = [r["peak_memory_bytes"] for r in train if r.get("peak_memory_bytes")]
    tokens = train[-1].get("tokens_seen")
    return dict(
        steps=len(train),
        timed_steps=f"{timed[0]['step']}-{timed[-1]['step']}",
        tok_per_sec=statistics.median(r["tok_per_sec"] for r in timed),
        mfu=statistics.median(mfus) if mfus else None,
        final_loss=train[-1]["loss"],
        peak_memory_gib=max(peaks) / 2**30 if peaks else None,
        tokens_seen=tokens,
        passes_over_data=tokens / train_tokens if tokens and train_tokens else None,
    )


def junit_counts(xml: Path) -> dict | None:
    if not xml.exists():
        return None
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return dict(passed=total - failed - errors - skipped, failed=failed, errors=errors, skipped=skipped)


def last_json_line(log: Path) -> dict | None:
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def summary(key: str, f) -> str:
    """The step's figures in one line for the step table ('' where its log's last line says it best)."""
    if not f:
        return ""
    if key in ("train", "train_reference") and f.get("steps"):
        return (
            f"{f['steps']} steps; {f['tok_per_sec']:,.0f} tokens/s, MFU {_f(f['mfu'], '{:.1f}%')} over steps "
            f"{f['timed_steps']}; peak {_f(f['peak_memory_gib'], '{:.1f}')} GiB"
        )
    if key == "infer" and f.get("sweep"):
        return "; ".join(
            f"batch {m['batch_size']}: {m['decode_tok_per_s']:,.0f} tok/s, MBU {_f(m.get('mbu_percent'), '{:.0f}%')}"
            for m in f["sweep"]
        )
    if key == "gpu_tests":
        return ", ".join(f"{v} {k}" for k, v in f.items())
    return ""


class Report:
    def __init__(self, out: Path, work: Path, bundle: Path, rehearse: bool):
        self.out, self.work, self.rehearse = out, work, rehearse
        self.started = time.strftime("%Y-%m-%d %H:%M %Z")
        self.bundle = _json(bundle / "manifest.json") or {}
        self.steps = []

    def figures(self, key: str):
        w = self.work
        if key in ("environment", "kernels", "adamw", "newton_schulz", "muon", "cross_entropy"):
            return _json(w / f"{key}.json")
        if key in ("train", "train_reference"):
            run = "gpu_check_d12" if key == "train" else "gpu_check_d12_reference"
            return train_figures(
                w / "home" / "runs" / run / "metrics.jsonl", self.bundle.get("home", {}).get("train_tokens")
            )
        if key == "infer":
            return last_json_line(w / "logs" / "infer.log")
        if key == "gpu_tests":
            return junit_counts(w / "gpu-tests.xml")
        return None

    def add(self, step, status: str, detail: str, seconds: float, cap: float):
        figures = self.figures(step.key)
        self.steps.append(
            dict(
                key=step.key,
                title=step.title,
                status=status,
                detail=summary(step.key, figures) or detail,
                seconds=round(seconds, 1),
                cap_s=round(cap),
                figures=figures,
            )
        )
        self.write()

    def all_ok(self) -> bool:
        return all(s["status"] == "ok" for s in self.steps)

    def verdict(self) -> str:
        bad = [f"{s['key']} ({s['status']})" for s in self.steps if s["status"] != "ok"]
        return (
            "all steps passed"
            if not bad
            else f"{len(self.steps) - len(bad)} of {len(self.steps)} steps passed; not: {', '.join(bad)}"
        )

    def write(self, final: bool = False):
        env = next((s["figures"] for s in self.steps if s["key"] == "environment"), None) or {}
        data = dict(
            started=self.started,
            finished=final,
            rehearsal=self.rehearse,
            verdict=self.verdict(),
            environment=env,
            bundle={k: self.bundle.get(k) for k in ("python", "created", "home", "wheels")},
            seconds=sum(s["seconds"] for s in self.steps),
            steps=self.steps,
        )
        _replace(self.out / "results-cuda.json", json.dumps(data, indent=1))
        _replace(self.out / "RESULTS-cuda.md", "\n".join(self.markdown(data, env)) + "\n")
        tmp = self.out / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for log in sorted((self.work / "logs").glob("*")):
                tar.add(log, arcname=f"logs/{log.name}")
        os.replace(tmp, self.out / "logs.tar.gz")

    def markdown(self, data: dict, env: dict) -> list[str]:
        gpu = env.get("gpu", "no usable GPU")
        where = (
            f"{env.get('count', 1)} x {gpu} ({env.get('arch')}, {env.get('sms')} SMs, {env.get('memory_gib')} GiB), "
            f"driver {env.get('driver')}"
            if "gpu" in env
            else gpu
        )
        lines = [
            f"# GPU check: {gpu}",
            "",
            f"Made by `make gpu-check` on {self.started}"
            f"{' (a rehearsal on a CPU: small shapes)' if self.rehearse else ''}: "
            f"{where}; torch {env.get('torch')} (CUDA {env.get('cuda')}), Triton {env.get('triton')}, "
            f"Python {env.get('python')}; the bundle made {self.bundle.get('created')}.  ",
            f"Verdict: **{data['verdict']}**"
            f"{'' if data['finished'] else ' (so far: the check is running or was stopped)'}. "
            f"{data['seconds']:.0f} s in all. Logs: logs.tar.gz; every figure: results-cuda.json.",
            "",
            "| step | result | time / cap | detail |",
            "|---|---|---:|---|",
        ]
        lines += [
            f"| {s['key']}: {s['title']} | {'ok' if s['status'] == 'ok' else '**' + s['status'] + '**'} | "
            f"{s['seconds']:.0f} / {s['cap_s']} s | {s['detail'].replace('|', '/')[:160]} |"
            for s in self.steps
        ]
        for s in self.steps:
            render = SECTIONS.get(s["key"])
            if render and s["figures"]:
                lines += ["", *render(s["figures"], self)]
        return lines


def _replace(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _f(x, fmt="{:,.2f}"):
    return "n/a" if x is None else fmt.format(x)


def _environment(f: dict, report) -> list[str]:
    lines = [
        "## Environment",
        "",
        "Extension: "
        + ("built with CUDA" if f.get("extension_cuda") else f"NOT built with CUDA: {f.get('extension_why_not')}")
        + ".  ",
    ]
    differ = f.get("node_packages_differ") or {}
    lines.append(
        "The node's packages match benchmarks/gpu_node.txt."
        if not differ
        else "Packages that differ from benchmarks/gpu_node.txt: "
        + ", ".join(f"{n} {d['installed'] or 'missing'} (listed {d['listed']})" for n, d in sorted(differ.items()))
    )
    return lines


def _kernels(f: dict, report) -> list[str]:
    lines = [
        "## Kernels against float64 or the reference backend",
        "",
        "| kernel / config / dtype | max error | tolerance | result |",
        "|---|---:|---:|---|",
    ]
    for key, r in f.get("results", {}).items():
        if not isinstance(r, dict):
            continue
        err = r.get("max_error")
        err = ", ".join(f"{k} {v:.2e}" for k, v in err.items()) if isinstance(err, dict) else _f(err, "{:.2e}")
        result = {True: "ok", False: "**FAILED**", None: "not run"}[r.get("ok")]
        why = (
            r.get("error")
            or r.get("skipped")
            or (f"stock bf16 {r['stock_bf16_error']:.2e}" if "stock_bf16_error" in r else "")
        )
        lines.append(f"| {key} | {err} | {_f(r.get('tolerance'), '{:.1e}')} | {result}{': ' + why if why else ''} |")
    return lines


def _variants_table(title: str, rows: list[tuple], columns: list[str]) -> list[str]:
    return [
        title,
        "",
        "| " + " | ".join(columns) + " |",
        "|---" + "|---:" * (len(columns) - 1) + "|",
        *("| " + " | ".join(map(str, r)) + " |" for r in rows),
    ]


def _adamw(f: dict, report) -> list[str]:
    r = f.get("results", {}).get("adamw")
    if not r:
        return []
    bw = r.get("datasheet_bandwidth")
    rows = [
        (
            name,
            _f(v["ms"], "{:.3f}"),
            _f(v["GB_per_s"], "{:,.0f}"),
            _f(v["pct_of_datasheet"], "{:.0f}%"),
            f"{v['speedup']:.2f}x",
        )
        for name, v in r["variants"].items()
    ]
    return _variants_table(
        f"## AdamW slice update: {r['params'] / 1e6:.1f}M fp32 values in {r['tensors']} tensors, "
        f"{r['bytes_per_param']} B each; datasheet bandwidth {_f(bw and bw / 1e12, '{:.2f}')} TB/s",
        rows,
        ["variant", "ms", "GB/s", "% of datasheet", "vs torch fused"],
    )


def _newton_schulz(f: dict, report) -> list[str]:
    rows = []
    for key, r in f.get("results", {}).items():
        if key.startswith("newton_schulz/") and "variants" in r:
            ours, stock = r["variants"]["triton symmetric (ours)"], r["variants"]["torch bf16 matmuls (cuBLAS)"]
            rows.append(
                (
                    f"{r['shape'][0]} x {r['shape'][1]}",
                    f"{ours['ms']:.2f}",
                    f"{stock['ms']:.2f}",
                    f"{ours['speedup']:.2f}x",
                    f"{ours['plain_tflops']:.0f}",
                    f"{r['difference']:.1e}",
                )
            )
    return _variants_table(
        "## Newton-Schulz, 5 quintic steps, bf16: ours (Triton, symmetric) vs plain bf16 cuBLAS",
        rows,
        ["m x m", "ours ms", "cuBLAS ms", "speedup", "ours TFLOP/s (plain-equivalent)", "max difference"],
    )


def _muon(f: dict, report) -> list[str]:
    rows = []
    for key, r in f.get("results", {}).items():
        if key.startswith("muon/") and "variants" in r:
            ours, stock = r["variants"]["ours (Muon, defaults)"], r["variants"]["torch.optim.Muon"]
            rows.append(
                (
                    r["depth"],
                    r["matrices"],
                    f"{r['params'] / 1e6:.1f}M",
                    f"{ours['ms']:.2f}",
                    f"{stock['ms']:.2f}",
                    f"{ours['speedup']:.2f}x",
                )
            )
    return _variants_table(
        "## Muon step vs torch.optim.Muon",
        rows,
        ["depth", "matrices", "values", "ours ms", "torch.optim.Muon ms", "speedup"],
    )


def _cross_entropy(f: dict, report) -> list[str]:
    r = f.get("results", {}).get("cross_entropy")
    if not r:
        return []
    rows = [
        (
            name,
            _f(v.get("ms"), "{:.2f}"),
            _f(v.get("peak_extra_MiB"), "{:,.0f}"),
            _f(v.get("speedup_vs_best_stock"), "{:.2f}x"),
            v.get("error") or f"{v.get('loss'):.5f}",
        )
        for name, v in r["variants"].items()
    ]
    return _variants_table(
        f"## Softcapped cross-entropy, forward+backward: {r['rows']:,} rows x {r['n_embd']} -> "
        f"{r['vocab']:,} ({r['dtype']})",
        rows,
        ["variant", "ms", "peak extra MiB", "vs best stock", "loss"],
    )


def _train(f: dict, report) -> list[str]:
    ref = next((s["figures"] for s in report.steps if s["key"] == "train_reference"), None)
    ours = next((s["figures"] for s in report.steps if s["key"] == "train"), None) or {}
    home = report.bundle.get("home", {})
    lines = [
        "## Training: base_train --depth=12 with the defaults",
        "",
        "| run | steps | timed steps | tokens/s | MFU | final loss | peak memory GiB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in (("ours", ours), ("NANOCHAT_FAST_KERNELS=reference", ref)):
        if r and r.get("steps"):
            lines.append(
                f"| {name} | {r['steps']} | {r['timed_steps']} | {r['tok_per_sec']:,.0f} | "
                f"{_f(r['mfu'], '{:.1f}%')} | {r['final_loss']:.3f} | {_f(r['peak_memory_gib'])} |"
            )
    if ours.get("tok_per_sec") and ref and ref.get("tok_per_sec"):
        lines += ["", f"Ours over the reference kernels: {ours['tok_per_sec'] / ref['tok_per_sec']:.2f}x tokens/s."]
    if ours.get("passes_over_data"):
        lines += [
            "",
            f"The bundle's home holds {home.get('train_tokens', 0):,} training tokens (the built-in corpus): "
            f"the run looped its shards {ours['passes_over_data']:.1f} times, so its loss says nothing of quality.",
        ]
    return lines


def _infer(f: dict, report) -> list[str]:
    rows = [
        (
            m["batch_size"],
            f"{m['decode_tok_per_s']:,.0f}",
            f"{m['per_token_latency_s'] * 1e3:.2f}",
            _f(m.get("mbu_percent"), "{:.1f}%"),
            _f(m.get("mfu_percent"), "{:.2f}%"),
            f"{m['prefill_tok_per_s']:,.0f}",
            f"{m['peak_memory_bytes'] / 2**30:.2f}",
        )
        for m in f.get("sweep", [])
    ]
    return _variants_table(
        "## Inference: infer_bench --depth=12 (random weights, 128-token prompts, 128 tokens each)",
        rows,
        ["batch", "decode tok/s", "ms/token", "MBU", "MFU", "prefill tok/s", "peak GiB"],
    )


SECTIONS = dict(
    environment=_environment,
    kernels=_kernels,
    adamw=_adamw,
    newton_schulz=_newton_schulz,
    muon=_muon,
    cross_entropy=_cross_entropy,
    train=_train,
    infer=_infer,
)
