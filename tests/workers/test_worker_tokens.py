"""Worker tokens: by a 0600 file or the environment, never on a command line, never on disk in a
run's config; a resumed run reads them again or asks."""

from __future__ import annotations

import os

import httpx
import pytest

from homerlhf.config import REDACTED, from_yaml_file, load_config, to_yaml
from homerlhf.errors import UserError
from homerlhf.workers.backends import connect, llamacpp_reference
from homerlhf.workers.process import WorkerProcess
from homerlhf.workers.tokens import client_token, read_token_file, restore_redacted_tokens, worker_token


def _file(path, text: str, mode: int):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_token_file_owner_only_is_read_and_any_other_mode_refused(tmp_path):
    assert read_token_file(_file(tmp_path / "ok", "abc\n", 0o600)) == "abc"
    assert read_token_file(_file(tmp_path / "ro", "abc", 0o400)) == "abc"
    for mode in (0o640, 0o604, 0o644, 0o660):
        with pytest.raises(UserError, match=rf"readable by others \(mode 0{mode:o}\); run `chmod 600 "):
            read_token_file(_file(tmp_path / f"m{mode:o}", "abc", mode))
    with pytest.raises(UserError, match="is empty"):
        read_token_file(_file(tmp_path / "empty", "\n", 0o600))
    with pytest.raises(UserError, match="cannot read token file"):
        read_token_file(tmp_path / "missing")


def test_where_tokens_come_from(tmp_path, monkeypatch):
    monkeypatch.delenv("HOMERLHF_REF_TOKEN", raising=False)
    monkeypatch.delenv("HOMERLHF_WORKER_TOKEN", raising=False)
    secret = _file(tmp_path / "tok", "from-file", 0o600)
    assert client_token("ref", "in-config", None) == "in-config"
    assert client_token("ref", "in-config", str(secret)) == "from-file"
    monkeypatch.setenv("HOMERLHF_REF_TOKEN", "from-env")
    assert client_token("ref", "in-config", str(secret)) == "from-env"
    assert client_token("ref", REDACTED, None) == "from-env"
    monkeypatch.delenv("HOMERLHF_REF_TOKEN")
    with pytest.raises(UserError, match="ref.token is not saved with a run; set HOMERLHF_REF_TOKEN"):
        client_token("ref", REDACTED, None)
    assert worker_token(None) is None
    monkeypatch.setenv("HOMERLHF_WORKER_TOKEN", "w-env")
    assert worker_token(None) == "w-env" and worker_token(secret) == "from-file"


def test_saved_config_is_redacted_and_resume_asks_again(tmp_path, monkeypatch):
    monkeypatch.delenv("HOMERLHF_REWARD_TOKEN", raising=False)
    cfg = load_config("cpu-tiny", None, ["reward.url=http://cpu-box:8601", "reward.token=s3cret-tok"])
    text = to_yaml(cfg)
    assert "s3cret-tok" not in text and REDACTED in text
    (tmp_path / "config.yaml").write_text(text)
    saved = from_yaml_file(tmp_path / "config.yaml")
    assert saved.reward.token == REDACTED and saved.ref.token is None
    assert restore_redacted_tokens(saved) is saved  # nothing to ask with: the worker layer says what to set
    asked = []
    again = restore_redacted_tokens(saved, ask=lambda prompt: asked.append(prompt) or "typed-tok")
    assert again.reward.token == "typed-tok" and asked == ["bearer token of the reward worker at http://cpu-box:8601: "]
    monkeypatch.setenv("HOMERLHF_REWARD_TOKEN", "env-tok")
    assert restore_redacted_tokens(saved, ask=lambda prompt: pytest.fail("asked though the env has it")) is saved


def test_a_spawned_worker_has_no_token_on_its_command_line(llama_f32_gguf, tmp_path, tiny_llama_dir, monkeypatch):
    """The trainer's local worker: its token in a 0600 file (gone after stop), not in argv or env;
    a remote client needs that token, from the config, the environment or a 0600 file."""
    monkeypatch.delenv("HOMERLHF_REF_TOKEN", raising=False)
    proc = WorkerProcess("ref", llama_f32_gguf, ctx=64, threads=1, log_path=tmp_path / "workers" / "ref.log")
    owner = connect("ref", process=proc)
    try:
        token = proc.token
        assert len(token) >= 32
        argv = open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")
        environ = open(f"/proc/{proc.pid}/environ", "rb").read()
        assert token.encode() not in b" ".join(argv) and token.encode() not in environ
        assert b"--token-file" in argv and (proc.token_path.stat().st_mode & 0o777) == 0o600
        assert httpx.get(f"{proc.url}/health").status_code == 401
        want = owner.logprobs([[2, 3]], [[4, 5]])[0]

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        with pytest.raises(UserError, match="rejected the token"):
            llamacpp_reference(load_config("cpu-tiny", None, [f"ref.url={proc.url}"]), "unused", tokenizer, tmp_path)
        secret = _file(tmp_path / "ref.token", token, 0o600)
        for overrides, env in (([f"ref.token={token}"], None), ([f"ref.token_file={secret}"], None), ([], token)):
            if env:
                monkeypatch.setenv("HOMERLHF_REF_TOKEN", env)
            remote = llamacpp_reference(load_config("cpu-tiny", None, [f"ref.url={proc.url}", *overrides]),
                                        "unused", tokenizer, tmp_path)
            assert remote.logprobs([[2, 3]], [[4, 5]])[0] == pytest.approx(want, abs=1e-9)
            remote.close()
    finally:
        owner.close()
    assert not proc.token_path.exists()


def test_worker_cli_takes_a_token_file_or_the_environment_never_argv(llama_f32_gguf, tmp_path, capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["worker", "--role", "ref", "--model", str(llama_f32_gguf), "--token", "s3cret"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == ["error: --token puts the secret in the process list; set HOMERLHF_WORKER_TOKEN or pass "
                   "--token-file (a 0600 file) instead"]
    shared = _file(tmp_path / "tok", "s3cret", 0o644)
    with pytest.raises(SystemExit):
        main(["worker", "--role", "ref", "--model", str(llama_f32_gguf), "--token-file", str(shared)])
    assert f"token file {shared} is readable by others (mode 0644)" in capsys.readouterr().err
    os.chmod(shared, 0o600)
    proc = WorkerProcess("ref", llama_f32_gguf, ctx=64, threads=1, log_path=tmp_path / "w.log", token="s3cret")
    command = proc.command
    proc.command = lambda: [a if a != str(proc.token_path) else str(shared) for a in command()]  # the user's file
    backend = connect("ref", process=proc)
    try:
        assert httpx.get(f"{proc.url}/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{proc.url}/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        backend.close()
