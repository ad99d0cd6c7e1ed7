"""README's first screen and its two set-up commands: the demo a newcomer runs, the test command CI runs.

Each set-up command is the bash block right after its marker (``<!-- set-up: demo -->``,
``<!-- set-up: tests -->``), wherever README puts it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIRST_SCREEN = 40  # lines
FIRST_SCREEN_CHARS = 3500


def _bash_blocks():
    return re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)


def set_up(name: str) -> str:
    """The bash block under ``<!-- set-up: NAME -->``."""
    found = re.findall(rf"<!-- set-up: {name} -->\n```bash\n(.*?)```", README.read_text(), re.S)
    assert len(found) == 1, f"README needs one bash block under <!-- set-up: {name} -->"
    return found[0].strip()


def test_ci_runs_exactly_the_readme_test_command():
    test_cmd = set_up("tests")
    assert "pytest" in test_cmd and "\n" not in test_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


def test_readme_main_job_is_the_demo_from_a_clone_with_the_cpu_torch_index():
    demo = set_up("demo").splitlines()
    assert demo[0].startswith("git clone https://") and demo[0].endswith("&& cd homerlhf")
    assert demo[-1].endswith("homerlhf demo")
    # A CPU-only machine without a local CPU wheel of torch: PyTorch's CPU index, not PyPI's CUDA build.
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in demo[-1]


def test_the_first_screen_says_what_it_is_how_to_try_it_and_run_your_own():
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    assert len(first) < FIRST_SCREEN_CHARS, len(first)
    assert "<!-- set-up: demo -->" in first and "homerlhf demo" in first
    assert "alignment improved: " in first  # the verdict line the demo prints
    for stage in ("homerlhf plan", "homerlhf sft", "homerlhf reward", "homerlhf train", "homerlhf export policy"):
        assert stage in first, stage
    train = next(line for line in first.splitlines() if line.startswith("homerlhf train"))
    assert "--data " in train and "--model " in train and "--reward " in train
    assert "](docs/status.md)" in first and "](docs/guide.md)" in first
    assert "| what | where | result |" in first  # the results table
    assert max(len(cell) for line in first.splitlines() if line.startswith("| ")
               for cell in line.strip("|").split("|")) <= 40  # a few words a cell


def test_ci_readme_and_worker_message_build_the_same_portable_llama_cpp():
    from homerlhf.workers.process import PORTABLE_CMAKE_ARGS

    ci = (ROOT / ".ci" / "run").read_text()
    assert f'LLAMA_CPP_CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}"' in ci
    version = re.search(r"^LLAMA_CPP_VERSION=(\S+)$", ci, re.M).group(1)
    readme_cmd = next(b.strip() for b in _bash_blocks() if "CMAKE_ARGS" in b)
    assert readme_cmd == (f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --force-reinstall --no-deps '
                          f"--no-cache-dir --no-binary llama-cpp-python llama-cpp-python=={version}")
    assert "--no-cache-dir" in ci and "--no-index" in ci  # pip's wheel cache never decides the build
