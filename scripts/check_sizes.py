"""Size check of the package: no module over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES.

A function's size runs from its ``def`` line to its last line (decorators aside), nested functions
included: a builder that defines its handlers inline carries them. Prints one line per offender and
exits 1 when there is any; ``tests/test_sizes.py`` runs it in CI.

    python scripts/check_sizes.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ROOT = Path(__file__).resolve().parents[1]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def oversized(package: Path) -> list[str]:
    """One line per module over the line limit and per function over the function limit."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        n_lines = len(text.splitlines())
        if n_lines > MAX_MODULE_LINES:
            found.append(f"{rel}: module has {n_lines} lines (limit {MAX_MODULE_LINES})")
        for name, n in _functions(ast.parse(text, filename=str(path))):
            if n > MAX_FUNCTION_LINES:
                found.append(f"{rel}: {name} has {n} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else ROOT / "homerlhf"
    found = oversized(package)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
