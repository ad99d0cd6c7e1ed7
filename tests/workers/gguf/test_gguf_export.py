"""GGUF export: q8_0 stays close, the NF4 export is KL-consistent with the 4-bit actor, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.workers.gguf import export_ref, export_reward, permute_qk
from tolerances import LLAMA_CPP_F32

IDS = [2, 4, 17, 30, 41, 50, 51, 52, 60, 61, 62, 63, 64, 65, 1, 7, 8, 9, 10, 11]


def mean_kl(logits_p: np.ndarray, logits_q: np.ndarray) -> float:
    """Mean over positions of KL(p || q) in nats, from (T, V) logits."""
    logp = torch.log_softmax(torch.as_tensor(logits_p, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.as_tensor(logits_q, dtype=torch.float64), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def test_permute_qk_interleaves_rotate_half_pairs():
    # One head of dim 4: HF rows [x0, x1, y0, y1] (rotate-half halves) -> llama.cpp [x0, y0, x1, y1].
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert permute_qk(w, 1)[:, 0].tolist() == [0, 4, 2, 6]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_export_loads_and_stays_close(arch, tiny_llama_dir, tiny_qwen2_dir, tmp_path, llama_cpp_logits):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    path = export_ref(str(model_dir), tmp_path / "q8.gguf", outtype="q8_0")
    f32 = export_ref(str(model_dir), tmp_path / "f32.gguf", outtype="f32")
    assert path.stat().st_size < 0.4 * f32.stat().st_size  # really quantized
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([IDS])).logits[0].double().numpy()
    q8 = llama_cpp_logits(path, IDS)
    kl = mean_kl(hf, q8)
    print(f"{arch} q8_0: max |logit diff| {np.abs(q8 - hf).max():.2e}, KL(HF || q8_0) {kl:.2e} nats/token")
    assert np.abs(q8 - hf).max() < 0.05 and kl < 1e-3


def test_from_nf4_export_is_kl_consistent_with_the_4bit_actor(tiny_llama_dir, tmp_path, llama_cpp_logits):
    """KL(actor at step 0 || reference): the NF4 base (LoRA B = 0 adds nothing) vs the llama.cpp ref."""
    from transformers import AutoModelForCausalLM

    from homerlhf.config.schema import QuantConfig
    from homerlhf.models.policy import quantization_config

    quant = QuantConfig(compute_dtype="fp32")
    actor = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=quantization_config(quant, "cpu"), dtype=torch.float32, device_map="cpu"
    ).eval()
    assert any(type(m).__name__ == "Linear4bit" for m in actor.modules())
    with torch.no_grad():
        # Train mode (dropout is 0) keeps bitsandbytes on its dequantize-then-matmul path in fp32; in
        # eval mode on an AVX512-BF16 CPU it repacks the weights for a bf16 kernel (rounding ~3e-3).
        actor.train()
        actor_exact = actor(torch.tensor([IDS])).logits[0].double().numpy()
        actor.eval()
        actor_eval = actor(torch.tensor([IDS])).logits[0].double().numpy()
    nf4_ref = llama_cpp_logits(export_ref(str(tiny_llama_dir), tmp_path / "nf4.gguf", outtype="f32", from_nf4=True, quant=quant), IDS)
    plain_ref = llama_cpp_logits(export_ref(str(tiny_llama_dir), tmp_path / "plain.gguf", outtype="f32"), IDS)
    kl_nf4, kl_plain = mean_kl(actor_exact, nf4_ref), mean_kl(actor_exact, plain_ref)
    kl_nf4_eval, kl_plain_eval = mean_kl(actor_eval, nf4_ref), mean_kl(actor_eval, plain_ref)
    print(f"KL(actor NF4 || llama.cpp ref), fp32 path: --from-nf4 export {kl_nf4:.2e} nats/token, "
          f"plain export {kl_plain:.2e}; eval-mode CPU kernel: {kl_nf4_eval:.2e} vs {kl_plain_eval:.2e}")
    assert kl_nf4 <= 1e-3 and kl_nf4_eval <= 1e-3
    assert kl_nf4 < kl_plain / 100  # the NF4 export is what makes it consistent


def test_reward_export_writes_head_and_manifest(llama_rm_dir, llama_rm_export, tiny_llama_dir):
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from homerlhf.workers.vocab import tokenizer_fingerprint

    manifest = json.loads((llama_rm_export / "manifest.json").read_text())
    assert manifest["architecture"] == "llama" and manifest["hidden_size"] == 128
    assert manifest["outtype"] == "f32" and manifest["format_version"] == 1
    assert manifest["vocab_fingerprint"] == tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_llama_dir))
    head = load_file(str(llama_rm_export / "score_head.safetensors"))
    assert head["weight"].shape == (1, 128) and "bias" not in head


def test_reward_export_from_a_reward_run_dir(llama_rm_dir, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(llama_rm_dir, run / "model")
    out = export_reward(str(run), tmp_path / "out", outtype="f16")
    assert json.loads((out / "manifest.json").read_text())["source"] == str(run / "model")


def _multi_label_dir(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from homerlhf.tiny import model_config

    config = model_config("llama", 512, hidden=32, layers=1)
    config.num_labels = 3
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "multi")
    return tmp_path / "multi"


def test_clear_errors(tmp_path, tiny_llama_dir, llama_rm_dir):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    cases = [
        (lambda: export_ref(str(tmp_path / "gpt2"), tmp_path / "x.gguf"), "supported: gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"),
        (lambda: export_ref(str(tmp_path / "nope"), tmp_path / "x.gguf"), "does not exist"),
        (lambda: export_ref("some-org/some-model", tmp_path / "x.gguf"), "not found locally and the hub is unreachable"),
        (lambda: export_ref(str(tmp_path / "adapter"), tmp_path / "x.gguf"), "LoRA adapter"),
        (lambda: export_ref(str(tiny_llama_dir), tmp_path / "x.gguf", outtype="q4_k"), "f32, f16, bf16, q8_0"),
        (lambda: export_ref(str(llama_rm_dir), tmp_path / "x.gguf"), "export reward"),
        (lambda: export_reward(str(tiny_llama_dir), tmp_path / "r"), "ForSequenceClassification"),
        (lambda: export_reward(str(_multi_label_dir(tmp_path)), tmp_path / "r"), "exactly one"),
    ]
    for call, words in cases:
        with pytest.raises(UserError, match=words.replace("(", r"\(")):
            call()
    assert not (tmp_path / "x.gguf").exists()


def test_cli_export_ref_reports_user_errors(tmp_path, capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", "ref", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "r.gguf")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_mistral_and_qwen3_exports_match_hf(arch, tmp_path, llama_cpp_logits):
    """Mistral (llama graph, q/k permuted) and Qwen3 (q/k norms, head_dim != H / heads, tied embeddings)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    from homerlhf.tiny import build_tokenizer

    tok = build_tokenizer()
    config_cls, head_dim, tied = (MistralConfig, 32, False) if arch == "mistral" else (Qwen3Config, 48, True)
    config = config_cls(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                        max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / arch)
    tok.save_pretrained(tmp_path / arch)
    gguf = export_ref(str(tmp_path / arch), tmp_path / f"{arch}.gguf", outtype="f32")
    with torch.no_grad():
        hf = model(torch.tensor([IDS])).logits[0].double().numpy()
    assert np.abs(llama_cpp_logits(gguf, IDS) - hf).max() < LLAMA_CPP_F32


def test_sentencepiece_style_vocabulary(tmp_path, llama_cpp_logits):
    """A byte-fallback BPE vocabulary (Llama-2/Mistral style) exports as "llama" and loads in llama.cpp."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from homerlhf.data import builtin
    from homerlhf.tiny import model_config
    from homerlhf.workers.engine import read_gguf_info
    from homerlhf.workers.vocab import tokenizer_fingerprint, vocab_fingerprint

    spm = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Metaspace()
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False)
    spm.train_from_iterator(builtin.corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = model_config("llama", len(tok), hidden=64, layers=1)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = None, 1, 2
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "spm")
    tok.save_pretrained(tmp_path / "spm")

    gguf = export_ref(str(tmp_path / "spm"), tmp_path / "spm.gguf", outtype="f32")
    fields = GGUFReader(str(gguf)).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[0] == 2 and types[3] == 6 and types[258] == 6  # <unk> UNKNOWN, <0x00>/<0xFF> BYTE
    assert vocab_fingerprint(read_gguf_info(gguf).tokens) == tokenizer_fingerprint(tok)
    ids = [1, 300, 301, 350, 7, 399, 260, 270]
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(llama_cpp_logits(gguf, ids) - hf).max() < LLAMA_CPP_F32


def test_cli_export_ref_quantizes_as_the_trainer_would(tiny_llama_dir, tmp_path, capsys):
    """--preset/--config/--set give the export the run config's quant:, device and ref.outtype."""
    from homerlhf.cli import main
    from homerlhf.config import load_config

    cfg = load_config("cpu-tiny", overrides=["quant.quant_type=fp4"])
    trainer = export_ref(str(tiny_llama_dir), tmp_path / "trainer.gguf", outtype=cfg.ref.outtype, from_nf4=True,
                         quant=cfg.quant, device=cfg.card.device)
    main(["export", "ref", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "cli.gguf"), "--from-nf4",
          "--preset", "cpu-tiny", "--set", "quant.quant_type=fp4"])
    main(["export", "ref", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "nf4.gguf"), "--from-nf4",
          "--preset", "cpu-tiny"])
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "cli.gguf").read_bytes() == trainer.read_bytes()  # f32 (cpu-tiny's ref.outtype), FP4
    assert (tmp_path / "nf4.gguf").read_bytes() != trainer.read_bytes()  # the --set really changed the export


@pytest.mark.parametrize("preset", ["4090", "t4-colab"])  # bf16 and fp16 compute
def test_gpu_preset_reference_type_holds_the_actors_weights_exactly(preset, tiny_llama_dir):
    """The GPU presets' ref.outtype (f16) stores every dequantized NF4 weight, in the actor's compute
    dtype, without rounding: the export adds nothing to the actor's own arithmetic (docs/workers.md)."""
    import gguf

    from homerlhf.config import load_config
    from homerlhf.workers.gguf import nf4_tensors
    from homerlhf.workers.gguf.quant import encode, tensor_qtype

    cfg = load_config(preset)
    assert cfg.ref.from_nf4 and cfg.ref.outtype == "f16"
    tensors = nf4_tensors(tiny_llama_dir, cfg.quant, cfg.card.device)
    quantized = [k for k in tensors if "_proj." in k]
    assert len(quantized) == 4 * 7
    for key in quantized:
        weight = tensors[key].load()
        qtype = tensor_qtype(cfg.ref.outtype, "blk.0.attn_q.weight", weight.shape)
        assert qtype == gguf.GGMLQuantizationType.F16
        np.testing.assert_array_equal(encode(weight, qtype).astype(np.float32), weight)
    q8 = encode(tensors[quantized[0]].load(), gguf.GGMLQuantizationType.Q8_0)
    assert not np.array_equal(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0), tensors[quantized[0]].load())
