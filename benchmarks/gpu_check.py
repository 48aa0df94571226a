"""
`make gpu-check`: the GPU verdict on the node users have: one GPU, its own Python, torch and triton, no network.

    make gpu-bundle                                  # where the package registries are: build/gpu-bundle
    make gpu-check BUNDLE=build/gpu-bundle OUT=DIR   # on the node, with the bundle beside the source tree
      = python3 benchmarks/gpu_check.py check --bundle build/gpu-bundle --out DIR

check     The preflight says in one line (exit 2), before any work, what this machine lacks; then every
          step of the plan (PLAN: install, environment, kernels, adamw, newton_schulz, muon, cross_entropy,
          train, train_reference, infer, gpu_tests), each under its own time cap, all within BUDGET_S on
          one H100. OUT gets RESULTS-cuda.md, results-cuda.json and logs.tar.gz, rewritten after every
          step. Exit 1 if any step failed.
rehearse  Every part that needs no GPU, here, offline (python_tests/benchmarks/test_gpu_check.py, on every CI run).

What each step and the rehearsal do: docs/gpu.md ("The GPU verdict") and docs/measurements.md#gpu-check.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nanochat_fast.core import torch_floor  # noqa: E402  standard library only, like this module

WORK = ROOT / "build" / "gpu-check"
BUDGET_S = 480  # the node's check gets 8 minutes, the build included
OUTPUTS = ("RESULTS-cuda.md", "results-cuda.json", "logs.tar.gz")
TRAIN = ["-m", "nanochat_fast.scripts.base_train", "--depth=12", "--eval-every=-1", "--sample-every=-1", "--overwrite"]
# what the rehearsal appends to a step's command (argparse keeps the last value): CPU-sized, same code
TINY_TRAIN = ["--depth=1", "--max-seq-len=64", "--device-batch-size=2", "--total-batch-size=256", "--num-iterations=3"]


@dataclass
class Step:
    key: str
    title: str
    cap_s: int
    command: list  # argv after the venv's python ("" entries dropped); {work} is the work folder
    env: dict = field(default_factory=dict)
    tiny: list = field(default_factory=list)  # appended by the rehearsal


def measure(key: str, title: str, cap_s: int) -> Step:
    return Step(
        key, title, cap_s, ["benchmarks/gpu_measure.py", key, "--json", "{work}/" + key + ".json"], tiny=["--tiny"]
    )


# Caps for one H100, from estimates (a depth-12 step of 524,288 tokens ~1 s, the first torch.compile ~1 min);
# RESULTS-cuda.md's time column shows what each step took, to set them from.
PLAN = [
    Step("install", "venv, bundle wheels, extension built with CUDA", 110, []),
    Step(
        "environment",
        "GPU, versions, extension with CUDA, kernel table",
        10,
        ["benchmarks/gpu_check.py", "facts", "--json", "{work}/environment.json"],
    ),
    measure("kernels", "Triton kernels at every GPU config, CUDA AdamW: max error", 55),
    measure("adamw", "fused AdamW slice update vs torch fused AdamW", 15),
    measure("newton_schulz", "Newton-Schulz m = 1024..8192 vs bf16 cuBLAS", 25),
    measure("muon", "Muon step, depth 12 and 20, vs torch.optim.Muon", 25),
    measure("cross_entropy", "softcapped cross-entropy fwd+bwd vs stock eager and compiled", 30),
    Step(
        "train",
        "base_train depth 12, 50 steps, defaults",
        120,
        [*TRAIN, "--num-iterations=50", "--run=gpu_check_d12"],
        tiny=TINY_TRAIN,
    ),
    Step(
        "train_reference",
        "the same with NANOCHAT_FAST_KERNELS=reference, 20 steps",
        55,
        [*TRAIN, "--num-iterations=20", "--run=gpu_check_d12_reference"],
        {"NANOCHAT_FAST_KERNELS": "reference"},
        tiny=TINY_TRAIN,
    ),
    Step(
        "infer",
        "infer_bench depth 12 at batch 1, 8, 32",
        30,
        ["-m", "nanochat_fast.scripts.infer_bench", "--depth=12", "--batch-sizes=1,8,32"],
        tiny=["--depth=1", "--batch-sizes=1,2", "--prompt-tokens=8", "--decode-tokens=4", "--max-seq-len=64"],
    ),
]
# last, in whatever the plan left of the budget (the measurements above come first)
GPU_TESTS = Step(
    "gpu_tests",
    "the tests marked gpu",
    0,
    ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--junitxml={work}/gpu-tests.xml"],
)


# ---------------------------------------------------------------------------------------------
# preflight (standard library only: the node's python3, before anything is installed)


def nvcc() -> str | None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [str(Path(h) / "bin" / "nvcc") for h in homes if h and (Path(h) / "bin" / "nvcc").exists()]
    return shutil.which("nvcc") or (found[0] if found else None)


def gpu_problem() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU (no nvidia-smi: no NVIDIA driver here)"
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True)
    if listed.returncode != 0 or not any(line.startswith("GPU ") for line in listed.stdout.splitlines()):
        why = (listed.stderr or listed.stdout).strip().splitlines()[:1] or ["it lists none"]
        return f"no GPU (nvidia-smi -L: {why[0]})"
    return ""


def preflight(bundle: Path | None, out: Path | None, rehearse: bool = False) -> dict:
    """What keeps this machine from running the check: {what: one phrase}, empty when nothing."""
    problems = {}
    gpu = "" if rehearse else gpu_problem()  # the rehearsal runs the rest of the check on a CPU
    if gpu:
        problems["gpu"] = gpu
    if nvcc() is None and not rehearse:
        problems["nvcc"] = "no nvcc (the CUDA toolkit): put it on PATH or set CUDA_HOME"
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        problems["torch"] = f"no torch in {sys.executable}: the check uses the node's own torch and triton"
    else:
        too_old = torch_floor.why_not(torch_version)
        if too_old:
            problems["torch"] = too_old
        elif not gpu and not rehearse and "+cpu" in torch_version:
            problems["torch"] = f"torch {torch_version} is a CPU build: the node's python3 needs a CUDA torch"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if bundle is None or not (bundle / "manifest.json").is_file():
        problems["bundle"] = (
            f"no bundle at {bundle or 'BUNDLE='}: make one with `make gpu-bundle` where the package "
            "registries are reachable, and copy it beside the source tree"
        )
    else:
        made_for = json.loads((bundle / "manifest.json").read_text()).get("python")
        if made_for != here:
            problems["bundle"] = (
                f"the bundle at {bundle} is for Python {made_for}, this is Python {here} "
                f"({sys.executable}): make it with `make gpu-bundle GPU_PYTHON={here}`"
            )
    if out is None:
        problems["out"] = "no OUT: name a folder for the report, e.g. make gpu-check OUT=gpu-report"
    return problems


def preflight_line(problems: dict) -> str:
    return f"gpu-check cannot run here: {'; '.join(problems.values())}" if problems else ""


def check_plan(plan=PLAN, budget_s=BUDGET_S) -> str:
    """'' when every step's command names a file or module of the tree and the caps fit the budget."""
    total = sum(s.cap_s for s in plan)
    if total > budget_s:
        return f"the plan's caps add up to {total} s, over the {budget_s} s budget"
    for s in plan:
        if not s.command:
            continue
        target = s.command[1].replace(".", "/") + ".py" if s.command[0] == "-m" else s.command[0]
        if s.command[0] == "-m" and s.command[1] == "pytest":
            continue
        if not (ROOT / target).is_file():
            return f"step {s.key}: {target} is not in the tree"
    return ""


# ---------------------------------------------------------------------------------------------
# install: a venv over the node's packages


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_stamp(bundle: Path) -> str:
    """What the installed venv was made from: the bundle, the build sources, this Python and torch."""
    h = hashlib.sha256()
    for path in [
        bundle / "manifest.json",
        ROOT / "setup.py",
        ROOT / "pyproject.toml",
        *sorted((ROOT / "csrc").rglob("*")),
        Path(sys.executable),
    ]:
        if path.is_file():
            h.update(str(path).encode() + path.read_bytes() if path.stat().st_size < 1 << 20 else str(path).encode())
    h.update(metadata.version("torch").encode())
    return h.hexdigest()


def make_venv(venv: Path, log) -> list[str]:
    """A venv over this Python's packages; returns the pip command that installs into it.

    --system-site-packages reaches the *base* interpreter's packages; where python3 is itself a venv (the
    node's is /opt/torch/.venv) its site-packages are added as site directories, so torch stays the node's
    own. No pip of the venv's own: ensurepip would bring its old setuptools, which shadows the node's."""
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        stdout=log,
        stderr=subprocess.STDOUT,
        check=True,
    )
    if sys.prefix != sys.base_prefix:
        import site

        add_site_dirs(venv, site.getsitepackages(), "_node_python_packages.pth")
    python = str(venv_python(venv))
    if subprocess.run([python, "-c", "import pip"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "ensurepip"], stdout=log, stderr=subprocess.STDOUT, check=True)
    return [python, "-m", "pip"]


def add_site_dirs(venv: Path, dirs: list, name: str):
    """Make `dirs` site directories of the venv (their own .pth files processed too, as the parent's are)."""
    purelib = subprocess.run(
        [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, name).write_text("".join(f"import site; site.addsitedir({str(d)!r})\n" for d in dirs))


def install(bundle: Path, work: Path, cap_s: int, log_path: Path, no_ext: bool = False) -> tuple[str, str]:
    """(status, detail): the package installed into work/venv from the bundle alone, or why not."""
    venv, stamp = work / "venv", install_stamp(bundle)
    if (venv / ".installed").is_file() and (venv / ".installed").read_text() == stamp:
        return "ok", "already installed from this bundle and these sources (build/gpu-check/venv)"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        pip = make_venv(venv, log)
        env = {
            **os.environ,
            "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "MAX_JOBS": str(os.cpu_count() or 1),
        }
        if no_ext:
            env["NANOCHAT_FAST_NO_EXT"] = "1"
        cmd = [
            *pip,
            "install",
            "--no-index",
            "--find-links",
            str(bundle / "wheels"),
            "--no-build-isolation",
            "-e",
            str(ROOT),
        ]
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        status = run_capped(cmd, cap_s - (time.perf_counter() - t0), log, env)
    if status != "ok":
        return status, tail(log_path)
    (venv / ".installed").write_text(stamp)
    return "ok", f"installed in {time.perf_counter() - t0:.0f} s with MAX_JOBS={env['MAX_JOBS']}"


# ---------------------------------------------------------------------------------------------
# running steps


def run_capped(cmd: list[str], cap_s: float, log, env: dict | None = None) -> str:
    """Run cmd in the tree's root, output to log, killed (with its children) at cap_s: 'ok', 'failed'
    (non-zero exit) or 'hit its cap'."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True
    )
    try:
        return "ok" if proc.wait(timeout=max(cap_s, 1)) == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing to save: the figures so far are already on disk
        proc.wait()
        return "hit its cap"


def tail(log: Path) -> str:
    lines = (
        [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    )
    return lines[-1][:300] if lines else "no output"


def step_command(step: Step, python: Path, work: Path, rehearse: bool) -> list[str]:
    return [str(python), *(a.replace("{work}", str(work)) for a in step.command), *(step.tiny if rehearse else [])]


def prepared_home(bundle: Path, work: Path) -> Path:
    """A NANOCHAT_FAST_HOME whose data is the bundle's (linked, read only) and whose runs are the check's."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    for part in ("tokenizer", "tokens"):
        link = home / part
        if link.is_symlink() or link.exists():
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to((bundle / "home" / part).resolve(), target_is_directory=True)
    return home


def gpu_test_files() -> list[str]:
    """The test files with a test marked gpu (collecting the others would import what the node lacks)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "python_tests").rglob("test_*.py")
        if "@pytest.mark.gpu" in p.read_text()
    )


def check(bundle: Path, out: Path, rehearse: bool = False, no_ext: bool = False) -> int:
    problems = preflight(bundle, out, rehearse)
    if problems:
        print(preflight_line(problems), file=sys.stderr)
        return 2
    import gpu_report

    work, started = WORK, time.perf_counter()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report = gpu_report.Report(out, work, bundle, rehearse)
    python = venv_python(work / "venv")
    env = {
        **os.environ,
        "NANOCHAT_FAST_HOME": str(prepared_home(bundle, work)),
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"),
    }
    plan = PLAN + [GPU_TESTS]
    for step in plan:
        t0, log = time.perf_counter(), work / "logs" / f"{step.key}.log"
        cap = step.cap_s if step is not GPU_TESTS else max(0, BUDGET_S - (t0 - started))
        cap = max(cap, 300) if rehearse else cap  # a 2-core CPU runs the small shapes slower than an H100 the big
        print(f"\n=== {step.key}: {step.title} (cap {cap:.0f} s)", flush=True)
        if step.key == "install":
            status, detail = install(bundle, work, cap, log, no_ext)
        elif step is GPU_TESTS and cap < 10:
            status, detail = "skipped", f"{cap:.0f} s of the budget left"
        else:
            cmd = step_command(step, python, work, rehearse)
            if step is GPU_TESTS:
                cmd[3:3] = gpu_test_files()  # after `python -m pytest`
            with open(log, "w") as f:
                f.write(f"$ {' '.join(cmd)}\n")
                f.flush()
                status = run_capped(cmd, cap, f, {**env, **step.env})
            detail = tail(log)
        report.add(step, status, detail, time.perf_counter() - t0, cap)
        print(f"--- {step.key}: {status} in {time.perf_counter() - t0:.0f} s", flush=True)
        if step.key == "install" and status != "ok":
            break  # nothing else can run without the package
    report.write(final=True)
    print(f"\n{report.verdict()}\nwrote {', '.join(str(out / name) for name in OUTPUTS)}")
    return 0 if report.all_ok() else 1


# ---------------------------------------------------------------------------------------------
# facts: run inside the venv (torch imported)


def facts(path: Path):
    """The GPU, the versions, the extension, the kernel table and the node's packages, as JSON."""
    import torch
    import triton

    from nanochat_fast.kernels import registry

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bundle import read_node

    node = read_node()
    installed = {}
    for name in node.packages:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed[name] = None
    f = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        extension=registry._C is not None,
        extension_cuda=bool(getattr(registry._C, "with_cuda", False)),
        extension_why_not=registry.cpp_why_not("adamw_slice_update", "cuda"),
        node_packages_differ={
            n: dict(listed=node.packages[n], installed=v)
            for n, v in installed.items()
            if v is None or v.split("+")[0] != node.packages[n]
        },
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.split()
        f.update(
            gpu=props.name,
            count=torch.cuda.device_count(),
            arch=f"sm_{props.major}{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            driver=smi[0] if smi else None,
        )
    table = subprocess.run([sys.executable, "-m", "nanochat_fast.kernels", "--json"], capture_output=True, text=True)
    f["kernels"] = json.loads(table.stdout) if table.returncode == 0 else table.stderr.strip()[-300:]
    path.write_text(json.dumps(f, indent=1))
    print(json.dumps({k: v for k, v in f.items() if k != "kernels"}, indent=1))
    ok = bool(f.get("gpu")) and f["extension_cuda"]
    print(
        f"{f.get('gpu', 'no GPU')}; torch {f['torch']}, triton {f['triton']}; extension "
        f"{'with CUDA' if f['extension_cuda'] else 'WITHOUT CUDA'}; {len(f['node_packages_differ'])} package(s) "
        "differ from gpu_node.txt"
    )
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# the rehearsal (this machine's .venv: torch and packaging installed)


def node_stand_in(venv: Path, node_packages: dict) -> Path:
    """A python3 like the node's: a fresh venv whose only packages are those of this environment that
    the node has (linked from here through a .pth file), so what the node lacks is missing here too."""
    import sysconfig

    from packaging.utils import canonicalize_name

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    view = venv / "node-packages"
    view.mkdir()
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for dist in metadata.distributions(path=[str(site_packages)]):
        if canonicalize_name(dist.metadata["Name"]) not in node_packages:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (site_packages / top).exists() and not (view / top).exists() and top != "__pycache__":
                (view / top).symlink_to(site_packages / top)
    add_site_dirs(venv, [view], "node_packages.pth")
    return venv_python(venv)


def small_corpus(folder: Path):
    """A few hundred KB of text for the rehearsal's home (the real bundle tokenizes the built-in corpus)."""
    import random

    rng = random.Random(0)
    words = (
        "the a river stone light over under between quietly seven old new house field song wind "
        "north morning evening bread water road village garden letter window"
    ).split()
    folder.mkdir(parents=True)
    (folder / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(150)) for _ in range(400)))


def rehearse(keep: Path | None = None, requirements: list[str] | None = None) -> int:
    """Every part of the check that needs no GPU, here; 0 when all went as on the node."""
    import gpu_bundle
    import stage_tree

    tmp = Path(tempfile.mkdtemp(prefix="gpu-rehearsal-")) if keep is None else keep
    try:
        node = gpu_bundle.read_node()
        reqs = gpu_bundle.runtime_requirements() if requirements is None else requirements
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        print(
            f"1. the node's wheels (cp{node.python.replace('.', '')}) resolved for the node against gpu_node.txt",
            flush=True,
        )
        gpu_bundle.download_wheels(reqs, tmp / f"wheels-{node.python}", node, node.python)
        why = gpu_bundle.resolve_for_node(reqs, tmp / f"wheels-{node.python}", node)
        if why:
            print(f"rehearsal: {why}", file=sys.stderr)
            return 1
        print(f"2. a small bundle for this Python ({here})", flush=True)
        small_corpus(tmp / "corpus")
        gpu_bundle.build(tmp / "src" / "build" / "gpu-bundle", here, tmp / "corpus", vocab_size=512, requirements=reqs)
        print("3. the source tree staged, and a stand-in for the node's python3", flush=True)
        stage_tree.stage(tmp / "src")
        python = node_stand_in(tmp / "node-python", node.packages)
        script = str(tmp / "src" / "benchmarks" / "gpu_check.py")
        bundle, out = "build/gpu-bundle", str(tmp / "out")
        print("4. its preflight must find only the missing GPU", flush=True)
        pre = subprocess.run(
            [str(python), script, "preflight", "--bundle", bundle, "--out", out],
            capture_output=True,
            text=True,
            cwd=tmp / "src",
        )
        missing = {"gpu": gpu_problem(), **({"nvcc": preflight(None, None)["nvcc"]} if nvcc() is None else {})}
        expected = preflight_line(missing)  # on a machine like CI's, the GPU alone
        if pre.returncode != 2 or pre.stderr.strip() != expected:
            print(
                f"rehearsal: the preflight said {pre.stderr.strip()!r} (exit {pre.returncode}), not {expected!r}",
                file=sys.stderr,
            )
            return 1
        why = check_plan()
        if why:
            print(f"rehearsal: {why}", file=sys.stderr)
            return 1
        print("5. the check itself, small shapes on the CPU", flush=True)
        env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
        env.pop("PIP_FIND_LINKS", None)
        result = subprocess.run(
            [str(python), script, "check", "--bundle", bundle, "--out", out, "--rehearse"], cwd=tmp / "src", env=env
        )
        steps = json.loads((Path(out) / "results-cuda.json").read_text())["steps"]
        # on a CPU the environment step fails (no GPU, no CUDA in the extension) and the gpu tests skip
        # themselves; both must still have left their figures
        wrong = [
            s["key"]
            for s in steps
            if (s["status"] != "ok" and s["key"] not in ("environment", "gpu_tests"))
            or not s["figures"]
            and s["key"] != "install"
        ]
        print(
            f"rehearsal: {len(steps)} steps ran; check exit {result.returncode}; "
            f"{'all as expected' if not wrong else 'FAILED: ' + ', '.join(wrong)}"
        )
        return 1 if wrong or len(steps) != len(PLAN) + 1 else 0
    finally:
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (
        ("preflight", "one line and exit 2 when this machine cannot run the check"),
        ("check", "the preflight, then every step of the plan; the report in OUT"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--bundle", type=Path, default=None, help="the bundle `make gpu-bundle` made")
        p.add_argument("--out", type=Path, default=None, help="the folder for the report (RESULTS-cuda.md ...)")
        if name == "check":
            p.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)  # rehearse's own run
    p = sub.add_parser("facts", help="(inside the venv) the environment step's figures")
    p.add_argument("--json", type=Path, required=True)
    p = sub.add_parser("rehearse", help="every part that needs no GPU, here (a test)")
    p.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.command == "preflight":
        line = preflight_line(preflight(args.bundle, args.out))
        if line:
            print(line, file=sys.stderr)
        return 2 if line else 0
    if args.command == "check":
        bundle = args.bundle.resolve() if args.bundle else None
        return check(bundle, args.out.resolve() if args.out else None, args.rehearse, no_ext=args.rehearse)
    if args.command == "facts":
        return facts(args.json)
    return rehearse(args.keep)


if __name__ == "__main__":
    sys.exit(main())
