"""
The report card of a pipeline: the base, mid, sft and rl runs and their evaluations in one
report.md, like nanochat's report card, also printed.

    python -m nanochat_fast.scripts.report                  # the newest rl (else sft) run and the runs it started from
    python -m nanochat_fast.scripts.report --sft-run=sft_d20 --rl-run=none --output=report.md
    python -m nanochat_fast.scripts.report --base-run=base_d4 --mid-run=mid_d4 --sft-run=none --rl-run=none

Which runs: --rl-run (default: the newest rl run); --sft-run (default: the run that rl run started
from, else the newest sft run); --mid-run (default: the run that sft run started from, else the
newest mid run); --base-run (default: the run the mid (or sft) run started from, else the newest
base run); "none" leaves a stage out. Each run is read at its newest complete checkpoint: meta.json
(model, steps, tokens, training time, device) and evals.json (what base_eval and chat_eval measured
at that step, with their own run time). Cost is training time (optimizer steps only) times what
ran: GPU-hours (processes, one GPU each) or core-hours (processes x threads per process) on a CPU.
"""

import time
from pathlib import Path

from .. import checkpoints
from ..core import cli, paths
from ..core.errors import UserError
from ..evals import task_runner, tasks
from ..model import loading
from ..train.env_vars import check_environment
from .chat_eval import chat_core

STAGES = (("base", "BASE"), ("mid", "MID"), ("sft", "SFT"), ("rl", "RL"))
NONE = "none"


def run_or_none(value) -> str:
    return value if value == NONE else cli.run_ref(value)


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.report", description=__doc__)
    for phase, _ in STAGES:
        p.add_argument(
            f"--{phase}-run",
            type=run_or_none,
            default="",
            help=f"the {phase} run (name or directory; 'none': leave it out; default: see above)",
        )
    p.add_argument(
        "--output", default="", help="where to write the report card (default: NANOCHAT_FAST_HOME/report.md)"
    )
    return p


def newest_meta(run_dir: Path) -> dict:
    return checkpoints.load_meta(checkpoints.resolve_checkpoint(run_dir))


def ancestor(run_dir: Path, phase: str) -> Path | None:
    """The run of `phase` that run_dir descends from (its source, its source's source, ... while there)."""
    seen = set()
    while run_dir not in seen:
        seen.add(run_dir)
        source = newest_meta(run_dir).get("base_checkpoint")
        run_dir = Path(source).parent.parent if source else None
        if run_dir is None or not checkpoints.complete_checkpoints(run_dir):
            return None
        if newest_meta(run_dir).get("phase") == phase:
            return run_dir
    return None


def pick_runs(args) -> dict:
    """{phase: run directory or None}: the flags, else the sft run's lineage, else the newest runs."""
    chosen = {}
    for phase, _ in reversed(STAGES):  # rl first: the earlier stages follow its lineage
        flag = getattr(args, f"{phase}_run")
        later = [d for d in chosen.values() if d is not None]
        if flag:
            chosen[phase] = None if flag == NONE else checkpoints.run_dir_of(flag, (phase,))
        elif later:
            lineage = [a for a in (ancestor(d, phase) for d in later) if a is not None]
            chosen[phase] = lineage[0] if lineage else None
        else:
            try:
                chosen[phase] = checkpoints.newest_run((phase,))
            except UserError:
                chosen[phase] = None
    if not any(chosen.values()):
        raise UserError(
            f"no runs to report on in {paths.runs_dir()}: train one with "
            "`python -m nanochat_fast.scripts.base_train` (or pick runs with --base-run, --mid-run, --sft-run, "
            "--rl-run)"
        )
    return {phase: chosen[phase] for phase, _ in STAGES}


def cost(meta: dict) -> str:
    """GPU-hours or core-hours of the optimizer steps."""
    device, seconds = meta.get("device"), meta["loop_state"]["train_time"]
    if not device:
        return "n/a (no device recorded)"
    if device["type"] == "cpu":
        n, threads = device["processes"], device["threads_per_process"]
        return f"{n * threads * seconds / 3600:.3f} core-hours ({n} x {threads} threads)"
    return f"{device['processes'] * seconds / 3600:.3f} GPU-hours ({device['processes']} x {device['type']})"


def stage_facts(run_dir: Path) -> dict:
    """A run's newest checkpoint's meta and its evaluations there (else at the newest step evaluated)."""
    ckpt = checkpoints.resolve_checkpoint(run_dir)
    meta = checkpoints.load_meta(ckpt)
    recorded = task_runner.read_records(run_dir)["steps"]
    step = str(meta["step"]) if str(meta["step"]) in recorded else max(recorded, key=int, default=None)
    return {
        "run_dir": run_dir,
        "ckpt": ckpt,
        "meta": meta,
        "evals": recorded.get(step, {}) if step else {},
        "evals_step": int(step) if step else None,
    }


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def chat_cell(r: dict) -> str:
    lo, hi = r["interval_95"]
    return f"{percent(r['accuracy'])} [{percent(lo)}, {percent(hi)}] (n={r['total']:,})"


def summary_rows(facts: dict) -> list[tuple[str, dict]]:
    """(metric, {phase: text}): one metric per row, one stage per column."""

    def cell(fn, fmt=lambda value: value):
        values = {phase: fn(f) for phase, f in facts.items()}
        return {phase: fmt(v) for phase, v in values.items() if v is not None}

    def pass_at_1(f):
        return f["meta"]["loop_state"].get("last_evals", {}).get("pass@1") if f["meta"].get("phase") == "rl" else None

    four = "{:.4f}".format
    bpb = cell(lambda f: f["meta"]["loop_state"].get("last_val_bpb"), four)
    rows = [("val bpb (end of training, the stage's own val split)", bpb)]
    core = cell(lambda f: f["evals"].get("base_eval", {}).get("core_subset"))
    if core:
        rows.append((next(iter(core.values()))["name"], {p: four(c["core_subset"]) for p, c in core.items()}))
    for task in tasks.CHAT_TASKS:
        found = cell(lambda f, t=task.name: f["evals"].get("chat_eval", {}).get(t), chat_cell)
        if found:
            rows.append((f"{task.name} (chance {percent(task.chance)})", found))
    chatcore = cell(lambda f: chat_core(f["evals"].get("chat_eval", {})), four)
    if chatcore:
        rows.append(("ChatCORE (six tasks, centred by chance)", chatcore))
    rl = cell(pass_at_1, four)
    if rl:
        task = next(f["meta"]["args"].get("task") for f in facts.values() if f["meta"].get("phase") == "rl")
        rows.append((f"pass@1 on held-out {task} questions (chat_rl's eval, sampled)", rl))
    return rows + [
        ("training time (optimizer steps)", cell(lambda f: f"{f['meta']['loop_state']['train_time']:.0f} s")),
        ("tokens seen", cell(lambda f: f"{f['meta']['loop_state']['tokens_seen']:,}")),
        ("cost", cell(lambda f: cost(f["meta"]))),
    ]


def stage_section(phase: str, f: dict) -> list[str]:
    meta, state = f["meta"], f["meta"]["loop_state"]
    config, device = meta["model_config"], meta.get("device") or {}
    n_params = sum(p.numel() for p in loading.meta_model(loading.config_of(meta, Path("meta.json"))).parameters())
    first, last = state.get("first_val_bpb"), state.get("last_val_bpb")
    facts = {
        "run": f"{f['run_dir'].name} ({f['run_dir']})",
        "checkpoint": f"step {meta['step']} ({f['ckpt']})",
        "started from": meta.get("base_checkpoint", "fresh weights (the depth dial)"),
        "model": f"{config['n_layer']} layers, n_embd {config['n_embd']}, {n_params:,} parameters, "
        f"context {config['sequence_len']}",
        "data": meta["args"].get("dataset", "n/a"),
        "steps": f"{state['step']:,}",
        "tokens seen": f"{state['tokens_seen']:,}" + (" (padding included)" if phase == "sft" else ""),
        "training time (optimizer steps)": f"{state['train_time']:.1f} s",
        "cost": cost(meta),
        "ran on": f"{device.get('hardware', 'n/a')}; {device.get('processes', '?')} process(es)",
        "val bpb": f"{first:.4f} at start -> {last:.4f} at the end"
        if first is not None and last is not None
        else "n/a",
        **{f"{k} (last in-training eval)": f"{v:.4f}" for k, v in state.get("last_evals", {}).items()},
    }
    lines = [
        f"## {phase}: {f['run_dir'].name}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts.items()),
        "",
    ]
    evals, at = f["evals"], f" (checkpoint step {f['evals_step']})" if f["evals_step"] != meta["step"] else ""
    base = evals.get("base_eval", {})
    if "val_bpb" in base:
        v = base["val_bpb"]
        lines += [
            f"base_eval{at}: val bpb {v['value']:.4f} on the {v['dataset']} val split "
            f"(up to {v['eval_tokens']:,} tokens).",
            "",
        ]
    core = base.get("core_subset")
    if core:
        sample = f"{core['max_examples']} items per task" if core.get("max_examples") else "every item"
        lines += [
            f"{core['name']}{at}: **{core['core_subset']:.4f}** (mean of the centred accuracies; {sample})",
            "",
            "| task | shots | accuracy | correct / total | chance | centred |",
            "|---|---|---|---|---|---|",
        ]
        for label, acc in core["results"].items():
            c = core["counts"][label]
            lines.append(
                f"| {label} | {c['shots']} | {percent(acc)} | {c['correct']} / {c['total']} | "
                f"{percent(core['chance'][label])} | {core['centered'][label]:+.4f} |"
            )
        lines.append("")
    chat = evals.get("chat_eval")
    if chat:
        lines += [
            f"chat_eval{at}:",
            "",
            "| task | accuracy | correct / total | chance | 95% interval | time |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in chat.items():
            lo, hi = r["interval_95"]
            lines.append(
                f"| {name} | {percent(r['accuracy'])} | {r['correct']} / {r['total']} {r['split']} | "
                f"{percent(r['chance'])} | {percent(lo)} - {percent(hi)} | {r['seconds']:.1f} s |"
            )
        lines.append("")
    return lines


def render(facts: dict) -> str:
    present = [(phase, title) for phase, title in STAGES if facts[phase] is not None]
    lines = [
        "# nanochat_fast report card",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "",
        "Runs: "
        + ", ".join(
            f"{phase} `{facts[phase]['run_dir'].name}` (step {facts[phase]['meta']['step']})" for phase, _ in present
        )
        + ". Pick others with --base-run, --mid-run, --sft-run, --rl-run "
        "(a run name or directory, or none).",
        "",
        "## Summary",
        "",
        "| metric | " + " | ".join(title for _, title in present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for metric, values in summary_rows({p: facts[p] for p, _ in present}):
        lines.append(f"| {metric} | " + " | ".join(values.get(p, "-") for p, _ in present) + " |")
    total = sum(facts[p]["meta"]["loop_state"]["train_time"] for p, _ in present)
    lines += [
        "",
        f"Total training time: {total / 60:.1f} min.",
        "",
        "Chat tasks: accuracy [95% Wilson interval] (n = examples evaluated). A score whose interval holds "
        "the chance level is indistinguishable from guessing. The CORE subset averages the accuracies of the "
        f"{len(tasks.CORE_SUBSET)} CORE tasks we have offline, each centred by its chance level (0 = chance, "
        "1 = perfect); it is not comparable with published (22-task) CORE scores.",
        "",
    ]
    for phase, _ in present:
        lines += stage_section(phase, facts[phase])
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_environment()
    text = render({phase: stage_facts(d) if d is not None else None for phase, d in pick_runs(args).items()})
    output = Path(args.output).expanduser() if args.output else paths.home() / "report.md"
    if output.is_dir():
        raise UserError(f"argument --output: {output} is a directory; give a file name")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        paths.write_durably(output, lambda f: f.write((text + "\n").encode()))
    except OSError as e:
        raise UserError(f"argument --output: cannot write {output} ({e.strerror or e})") from None
    print(text)
    print(f"report card: {output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
