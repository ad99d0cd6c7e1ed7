"""Real vocabularies through the export and the worker: the Qwen3, Llama-3.1 and Gemma-3 tokenizers
(tests/fixtures/tokenizers) on tiny random-init models with their checkpoints' embedding rows —
Qwen3 151,936 for 151,669 tokens (padding rows), Gemma-3 262,144 for 262,145 tokens (one added
token past the embedding). The worker must accept the actor tokenizer's fingerprint and give HF's
log-probs on a chat-templated prompt.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import LLAMA_CPP_F32

# tokenizer fixture -> (architecture, embedding rows of the real checkpoint)
REAL = {"qwen3": ("qwen3", 151936), "llama3_1": ("llama", 128256), "gemma3": ("gemma3_text", 262144)}


@pytest.mark.slow  # a 262k-token vocabulary is written and loaded (~30 s for Gemma-3 on 2 cores)
@pytest.mark.parametrize("name", list(REAL))
def test_real_vocabulary_exports_and_serves(name, real_tokenizer_dirs, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homerlhf.tiny import model_config
    from homerlhf.workers.backends import connect
    from homerlhf.workers.gguf import export_ref
    from homerlhf.workers.process import WorkerProcess
    from homerlhf.workers.vocab import tokenizer_fingerprint

    model_dir = tmp_path / name
    shutil.copytree(real_tokenizer_dirs[name], model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    arch, rows = REAL[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(arch, rows, hidden=64, layers=2)).eval()
    model.save_pretrained(model_dir)
    gguf = export_ref(str(model_dir), tmp_path / "ref.gguf", outtype="f32")

    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about tea, please."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    response = tok.encode("Tea is made by steeping leaves.", add_special_tokens=False)
    backend = connect("ref", process=WorkerProcess("ref", gguf, ctx=64, f32_kv_cache=True, threads=1),
                      fingerprint=tokenizer_fingerprint(tok))  # refuses a vocabulary other than tok's
    try:
        got = backend.logprobs([prompt], [response])[0]
        assert backend.health()["vocab_size"] == rows
    finally:
        backend.close()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].double(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"{name} ({len(tok)} tokens, {rows} rows): worker vs HF max |logprob diff| {diff:.2e}")
    assert diff <= LLAMA_CPP_F32
