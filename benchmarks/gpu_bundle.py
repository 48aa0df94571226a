"""
`make gpu-bundle`: what the air-gapped GPU node lacks, in one folder that travels with the source tree.

    python benchmarks/gpu_bundle.py build/gpu-bundle [--python-version 3.12]

The node (benchmarks/gpu_node.txt) has its own Python, torch and triton and no network, so the bundle holds:
  wheels/     a wheel of every runtime dependency the node lacks (pyproject's dependencies, then theirs),
              for its Python on manylinux x86_64
  home/       a prepared NANOCHAT_FAST_HOME: the built-in corpus tokenized (tokens/base) and its
              tokenizer, so the node trains without preparing data (the depth-12 run loops its shards)
  manifest.json  what is in it, for which Python and platform, and the sha256 of every file

`resolve_for_node` asks pip's resolver whether the package installs on the node from the bundle alone
(the node's packages stand in as metadata-only wheels at the listed versions): the rehearsal runs it on
every CI run, so a new dependency the node lacks fails there, not on the node.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
NODE_LIST = Path(__file__).with_name("gpu_node.txt")
MAX_BYTES = 48 << 20  # the bundle and the source tree travel together in 64 MiB
# the node is manylinux_2_39 (glibc 2.39); pip matches each tag exactly, so name the common ones
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
MANIFEST_FORMAT = 1


class BundleError(Exception):
    """A bundle that cannot be made or does not fit the node: one line for the user."""


@dataclass(frozen=True)
class Node:
    python: str  # "3.12"
    packages: dict  # canonical name -> version


def read_node(path: Path = NODE_LIST) -> Node:
    """The node's Python ("python 3.12") and packages ("name==version"), comments ignored."""
    python, packages = None, {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("python "):
            python = line.split()[1]
        elif line:
            name, version = line.split("==")
            packages[canonicalize_name(name)] = version.strip()
    if python is None:
        raise BundleError(f"{path} names no Python ('python 3.12')")
    return Node(python, packages)


def runtime_requirements(root: Path = ROOT) -> list[str]:
    """pyproject.toml's [project].dependencies: what `pip install .` must find."""
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]


def target_environment(python_version: str) -> dict:
    """Marker values of the node (Linux x86_64 CPython of that version), for Requires-Dist markers."""
    env = default_environment()
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def wheel_requirements(wheel: Path, python_version: str) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the node (no extras asked for)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    env = target_environment(python_version)
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ""})]


def pip_target_args(python_version: str) -> list[str]:
    return [
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *(arg for p in PLATFORMS for arg in ("--platform", p)),
    ]


def download_wheels(requirements: list[str], dest: Path, node: Node, python_version: str) -> list[dict]:
    """Wheels of every requirement the node lacks, and of whatever those need that it lacks too
    (one `pip download --no-deps` each, so pip never fetches what the node already has)."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = [Requirement(r) for r in requirements]
    fetched, done = [], set()
    while wanted:
        req = wanted.pop(0)
        name = canonicalize_name(req.name)
        if name in node.packages or name in done:
            continue
        done.add(name)
        before = set(dest.iterdir())
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            *pip_target_args(python_version),
            "-d",
            str(dest),
            str(req),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        new = sorted(set(dest.iterdir()) - before) or sorted(dest.glob(f"{req.name.replace('-', '_')}-*.whl"))
        if result.returncode != 0 or not new:
            why = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise BundleError(
                f"no cp{python_version.replace('.', '')} manylinux x86_64 wheel of {req} for the node "
                f"({why}); the node cannot build it without network"
            )
        fetched.append(dict(file=new[0].name, requirement=str(req)))
        wanted += wheel_requirements(new[0], python_version)
    return fetched


def _stub_wheel(dest: Path, name: str, version: str):
    """A metadata-only wheel: what the resolver needs to know that the node has name==version."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: gpu_bundle\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(dest / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def resolve_for_node(requirements: list[str], wheels: Path, node: Node, python_version: str | None = None) -> str:
    """'' when pip's resolver installs `requirements` for the node from the bundle's wheels and the
    node's packages (as listed) alone, with no index; otherwise the one line of what is missing."""
    python_version = python_version or node.python
    if not requirements:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "node"
        stubs.mkdir()
        for name, version in node.packages.items():
            _stub_wheel(stubs, name, version)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip config (its find-links, constraints) is not the node's
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-index",
            "--disable-pip-version-check",
            "--find-links",
            str(wheels),
            "--find-links",
            str(stubs),
            *pip_target_args(python_version),
            "--target",
            str(Path(tmp) / "target"),
            *requirements,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode == 0:
        return ""
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("ERROR")]
    return (
        f"the package does not install on the node (Python {python_version}) from the bundle: "
        f"{lines[0] if lines else result.stderr.strip()[-300:]}"
    )


def prepare_home(dest: Path, corpus: Path | None = None, vocab_size: int | None = None):
    """A NANOCHAT_FAST_HOME in dest holding tokens/base and tokenizer/ only: the built-in corpus (or
    the text files under `corpus`) prepared and tokenized here, with this machine's package."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NANOCHAT_FAST_HOME": tmp}
        data = ["--input", str(corpus), "--name", "base"] if corpus else ["--datasets=base"]
        vocab = [f"--vocab-size={vocab_size}"] if vocab_size else []
        for script, flags in (("prepare_data", data), ("tok_train", vocab)):
            result = subprocess.run(
                [sys.executable, "-m", f"nanochat_fast.scripts.{script}", *flags],
                env=env,
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise BundleError(
                    f"{script} failed while preparing the bundle's home: "
                    f"{(result.stderr.strip().splitlines() or ['no output'])[-1]}"
                )
        for part in ("tokenizer", "tokens/base"):
            shutil.copytree(Path(tmp) / part, dest / part)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def home_summary(home: Path) -> dict:
    shards = [json.loads(p.read_text()) for p in sorted((home / "tokens" / "base").glob("*/*.json"))]
    train = [s for s in shards if s.get("source", "").startswith("train/")]
    return dict(
        dataset="base",
        train_tokens=sum(s["n_tokens"] for s in train),
        val_tokens=sum(s["n_tokens"] for s in shards) - sum(s["n_tokens"] for s in train),
        vocab_size=shards[0]["vocab_size"] if shards else None,
        tokenizer=shards[0]["tokenizer"] if shards else None,
    )


def write_manifest(bundle: Path, python_version: str, wheels: list[dict], node: Node) -> dict:
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != "manifest.json")
    by_file = {w["file"]: w for w in wheels}
    manifest = dict(
        format=MANIFEST_FORMAT,
        python=python_version,
        platforms=PLATFORMS,
        implementation="cp",
        created=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        package_version=_package_version(),
        node_list_sha256=sha256(NODE_LIST),
        wheels=[
            dict(by_file[p.name], sha256=sha256(p), bytes=p.stat().st_size) for p in files if p.parent.name == "wheels"
        ],
        home=home_summary(bundle / "home"),
        files=[dict(path=str(p.relative_to(bundle)), sha256=sha256(p), bytes=p.stat().st_size) for p in files],
    )
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"])
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def verify(bundle: Path) -> str:
    """'' when every file the manifest lists is there with its sha256; else the first problem."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for f in manifest["files"]:
        path = bundle / f["path"]
        if not path.is_file() or sha256(path) != f["sha256"]:
            return f"{path} is missing or differs from the bundle's manifest: make the bundle again (make gpu-bundle)"
    return ""


def build(
    out: Path,
    python_version: str | None = None,
    corpus: Path | None = None,
    vocab_size: int | None = None,
    requirements: list[str] | None = None,
    node: Node | None = None,
) -> dict:
    """Make the bundle in out (replaced whole only once complete) and return its manifest."""
    node = node or read_node()
    python_version = python_version or node.python
    requirements = runtime_requirements() if requirements is None else requirements
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        print(f"wheels for Python {python_version} of what the node lacks ...", flush=True)
        wheels = download_wheels(requirements, staging / "wheels", node, python_version)
        why = resolve_for_node(requirements, staging / "wheels", node, python_version)
        if why:
            raise BundleError(why)
        print("a prepared home (the built-in corpus, its tokenizer and token shards) ...", flush=True)
        prepare_home(staging / "home", corpus, vocab_size)
        manifest = write_manifest(staging, python_version, wheels, node)
        if manifest["total_bytes"] > MAX_BYTES:
            raise BundleError(
                f"the bundle takes {manifest['total_bytes'] / 2**20:.1f} MiB, over its "
                f"{MAX_BYTES >> 20} MiB (it travels with the source tree in 64 MiB)"
            )
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu_bundle.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path, help="the bundle's folder (replaced), e.g. build/gpu-bundle")
    p.add_argument("--python-version", default=None, help="the node's Python (default: gpu_node.txt's)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        manifest = build(args.out.resolve(), args.python_version)
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wheels = ", ".join(w["file"] for w in manifest["wheels"]) or "none needed"
    home = manifest["home"]
    print(
        f"wrote {args.out}: {manifest['total_bytes'] / 2**20:.1f} MiB in {time.perf_counter() - t0:.0f} s for "
        f"Python {manifest['python']}; wheels: {wheels}; home: {home['train_tokens']:,} train tokens, "
        f"vocabulary {home['vocab_size']:,}"
    )
    print(f"next, on the GPU node: make gpu-check BUNDLE={args.out} OUT=<folder for the report>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
