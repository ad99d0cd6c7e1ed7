"""Files and functions of a size a reader can hold: ``scripts/check_sizes.py`` over the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_sizes.py"


def _check(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, timeout=60)


def test_no_module_over_400_lines_and_no_function_over_60_in_the_package():
    result = _check(ROOT / "homerlhf")
    assert result.returncode == 0, "too large, split by concern:\n" + result.stdout


def test_the_check_names_each_oversized_module_and_function(tmp_path):
    """The check can fail: a 401-line module and a 61-line method (nested in a class) are named, a
    60-line function is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    body61 = "\n".join(["    x = 0"] * 59 + ["    return x"])
    body60 = "\n".join(["    x = 0"] * 58 + ["    return x"])
    method = "\n".join("    " + line for line in ("def long(self):\n" + body61).splitlines())
    (package / "small.py").write_text(f"class A:\n{method}\n\n\ndef fine():\n{body60}\n")
    (package / "big.py").write_text("\n".join(f"v{i} = {i}" for i in range(401)) + "\n")
    result = _check(package)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "pkg/big.py: module has 401 lines (limit 400)",
        "pkg/small.py: A.long has 61 lines (limit 60)",
    ]
