"""README's two set-up commands are the ones CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_exactly_the_readme_test_command():
    test_cmd = _bash_blocks()[1].strip()
    assert "pytest" in test_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


def test_readme_main_job_is_the_demo():
    assert _bash_blocks()[0].strip().endswith("homerlhf demo")
