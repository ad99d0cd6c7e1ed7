"""Runs that survive, end to end through the real CLI in subprocesses:

- a ``kill -9`` in the middle of a checkpoint write, then ``--resume`` to N: the resume continues
  from the previous checkpoint and the run completes equal to the N iterations run straight (the same
  adapter and value-head weights, max abs diff <= 1e-6, and the same metrics rows, wall-time fields
  aside). A kill between writes is the case below with llama.cpp workers (and the data-parallel
  launcher's in tests/stages/test_data_parallel.py): one straight-vs-killed pair on the in-process
  backends is enough;
- the same kill and resume with the default backends (llama.cpp reference and reward workers), in
  sync mode and in the asynchronous mode (``rollout.async`` with the llamacpp engine: the batch
  sampled ahead is in flight at the kill, the resume takes the checkpoint's), each sample's policy
  version lag 0 in iteration 1 and exactly 1 after;
- SIGINT mid-run with the real llama.cpp workers: exit 0, a checkpoint, no worker process left.

Bit-exact resume on CPU needs the same torch thread count in every process (the float reductions
of a matmul depend on how it is split); the runs here use ``OMP_NUM_THREADS=1``, and one thread
for each llama.cpp worker and the engine. Everything random
(sampling, mini-batch shuffles, data order) is restored from the checkpoint's RNG states.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from homerlhf.ppo.checkpoint import FAULT_ENV, latest_complete_checkpoint, list_checkpoints

N = 4
WALL_TIME = ("time_", "tokens_per_s_", "peak_mem_")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama_dir):
    from homerlhf.tiny import build_sequence_classifier

    return tiny_llama_dir, build_sequence_classifier(tmp_path_factory.mktemp("rm"), arch="llama", seed=3)


def _env(extra=None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop(FAULT_ENV, None)
    env.update(extra or {})
    return env


def _args(models, out: Path, *sets: str, reward="hf") -> list[str]:
    policy_dir, rm_dir = models
    overrides = [
        f"model.name_or_path={policy_dir}", "ref.backend=adapter_off" if reward == "hf" else "ref.backend=llamacpp",
        f"reward.backend={'hf' if reward == 'hf' else 'llamacpp'}", f"reward.model={rm_dir}",
        "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=6",
        "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "ppo.score_norm=true", "ppo.adaptive_kl=true", "logging.progress=false",
        "logging.samples_per_iteration=1", "checkpoint.every=2", "checkpoint.keep=2",
        f"ppo.iterations={N}", *sets,
    ]
    return ["train", "--preset", "cpu-tiny", "--out", str(out)] + [x for o in overrides for x in ("--set", o)]


def _cli(argv, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "homerlhf.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or _env(), **kw)


def _finish(proc: subprocess.Popen, timeout=300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for rel in ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "value_head.safetensors"):
        for key, value in load_file(str(ckpt / rel)).items():
            out[f"{rel}:{key}"] = value
    return out


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(WALL_TIME)} for row in rows]


def _assert_same_run(straight: Path, resumed: Path) -> None:
    a, b = _weights(latest_complete_checkpoint(straight)), _weights(latest_complete_checkpoint(resumed))
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |weight diff| straight vs resumed: {diff:.3e}")
    assert diff <= 1e-6
    rows_a, rows_b = _rows(straight), _rows(resumed)
    assert [r["iteration"] for r in rows_b] == list(range(1, N + 1))
    assert rows_a == rows_b


@pytest.fixture(scope="module")
def straight_run(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    code, err = _finish(_cli(_args(models, out)))
    assert code == 0, err
    assert latest_complete_checkpoint(out).name == f"iter_{N:06d}"
    return out


def _kill_at_first_checkpoint(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 300
    while latest_complete_checkpoint(out) is None:  # iter_000002: k = 2
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest_complete_checkpoint(out).name == "iter_000002"


# Deterministic workers and engine: one llama.cpp thread each.
WORKER_MODES = {
    "sync": ("ref.threads=1", "reward.threads=1"),
    "async": ("ref.threads=1", "reward.threads=1", "rollout.engine=llamacpp", "rollout.engine_threads=1",
              "rollout.async=true"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(WORKER_MODES))
def test_kill9_then_resume_with_llamacpp_workers(models, mode, tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "run"
    code, err = _finish(_cli(_args(models, straight, *WORKER_MODES[mode], reward="llamacpp")))
    assert code == 0, err
    _kill_at_first_checkpoint(_cli(_args(models, out, *WORKER_MODES[mode], reward="llamacpp")), out)
    if mode == "async":  # the batch of iteration 3, sampled ahead during iteration 2, is in the checkpoint
        assert json.loads((latest_complete_checkpoint(out) / "buffer" / "pending.json").read_text())["iteration"] == 3

    code, err = _finish(_cli(["train", "--resume", str(out)]))
    assert code == 0, err
    _assert_same_run(straight, out)
    lags = [(row["policy_version_lag_mean"], row["policy_version_lag_max"]) for row in _rows(out)]
    assert lags == ([(0.0, 0.0)] + [(1.0, 1.0)] * (N - 1) if mode == "async" else [(0.0, 0.0)] * N)


@pytest.mark.slow
def test_kill_during_checkpoint_write_resumes_from_previous(models, straight_run, tmp_path):
    out = tmp_path / "run"
    # checkpoint.every=1: iteration 3's save is cut short by a SIGKILL after its adapters are written.
    code, err = _finish(_cli(_args(models, out, "checkpoint.every=1"), env=_env({FAULT_ENV: "3"})))
    assert code == -signal.SIGKILL, err
    assert any(p.name.startswith(".tmp-iter_000003") for p in (out / "checkpoints").iterdir())
    assert latest_complete_checkpoint(out).name == "iter_000002"

    code, err = _finish(_cli(["train", "--resume", str(out), "--set", "checkpoint.every=1"]))
    assert code == 0, err
    assert [p.name for p in list_checkpoints(out)] == ["iter_000003", "iter_000004"]
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())
    _assert_same_run(straight_run, out)


def _workers_of(pid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "homerlhf.cli" in cmd and "worker" in cmd and str(pid) in cmd:
            found.append(proc)
    return found


def _assert_workers_gone(pid: int, within: float = 60.0) -> None:
    """The run's workers end after their owner: waited for (they exit on their own watch of the owner,
    which can lag the owner's exit on a busy machine), never a fixed sleep."""
    deadline = time.monotonic() + within
    while _workers_of(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _workers_of(pid) == []


@pytest.mark.slow
def test_sigint_stops_cleanly_with_real_workers(models, tmp_path):
    out = tmp_path / "run"
    proc = _cli(_args(models, out, "ppo.iterations=200", "checkpoint.every=1000", reward="llamacpp"))
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.1)
    assert len(_workers_of(proc.pid)) == 2  # the ref and reward llama.cpp workers
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc, timeout=120)
    assert code == 0, err
    assert "Traceback" not in err
    ckpt = latest_complete_checkpoint(out)
    assert ckpt is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((ckpt / "trainer_state.json").read_text())["iteration"] == len(rows) < 200
    _assert_workers_gone(proc.pid)


@pytest.mark.slow
def test_second_sigint_aborts_at_once_and_leaves_no_worker(models, tmp_path):
    out = tmp_path / "run"
    # Long phases (bigger batch, longer responses) so the abort lands before the graceful stop ends.
    proc = _cli(_args(models, out, "ppo.iterations=200", "checkpoint.every=1000", "rollout.batch_size=32",
                      "rollout.chunk_size=32", "rollout.max_new_tokens=64", "ppo.mini_batch_size=8",
                      "ppo.micro_batch_size=8", reward="llamacpp"))
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    assert len(_workers_of(proc.pid)) == 2
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals so close together could be delivered as one
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc, timeout=120)
    assert code == 130, err
    assert "aborting now" in err
    _assert_workers_gone(proc.pid)


def _flip_byte(path: Path) -> None:
    """One byte changed in place, the size kept: what no size check sees."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_resume_refuses_a_changed_checkpoint_before_any_weight_loads(straight_run, tmp_path, capsys, monkeypatch):
    """A byte flipped (same size) in the newest checkpoint's actor adapter: `train --resume` exits 2 with
    one line naming the file and the checkpoint to continue from, before a model is built or a log is
    cut back. In process, on a copy of the shared straight run."""
    import shutil

    from homerlhf.cli import main
    from homerlhf.errors import UserError
    from homerlhf.ppo.resuming import saved_config
    from homerlhf.stages.ppo import run_ppo

    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    newest = run / "checkpoints" / f"iter_{N:06d}"
    _flip_byte(newest / "actor" / "adapter_model.safetensors")
    built = []
    monkeypatch.setattr("homerlhf.models.policy.PolicyModel.from_config",
                        classmethod(lambda cls, *a, **k: built.append(a)))
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(run)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        f"error: checkpoint {newest}: actor/adapter_model.safetensors does not match its MANIFEST.json sha256 "
        f"(changed after it was written); move it out of the way (mv {newest} {run}/{newest.name}.damaged) and run "
        f"`homerlhf train --resume {run}` again to continue from iter_000002"]
    with pytest.raises(UserError, match="actor/adapter_model.safetensors does not match"):
        run_ppo(saved_config(newest), resume=run)  # the stage refuses it too, called without the CLI
    assert built == [] and (run / "metrics.jsonl").read_bytes() == metrics

    (newest / "actor" / "adapter_model.safetensors").unlink()  # gone: named, not "no complete checkpoint"
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(run)])
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: checkpoint {newest}: actor/adapter_model.safetensors is missing")
    assert built == []
