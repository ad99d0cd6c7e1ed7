"""scripts/demo_reference.py: the packaged reference is what it writes from the measured demo run (where that
run's directory is on this machine), and a directory that holds no run is refused in one line."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from homerlhf.app import monitor_reference

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_reference.py"
MEASURED = Path("/tmp/h61ref_demo_run")  # `homerlhf demo --fast`'s run directory, where the file was written from


def _main():
    return runpy.run_path(str(SCRIPT))["main"]


@pytest.mark.skipif(not (MEASURED / "metrics.jsonl").is_file(), reason="the measured demo run is not on this machine")
def test_the_packaged_reference_is_what_the_script_writes_from_the_measured_run(tmp_path):
    head = monitor_reference.load()["header"]
    out = tmp_path / "ref.json"
    assert _main()([str(MEASURED), "--cpu", head["cpu"], "--date", head["date"], "--out", str(out)]) == 0
    packaged = Path(monitor_reference.__file__).parent / "reference" / monitor_reference.FILE
    assert out.read_text() == packaged.read_text()


def test_a_directory_without_a_run_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "ref.json"
    assert _main()([str(tmp_path), "--cpu", "c", "--date", "d", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl rows or no config.yaml" in err and not out.exists()
