"""The import rules of ARCHITECTURE.md: a module imports only from its own layer or the ones below
(imports inside functions count too). Modules not in LAYERS are not checked."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nanochat_fast"
# lowest first; a module may import modules of its own layer and of lower ones
LAYERS = [
    ("foundations", ["errors", "paths", "common", "precision", "hardware", "compiling", "checkpoint", "_C"]),
    ("kernels", ["kernels"]),
    ("model / optim, data and evaluation", ["gpt", "optim", "generation", "calculator", "dataset", "dataloader",
                                            "tokenizer", "sources", "eval_data", "eval_sources", "tasks",
                                            "scoring", "sandbox", "evaluation"]),
    ("loop", ["training", "report"]),
    ("stage / run", ["stage", "config", "environment", "training_data", "padded_conversations", "models", "runs",
                     "next_steps", "cli"]),
    ("scripts", ["scripts", "web"]),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> int | None:
    """'nanochat_fast.kernels.registry' -> the level of 'kernels' (None: not in the table). A
    package's __main__ is a command-line entry point (`python -m nanochat_fast.hardware`): the
    scripts layer, whatever its package's layer."""
    parts = module.split(".")
    if parts[-1] == "__main__" and parts[0] == "nanochat_fast":
        return LEVEL["scripts"]
    return LEVEL.get(parts[1]) if len(parts) > 1 and parts[0] == "nanochat_fast" else None


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """The nanochat_fast modules `source` (the text of `module`) imports, relative imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + (node.module.split(".") if node.module else []))
            out |= {base} if node.module else {f"{base}.{a.name}" for a in node.names}
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("nanochat_fast",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def upward_imports(source: str, module: str, is_package=False) -> list[str]:
    own = layer_of(module)
    if own is None:
        return []
    return [f"{module} ({LAYERS[own][0]}) imports {name} ({LAYERS[layer_of(name)][0]})"
            for name in sorted(imported(source, module, is_package))
            if layer_of(name) is not None and layer_of(name) > own]


def test_no_module_imports_from_a_layer_above_its_own():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        violations += upward_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not violations, "\n".join(violations)


def test_the_check_sees_relative_and_late_imports():
    late = "def f():\n    from .. import stage\n"
    assert upward_imports(late, "nanochat_fast.optim.adamw") == [
        "nanochat_fast.optim.adamw (model / optim, data and evaluation) imports nanochat_fast.stage (stage / run)"]
    assert upward_imports("from .training import train", "nanochat_fast.gpt") != []
    assert upward_imports("from .kernels import registry\nfrom . import errors", "nanochat_fast.environment") == []
    assert upward_imports("from .. import models", "nanochat_fast.hardware.__main__") == []  # an entry point
    assert upward_imports("from .. import models", "nanochat_fast.hardware.tuning") != []
