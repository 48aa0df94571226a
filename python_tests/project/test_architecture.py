"""The rules of ARCHITECTURE.md: one folder per layer, each importing only the folders below it
(imports inside functions count too); the tree is the table; modules and the loop stay readable;
only the checkpoint home reads and writes tensor files; only interop/ knows nanochat's files."""

import ast
import re
from pathlib import Path

from support.repo_paths import ROOT

PACKAGE = ROOT / "nanochat_fast"
BELOW = {  # folder -> the folders it may import (its own is always allowed)
    "core": set(),
    "checkpoints": {"core"},  # the on-disk format of a run: below everything that saves or loads
    "hardware": {"core"},
    "kernels": {"core", "hardware"},
    "optim": {"core", "hardware", "kernels"},
    "data": {"core", "kernels"},
    "model": {"core", "hardware", "kernels", "optim", "checkpoints"},
    "evals": {"core", "hardware", "kernels", "data", "model"},
    "train": {"core", "hardware", "kernels", "optim", "data", "model", "evals", "checkpoints"},
    "interop": {"core", "checkpoints", "data", "optim", "model"},  # nanochat's formats; scripts use it
    "web": set(),  # the browser app knows nothing of models: chat_web hands it engines and a prepare function
}
ENTRY_POINTS = {"scripts"}  # and every package's __main__: they may import anything
PUBLIC_NAMES = {"common": {"core"}, "gpt": {"model"}}  # the SPEC's import paths, re-exports only
EXTENSION = {"_C": {"kernels"}}  # the compiled ops: loaded by the kernel registry alone
MAX_MODULE_LINES = 500  # formatted by ruff: nanochat-sized flat modules
MAX_FUNCTION_LINES = 60
MAX_DOCSTRING_LINES = 6  # what a module is for
MAX_HELP_LINES = 15  # a script's docstring is its --help text
READABLE = ["train/training_loop.py", "train/stage.py", "train/training_config.py"]


def folder_of(module: str) -> str | None:
    """'nanochat_fast.kernels.registry' -> 'kernels'; None outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "nanochat_fast" and len(parts) > 1 else None


def allowed(importer: str, imported_module: str) -> bool:
    src, dst = folder_of(importer), folder_of(imported_module)
    if dst is None or src == dst or src in ENTRY_POINTS or importer.endswith(".__main__"):
        return True
    if dst in EXTENSION:
        return src in EXTENSION[dst]
    if src in PUBLIC_NAMES:
        return dst in PUBLIC_NAMES[src]
    return src in BELOW and dst in BELOW[src]


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """The nanochat_fast names `source` (the text of `module`) imports, relative imports resolved:
    'from ..core.errors import UserError' -> nanochat_fast.core.errors.UserError."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base + (node.module.split(".") if node.module else []))
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("nanochat_fast.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("nanochat_fast",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    return [
        f"{module} ({folder_of(module)}/) imports {name} ({folder_of(name)}/)"
        for name in sorted(imported(source, module, is_package))
        if not allowed(module, name)
    ]


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_folder_imports_one_above_it():
    violations = []
    for path in modules():
        violations += forbidden_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not violations, "\n".join(violations)


def test_the_check_fails_on_an_upward_import():
    late = "def f():\n    from ..train import stage\n"
    assert forbidden_imports(late, "nanochat_fast.optim.adamw") == [
        "nanochat_fast.optim.adamw (optim/) imports nanochat_fast.train.stage (train/)"
    ]
    assert forbidden_imports("from nanochat_fast.common import print0", "nanochat_fast.data.tokenizer") != []
    assert forbidden_imports("from ..train.training_loop import train", "nanochat_fast.model.gpt") != []
    assert forbidden_imports("from .. import hardware", "nanochat_fast.core.distributed") != []
    assert forbidden_imports("from ..model import gpt", "nanochat_fast.data.tokenizer") != []  # siblings too
    assert (
        forbidden_imports("from ..kernels import registry\nfrom ..core import errors", "nanochat_fast.train.env_vars")
        == []
    )
    assert forbidden_imports("from ..train import model_setup", "nanochat_fast.hardware.__main__") == []
    assert forbidden_imports("from nanochat_fast import _C", "nanochat_fast.optim.zero") != []


def test_the_tree_is_the_layer_table():
    """`ls nanochat_fast` shows the folders of ARCHITECTURE.md's layer table, one row each, and no
    module outside them but the package's public names."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(BELOW) | ENTRY_POINTS
    table = (ROOT / "ARCHITECTURE.md").read_text().split("## Layers")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)/` \|", table, re.M)
    assert sorted(rows) == sorted(folders) and len(rows) == len(set(rows))
    loose = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert loose == set(PUBLIC_NAMES)


def test_public_names_are_the_packages_own():
    from nanochat_fast import common, gpt
    from nanochat_fast.core import distributed
    from nanochat_fast.model import gpt as model_gpt

    assert common.compute_init is distributed.compute_init and common.print0 is distributed.print0
    assert gpt.GPT is model_gpt.GPT and gpt.GPTConfig is model_gpt.GPTConfig


def test_modules_and_loop_functions_stay_short():
    long_modules = [
        f"{p.relative_to(PACKAGE)}: {n} lines"
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    long_functions = []
    for rel in READABLE:
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}: {node.name} {n} lines")
    assert not long_modules and not long_functions, "\n".join(long_modules + long_functions)


def test_module_docstrings_say_what_a_module_is_for_in_6_lines():
    """Longer notes and figures belong in docs/measurements.md, where the docstring points; a script's
    docstring is its --help text, and may say more."""
    long_docstrings = []
    for p in modules():
        n = len((ast.get_docstring(ast.parse(p.read_text())) or "").strip().splitlines())
        if n > (MAX_HELP_LINES if p.parent.name == "scripts" else MAX_DOCSTRING_LINES):
            long_docstrings.append(f"{p.relative_to(PACKAGE)}: {n} lines")
    assert not long_docstrings, "\n".join(long_docstrings)


# Only the checkpoint home (checkpoints/) calls torch.save, torch.load or torch.distributed.checkpoint
# (DCP), so every tensor file is written atomically and read with weights_only=True in one place.
# DCP's state_dict API (get_model_state_dict, used by model/sharding.py) builds state dicts and
# touches no file, so it is allowed everywhere.
FILE_HOME = "checkpoints"
DCP, DCP_STATE_DICT = "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"
TENSOR_FILE_EXCEPTIONS = {
    # the tokenizer's own token_bytes.pt, saved and read beside its ranks and pattern files: it is
    # the tokenizer's file, not a run's, and data/ stands below the layers that use the home
    "data/tokenizer.py"
}


def dotted(node) -> str:
    """'torch.distributed.checkpoint.save' for that attribute chain; '' when it does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def is_dcp(module: str) -> bool:
    return (module == DCP or module.startswith(DCP + ".")) and not module.startswith(DCP_STATE_DICT)


def tensor_file_io(source: str) -> list[str]:
    """Where `source` reads or writes tensor files itself: torch.save/torch.load (called, or imported
    by name), DCP imported (any way but its state_dict API) or reached as an attribute
    (dist.checkpoint.save), or its FileSystemReader/FileSystemWriter."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if (
                name in ("torch.save", "torch.load")
                or re.search(r"(^|\.)checkpoint\.(save|load|async_save)$", name)
                or node.attr in ("FileSystemReader", "FileSystemWriter")
            ):
                what = name or node.attr
        elif isinstance(node, ast.Import):
            what = next((a.name for a in node.names if is_dcp(a.name)), None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if (
                is_dcp(node.module)
                or node.module == "torch.serialization"
                or (node.module == "torch" and names & {"save", "load"})
                or (node.module == "torch.distributed" and "checkpoint" in names)
            ):
                what = f"from {node.module} import {', '.join(sorted(names))}"
        if what:
            found.append(f"line {node.lineno}: {what}")
    return sorted(set(found))


def package_modules_outside(folder: str):
    for path in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(folder + "/"):
            yield rel, path.read_text()


def test_only_the_checkpoint_home_reads_and_writes_tensor_files():
    found = {rel: io for rel, source in package_modules_outside(FILE_HOME) if (io := tensor_file_io(source))}
    violations = [f"{rel} {line}" for rel, io in found.items() if rel not in TENSOR_FILE_EXCEPTIONS for line in io]
    assert not violations, "use nanochat_fast.checkpoints (read_tensors, write_tensors, ...):\n" + "\n".join(violations)
    assert set(found) >= TENSOR_FILE_EXCEPTIONS, "an exception no longer needed: remove it"
    assert tensor_file_io((PACKAGE / FILE_HOME / "checkpoint.py").read_text())  # the home does it (the check sees it)


def test_the_tensor_file_check_fails_on_io_outside_the_home():
    assert tensor_file_io("import torch\ndef f(x, p):\n    torch.save(x, p)\n") == ["line 3: torch.save"]
    assert tensor_file_io("def f(p):\n    return torch.load(p, weights_only=True)\n") == ["line 2: torch.load"]
    assert tensor_file_io("from torch import load\n") != []
    assert (
        tensor_file_io(
            "def f(s, p):\n    import torch.distributed.checkpoint as dcp\n    dcp.save(s, checkpoint_id=p)\n"
        )
        != []
    )
    assert tensor_file_io("from torch.distributed.checkpoint import FileSystemReader\n") != []
    assert tensor_file_io("from torch.distributed import checkpoint\n") != []
    assert tensor_file_io("import torch.distributed as dist\ndist.checkpoint.load(s, checkpoint_id=p)\n") != []
    assert (
        tensor_file_io(
            "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
            "model.load_state_dict(checkpoints.read_tensors(p))\n"
            "checkpoints.save_checkpoint(run_dir, 3, model_state=s)\n"
        )
        == []
    )


# Only interop/ knows nanochat's files. The marker: a string in code (not a docstring, which may
# describe the formats to users) naming one of nanochat's file or folder names, literally, as a
# format string, glob or regex: tokenizer.pkl, model_NNNNNN.pt, meta_NNNNNN.json,
# optim_NNNNNN_rankR.pt, <stage>_checkpoints. f-strings are read with {} for each field.
STEP = r"(?:\{[^}]*\}|%\d*d|\*|N{6}|\(\\d\+\)|\\d\+|\d{6})"  # {:06d}, %06d, *, NNNNNN, (\d+), \d+, 000100
NANOCHAT_NAMES = re.compile(
    rf"tokenizer\.pkl|\b(?:model|meta)_{STEP}\\?\.(?:pt|json)|\boptim_{STEP}_rank"
    r"|\b(?:base|mid|chatsft|chatrl)_checkpoints\b"
)
INTEROP = "interop"


def strings_in_code(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant of `source` but its docstrings; an f-string as one
    text with {} for each field."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | parts:
            out.append((node.lineno, node.value))
    return out


def nanochat_names(source: str) -> list[str]:
    return [f"line {line}: {text!r}" for line, text in strings_in_code(source) if NANOCHAT_NAMES.search(text)]


def test_only_interop_names_nanochats_files():
    violations = [f"{rel} {hit}" for rel, source in package_modules_outside(INTEROP) for hit in nanochat_names(source)]
    assert not violations, "nanochat's formats belong in nanochat_fast/interop/:\n" + "\n".join(violations)
    assert nanochat_names((PACKAGE / INTEROP / "nanochat_checkpoint.py").read_text())  # the check sees interop's


def test_the_nanochat_names_check_fails_on_a_format_outside_interop():
    assert nanochat_names('PICKLE = "tokenizer.pkl"\n') == ["line 1: 'tokenizer.pkl'"]
    assert nanochat_names('def f(step):\n    return f"model_{step:06d}.pt"\n') == ["line 2: 'model_{}.pt'"]
    for text in [
        "meta_{:06d}.json",
        "optim_{:06d}_rank{}.pt",
        "optim_%06d_rank%d.pt",
        "meta_*.json",
        r"meta_(\d+)\.json",
        "model_000100.pt",
        "no optim_NNNNNN_rank*.pt here",
        "base_checkpoints",
    ]:
        assert nanochat_names(f"x = {text!r}\n") != [], text
    # our own names, a docstring and a comment are not nanochat's formats
    assert (
        nanochat_names(
            '"""Reads tokenizer.pkl and model_NNNNNN.pt."""\n# meta_{:06d}.json\n'
            'FILES = ["model.pt", "meta.json", "optim_rank{}.pt", "step_{:06d}", "checkpoints"]\n'
            'def f(r):\n    """meta_*.json"""\n    return f"optim_rank{r}.pt"\n'
        )
        == []
    )


def test_every_path_of_the_concept_map_exists():
    """ARCHITECTURE.md's "Where each concept lives": every backticked path (under nanochat_fast/, or
    from the repository's top) is there."""
    section = (ROOT / "ARCHITECTURE.md").read_text().split("## Where each concept lives")[1].split("\n## ")[0]
    paths = [t for t in re.findall(r"`([^` ]+)`", section) if "/" in t or re.search(r"\.(py|cpp|cu|h|md|txt)$", t)]
    assert len(paths) > 40
    missing = [p for p in paths if not (ROOT / p).exists() and not (PACKAGE / p).exists()]
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"
