"""Tiny tokenizers and models built from code alone, seeded: the offline stand-ins for real checkpoints.

Everything is written with ``save_pretrained`` so the rest of homerlhf loads it exactly like a model
from the hub (``AutoTokenizer.from_pretrained(dir)``, ``AutoModelForCausalLM.from_pretrained(dir)``).
Given ``tokenizer_dir`` (a real tokenizer: its vocabulary, special tokens and chat template), the
models are built for that vocabulary instead of the builtin one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch

from homerlhf.data import builtin

PAD, EOS, BOS = "<|pad|>", "<|end|>", "<|begin|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# transformers maps a qwen2 checkpoint to Qwen2Tokenizer, which adds this token when it is missing.
UNK = "<|endoftext|>"

# One turn is <|role|>text<|end|>; generation stops at <|end|> (the eos token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

Arch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "gpt_oss"]
# Sliding window of the tiny Gemmas and gpt-oss: short, so every test sequence crosses it.
TINY_WINDOW = 16
# The tiny mixtures of experts: 8 experts, 2 routed per token, each expert's MLP half the hidden width.
TINY_EXPERTS, TINY_TOP_K = 8, 2


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the builtin corpus, with pad/eos and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, BOS, *ROLE_TOKENS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus does not change BPE merges but keeps counts clear of ties with 1.
    tok.train_from_iterator(builtin.corpus() * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        additional_special_tokens=ROLE_TOKENS,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(arch: Arch, vocab_size: int, hidden: int = 128, layers: int = 4, tie_embeddings: bool = False):
    """A small config of ``arch`` (GQA: 4 query heads, 2 key/value heads). Tie the embeddings for a
    real 128k-262k vocabulary: the embedding is then the only vocab-sized matrix.

    The Gemmas keep their real quirks (and always tie): soft-caps (Gemma 2), a query scale other than
    1/sqrt(head_dim) (``query_pre_attn_scalar`` 256), sliding-window layers with a window of
    ``TINY_WINDOW`` tokens, Gemma 3's global layer last and its two rope bases. The mixtures of experts
    (``qwen3_moe``, ``gpt_oss``) route each token to ``TINY_TOP_K`` of ``TINY_EXPERTS`` experts held as
    transformers' fused 3-D weights; gpt-oss keeps its biases, attention sinks, clamped SwiGLU,
    alternating sliding-window layers and YaRN rope.
    """
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    if arch in ("qwen3_moe", "gpt_oss"):
        return _moe_config(arch, vocab_size, hidden, layers, tie_embeddings)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // 4, rope_theta=10000.0, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, head_dim=hidden // 4, sliding_window=None)
    if arch == "phi3":
        return Phi3Config(**common, original_max_position_embeddings=512, sliding_window=None)
    gemma = dict(common, tie_word_embeddings=True, head_dim=hidden // 4, query_pre_attn_scalar=256,
                 sliding_window=TINY_WINDOW)
    if arch == "gemma2":
        return Gemma2Config(**gemma)
    if arch == "gemma3_text":
        layer_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return Gemma3TextConfig(**gemma, layer_types=layer_types)
    raise ValueError(f"unknown tiny architecture {arch!r}; use one of {', '.join(Arch.__args__)}")


def _moe_config(arch: Arch, vocab_size: int, hidden: int, layers: int, tie_embeddings: bool):
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=tie_embeddings, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                  num_experts_per_tok=TINY_TOP_K)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=hidden * 3, moe_intermediate_size=hidden // 2,
                              num_experts=TINY_EXPERTS, norm_topk_prob=True, rope_theta=10000.0)
    # YaRN as the real gpt-oss (factor 32), its original context scaled down to the tiny one's.
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    return GptOssConfig(**common, intermediate_size=hidden // 2, num_local_experts=TINY_EXPERTS,
                        sliding_window=TINY_WINDOW, rope_parameters=rope)


def _tokenizer(tokenizer_dir: Optional[str | Path]):
    """The builtin tokenizer, or the real one in ``tokenizer_dir``."""
    if tokenizer_dir is None:
        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def build_causal_lm(out_dir: str | Path, arch: Arch = "llama", seed: int = 0,
                    tokenizer_dir: Optional[str | Path] = None, head_scale: float = 1.0,
                    rows: Optional[int] = None, eos_probability: Optional[float] = None, **shape) -> Path:
    """Write tokenizer + randomly initialised tiny causal LM to ``out_dir``; returns the path.
    ``rows``: embedding and LM head rows (default the tokenizer's length; more: padded, as Qwen pads).

    With ``tokenizer_dir``, its tokenizer is used, and its ``generation_config.json``, if it holds
    one, becomes the model's (as a checkpoint ships it: eos list, sampling defaults).
    ``head_scale`` multiplies the LM head's weights: above 1 a peaked next-token distribution, like a
    trained LM's (20 gives ~3 nats of entropy instead of ln 512). ``eos_probability``: the end token's
    row of the LM head set so that, averaged over the builtin corpus's positions, the model ends its
    reply there with about this probability (:func:`set_eos_probability`): replies of varied lengths.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    tokenizer = _tokenizer(tokenizer_dir)
    config = model_config(arch, rows or len(tokenizer), **shape)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    if eos_probability is not None:
        set_eos_probability(model, tokenizer, eos_probability)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(tokenizer_dir))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def set_eos_probability(model, tokenizer, target: float, new_tokens: int = 16) -> None:
    """Set the LM head's end-token row to ``c * u``, ``u`` the unit mean of the final hidden states where
    the model samples a reply (16 tokens sampled, the end token suppressed, after the builtin prompts in
    the chat template), ``c`` bisected so the mean end-token probability over those positions is
    ``target`` (within 1e-3): the end logit then follows each position's projection on ``u``."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                             add_generation_prompt=True) for ex in builtin.all_examples()[:32]]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        sequences = model.generate(**batch, do_sample=True, max_new_tokens=new_tokens, suppress_tokens=[eos],
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
        mask = torch.cat([batch["attention_mask"], torch.ones_like(sequences[:, batch["input_ids"].shape[1]:])], dim=1)
        states = model.model(input_ids=sequences, attention_mask=mask).last_hidden_state
        hidden = states[:, batch["input_ids"].shape[1] - 1:-1].reshape(-1, states.shape[-1])  # each reply token's
        head = model.get_output_embeddings().weight
        direction = hidden.mean(dim=0)
        direction = direction / direction.norm()
        logits = hidden @ head.T

        def mean_probability(c: float) -> float:
            logits[:, eos] = c * (hidden @ direction)
            return float(logits.softmax(dim=-1)[:, eos].mean())

        lo, hi = -1e3, 1e3
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_probability(mid) < target else (lo, mid)
            if abs(mean_probability(mid) - target) < 1e-3:
                break
        head[eos] = mid * direction


def build_sequence_classifier(out_dir: str | Path, arch: Arch = "llama", seed: int = 0,
                              tokenizer_dir: Optional[str | Path] = None, **shape) -> Path:
    """A tiny ``*ForSequenceClassification`` (num_labels 1): a reward-model shaped checkpoint.
    ``tokenizer_dir``: a real tokenizer to build it for (default: the builtin one)."""
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    tokenizer = _tokenizer(tokenizer_dir)
    config = model_config(arch, len(tokenizer), **shape)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
