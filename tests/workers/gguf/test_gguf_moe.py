"""A mixture of experts as GGUF: llama.cpp's expert layout, and the reference worker against the 4-bit
trainer on a tiny Qwen3-MoE, within the dense families' 1e-3 (F32 export, F32 KV cache)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.workers.gguf import export_ref, export_reward
from test_gguf_archs import PROMPTS, RESPONSES, _max_diff, _worker, build_variant


def gguf_tensors(path) -> dict[str, tuple]:
    import gguf

    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in gguf.GGUFReader(str(path)).tensors}


def test_experts_are_written_in_llama_cpps_layout(tiny_qwen3_moe_dir, tmp_path):
    """From the checkpoint (one matrix per expert, stacked) and from the NF4 experts (transformers' fused
    gate_up, split): the same three 3-D tensors per layer, the router as ffn_gate_inp."""
    from homerlhf.config.schema import QuantConfig

    config = json.loads((tiny_qwen3_moe_dir / "config.json").read_text())
    e, i, h = config["num_local_experts"], config["moe_intermediate_size"], config["hidden_size"]
    plain = gguf_tensors(export_ref(str(tiny_qwen3_moe_dir), tmp_path / "plain.gguf", outtype="f32"))
    nf4 = gguf_tensors(export_ref(str(tiny_qwen3_moe_dir), tmp_path / "nf4.gguf", outtype="q8_0", from_nf4=True,
                                  quant=QuantConfig(compute_dtype="fp32")))
    for tensors in (plain, nf4):
        assert tensors["blk.3.ffn_gate_exps.weight"] == tensors["blk.3.ffn_up_exps.weight"] == (e, i, h)
        assert tensors["blk.3.ffn_down_exps.weight"] == (e, h, i)
        assert tensors["blk.3.ffn_gate_inp.weight"] == (e, h)
        assert not any("experts" in name for name in tensors)
    assert set(plain) == set(nf4)


@pytest.mark.slow  # a worker process
def test_the_reference_worker_gives_the_4bit_trainers_logprobs(tiny_qwen3_moe_dir, tmp_path):
    """The reference exported from the dequantized NF4 base (the run's ``ref.from_nf4``) scores through the
    real worker what the trainer's 4-bit MoE with its adapters off scores."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf"])
    policy = PolicyModel.from_config(cfg, str(tiny_qwen3_moe_dir))
    pad = policy.tokenizer.pad_token_id
    p_len, r_len = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    ids = torch.tensor([[pad] * (p_len - len(p)) + p + r + [pad] * (r_len - len(r)) for p, r in zip(PROMPTS, RESPONSES)])
    mask = torch.tensor([[0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r))
                         for p, r in zip(PROMPTS, RESPONSES)])
    trainer = policy.reference_logprobs(ids, mask, r_len)
    want = [trainer[row, :len(r)].tolist() for row, r in enumerate(RESPONSES)]
    gguf = export_ref(str(tiny_qwen3_moe_dir), tmp_path / "ref.gguf", outtype="f32", from_nf4=True,
                      quant=cfg.quant, device=cfg.card.device)
    backend = _worker("ref", gguf, tmp_path)
    try:
        got = backend.logprobs(PROMPTS, RESPONSES)
    finally:
        backend.close()
    diff = _max_diff(got, want)
    print(f"qwen3_moe: NF4 export, F32 KV cache, worker vs 4-bit trainer max |logprob diff| {diff:.2e}")
    assert diff <= 1e-3


@pytest.mark.slow
def test_a_moe_reward_model_scores_as_hf(tmp_path):
    model_dir, model = build_variant(tmp_path / "rm", "qwen3_moe", seed=22, classifier=True)
    export = export_reward(str(model_dir), tmp_path / "export", outtype="f32")
    backend = _worker("reward", export, tmp_path)
    try:
        got = backend.score(PROMPTS, RESPONSES)
    finally:
        backend.close()
    with torch.no_grad():
        want = [float(model(torch.tensor([p + r])).logits[0, 0]) for p, r in zip(PROMPTS, RESPONSES)]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3 and np.std(want) > 1e-3


def test_a_router_llama_cpp_computes_otherwise_is_refused(tiny_qwen3_moe_dir, tmp_path):
    for item in tiny_qwen3_moe_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(UserError, match="norm_topk_prob is off"):
        export_ref(str(tmp_path), tmp_path / "x.gguf")
