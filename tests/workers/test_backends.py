"""The trainer's factories: cached export, local worker with its log in the run dir, reward run dirs, url."""

from __future__ import annotations

import shutil

import pytest

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.workers.backends import connect, llamacpp_reference, llamacpp_reward
from homerlhf.workers.process import WorkerProcess
from tolerances import LLAMA_CPP_F32


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_reference_factory_exports_once_and_spawns(tiny_llama_dir, tokenizer, tmp_path, samples, monkeypatch):
    from homerlhf.memory import threads
    from homerlhf.paths import cache_dir

    # On a 6-core machine cpu-tiny's ref worker shares with the reward worker and the CPU trainer.
    monkeypatch.setattr(threads, "physical_cores", lambda: 6)
    cfg = load_config("cpu-tiny", None, ["ref.f32_kv_cache=true", "rollout.temperature=0.7"])
    assert cfg.ref.from_nf4 and cfg.ref.outtype == "f32"
    backend = llamacpp_reference(cfg, str(tiny_llama_dir), tokenizer, tmp_path / "run")
    try:
        assert backend.temperature == 0.7  # the rollout's, sent with every request
        health = backend.health()
        assert health["role"] == "ref" and health["n_ctx"] == cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
        assert health["f32_kv_cache"] is True
        assert health["threads"] == 2  # 6 cores // 3 sharers, read back from the llama.cpp context
        got = backend.submit_logprobs(*samples).result(timeout=60)
        assert [len(x) for x in got] == [len(r) for r in samples[1]]
        exports = sorted(cache_dir("gguf").glob("ref-*/ref.gguf"))
        stamp = [p.stat().st_mtime_ns for p in exports]
    finally:
        backend.close()
    assert (tmp_path / "run" / "workers" / "ref.log").exists()
    again = llamacpp_reference(cfg, str(tiny_llama_dir), tokenizer, tmp_path / "run")
    again.close()
    assert [p.stat().st_mtime_ns for p in sorted(cache_dir("gguf").glob("ref-*/ref.gguf"))] == stamp  # reused


def test_reward_factory_uses_a_run_dirs_own_export_and_remote_url(llama_rm_dir, llama_rm_export, tokenizer, tmp_path, samples):
    run = tmp_path / "reward-run"
    shutil.copytree(llama_rm_dir, run / "model")
    shutil.copytree(llama_rm_export, run / "gguf")
    cfg = load_config("cpu-tiny", None, [f"reward.model={run}"])
    local = llamacpp_reward(cfg, tokenizer, tmp_path / "ppo")
    try:
        assert local.client.process.model == run / "gguf"
        want = local.score(*samples)
        remote_cfg = load_config("cpu-tiny", None, [f"reward.url={local.client.url}",
                                                    f"reward.token={local.client.process.token}"])
        remote = llamacpp_reward(remote_cfg, tokenizer, tmp_path / "ppo")
        assert remote.client.process is None
        assert remote.score(*samples) == pytest.approx(want, abs=1e-6)
        remote.close()
        wrong_role = load_config("cpu-tiny", None, [f"ref.url={local.client.url}", "ref.from_nf4=false",
                                                    f"ref.token={local.client.process.token}"])
        with pytest.raises(UserError, match="serves role 'reward'"):
            llamacpp_reference(wrong_role, "unused", tokenizer, tmp_path / "ppo")
    finally:
        local.close()


def test_remote_worker_with_token(llama_f32_gguf, tokenizer, tmp_path):
    proc = WorkerProcess("ref", llama_f32_gguf, ctx=64, log_path=tmp_path / "ref.log", token="tok")
    owner = connect("ref", process=proc)
    try:
        with pytest.raises(UserError, match="rejected the token"):
            llamacpp_reference(load_config("cpu-tiny", None, [f"ref.url={proc.url}"]), "unused", tokenizer, tmp_path)
        cfg = load_config("cpu-tiny", None, [f"ref.url={proc.url}", "ref.token=tok"])
        remote = llamacpp_reference(cfg, "unused", tokenizer, tmp_path)
        assert remote.logprobs([[2, 3]], [[4, 5]])[0] == pytest.approx(owner.logprobs([[2, 3]], [[4, 5]])[0], abs=1e-6)
        remote.close()
    finally:
        owner.close()


def test_unreachable_remote_worker_is_a_user_error(tokenizer, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = load_config("cpu-tiny", None, [f"reward.url=http://127.0.0.1:{port}"])
    with pytest.raises(UserError, match="cannot use the reward worker.*unreachable"):
        llamacpp_reward(cfg, tokenizer, tmp_path)


def test_a_gguf_reference_is_served_as_it_is(llama_f32_gguf, tiny_llama_dir, tokenizer, tmp_path, samples, hf_ref,
                                             capsys):
    """ref.model=X.gguf: no export, the vocabulary checked, a one-line warning about the step-0 KL."""
    from transformers import AutoModelForCausalLM

    from homerlhf.paths import cache_dir

    cached = sorted(cache_dir("gguf").glob("*"))
    cfg = load_config("cpu-tiny", None, [f"ref.model={llama_f32_gguf}", "ref.f32_kv_cache=true"])
    backend = llamacpp_reference(cfg, str(tiny_llama_dir), tokenizer, tmp_path / "run", vocab_rows=len(tokenizer))
    try:
        got = backend.logprobs(*samples)
    finally:
        backend.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    diff = max(abs(a - b) for xs, ys in zip(got, hf_ref(model, *samples)) for a, b in zip(xs, ys))
    assert diff <= LLAMA_CPP_F32 and sorted(cache_dir("gguf").glob("*")) == cached  # served, not exported again
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warning == [f"[homerlhf] warning: ref.model {llama_f32_gguf.name} is served as it is, not exported from "
                       "the policy's weights: the step-0 KL will not be ~0 (iteration 1's kl_mean measures it)"]


def test_a_gguf_reference_with_other_tokens_is_refused(llama_f32_gguf, tokenizer):
    from homerlhf.workers.engine import read_gguf_info
    from homerlhf.workers.vocab import check_same_vocabulary

    tokens = read_gguf_info(llama_f32_gguf, all_tokens=True).tokens
    check_same_vocabulary(tokens, tokenizer, len(tokenizer), "ref.model x.gguf")
    swapped = [*tokens[:7], tokens[8], tokens[7], *tokens[9:]]
    with pytest.raises(UserError, match=r"ref.model x.gguf has a different vocabulary from the policy tokenizer \(id 7: "):
        check_same_vocabulary(swapped, tokenizer, len(tokenizer), "ref.model x.gguf")
    with pytest.raises(UserError, match="has 512 tokens but the policy's embedding 520"):
        check_same_vocabulary(tokens, tokenizer, 520, "ref.model x.gguf")
