"""scripts/demo_reference.py: a directory that holds no run is refused in one line (the packaged reference was
written by it from the measured demo run: docs/audit.md)."""

from __future__ import annotations

import runpy
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_reference.py"


def _main():
    return runpy.run_path(str(SCRIPT))["main"]


def test_a_directory_without_a_run_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "ref.json"
    assert _main()([str(tmp_path), "--cpu", "c", "--date", "d", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl rows or no config.yaml" in err and not out.exists()
