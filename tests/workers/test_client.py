"""Client and lifecycle: restart after kill -9 with every sample answered once, no orphan workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from homerlhf.errors import UserError
from homerlhf.workers.backends import connect
from homerlhf.workers.process import WorkerProcess


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _same(got: list[list[float]], want: list[list[float]]) -> bool:
    """Same samples in the same order, each with its own log-probs (a duplicate or a loss shifts them).

    1e-4: packing the same sequence with different neighbours moves F32 results by ~4e-6; distinct
    samples differ by ~1e-2 and more."""
    return len(got) == len(want) and all(
        len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-4 for g, w in zip(got, want)
    )


def test_kill_9_between_and_during_requests(llama_f32_gguf, tmp_path, samples):
    prompts, responses = samples
    # 40 distinct samples (a lost or repeated one shifts the rest) = 3 HTTP requests of <= 16.
    many_p = [prompts[i % 4] + [100 + i] for i in range(40)]
    many_r = [responses[i % 4] for i in range(40)]
    backend = connect("ref", process=WorkerProcess("ref", llama_f32_gguf, ctx=64, f32_kv_cache=True,
                                                   threads=1, log_path=tmp_path / "ref.log"))
    try:
        want = backend.logprobs(many_p, many_r)
        first_pid = backend.health()["pid"]

        os.kill(first_pid, signal.SIGKILL)  # between requests
        assert _same(backend.logprobs(many_p, many_r), want)
        second_pid = backend.health()["pid"]
        assert second_pid != first_pid and backend.client.restarts == 1

        # During requests: 3 calls of 200 samples (13 requests each) are in flight when the kill lands.
        # Identical 40-sample blocks: a lost or repeated request (16 samples) would misalign them.
        futures = [backend.submit_logprobs(many_p * 5, many_r * 5) for _ in range(3)]
        time.sleep(0.05)
        os.kill(second_pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
        assert all(_same(got, want * 5) for got in results)  # every sample has its own result, once
        assert backend.client.restarts == 2
        assert _wait_gone(first_pid, 1) and _wait_gone(second_pid, 1)
        last_pid = backend.health()["pid"]
    finally:
        backend.close()
    assert _wait_gone(last_pid, 10)  # close() stops the worker


def test_vocabulary_mismatch_is_a_clear_error(llama_f32_gguf, tmp_path):
    proc = WorkerProcess("ref", llama_f32_gguf, ctx=64, log_path=tmp_path / "ref.log")
    with pytest.raises(UserError, match="different vocabulary"):
        connect("ref", process=proc, fingerprint="0" * 64)
    assert not proc.alive()  # a failed connect stops what it started


def test_worker_that_cannot_start_reports_its_stderr(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    proc = WorkerProcess("ref", broken, ctx=64, log_path=tmp_path / "ref.log", startup_timeout=60)
    with pytest.raises(UserError, match="exited with code") as info:
        proc.start()
    assert "its last lines" in str(info.value) and len(str(info.value).splitlines()) > 1
    assert not proc.alive()


# "sleep": the owner waits for a signal on a wakeup fd, not in one long time.sleep(). CPython runs a
# Python signal handler only between bytecodes: a SIGINT that lands after the last check and before
# sleep()'s syscall (the test sends it just as the owner heads there) is caught in C but raises
# KeyboardInterrupt only when the syscall returns, 600 s later. The wakeup fd gets its byte whenever
# the signal lands, so select() returns and KeyboardInterrupt is raised at once.
OWNER = textwrap.dedent(
    """
    import os, select, signal, sys
    # Ctrl-C's KeyboardInterrupt, as in a shell: a parent that ignores SIGINT (a pytest-xdist
    # worker does) hands the ignoring on to its children.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from homerlhf.workers.backends import connect
    from homerlhf.workers.process import WorkerProcess
    backend = connect("ref", process=WorkerProcess("ref", sys.argv[1], ctx=64, threads=1, log_path=sys.argv[2]))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # before the pid line: the test signals only after reading it
    print(backend.health()["pid"], flush=True)
    while sys.argv[3] == "sleep":
        select.select([wake_r], [], [])
    # "exit": leave without close(); the atexit hook must stop the worker.
    """
)


@pytest.mark.parametrize("how", ["kill -9", "ctrl-c", "exit without close"])
def test_no_worker_outlives_its_owner(llama_f32_gguf, tmp_path, how):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(llama_f32_gguf), str(tmp_path / "ref.log"), "exit" if how.startswith("exit") else "sleep"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        worker_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(worker_pid)
        if how == "kill -9":
            owner.kill()
        elif how == "ctrl-c":
            owner.send_signal(signal.SIGINT)  # KeyboardInterrupt in the owner; its atexit hook stops the worker
        owner.wait(timeout=60)
        assert _wait_gone(worker_pid, 15), f"worker {worker_pid} outlived its owner ({how})"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
