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


def test_ci_readme_and_worker_message_build_the_same_portable_llama_cpp():
    from homerlhf.workers.process import PORTABLE_CMAKE_ARGS

    ci = (ROOT / ".ci" / "run").read_text()
    assert f'LLAMA_CPP_CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}"' in ci
    version = re.search(r"^LLAMA_CPP_VERSION=(\S+)$", ci, re.M).group(1)
    readme_cmd = next(b.strip() for b in _bash_blocks() if "CMAKE_ARGS" in b)
    assert readme_cmd == (f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --force-reinstall --no-deps '
                          f"--no-cache-dir --no-binary llama-cpp-python llama-cpp-python=={version}")
    assert "--no-cache-dir" in ci and "--no-index" in ci  # pip's wheel cache never decides the build
