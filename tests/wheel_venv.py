"""The package as PyPI, a Docker image or ``pip install .`` gets it, for the tests that run its commands.

:func:`build_dists` builds the sdist from a copy of the source tree, then the wheel from that sdist
(``python -m build`` without isolation: the build backend installed with ``.[test]``, no download), so a
file the sdist leaves out is missing from the wheel too. :func:`install` puts the wheel (not editable)
into a fresh virtual environment that sees the suite's installed dependencies (``--system-site-packages``:
seconds, not the minutes of a dependency install). :class:`Installed` runs its ``homerlhf`` with the
checkout off the import path (no ``PYTHONPATH``) from a folder outside the checkout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
# What the build reads: the project metadata, the long description and the package.
SOURCE = ("pyproject.toml", "README.md", "homerlhf")


def build_dists(dest: Path) -> tuple[Path, Path]:
    """(sdist, wheel) of the checkout, built in ``dest`` (the checkout gets no build/ or egg-info)."""
    src, dist = dest / "src", dest / "dist"
    src.mkdir(parents=True)
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [sdist], [wheel] = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    return sdist, wheel


@dataclass
class Installed:
    """A virtual environment holding the wheel; :meth:`run` runs its ``homerlhf`` in ``cwd``."""

    venv: Path
    wheel: Path
    sdist: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(VIRTUAL_ENV=str(self.venv), PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
                   PYTHONUNBUFFERED="1", **extra)
        return env

    def run(self, *args: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "homerlhf"), *args], capture_output=True, text=True, cwd=cwd,
                              timeout=timeout, env=self.env(**env))

    @contextlib.contextmanager
    def app(self, *args: str, cwd: Path, timeout: float = 300) -> Iterator[str]:
        """``homerlhf app ARGS`` on a free port, yielded as its URL once it answers ``GET /``; stopped after."""
        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen([str(self.bin / "homerlhf"), "app", *args, "--port", str(port)], cwd=cwd,
                                env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
        try:
            while True:  # wait for the state (it answers), not a time: gradio imports and builds its page first
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if httpx.get(url + "/", timeout=10).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"homerlhf app did not answer in {timeout:.0f} s"
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def python(self, code: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "python"), "-c", code], capture_output=True, text=True, cwd=cwd,
                              timeout=120, env=self.env())


def install(dest: Path) -> Installed:
    """The wheel of :func:`build_dists`, installed into a fresh virtual environment under ``dest``."""
    sdist, wheel = build_dists(dest / "build")
    venv = dest / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    # The venv's own site-packages comes first on its path: its homerlhf shadows an editable install of
    # the checkout in the system site-packages. --force-reinstall: pip would call that one "satisfied".
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--force-reinstall", str(wheel)], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Installed(venv, wheel, sdist)
