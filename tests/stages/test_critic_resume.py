"""A smaller critic of its own (``critic.model``) end to end through the real CLI, in subprocesses:

- N iterations straight vs k iterations, ``kill -9``, ``--resume`` to N: the same actor and critic
  adapters and value head, bit for bit, and the same metrics rows (wall-time fields aside); the
  critic's adapter is the smaller model's (its width) and it trained;
- a critic of another tokenizer: one line, exit 2, no traceback, before any weight loads.

As tests/stages/test_resume.py: ``OMP_NUM_THREADS=1`` in every process (bit-exact resume on CPU needs
the same thread count), the adapter-off reference and an in-process reward model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from homerlhf.ppo.checkpoint import FAULT_ENV, latest_complete_checkpoint

N = 4
WALL_TIME = ("time_", "tokens_per_s_", "peak_mem_")
WEIGHTS = ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "value_head.safetensors")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from homerlhf.tiny import build_sequence_classifier

    return build_sequence_classifier(tmp_path_factory.mktemp("rm"), arch="llama", seed=3)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop(FAULT_ENV, None)
    return env


def _train(policy: Path, critic: Path, rm: Path, out: Path, *sets: str) -> subprocess.Popen:
    return _cli(_train_argv(policy, critic, rm, out, *sets))


def _train_argv(policy: Path, critic: Path, rm: Path, out: Path, *sets: str) -> list[str]:
    overrides = [
        f"model.name_or_path={policy}", f"critic.model={critic}", "ref.backend=adapter_off", "reward.backend=hf",
        f"reward.model={rm}", "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=6",
        "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1", "ppo.score_norm=true",
        "logging.progress=false", "logging.samples_per_iteration=1", "checkpoint.every=2", "checkpoint.keep=2",
        f"ppo.iterations={N}", "rollout.engine=hf", *sets]
    return ["train", "--preset", "cpu-tiny", "--out", str(out)] + [x for o in overrides for x in ("--set", o)]


def _cli(argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "homerlhf.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _finish(proc: subprocess.Popen, timeout=300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _weights(ckpt: Path) -> dict:
    return {f"{rel}:{key}": value for rel in WEIGHTS for key, value in load_file(str(ckpt / rel)).items()}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(WALL_TIME)} for row in rows]


@pytest.mark.slow
def test_a_smaller_critic_trains_and_resumes_exactly_after_kill9(tiny_llama_dir, small_critic_dir, rm_dir, tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "run"
    code, err = _finish(_train(tiny_llama_dir, small_critic_dir, rm_dir, straight))
    assert code == 0, err
    proc = _train(tiny_llama_dir, small_critic_dir, rm_dir, out)
    deadline = time.monotonic() + 300
    while latest_complete_checkpoint(out) is None:  # iter_000002
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest_complete_checkpoint(out).name == "iter_000002"
    code, err = _finish(_cli(["train", "--resume", str(out)]))
    assert code == 0, err

    ckpt = latest_complete_checkpoint(straight)
    a, b = _weights(ckpt), _weights(latest_complete_checkpoint(out))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert _rows(straight) == _rows(out) and [r["iteration"] for r in _rows(out)] == list(range(1, N + 1))
    # The critic's adapter is on the smaller model (width 64, the policy's 128) and trained; so did the head.
    critic = json.loads((ckpt / "critic" / "adapter_config.json").read_text())
    assert critic["base_model_name_or_path"] == str(small_critic_dir)
    lora_b = {k: v for k, v in a.items() if k.startswith("critic/") and "lora_B" in k}
    assert lora_b and all(v.shape[0] in (64, 32, 192) for v in lora_b.values())
    assert all(v.abs().max() > 0 for v in lora_b.values())
    assert a["value_head.safetensors:linear.weight"].shape == (1, 64)
    assert all(row["value_loss"] >= 0 and "explained_variance" in row for row in _rows(out))


def test_a_critic_of_another_tokenizer_is_one_line_before_any_weight(tiny_llama_dir, rm_dir, tmp_path, capsys):
    """In process (``homerlhf.cli.main``): a fresh interpreter proves nothing more for a refusal."""
    from homerlhf.cli import main
    from homerlhf.tiny import build_causal_lm, build_tokenizer

    build_tokenizer(vocab_size=384).save_pretrained(tmp_path / "tokenizer")
    other = build_causal_lm(tmp_path / "other", tokenizer_dir=tmp_path / "tokenizer", hidden=32, layers=1)
    (other / "model.safetensors").write_bytes(b"not weights: reading them would fail")
    capsys.readouterr()  # the build's own progress lines
    with pytest.raises(SystemExit) as exit_:
        main(_train_argv(tiny_llama_dir, other, rm_dir, tmp_path / "run", "ppo.iterations=1"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"critic.model {other} does not share the tokenizer of the policy {tiny_llama_dir}" in err
