"""Imports go one way: a homerlhf module imports only from its own layer or lower ones.

``LAYERS`` is the order, lowest first, and the one place it is written down. Each entry names the
top-level modules and packages of ``homerlhf`` in that layer; a module's layer is that of the first
name after ``homerlhf.`` in its dotted name. Every import is checked, at module level or inside a
function (lazy imports are still dependencies), relative or absolute, and
``importlib.import_module("homerlhf...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "homerlhf"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "paths", "hub", "presets"),  # hub: whether the model/dataset hub can be reached; presets: YAML only
    ("config",),
    ("data", "tiny"),  # tiny builds its tokenizer from the builtin task's corpus (data.builtin)
    ("models",),  # incl. models.registry: model names resolved to directories
    ("ppo", "memory", "tracking"),  # tracking: experiment trackers, for PPO and the TRL stages
    ("workers",),
    ("stages", "doctor"),  # doctor checks a machine with the workers and models below it
    ("check",),  # `homerlhf check`: short runs of the stages' pieces on a GPU, measured against the planner
    ("app",),
    ("cli", "cli_export", "cli_check", "cli_preference", "cli_train"),  # `export`, `check`, `dpo`/`kto`, `train`/`config`
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The layer name of a dotted ``homerlhf...`` module; None for the package root itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every ``homerlhf`` module ``source`` imports, wherever it does."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from homerlhf import tiny` imports homerlhf.tiny; `from x.y import f` imports x.y.
            found += [(node.lineno, f"{base}.{alias.name}" if base == "homerlhf" else base) for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return sorted({(line, name) for line, name in found if name == "homerlhf" or name.startswith("homerlhf.")})


def upward_imports(path: Path, source: str | None = None) -> list[str]:
    """One line per import of a higher layer in the file at ``path``."""
    module = module_name(path)
    own = layer_of(module)
    if own is None:  # the package root: __version__ and a docstring, importable by all
        return []
    source = path.read_text() if source is None else source
    problems = []
    for line, name in imported_modules(source, module, path.name == "__init__.py"):
        target = layer_of(name)
        if target is not None and RANK[target] > RANK[own]:
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} "
                            f"(layer '{target}' is above '{own}')")
    return problems


def test_every_top_level_module_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert sorted(names - set(RANK)) == [], "add the new module to LAYERS"
    assert sorted(set(RANK) - names) == [], "LAYERS names a module that does not exist"


def test_no_module_imports_a_higher_layer():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the real package, not an empty glob
    problems = [problem for path in files for problem in upward_imports(path)]
    assert problems == []


def test_the_check_finds_upward_imports_of_every_form():
    """The walk above can fail: each kind of upward import in a models module is reported."""
    source = (
        "import homerlhf.stages.builtin\n"
        "from homerlhf.ppo.math import masked_mean\n"
        "def f():\n"
        "    from homerlhf.app import chat\n"
        "    from ..workers import export\n"
        "    importlib.import_module('homerlhf.cli')\n"
        "from homerlhf import cli\n"
        "from homerlhf.models.logprobs import chunked_logprobs\n"  # same layer: fine
        "from homerlhf.errors import UserError\n"  # lower: fine
        "from . import policy\n"  # same package: fine
    )
    problems = upward_imports(PACKAGE / "models" / "example.py", source)
    assert [p.split(" imports ")[1].split(" ")[0] for p in problems] == [
        "homerlhf.stages.builtin", "homerlhf.ppo.math", "homerlhf.app", "homerlhf.workers",
        "homerlhf.cli", "homerlhf.cli",
    ]
    assert problems[0] == "homerlhf/models/example.py:1 imports homerlhf.stages.builtin (layer 'stages' is above 'models')"
