"""Size check of the package: modules, functions, module docstrings and parameter lists a reader can hold.

No module over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES (from its ``def`` line to its
last, nested functions included), no module docstring over MAX_DOCSTRING_LINES, no function of
``ppo/`` taking more than MAX_PARAMETERS (``self`` aside), and no issue number in a comment or docstring
(``issue 41``: history goes in commit messages and docs). LONGER_ALLOWED names the modules that may be
longer, with why. Prints one line per offender and exits 1 when there is any; ``tests/test_sizes.py``
runs it in CI.

    python scripts/check_sizes.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_DOCSTRING_LINES = 15
MAX_PARAMETERS = 7
PARAMETER_CHECKED = ("ppo",)  # the subpackages whose functions take at most MAX_PARAMETERS
# The algorithm view and the update read top to bottom in one place each: they are not split to fit.
# Module -> (its line limit, its functions' line limit).
LONGER_ALLOWED = {"ppo/loop.py": (800, 120), "ppo/update.py": (800, 120)}
ISSUE_NUMBER = re.compile(r"\bissue \d", re.IGNORECASE)
ROOT = Path(__file__).resolve().parents[1]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller passes: every named one, ``*args`` and ``**kwargs`` one each, ``self`` /
    ``cls`` aside."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def oversized(package: Path) -> list[str]:
    """One line per module, function, docstring or parameter list over its limit, and per issue number."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        inner = path.relative_to(package).as_posix()
        max_module, max_function = LONGER_ALLOWED.get(inner, (MAX_MODULE_LINES, MAX_FUNCTION_LINES))
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        n_lines = len(text.splitlines())
        if n_lines > max_module:
            found.append(f"{rel}: module has {n_lines} lines (limit {max_module})")
        docstring = ast.get_docstring(tree, clean=False) or ""
        if len(docstring.splitlines()) > MAX_DOCSTRING_LINES:
            found.append(f"{rel}: module docstring has {len(docstring.splitlines())} lines "
                         f"(limit {MAX_DOCSTRING_LINES})")
        for name, node in _functions(tree):
            n = node.end_lineno - node.lineno + 1
            if n > max_function:
                found.append(f"{rel}: {name} has {n} lines (limit {max_function})")
            if inner.split("/")[0] in PARAMETER_CHECKED and parameters(node) > MAX_PARAMETERS:
                found.append(f"{rel}: {name} takes {parameters(node)} parameters (limit {MAX_PARAMETERS})")
        found += _issue_numbers(rel, text)
    for path in sorted(package.rglob("*.yaml")):  # presets
        found += _issue_numbers(path.relative_to(package.parent).as_posix(), path.read_text(encoding="utf-8"))
    return found


def _issue_numbers(rel: str, text: str) -> list[str]:
    return [f"{rel}:{number}: an issue number (history goes in commit messages and docs)"
            for number, line in enumerate(text.splitlines(), 1) if ISSUE_NUMBER.search(line)]


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else ROOT / "homerlhf"
    found = oversized(package)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
