"""How README's test command spreads the suite over processes (pytest-xdist: ``-n 2``, ``--dist loadfile``).

- Each worker process is pinned to its own share of the CPUs (two workers on two cores: one each),
  with ``OMP_NUM_THREADS`` to match, and everything it starts inherits the pin. Unpinned, each
  worker's torch and llama.cpp threads counted every core (:func:`homerlhf.memory.threads.physical_cores`)
  and the two workers' busy-waiting threads preempted each other: tests ran up to 4x slower.
- A file's tests run in one worker (its module fixtures are built once); the files that share an
  expensive session fixture run in one worker too (:data:`GROUPS`), so it is built once.
- The longest files are sent first (:data:`FIRST`, then every file with a test marked ``slow``), so
  no worker is left alone with one of them at the end.
- Both workers share one model cache (``HOMERLHF_CACHE``, tests/conftest.py): the builtin models are
  built under a file lock (:mod:`homerlhf.models.registry`), once for the suite.
"""

from __future__ import annotations

import os

from xdist.scheduler import LoadScopeScheduling

FIRST = ("tests/stages/test_demo.py", "tests/stages/test_demo_verifiable.py", "tests/notebooks/test_notebooks.py")
GROUPS = {path: "gpu_session_smoke" for path in (  # tests/conftest.py:gpu_session_smoke, about 55 s
    "tests/scripts/test_gpu_session.py", "tests/benchmarks/test_gpu_generation.py",
    "tests/check/test_main.py", "tests/memory/test_check_report.py")}


def pin_this_worker() -> None:
    """In an xdist worker: its slice of the CPUs this process may use, and as many OpenMP threads."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, index, count = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw")), int(count)
    share = cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count] or [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, share)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(len(share))


def scope_of(nodeid: str) -> str:
    """The unit one worker runs whole: the test's file, or its file's group."""
    path = nodeid.split("::")[0]
    return GROUPS.get(path, path)


def order(items) -> None:
    """Sort ``items`` in place: :data:`FIRST`'s files, then the scopes with a slow test, then the rest
    (a stable sort: each file's own order is kept)."""
    slow = {scope_of(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return FIRST.index(path) if path in FIRST else len(FIRST) + (scope_of(item.nodeid) not in slow)

    items.sort(key=rank)


class FileOrGroupScheduling(LoadScopeScheduling):
    """``--dist loadfile`` with :data:`GROUPS` joined and the collection's order kept (xdist would
    otherwise send the files with the most tests first)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
