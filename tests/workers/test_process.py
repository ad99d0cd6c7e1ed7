"""A worker killed by a signal: one line naming the signal, its meaning here and the fix; crash
signals are never restarted. Real worker processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from homerlhf.errors import UserError
from homerlhf.workers.backends import connect
from homerlhf.workers.client import WorkerClient
from homerlhf.workers.process import PORTABLE_CMAKE_ARGS, WorkerProcess, portable_reinstall_command, signal_death

ILL_MEANING = "illegal instruction: the llama.cpp build uses CPU instructions this machine lacks"


def test_signal_death_explains_crash_and_outside_signals():
    ill = signal_death(-signal.SIGILL)
    assert (ill.name, ill.restartable) == ("SIGILL", False)
    assert ill.meaning == ILL_MEANING and ill.fix == f"reinstall the portable llama.cpp build: {portable_reinstall_command()}"
    assert not signal_death(-signal.SIGSEGV).restartable and not signal_death(-signal.SIGBUS).restartable
    kill = signal_death(-signal.SIGKILL)
    assert kill.name == "SIGKILL" and kill.restartable and "out-of-memory killer" in kill.meaning
    assert signal_death(-signal.SIGUSR1).name == "SIGUSR1"  # any other signal is still named
    assert signal_death(0) is None and signal_death(1) is None and signal_death(None) is None


def test_reinstall_command_builds_the_portable_flags_without_pip_cache():
    cmd = portable_reinstall_command()
    assert cmd.startswith(f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install ')
    assert "-DGGML_NATIVE=OFF" in cmd and "-DGGML_AVX512=OFF" in cmd
    for flag in ("--force-reinstall", "--no-cache-dir", "--no-binary llama-cpp-python"):
        assert flag in cmd
    assert re.search(r"llama-cpp-python==\d+\.\d+\.\d+$", cmd)


def _assert_sigill_line(message: str, log_path) -> None:
    assert len(message.splitlines()) == 1, message
    assert message.startswith("the ref worker died by SIGILL (")
    assert ILL_MEANING in message and portable_reinstall_command() in message and str(log_path) in message


def test_sigill_during_a_run_is_one_line_and_no_restart(llama_f32_gguf, tmp_path, samples):
    prompts, responses = samples
    log = tmp_path / "ref.log"
    process = WorkerProcess("ref", llama_f32_gguf, ctx=64, threads=1, log_path=log)
    backend = connect("ref", process=process)
    try:
        assert len(backend.logprobs(prompts, responses)) == 4
        os.kill(backend.health()["pid"], signal.SIGILL)
        with pytest.raises(UserError) as info:
            backend.logprobs(prompts, responses)
        _assert_sigill_line(str(info.value), log)
        assert info.value.exit_code == 1
        assert process.starts == 1 and backend.client.restarts == 0 and not process.alive()
    finally:
        backend.close()


def test_sigill_before_ready_is_one_line(llama_f32_gguf, tmp_path):
    log = tmp_path / "ref.log"
    process = WorkerProcess("ref", llama_f32_gguf, ctx=64, threads=1, log_path=log)

    def kill_once_spawned():  # Python alone takes longer to start than this loop to see the pid
        while process.pid is None:
            time.sleep(0.001)
        os.kill(process.pid, signal.SIGILL)

    killer = threading.Thread(target=kill_once_spawned)
    killer.start()
    with pytest.raises(UserError) as info:
        process.start()
    killer.join()
    _assert_sigill_line(str(info.value), log)
    assert "ready" not in log.read_text()


def test_restartable_death_gives_up_in_one_line(llama_f32_gguf, tmp_path, samples):
    prompts, responses = samples
    process = WorkerProcess("ref", llama_f32_gguf, ctx=64, threads=1, log_path=tmp_path / "ref.log")
    client = WorkerClient(process=process, max_restarts=0)
    try:
        pid = client.start()["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(UserError) as info:
            client.post("/logprobs", {"sequences": [{"prompt_ids": prompts[0], "response_ids": responses[0]}]})
    finally:
        client.close()
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("the ref worker died 1 times; giving up; the last time by SIGKILL (killed from outside")
    assert process.starts == 1


@pytest.mark.slow
def test_sigill_of_the_reward_worker_during_homerlhf_train(tiny_llama_dir, llama_rm_dir, tmp_path):
    """Through the real CLI: the train run ends with one error line naming SIGILL, and no restart."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "homerlhf.cli", "train", "--out", str(run_dir),
            "--set", f"model.name_or_path={tiny_llama_dir}", "--set", "ref.backend=adapter_off",
            "--set", f"reward.model={llama_rm_dir}", "--set", "reward.threads=1",
            "--set", "rollout.batch_size=4", "--set", "rollout.chunk_size=2", "--set", "rollout.max_new_tokens=4",
            "--set", "rollout.max_prompt_len=24", "--set", "ppo.mini_batch_size=4", "--set", "ppo.micro_batch_size=2",
            "--set", "ppo.epochs=1", "--set", "ppo.iterations=200", "--set", "logging.progress=false"]
    env = dict(os.environ, HOMERLHF_CACHE=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    train = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = run_dir / "workers" / "reward.log"
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and "homerlhf worker ready" in log.read_text()):
            assert train.poll() is None and time.monotonic() < deadline, train.communicate()
            time.sleep(0.1)
        os.kill(int(re.search(r"ready .* pid=(\d+)", log.read_text()).group(1)), signal.SIGILL)
        out, err = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert "Traceback" not in err, err
    # stderr also carries the run's own progress bars and library warnings; the error is its last line.
    lines = [line for line in err.splitlines() if line.strip()]
    want = (f"error: the reward worker died by SIGILL ({ILL_MEANING}); reinstall the portable llama.cpp build: "
            f"{portable_reinstall_command()} (worker log: {log})")
    assert [line for line in lines if "error" in line.lower() or "SIGILL" in line] == [want], err
    assert lines[-1] == want
    assert train.returncode == 1
    assert log.read_text().count("homerlhf worker ready") == 1  # not restarted
