"""scripts/gpu_session.sh, what a session lent a GPU runs: two commands, ``check`` (``homerlhf check``, the
installed command's code) and ``speed`` (benchmarks/gpu_generation.py), ``check`` under ``timeout -k 15 300`` and ``speed`` under 200 s, each with its output and
JSON under ``$OUT``, the machine's package versions beside them, a failure in its exit code; the wheels of
``.whl`` (scripts/device_wheels.sh) installed first."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.sh"


def test_each_command_runs_its_script_and_leaves_its_results_in_out(gpu_session_smoke):
    done, out = gpu_session_smoke
    for command, name, label in (("check", "gpu_check", "homerlhf check"), ("speed", "gpu_generation", "gpu_generation.py")):
        run = done.each[command]
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"{label} exit: 0 (" in run.stdout
        assert json.loads((out / f"{name}.json").read_text())["mode"] in ("cpu-smoke", "cpu_smoke")
        assert (out / f"{name}.log").read_text().strip()
    versions = dict(line.split(" ", 1) for line in (out / "environment.txt").read_text().splitlines()
                    if line.split(" ", 1)[0] in ("torch", "transformers", "bitsandbytes"))
    assert set(versions) == {"torch", "transformers", "bitsandbytes"} and "absent" not in versions.values()
    assert json.loads((out / "gpu_generation.json").read_text())["models"]
    text = SCRIPT.read_text()
    assert "limit=300 " in text and "limit=200 " in text and 'timeout -k 15 "$limit" "$PYTHON"' in text and "${PYTHON:-python3}" in text
    assert "run=(-m homerlhf.cli check --overwrite)" in text  # our GPU contact runs the code a user runs


def test_a_command_it_does_not_know_is_one_line_and_nonzero(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "all"], capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.startswith("usage: bash scripts/gpu_session.sh check|speed")
    assert not list(tmp_path.iterdir())


def _probe_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module, ``homerlhf_wheel_probe``, with its RECORD's hashes (as pip reads them)."""
    import base64
    import hashlib
    import zipfile

    files = {"homerlhf_wheel_probe.py": "VERSION = '1.0'\n",
             "homerlhf_wheel_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: homerlhf-wheel-probe\nVersion: 1.0\n",
             "homerlhf_wheel_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files["homerlhf_wheel_probe-1.0.dist-info/RECORD"] = "\n".join(record + ["homerlhf_wheel_probe-1.0.dist-info/RECORD,,"]) + "\n"
    wheel = folder / "homerlhf_wheel_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


def test_wheels_in_the_wheel_folder_are_installed_first_on_the_path_and_removed_after(tmp_path):
    """scripts/device_wheels.sh's .whl folder (here $HOMERLHF_WHEELS): installed into a folder of its own under
    /tmp, first on PYTHONPATH for the command (here a stand-in for python that imports the wheel's module in
    place of `homerlhf check`), and gone when the script ends."""
    import sys

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels)
    stand_in = tmp_path / "python"
    stand_in.write_text(f"""#!/usr/bin/env bash
case "$1 $2" in "-m pip"|"- ") exec {sys.executable} "$@" ;; esac
exec {sys.executable} -c 'import sys, homerlhf_wheel_probe as m; print("probe", m.__file__, sys.path[1])'
""")
    stand_in.chmod(0o755)
    done = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True, timeout=300,
                          env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin", "PYTHON": str(stand_in),
                               "HOMERLHF_WHEELS": str(wheels), "HOMERLHF_GPU_MODELS": str(tmp_path / "models")})
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("probe ")]
    _, module, first = line.split()
    assert Path(module).parent == Path(first) and first.startswith("/tmp/site.")
    assert not Path(first).exists()  # removed at the script's exit
