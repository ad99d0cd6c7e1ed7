"""The worker over real HTTP: numbers equal HF, bad requests are 4xx, auth, bind refusal."""

from __future__ import annotations

import httpx
import pytest
import torch

from homerlhf.workers.backends import connect
from homerlhf.workers.process import WorkerProcess
from homerlhf.workers.vocab import tokenizer_fingerprint
from tolerances import LLAMA_CPP_F32



def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_health_reports_model_and_vocab(llama_ref, tiny_llama_dir):
    from transformers import AutoTokenizer

    health = llama_ref.health()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert health["role"] == "ref" and health["architecture"] == "llama"
    assert health["vocab_size"] == len(tok) and health["n_ctx"] == 64
    assert health["vocab_fingerprint"] == tokenizer_fingerprint(tok)


def test_llama_logprobs_equal_hf(llama_ref, tiny_llama_dir, samples, hf_ref):
    PROMPTS, RESPONSES = samples
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    got = llama_ref.logprobs(PROMPTS, RESPONSES)
    diff = _max_diff(got, hf_ref(model, PROMPTS, RESPONSES))
    print(f"llama F32 export, F32 KV: max |logprob diff| vs HF = {diff:.2e}")
    assert diff <= LLAMA_CPP_F32


def test_logprobs_at_the_request_temperature_equal_hf(llama_ref, tiny_llama_dir, samples, hf_ref):
    """The worker scores log_softmax(logits / T), the distribution the actor sampled at T."""
    PROMPTS, RESPONSES = samples
    from transformers import AutoModelForCausalLM

    from homerlhf.workers.backends import LlamaCppReference

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tempered = LlamaCppReference(llama_ref.client, temperature=0.7)
    got = tempered.logprobs(PROMPTS, RESPONSES)
    diff = _max_diff(got, hf_ref(model, PROMPTS, RESPONSES, temperature=0.7))
    print(f"llama F32 export, F32 KV, T=0.7: max |logprob diff| vs HF = {diff:.2e}")
    assert diff <= LLAMA_CPP_F32
    # The temperature changes the numbers far beyond the tolerance: the check can fail.
    assert _max_diff(got, hf_ref(model, PROMPTS, RESPONSES)) > 1e-2


def test_qwen2_logprobs_equal_hf(qwen2_f32_gguf, tiny_qwen2_dir, tmp_path, samples, hf_ref):
    PROMPTS, RESPONSES = samples
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    backend = connect("ref", process=WorkerProcess("ref", qwen2_f32_gguf, ctx=64, f32_kv_cache=True,
                                                   threads=2, log_path=tmp_path / "qwen.log"))
    try:
        diff = _max_diff(backend.logprobs(PROMPTS, RESPONSES), hf_ref(model, PROMPTS, RESPONSES))
    finally:
        backend.close()
    print(f"qwen2 F32 export, F32 KV: max |logprob diff| vs HF = {diff:.2e}")
    assert diff <= LLAMA_CPP_F32


def _hf_scores(rm_dir, PROMPTS, RESPONSES) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p + r])).logits[0, 0].item() for p, r in zip(PROMPTS, RESPONSES)]


def test_llama_reward_score_equals_hf(llama_rm_dir, llama_rm_export, tmp_path, samples):
    from transformers import AutoModelForSequenceClassification

    from homerlhf.models.scores import score_sequences

    PROMPTS, RESPONSES = samples
    # One response ends with the pad id (0): sequences travel unpadded, so it is a real token (as
    # Llama-3's pad = eos is) and the score is read there, as HF scoring reads the last real token.
    RESPONSES = RESPONSES[:-1] + [RESPONSES[-1] + [0]]
    backend = connect("reward", process=WorkerProcess("reward", llama_rm_export, ctx=64, f32_kv_cache=True,
                                                      threads=2, log_path=tmp_path / "rm.log"))
    try:
        got = backend.score(PROMPTS, RESPONSES)
        without_pad = backend.score(PROMPTS[-1:], [RESPONSES[-1][:-1]])
    finally:
        backend.close()
    model = AutoModelForSequenceClassification.from_pretrained(llama_rm_dir, dtype=torch.float32).eval()
    want = score_sequences(model, [p + r for p, r in zip(PROMPTS, RESPONSES)], pad_id=0).tolist()
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"llama reward: max |score diff| vs HF = {diff:.2e}")
    assert diff <= LLAMA_CPP_F32
    assert abs(got[-1] - without_pad[0]) > 1e-3  # the trailing pad id was scored, not dropped
    assert len(set(round(s, 4) for s in want)) == len(want)  # distinct scores: the check can fail


def test_qwen2_reward_via_cli_export_and_token_auth(qwen2_rm_dir, tmp_path, samples):
    """`homerlhf export reward` then a token-protected reward worker: 401 without the token."""
    PROMPTS, RESPONSES = samples
    from homerlhf.cli import main

    out = tmp_path / "rm"
    main(["export", "reward", "--model", str(qwen2_rm_dir), "--out", str(out), "--outtype", "f32"])
    assert {"backbone.gguf", "score_head.safetensors", "manifest.json"} <= {p.name for p in out.iterdir()}

    proc = WorkerProcess("reward", out, ctx=64, f32_kv_cache=True, threads=2, log_path=tmp_path / "rm.log", token="s3cret")
    backend = connect("reward", process=proc)
    try:
        body = {"sequences": [{"prompt_ids": p, "response_ids": r} for p, r in zip(PROMPTS, RESPONSES)]}
        assert httpx.post(f"{proc.url}/score", json=body).status_code == 401
        assert httpx.get(f"{proc.url}/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
        got = backend.score(PROMPTS, RESPONSES)
    finally:
        backend.close()
    want = _hf_scores(qwen2_rm_dir, PROMPTS, RESPONSES)
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"qwen2 reward: max |score diff| vs HF = {diff:.2e}")
    assert diff <= LLAMA_CPP_F32


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/logprobs", {"sequences": []}, 422, "at least 1"),
        ("/logprobs", {"sequences": [{"prompt_ids": [2, 3], "response_ids": [4, 9999]}]}, 400, "outside the vocabulary"),
        ("/logprobs", {"sequences": [{"prompt_ids": [2, 3], "response_ids": [-1]}]}, 400, "outside the vocabulary"),
        ("/logprobs", {"sequences": [{"prompt_ids": list(range(3, 60)), "response_ids": list(range(3, 20))}]}, 400, "exceed the worker context"),
        ("/logprobs", {"sequences": [{"prompt_ids": [], "response_ids": [4]}]}, 400, "prompt_ids is empty"),
        ("/logprobs", {"sequences": [{"prompt_ids": ["a"], "response_ids": [4]}]}, 422, "valid integer"),
        ("/logprobs", {"sequences": [{"prompt_ids": [2]}]}, 422, "response_ids"),
        ("/logprobs", {"seqs": []}, 422, "malformed"),
        ("/logprobs", {"sequences": [{"prompt_ids": [2], "response_ids": [4]}], "temperature": 0}, 422, "temperature"),
        ("/score", {"sequences": [{"prompt_ids": [2], "response_ids": [4]}], "temperature": 0.7}, 422, "temperature"),
        ("/score", {"sequences": [{"prompt_ids": [2], "response_ids": [4]}]}, 400, "POST /logprobs"),
    ],
)
def test_bad_requests_are_4xx_and_worker_keeps_serving(llama_ref, path, body, status, words, samples):
    PROMPTS, RESPONSES = samples
    url = llama_ref.client.url
    response = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {llama_ref.client.token}"})
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]
    assert len(llama_ref.logprobs(PROMPTS[:1], RESPONSES[:1])[0]) == len(RESPONSES[0])


def test_not_json_is_422(llama_ref):
    response = httpx.post(f"{llama_ref.client.url}/logprobs", content=b"not json",
                          headers={"content-type": "application/json", "Authorization": f"Bearer {llama_ref.client.token}"})
    assert response.status_code == 422
    assert llama_ref.health()["role"] == "ref"


def test_non_loopback_bind_refused_without_token(llama_f32_gguf, capsys):
    from homerlhf.cli import main
    from homerlhf.errors import UserError
    from homerlhf.workers.server import check_bind

    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--role", "ref", "--model", str(llama_f32_gguf), "--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    assert "refusing to bind 0.0.0.0 without a token" in capsys.readouterr().err
    with pytest.raises(UserError):
        check_bind("192.168.1.5", None)
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "secret")


def test_worker_cli_rejects_unknown_role(llama_f32_gguf, capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--role", "critic", "--model", str(llama_f32_gguf)])
    assert exit_info.value.code == 2
    assert "use ref or reward" in capsys.readouterr().err
