"""Model shapes for the planner: from a local ``config.json``, the hub cache (offline), or a builtin
table of published shapes, so ``homerlhf plan --model Qwen/Qwen2.5-7B`` works with no download.

A :class:`ModelShape` knows the decoder's linear layers (the ones bitsandbytes packs to 4 bit and
LoRA adapts) and everything kept at full precision (embeddings, LM head, norms, biases). Its
parameter count equals that of the transformers model built from :meth:`ModelShape.to_hf_config`
(tests check it on the meta device).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from homerlhf.errors import UserError

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` in each decoder layer: ``name`` as in the module path, (in, out) features."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory."""

    name: str
    model_type: str  # transformers model_type: llama, mistral, qwen2, qwen3, gemma2, phi3, ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    norms_per_layer: int = 2  # Gemma 2 has four
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3)
    source: str = "builtin"  # builtin | local | hub-cache | builtin-tiny
    published_params_b: Optional[float] = None  # the model card's count, billions (builtin table only)
    # A mixture of experts (every layer's MLP; homerlhf.models.moe): 0 experts for a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    expert_biases: bool = False  # gpt-oss: a bias per expert projection and on the router
    router: str = "softmax-topk"  # Qwen3-MoE: softmax over all experts, then top-k; gpt-oss: "topk-softmax"
    attention_sinks: bool = False  # gpt-oss: a learned sink per head
    o_proj_bias: bool = False  # gpt-oss: attention_bias covers the output projection too
    eager_attention: bool = False  # transformers runs its attention eager (gpt-oss's sinks): T x T scores

    is_moe = property(lambda self: self.num_experts > 0)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_linears(self) -> list[Linear]:
        """The linear modules of one decoder layer, as transformers names them."""
        h, i, q, kv, b = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.attention_bias
        if self.fused_qkv:
            attn = [Linear("qkv_proj", h, q + 2 * kv, b)]
        else:
            attn = [Linear("q_proj", h, q, b), Linear("k_proj", h, kv, b), Linear("v_proj", h, kv, b)]
        attn.append(Linear("o_proj", q, h, self.o_proj_bias))
        if self.is_moe:  # the experts are fused 3-D weights, not linears (expert_matrices)
            return attn
        if self.fused_gate_up:
            mlp = [Linear("gate_up_proj", h, 2 * i)]
        else:
            mlp = [Linear("gate_proj", h, i), Linear("up_proj", h, i)]
        mlp.append(Linear("down_proj", i, h))
        return attn + mlp

    # -- parameter counts ------------------------------------------------------------------------
    @property
    def linear_weight_params(self) -> int:
        """Weights that bitsandbytes quantizes: every decoder linear layer (not the LM head)."""
        return self.num_layers * sum(lin.in_features * lin.out_features for lin in self.layer_linears())

    @property
    def linear_bias_params(self) -> int:
        return self.num_layers * sum(lin.out_features for lin in self.layer_linears() if lin.bias)

    # -- experts ---------------------------------------------------------------------------------
    def expert_matrices(self) -> list[tuple[int, int]]:
        """(out, in) of one expert's two fused weights: gate and up (2 I x h), down (h x I)."""
        h, i = self.hidden_size, self.expert_intermediate_size
        return [(2 * i, h), (h, i)] if self.is_moe else []

    @property
    def expert_weight_params(self) -> int:
        """Every expert's weights, every layer: what the 4-bit experts hold."""
        return self.num_layers * self.num_experts * sum(o * i for o, i in self.expert_matrices())

    @property
    def moe_small_params(self) -> int:
        """The router, the experts' biases and the attention sinks: kept in the non-quantized dtype."""
        e, h, i = self.num_experts, self.hidden_size, self.expert_intermediate_size
        per_layer = e * h + (e * (1 + 2 * i + h) if self.expert_biases else 0)
        return self.num_layers * (per_layer + (self.num_heads if self.attention_sinks else 0))

    def expert_lora_params(self, r: int) -> int:
        """LoRA on every expert's fused weights (peft's target_parameters): r x (in + out) per expert matrix."""
        return self.num_layers * self.num_experts * sum(r * (o + i) for o, i in self.expert_matrices())

    def adapter_params(self, lora) -> int:
        """The parameters of a LoRA section (``actor.lora``, ...): its linears, and its experts when set."""
        return self.lora_params(lora.r, lora.target_modules) + self.expert_lora_params(lora.r) * lora.experts

    @property
    def norm_params(self) -> int:
        per_layer = self.norms_per_layer * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * per_layer + self.hidden_size  # + the final norm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the LM head is the embedding matrix."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (
            self.linear_weight_params
            + self.linear_bias_params
            + self.norm_params
            + self.embedding_params
            + self.lm_head_params
            + self.expert_weight_params
            + self.moe_small_params
        )

    @property
    def largest_linear_params(self) -> int:
        return max(lin.in_features * lin.out_features for lin in self.layer_linears())

    def lora_params(self, r: int, target_modules: "str | list[str]" = "all-linear") -> int:
        """LoRA A (r x in) + B (out x r) on every targeted decoder linear layer."""
        linears = self.layer_linears()
        if target_modules != "all-linear":
            wanted = set(target_modules)
            linears = [lin for lin in linears if lin.name in wanted]
            if not linears:
                names = ", ".join(lin.name for lin in self.layer_linears())
                raise UserError(
                    f"LoRA target_modules {sorted(wanted)} match no linear layer of {self.name}; "
                    f"use 'all-linear' or some of: {names}"
                )
        return self.num_layers * sum(r * (lin.in_features + lin.out_features) for lin in linears)

    def to_hf_config(self):
        """A transformers config of this architecture (for meta-device checks and random init)."""
        from transformers import AutoConfig

        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.model_type != "phi3":  # Phi-3 derives head_dim from hidden / heads
            kwargs["head_dim"] = self.head_dim
        if self.model_type in ("llama", "mistral", "qwen3", "qwen3_moe", "gpt_oss"):
            kwargs["attention_bias"] = self.attention_bias
        if self.is_moe:  # Qwen3-MoE's names, or gpt-oss's (its intermediate_size is the experts')
            qwen = self.model_type == "qwen3_moe"
            kwargs.update({"num_experts" if qwen else "num_local_experts": self.num_experts,
                           "moe_intermediate_size" if qwen else "intermediate_size": self.expert_intermediate_size,
                           "num_experts_per_tok": self.experts_per_token})
        return AutoConfig.for_model(self.model_type, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the builtin table ---------------------------------------------------------------------------
# Published config.json values of each model (base and -Instruct share them).
# published_params_b: the count on the model card, billions; the tests compare it with ours.
def _s(name, model_type, vocab, hidden, inter, layers, heads, kv, head_dim, tied, params_b, **kw) -> ModelShape:
    return ModelShape(
        name=name, model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, tie_word_embeddings=tied,
        published_params_b=params_b, **kw,
    )


BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        _s("meta-llama/Llama-3.1-8B", "llama", 128256, 4096, 14336, 32, 32, 8, 128, False, 8.03),
        _s("meta-llama/Llama-3.2-1B", "llama", 128256, 2048, 8192, 16, 32, 8, 64, True, 1.24),
        _s("meta-llama/Llama-3.2-3B", "llama", 128256, 3072, 8192, 28, 24, 8, 128, True, 3.21),
        _s("Qwen/Qwen2.5-0.5B", "qwen2", 151936, 896, 4864, 24, 14, 2, 64, True, 0.49, attention_bias=True),
        _s("Qwen/Qwen2.5-1.5B", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, True, 1.54, attention_bias=True),
        _s("Qwen/Qwen2.5-3B", "qwen2", 151936, 2048, 11008, 36, 16, 2, 128, True, 3.09, attention_bias=True),
        _s("Qwen/Qwen2.5-7B", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False, 7.61, attention_bias=True),
        _s("Qwen/Qwen2.5-14B", "qwen2", 152064, 5120, 13824, 48, 40, 8, 128, False, 14.7, attention_bias=True),
        _s("Qwen/Qwen2.5-32B", "qwen2", 152064, 5120, 27648, 64, 40, 8, 128, False, 32.5, attention_bias=True),
        _s("Qwen/Qwen3-8B", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False, 8.2, qk_norm=True),
        _s("Qwen/Qwen3-14B", "qwen3", 151936, 5120, 17408, 40, 40, 8, 128, False, 14.8, qk_norm=True),
        _s("mistralai/Mistral-7B-v0.1", "mistral", 32000, 4096, 14336, 32, 32, 8, 128, False, 7.24),
        _s("mistralai/Mistral-7B-v0.3", "mistral", 32768, 4096, 14336, 32, 32, 8, 128, False, 7.25),
        _s("mistralai/Mistral-Small-24B-Base-2501", "mistral", 131072, 5120, 32768, 40, 32, 8, 128, False, 23.6),
        _s("google/gemma-2-9b", "gemma2", 256000, 3584, 14336, 42, 16, 8, 256, True, 9.24, norms_per_layer=4),
        _s("microsoft/Phi-3-mini-4k-instruct", "phi3", 32064, 3072, 8192, 32, 32, 32, 96, False, 3.82,
           fused_qkv=True, fused_gate_up=True),
        # Mixtures of experts: intermediate_size is the dense MLP's (no layer has one: mlp_only_layers is empty).
        _s("Qwen/Qwen3-30B-A3B", "qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, False, 30.5, qk_norm=True,
           num_experts=128, experts_per_token=8, expert_intermediate_size=768),
        _s("openai/gpt-oss-20b", "gpt_oss", 201088, 2880, 2880, 24, 64, 8, 64, False, 20.9, attention_bias=True,
           o_proj_bias=True, num_experts=32, experts_per_token=4, expert_intermediate_size=2880, expert_biases=True,
           router="topk-softmax", attention_sinks=True, eager_attention=True),
    ]
}

# Other names users type for the same weights' shapes.
_ALIASES: dict[str, str] = {
    "meta-llama/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "mistralai/Mistral-7B": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistralai/Mistral-7B-v0.1",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistralai/Mistral-7B-v0.1",  # 32000 vocab, same layers
    "mistralai/Mistral-Small-24B": "mistralai/Mistral-Small-24B-Base-2501",
    "mistralai/Mistral-Small-24B-Instruct-2501": "mistralai/Mistral-Small-24B-Base-2501",
    "google/gemma-2-9b-it": "google/gemma-2-9b",
    "microsoft/Phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/Phi-3-mini-128k-instruct": "microsoft/Phi-3-mini-4k-instruct",  # longrope: same weights' shapes
}


def _key(name: str) -> str:
    """Case-insensitive, org optional, ``-Instruct`` optional."""
    tail = name.strip().lower().split("/")[-1]
    return tail.replace("-instruct", "")


_INDEX: dict[str, str] = {}
for _name in list(BUILTIN_SHAPES) + list(_ALIASES):
    _INDEX.setdefault(_key(_name), _ALIASES.get(_name, _name))
del _name


def builtin_shape(name: str) -> Optional[ModelShape]:
    """The table entry for a hub id (base or -Instruct, org optional), or None."""
    canonical = _INDEX.get(_key(name))
    return BUILTIN_SHAPES[canonical] if canonical else None


# ---- from a transformers config -------------------------------------------------------------------
_TIED_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True}


def shape_from_config(config: "dict[str, Any] | Any", name: str, source: str) -> ModelShape:
    """A shape from a ``config.json`` mapping or a transformers ``PretrainedConfig``."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM under text_config
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    model_type = str(cfg.get("model_type", "llama"))
    from homerlhf.models.moe import moe_shape_fields

    moe = moe_shape_fields(cfg, name)
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if not cfg.get(k)]
    if missing:
        raise UserError(f"{name}: config.json lacks {', '.join(missing)}; is it a decoder-only causal LM?")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelShape(
        name=name,
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _TIED_DEFAULT.get(model_type, False))),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text", "olmo2"),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
        source=source,
        **moe,
    )


def _read_config_json(path: Path, name: str, source: str) -> ModelShape:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}; point --model at a HF model dir with a valid config.json") from None
    return shape_from_config(data, name, source)


def _hub_cache_config(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    # Only a file lookup in the local cache: never a network request.
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id (e.g. a missing local path "/a/b"): not in the cache
        return None
    return Path(found) if isinstance(found, str) else None


def _builtin_tiny(name: str) -> ModelShape:
    """``builtin:*`` models are the tiny ones of :mod:`homerlhf.tiny` (512-token BPE vocabulary)."""
    from homerlhf.tiny import model_config

    arch = next((a for a in ("qwen3_moe", "qwen2") if a.replace("_", "-") in name), "llama")
    return replace(shape_from_config(model_config(arch, vocab_size=512).to_dict(), name, "builtin-tiny"))


def resolve_shape(name_or_path: str, revision: Optional[str] = None) -> ModelShape:
    """A shape from, in order: a local dir or ``config.json``, ``builtin:<tiny>``, the hub cache, the table."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _read_config_json(path / "config.json", name_or_path, "local")
    if path.is_file() and path.name.endswith(".json"):
        return _read_config_json(path, name_or_path, "local")
    if path.is_file() and path.suffix == ".gguf":  # a GGUF model file: the shape its header names
        from homerlhf.models.gguf_import import gguf_config, gguf_header
        return shape_from_config(gguf_config(gguf_header(path)), name_or_path, "gguf")
    if name_or_path.startswith(BUILTIN_PREFIX):  # a registered model (builtin:gemma3-270m), else a tiny one
        from homerlhf.models.registry import builtin_config
        known = builtin_config(name_or_path)
        return shape_from_config(known, name_or_path, "builtin") if known else _builtin_tiny(name_or_path)
    cached = _hub_cache_config(name_or_path, revision)
    if cached is not None:
        return _read_config_json(cached, name_or_path, "hub-cache")
    shape = builtin_shape(name_or_path)
    if shape is not None:
        return replace(shape, name=name_or_path)
    if path.is_dir():
        raise UserError(f"{name_or_path} has no config.json; point --model at a HF model dir")
    raise UserError(
        f"unknown model '{name_or_path}': not a local model dir, not in the hub cache, not in the builtin "
        f"table ({', '.join(n.split('/')[-1] for n in BUILTIN_SHAPES)}); pass a local dir holding its config.json"
    )


def policy_shape(policy, name: str) -> Optional[ModelShape]:
    """The loaded policy's shape, for the planner's prediction beside the measured peaks; None (and a
    warning) for a model the planner cannot count."""
    try:
        return shape_from_config(policy.model.config, name, "loaded")
    except UserError as exc:
        logging.getLogger(__name__).warning("no predicted_mem_* metrics: %s", exc)
        return None


def critic_shape(cfg) -> Optional[ModelShape]:
    """The shape of ``critic.model``, the critic's own base (a reward run dir: its ``model/``), or None
    when the critic is on the policy's base or there is none. It loads no LM head (its decoder alone)."""
    if cfg.algorithm != "ppo" or not cfg.critic.model:
        return None
    return _critic_shape(cfg.critic.model)


@lru_cache(maxsize=8)
def _critic_shape(name: str) -> ModelShape:
    """Read once per process: the planner's search counts many candidate settings of one critic."""
    path = Path(name).expanduser()
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        return resolve_shape(str(path / "model"))
    return resolve_shape(name)
