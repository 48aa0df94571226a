"""The rules of ARCHITECTURE.md: one folder per layer, each importing only the folders below it
(imports inside functions count too); the tree is the table; modules and the loop stay readable."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanochat_fast"
BELOW = {  # folder -> the folders it may import (its own is always allowed)
    "core": set(),
    "hardware": {"core"},
    "kernels": {"core", "hardware"},
    "optim": {"core", "hardware", "kernels"},
    "data": {"core", "kernels"},
    "model": {"core", "hardware", "kernels", "optim"},
    "evals": {"core", "hardware", "kernels", "data", "model"},
    "train": {"core", "hardware", "kernels", "optim", "data", "model", "evals"},
    "web": set(),  # the browser app knows nothing of models: chat_web hands it engines and a prepare function
    "tools": {"core", "hardware", "kernels"},  # the kernels' ahead-of-time compile: nothing of training
}
ENTRY_POINTS = {"scripts"}  # and every package's __main__: they may import anything
PUBLIC_NAMES = {"common": {"core"}, "gpt": {"model"}}  # the SPEC's import paths, re-exports only
EXTENSION = {"_C": {"kernels"}}  # the compiled ops: loaded by the kernel registry alone
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
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
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + (node.module.split(".") if node.module else []))
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("nanochat_fast.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("nanochat_fast",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    return [f"{module} ({folder_of(module)}/) imports {name} ({folder_of(name)}/)"
            for name in sorted(imported(source, module, is_package)) if not allowed(module, name)]


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
        "nanochat_fast.optim.adamw (optim/) imports nanochat_fast.train.stage (train/)"]
    assert forbidden_imports("from nanochat_fast.common import print0", "nanochat_fast.data.tokenizer") != []
    assert forbidden_imports("from ..train.training_loop import train", "nanochat_fast.model.gpt") != []
    assert forbidden_imports("from .. import hardware", "nanochat_fast.core.distributed") != []
    assert forbidden_imports("from ..model import gpt", "nanochat_fast.data.tokenizer") != []  # siblings too
    assert forbidden_imports("from ..kernels import registry\nfrom ..core import errors",
                             "nanochat_fast.train.env_vars") == []
    assert forbidden_imports("from ..optim import muon", "nanochat_fast.tools.triton_aot") != []
    assert forbidden_imports("from ..tools import triton_aot", "nanochat_fast.kernels.registry") != []
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
    long_modules = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in modules()
                    if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    long_functions = []
    for rel in READABLE:
        for node in ast.walk(ast.parse((PACKAGE / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}: {node.name} {n} lines")
    assert not long_modules and not long_functions, "\n".join(long_modules + long_functions)
