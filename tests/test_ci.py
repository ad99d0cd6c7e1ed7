"""``.ci/run`` runs the suite from a folder named homerlhf, as users clone the repository
(``.ci/as_cloned``): a test that read the checkout's folder name would pass in CI under any other name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AS_CLONED = ROOT / ".ci" / "as_cloned"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, capture_output=True, text=True,
                          check=True).stdout.strip()


def _checkout(path: Path) -> Path:
    """A repository of two commits of ``version.txt`` ("1", then "2"), its folder ``path``."""
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    for version in ("1", "2"):
        (path / "version.txt").write_text(version)
        _git(path, "add", "version.txt")
        _git(path, "commit", "-q", "-m", f"version {version}")
    return path


def _as_cloned(repo: Path, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(AS_CLONED)], cwd=repo, env={**os.environ, **GIT_ENV, "TMPDIR": str(tmp)},
                          capture_output=True, text=True, check=True)


def test_a_checkout_named_otherwise_runs_from_a_clone_of_its_head_in_a_folder_named_homerlhf(tmp_path):
    repo, tmp = _checkout(tmp_path / "ci-checkout"), tmp_path / "tmp"
    _git(repo, "checkout", "-q", "--detach", "HEAD~1")  # CI checks a commit out, on no branch
    (repo / "version.txt").write_text("edited")
    done = _as_cloned(repo, tmp)
    where = Path(done.stdout.strip())
    assert where.name == "homerlhf" and where.parent.parent == tmp
    assert _git(where, "rev-parse", "HEAD") == _git(repo, "rev-parse", "HEAD")
    assert (where / "version.txt").read_text() == "1"  # the commit, not the edit
    assert "has uncommitted changes; the clone holds its last commit only" in done.stderr
    (where / "left-over").write_text("from the last run")
    assert Path(_as_cloned(repo, tmp).stdout.strip()) == where and not (where / "left-over").exists()  # replaced


def test_a_checkout_named_homerlhf_runs_where_it_is(tmp_path):
    repo = _checkout(tmp_path / "homerlhf")
    assert _as_cloned(repo, tmp_path / "tmp").stdout.strip() == str(repo)
    assert not (tmp_path / "tmp").exists()


def test_ci_run_moves_to_that_folder_before_readmes_test_command():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    moved = lines.index('cd "$suite_dir"')
    assert lines.index("suite_dir=$(bash .ci/as_cloned)") < moved < len(lines) - 1
    assert "pytest" in lines[-1]  # README's command, the last line (tests/test_readme.py)
