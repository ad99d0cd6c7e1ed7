"""The built package holds everything and runs from outside the checkout: each command's import path
through the installed wheel (tests/wheel_venv.py), not the source tree. The other commands run from the
wheel in the tests that check them: ``sft``, ``reward``, a cpu-tiny ``train``, ``app`` and ``export policy``
with a GGUF as docs/guide.md has them (tests/test_guide.py), ``demo --fast`` (tests/stages/test_demo.py),
``doctor`` (tests/test_doctor.py)."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

from wheel_venv import ROOT

PRESETS = {"4090", "3090", "4080", "4060ti-16g", "3060-12g", "t4-colab", "a100-80g", "cpu-tiny"}


def source_files() -> set[str]:
    """Every module, preset and reference run of the source tree, as paths from the repository root."""
    package = ROOT / "homerlhf"
    found = {p for p in package.rglob("*") if p.suffix in (".py", ".yaml", ".json") and "__pycache__" not in p.parts}
    return {p.relative_to(ROOT).as_posix() for p in found}


def test_the_wheel_and_the_sdist_hold_every_module_and_preset(installed_wheel):
    wanted = source_files()
    assert {f"homerlhf/presets/{name}.yaml" for name in PRESETS} <= wanted
    assert {"homerlhf/check/main.py", "homerlhf/workers/gguf/registry.py", "homerlhf/presets/__init__.py",
            "homerlhf/app/reference/demo_fast.json"} <= wanted
    in_wheel = set(zipfile.ZipFile(installed_wheel.wheel).namelist())
    assert sorted(wanted - in_wheel) == []
    with tarfile.open(installed_wheel.sdist) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert sorted(wanted - in_sdist) == []


def test_the_installed_package_is_the_wheel_and_lists_every_preset(installed_wheel, tmp_path):
    where = installed_wheel.python("import homerlhf, homerlhf.presets; print(homerlhf.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed_wheel.venv)  # not the checkout (editable or path)
    reference = installed_wheel.python(  # the monitor's reference run, read from the installed package's data
        "from homerlhf.app import monitor_reference as m; print(m.load()['header']['iterations'])", cwd=tmp_path)
    assert reference.returncode == 0 and int(reference.stdout) > 0, reference.stderr
    help_ = installed_wheel.run("--help", cwd=tmp_path)
    assert help_.returncode == 0 and "train" in help_.stdout and "demo" in help_.stdout, help_.stderr
    listed = installed_wheel.run("presets", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} == PRESETS
    dry = installed_wheel.run("check", cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert dry.returncode == 0 and "nothing run, nothing written" in dry.stdout, dry.stdout + dry.stderr
    assert list(tmp_path.iterdir()) == []
