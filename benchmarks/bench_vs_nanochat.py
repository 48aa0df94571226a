"""
Training speed against nanochat itself, at its best: its own base_train from a checkout and ours on the same
model, config, data and machine, in interleaved rounds (the machine may be shared).

    python benchmarks/bench_vs_nanochat.py --nanochat=DIR --home=HOME [--nanochat-gpt=DIR] [--depths=4,8]
        [--steps=25,200] [--rounds=2] [--dtypes=float32,bfloat16] [--ours=defaults,compile] [--pythonpath=DIR]

windowed: ours --arch=windowed against nanochat@92d63d4 (--nanochat), window pattern SL; gpt: ours --arch=gpt
against nanochat@92c6654 (--nanochat-gpt; fp32 only: it autocasts on CUDA alone). T=512, 8 rows, 4,096 tokens
per step; evaluation, sampling and CORE off. nanochat runs in each of --dtypes (NANOCHAT_DTYPE), compiled as it
always is; its fastest is the reference. Ours: defaults (the compile rule decides) and --compile. Per run: tok/s,
the median of the steps after the first 5 (compile excluded); wall, steps x 4,096 / the process's whole wall time
(start-up and compile included). HOME: a NANOCHAT_FAST_HOME with base data and a tokenizer (prepare_data,
tok_train). A checkout at another commit, or one whose imports fail, stops the script in one line before timing.
"""

import argparse
import ast
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nanochat_fast.core import cli
from nanochat_fast.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--max-seq-len=512", "--device-batch-size=8", "--total-batch-size=4096"]
CONFIG = ["--depth=4", *SHAPE, "--window-pattern=SL"]  # the windowed model at depth 4 (import_nanochat_trained)
TOKENS_PER_STEP = 4096
NANOCHAT_DTYPES = ("float32", "bfloat16", "float16")  # its NANOCHAT_DTYPE values
WARMUP = 5


@dataclass(frozen=True)
class Checkout:
    """A nanochat commit this benchmark drives: its id, the sha256 of scripts/base_train.py + nanochat/gpt.py
    (what names a checkout that is not a git one) and the dtypes it computes in on a CPU."""

    commit: str
    content_sha256: str
    dtypes: tuple[str, ...]


CHECKOUTS = {
    "windowed": Checkout(
        "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd",
        "3c8dcb4793326e8d3cd59b66b10fd6e9c200737ddb9478034f91150419db0ac4",
        NANOCHAT_DTYPES,
    ),
    "gpt": Checkout(
        "92c6654b9573362777daa44236b2269a75acf9b4",
        "3e9de78a45914cdf4c12bc44831180fbfafeeee2ec1f534124cee13d8a7b92f2",
        ("float32",),
    ),
}


def content_sha256(checkout: Path) -> str:
    h = hashlib.sha256()
    for part in ("scripts/base_train.py", "nanochat/gpt.py"):
        h.update((checkout / part).read_bytes())
    return h.hexdigest()


def checkout_commit(checkout: Path) -> str | None:
    """HEAD of the git checkout whose top is `checkout`, else None (not a git checkout of its own)."""
    git = ["git", "-C", str(checkout), "rev-parse", "--show-toplevel", "HEAD"]
    proc = subprocess.run(git, capture_output=True, text=True)
    if proc.returncode:
        return None
    top, head = proc.stdout.split()
    return head if Path(top).resolve() == checkout.resolve() else None


def identify(checkout: Path, family: str, flag: str) -> None:
    """Raises UserError unless `checkout` is nanochat at the family's commit: git's HEAD where it is a git
    checkout (local edits to the two files that define the model and the run count as another commit),
    else the content of those two files."""
    want = CHECKOUTS[family]
    short = want.commit[:7]
    if not (checkout / "scripts" / "base_train.py").is_file() or not (checkout / "nanochat" / "gpt.py").is_file():
        raise UserError(f"{flag}={checkout}: not a nanochat checkout (no scripts/base_train.py, nanochat/gpt.py)")
    head = checkout_commit(checkout)
    if head is not None and head != want.commit:
        raise UserError(
            f"{flag}={checkout} is nanochat@{head[:7]}, not {short} (the {family} family's): "
            f"git -C {checkout} checkout {short}"
        )
    if content_sha256(checkout) != want.content_sha256:
        what = "has local edits to" if head else "is not a git checkout and its"
        raise UserError(
            f"{flag}={checkout} {what} scripts/base_train.py or nanochat/gpt.py differ from nanochat@{short}: "
            f"use a clean checkout at {short}"
        )


def script_imports(script: Path) -> list[str]:
    """The modules a script imports at its top level (what running it needs first)."""
    tree = ast.parse(script.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return list(dict.fromkeys(names))


def smoke_test(checkout: Path, flag: str, extra_path: str) -> None:
    """Raises UserError unless every module nanochat's base_train imports imports, in the environment
    its runs get (a scratch base directory: nanochat makes folders there on import)."""
    modules = script_imports(checkout / "scripts" / "base_train.py")
    # argv emptied first: 92c6654's base_eval reads its flags from sys.argv on import
    code = (
        "import importlib, sys\nmodules = sys.argv[1:]; del sys.argv[1:]\nfor m in modules: importlib.import_module(m)"
    )
    with tempfile.TemporaryDirectory() as base:
        env = nanochat_env(checkout, Path(base), None, extra_path)
        proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=checkout, env=env, capture_output=True)
    if proc.returncode:
        lines = proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"]
        raise UserError(
            f"{flag}={checkout} cannot run here: importing its base_train's modules failed: {lines[-1]} "
            "(install what is missing, or give its folder with --pythonpath=DIR)"
        )


def nanochat_base_dir(home: Path, out: Path) -> Path:
    """nanochat's base directory holding our tokenizer and base data, made once: our base train shards as
    its parquet files and our val shard as its last one, under both commits' folder names."""
    env = dict(os.environ, NANOCHAT_FAST_HOME=str(home))
    data = out / "base_data_climbmix"
    if not data.is_dir():
        tmp = out / "base_data_climbmix.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        train = sorted((home / "data" / "base" / "train").glob("shard_*.parquet"))
        val = sorted((home / "data" / "base" / "val").glob("shard_*.parquet"))
        for i, path in enumerate([*train, val[0]]):  # nanochat's val split is its last file
            shutil.copy(path, tmp / f"shard_{i:05d}.parquet")
        script = (
            "import sys; from pathlib import Path; from nanochat_fast.data.tokenizer import get_tokenizer; "
            "from nanochat_fast.interop.nanochat_tokenizer import write_tokenizer_files; "
            "write_tokenizer_files(get_tokenizer(), Path(sys.argv[1]))"
        )
        subprocess.run([sys.executable, "-c", script, str(out / "tokenizer")], env=env, check=True)
        tmp.rename(data)
    if not (out / "base_data").exists():  # 92c6654's name for the same folder
        (out / "base_data").symlink_to(data.name)
    return out


def nanochat_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of a script that runs nanochat's own code beside ours."""
    p = cli.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanochat", type=Path, required=True, help="a nanochat checkout at 92d63d4 (windowed)")
    p.add_argument("--home", type=Path, required=True, help="a NANOCHAT_FAST_HOME with base data and a tokenizer")
    p.add_argument("--pythonpath", default="", help="where nanochat's own dependencies are (rustbpe, psutil)")
    return p


def nanochat_env(nanochat: Path, base: Path, dtype: str | None, extra_path: str = "") -> dict:
    """The environment nanochat's scripts run in: its base directory, its checkout on the path."""
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(nanochat), extra_path]))
    if dtype:
        env["NANOCHAT_DTYPE"] = dtype
    env.pop("NANOCHAT_FAST_HOME", None)
    return env


def run_checked(cmd: list, cwd, env: dict, what: str) -> subprocess.CompletedProcess:
    """cmd run to its end, its output captured; the script stops with that output if it failed."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def tok_per_s(log: str, pattern: str) -> float:
    values = [float(v.replace(",", "")) for v in re.findall(pattern, log)]
    if len(values) <= WARMUP:
        raise SystemExit(f"too few step lines ({len(values)}) in:\n{log[-3000:]}")
    return statistics.median(values[WARMUP:])


@dataclass
class Run:
    tok_s: float  # median over the steps after warmup
    wall_tok_s: float  # the whole run's tokens / the process's wall time
    log: str


def timed(cmd, cwd, env, what, steps: int, pattern: str) -> Run:
    """cmd run with a cold compile cache of its own (what a first run gets), timed as a whole."""
    with tempfile.TemporaryDirectory(prefix="inductor_") as cache:
        env = dict(env, TORCHINDUCTOR_CACHE_DIR=cache)
        t0 = time.perf_counter()
        proc = run_checked(cmd, cwd, env, what)
        wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    return Run(tok_per_s(log, pattern), steps * TOKENS_PER_STEP / wall, log)


def nanochat_cmd(family: str, depth: int, steps: int) -> list[str]:
    if family == "windowed":
        cmd = [f"--depth={depth}", *SHAPE, "--window-pattern=SL", f"--num-iterations={steps}", "--eval-every=-1"]
        return cmd + ["--core-metric-every=-1", "--sample-every=-1", "--device-type=cpu", "--run=dummy"]
    # 92c6654's configurator takes underscores; it evaluates and samples at its last step whatever the
    # flags (so one 4,096-token batch), and eval_every=-1 would evaluate at every step (step % -1 == 0)
    flags = ["--" + f[2:].replace("-", "_") for f in SHAPE]
    return [f"--depth={depth}", *flags, f"--num_iterations={steps}", f"--eval_every={steps + 1}"] + [
        "--eval_tokens=4096",
        "--core_metric_every=-1",
        f"--sample_every={steps + 1}",
        "--device_type=cpu",
        "--run=dummy",
    ]


def run_nanochat(checkout: Path, family: str, base: Path, depth: int, steps: int, dtype: str, extra: str) -> Run:
    env = nanochat_env(checkout, base, dtype, extra)
    cmd = [sys.executable, "-m", "scripts.base_train", *nanochat_cmd(family, depth, steps)]
    return timed(cmd, checkout, env, f"nanochat ({family}, {dtype})", steps, r"tok/sec: ([\d,]+)")


def run_ours(home: Path, family: str, depth: int, steps: int, flags: list[str]) -> Run:
    env = dict(os.environ, NANOCHAT_FAST_HOME=str(home))
    model = ["--arch=windowed", "--window-pattern=SL"] if family == "windowed" else ["--arch=gpt"]
    cmd = [sys.executable, "-m", "nanochat_fast.scripts.base_train", *model, f"--depth={depth}", *SHAPE, *flags]
    cmd += [f"--num-iterations={steps}", "--eval-every=-1", "--sample-every=-1", "--run=speed", "--overwrite"]
    return timed(cmd, ROOT, env, "ours", steps, r"tok/s ([\d,]+)")


def ours_note(log: str) -> str:
    """What our defaults decided: "bf16, eager" from the run's precision and compile lines."""
    dtype = re.search(r"^precision: (\w+)", log, re.M)
    compiled = re.search(r"^compile: (\w+)", log, re.M)
    return ", ".join(m.group(1) for m in (dtype, compiled) if m)


def variants(a, family: str, checkout: Path, base: Path, depth: int, steps: int) -> dict:
    """name -> a function timing it once, nanochat's dtypes first."""
    out = {}
    for dtype in (d for d in a.dtypes if d in CHECKOUTS[family].dtypes):
        name = f"nanochat@{CHECKOUTS[family].commit[:7]} NANOCHAT_DTYPE={dtype}"
        out[name] = lambda dtype=dtype: run_nanochat(checkout, family, base, depth, steps, dtype, a.pythonpath)
    if "defaults" in a.ours:
        out[f"ours --arch={family}, defaults"] = lambda: run_ours(a.home, family, depth, steps, [])
    if "compile" in a.ours:
        out[f"ours --arch={family} --compile"] = lambda: run_ours(a.home, family, depth, steps, ["--compile"])
    return out


def report(results: dict, loads: list[str]) -> None:
    """One table per (family, depth, steps): medians over rounds, ratios to nanochat's fastest dtype."""
    for (family, depth, steps), runs in results.items():
        best = max(
            (n for n in runs if n.startswith("nanochat")), key=lambda n: statistics.median(r.tok_s for r in runs[n])
        )
        ref = {k: statistics.median(getattr(r, k) for r in runs[best]) for k in ("tok_s", "wall_tok_s")}
        print(f"\n{family}, depth {depth}, {steps} steps; reference: {best} (its fastest after warmup)")
        print(
            "| variant | tok/s after warmup | vs best | whole-run tok/s (wall) | vs best "
            "| rounds (after warmup / whole run) |"
        )
        print("|---|---:|---:|---:|---:|---|")
        for name, rs in runs.items():
            med = {k: statistics.median(getattr(r, k) for r in rs) for k in ref}
            note = f" ({ours_note(rs[-1].log)})" if name.endswith("defaults") else ""
            print(
                f"| {name}{note} | {med['tok_s']:,.0f} | {med['tok_s'] / ref['tok_s']:.2f}x | "
                f"{med['wall_tok_s']:,.0f} | {med['wall_tok_s'] / ref['wall_tok_s']:.2f}x | "
                f"{', '.join(f'{r.tok_s:,.0f} / {r.wall_tok_s:,.0f}' for r in rs)} |"
            )
    print("\nload average (1, 5, 15 min) after each round: " + "; ".join(loads))


def check_checkouts(a) -> list[tuple[str, Path]]:
    """(family, checkout) to time, each identified and smoke-tested first (UserError: one line, exit 2)."""
    pairs = [("windowed", a.nanochat, "--nanochat")]
    if a.nanochat_gpt:
        pairs.append(("gpt", a.nanochat_gpt, "--nanochat-gpt"))
    for family, checkout, flag in pairs:
        identify(checkout, family, flag)
        smoke_test(checkout, flag, a.pythonpath)
    if not (a.home / "tokenizer").is_dir() or not (a.home / "data" / "base" / "val").is_dir():
        raise UserError(f"--home={a.home}: no tokenizer or base data: run prepare_data and tok_train with it")
    return [(family, checkout) for family, checkout, _ in pairs]


def positive_ints(value: str) -> list[int]:
    """ "4,8" -> [4, 8] (argparse's type for --depths and --steps)."""
    return [cli.positive_int(v) for v in value.split(",")]


def nanochat_dtypes(value: str) -> list[str]:
    dtypes = value.split(",")
    bad = [d for d in dtypes if d not in NANOCHAT_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"must be among float32, bfloat16, float16, got {', '.join(bad)}")
    return dtypes


def our_variants(value: str) -> list[str]:
    names = value.split(",")
    if not names or set(names) - {"defaults", "compile"}:
        raise argparse.ArgumentTypeError(f"must be among defaults, compile, got {value}")
    return names


def main(argv=None) -> int:
    p = nanochat_parser(__doc__)
    p.add_argument("--nanochat-gpt", type=Path, help="a nanochat checkout at 92c6654 (the gpt family)")
    p.add_argument("--depths", type=positive_ints, default=[4], help="model depths, comma-separated")
    p.add_argument("--steps", type=positive_ints, default=[25], help="run lengths, comma-separated")
    p.add_argument("--rounds", type=cli.positive_int, default=2)
    p.add_argument(
        "--dtypes", type=nanochat_dtypes, default="float32,bfloat16", help="nanochat's NANOCHAT_DTYPE values to time"
    )
    p.add_argument(
        "--ours",
        type=our_variants,
        default="defaults,compile",
        help="our runs to time: defaults (the compile rule decides), compile (--compile)",
    )
    a = p.parse_args(argv)
    pairs = check_checkouts(a)
    base = nanochat_base_dir(a.home, ROOT / "build" / "nanochat_base")
    plan = {
        (family, depth, steps): variants(a, family, checkout, base, depth, steps)
        for family, checkout in pairs
        for depth in a.depths
        for steps in a.steps
    }
    results = {key: {name: [] for name in vs} for key, vs in plan.items()}
    loads = []
    for r in range(a.rounds):  # interleaved: every variant once per round, the order rotated
        for key, vs in plan.items():
            names = list(vs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                results[key][name].append(vs[name]())
                run = results[key][name][-1]
                print(f"round {r + 1}: {key}: {name}: {run.tok_s:,.0f} tok/s, wall {run.wall_tok_s:,.0f}", flush=True)
        loads.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
    report(results, loads)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
