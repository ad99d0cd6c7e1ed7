"""The policy: one frozen 4-bit base shared by a LoRA ``actor``, a LoRA ``critic`` and a value head.

The base is loaded once in NF4 (bitsandbytes, double quant) and frozen. Two peft adapters sit on it;
``set_adapter`` picks which one a forward uses, and ``disable_adapter()`` gives the untouched base,
which is the reference model when ``ref.backend == "adapter_off"``. The value head is a small fp32
``Linear(hidden, 1)`` on the critic's final hidden state. With ``critic.shared_adapter`` there is a
single adapter (named ``actor``) and one forward gives both log-probs and values. Adapters and value
head are fp32 under every compute dtype (``homerlhf.models.precision``); the base's other weights,
hidden states and KV cache are in the compute dtype (fp32 under ``quant.upcast_non_quantized``), and a
16-bit LM head returns fp32 logits to every reader (``homerlhf.models.lm_head``).

Sequences everywhere are a left-padded prompt (B, P) followed by a right-padded response (B, T);
``attention_mask`` covers both, so padded slots change nothing.

The policy is the distribution the actor samples from, ``softmax(logits / temperature)``: every
log-prob it returns (actor and adapter-off reference) is taken at its ``temperature``, after the
model's own logit post-processing, and ``generate`` samples from exactly that distribution.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from homerlhf.config.schema import LoraConfig, QuantConfig, RunConfig
from homerlhf.errors import UserError
from homerlhf.models import cuda_kernels
from homerlhf.models.generation import checkpoint_defaults_off, stop_token_ids
from homerlhf.models.logprobs import chunked_logprobs, output_logit_transform, position_ids_from_mask, response_hidden
from homerlhf.models.lm_head import install_fp32_logits
from homerlhf.models.precision import adapters_to_fp32, prepare_frozen_base
from homerlhf.models.static_decode import StaticDecoder

ACTOR = "actor"
CRITIC = "critic"

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(quant: QuantConfig, device: str) -> torch.dtype:
    """``auto`` is bf16 on CUDA (fp16 on cards without bf16, e.g. T4) and fp32 on CPU (bf16 matmuls
    are slow there)."""
    if quant.compute_dtype == "auto":
        if device != "cuda":
            return torch.float32
        return torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else torch.float16
    return _DTYPES[quant.compute_dtype]


def kernels_for(cfg: RunConfig, device: torch.device) -> cuda_kernels.KernelSettings:
    """Set the TF32 and SDPA flags of a policy of ``cfg`` on ``device`` (:mod:`homerlhf.models.cuda_kernels`)."""
    upcast = cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized
    return cuda_kernels.set_for_policy(compute_dtype(cfg.quant, cfg.card.device), upcast, device)


def quantization_config(quant: QuantConfig, device: str, storage: torch.dtype = torch.uint8):
    """The bitsandbytes 4-bit config, or None when ``quant.load_in_4bit`` is off. ``storage``: the
    dtype the 4-bit codes are stored in (the compute dtype for FSDP: :mod:`homerlhf.models.sharding`)."""
    if not quant.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=compute_dtype(quant, device),
        bnb_4bit_quant_storage=storage,
    )


def peft_lora_config(lora: LoraConfig, task_type: str = "CAUSAL_LM"):
    """peft's LoraConfig from a ``LoraConfig`` section; ``SEQ_CLS`` also trains the score head in full."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                          bias="none", task_type=task_type)


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False, revision: Optional[str] = None,
                   padding_side: Optional[str] = "left"):
    """The model's tokenizer with a pad token (eos when the model has none).

    ``padding_side``: "left" for generation (the policy); None keeps the tokenizer's own (TRL's
    trainers pad as the tokenizer says).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a tokenizer from '{model_path}': {str(exc).strip().splitlines()[0][:200]} "
            "(give a local HF model dir, a cached hub id, or builtin:<name>)"
        ) from None
    if tokenizer.pad_token_id is None:  # many base models ship without one; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return tokenizer


def load_base(model_path: str, cfg: RunConfig):
    """The causal LM in 4-bit (or full precision when ``quant.load_in_4bit`` is off), frozen."""
    from transformers import AutoModelForCausalLM

    device = cfg.card.device
    dtype = compute_dtype(cfg.quant, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            quantization_config=quantization_config(cfg.quant, device),
            device_map={"": torch.cuda.current_device()} if device == "cuda" else "cpu",  # a rank's own GPU
            dtype=dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            revision=cfg.model.revision,
        )
    except OSError as exc:
        raise UserError(
            f"cannot load model '{model_path}': {str(exc).splitlines()[0]} "
            "(give a local HF model dir, a cached hub id, or builtin:<name>)"
        ) from None
    for param in model.parameters():
        param.requires_grad_(False)
    _keep_cpu_4bit_differentiable(model)
    return model


def _keep_cpu_4bit_differentiable(model) -> None:
    """Stop bitsandbytes from repacking CPU 4-bit weights for inference.

    On a CPU with AVX512-BF16, a ``Linear4bit`` forward in eval mode without grad repacks its weight
    into a layout served by ``gemv_4bit``, for good. That op has no autograd formula, so a later
    training forward would silently drop the gradient through the frozen base into earlier LoRA
    layers. We alternate rollout (eval) and update (train), so the repacking must never happen.
    """
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # no bitsandbytes: nothing is 4-bit
        return
    for module in model.modules():
        if isinstance(module, Linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


class ValueHead(nn.Module):
    """V(s) from the critic's final hidden state: fp32 ``Linear(hidden, 1)``."""

    def __init__(self, hidden_size: int, init_std: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Zero init: the first value estimates are 0, so early advantages are just the rewards.
        if init_std > 0:
            nn.init.normal_(self.linear.weight, std=init_std)
        else:
            nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: (B, T, H) any float dtype -> values (B, T) fp32."""
        return self.linear(hidden.float()).squeeze(-1)


@torch.no_grad()
def check_logits_path(causal_lm, where: str) -> None:
    """The chunked log-probs compute ``output_logit_transform(lm_head(final hidden state))``: refuse a
    model whose own forward does something else to its logits, on a probe of 8 tokens."""
    ids = torch.arange(8, device=causal_lm.device).unsqueeze(0) % causal_lm.config.get_text_config().vocab_size
    backbone = getattr(causal_lm, causal_lm.base_model_prefix)
    ours = causal_lm.get_output_embeddings()(backbone(input_ids=ids).last_hidden_state).float()
    transform = output_logit_transform(causal_lm.config)
    if transform is not None:
        ours = transform(ours)
    theirs = causal_lm(input_ids=ids).logits.float()
    gap = (ours - theirs).abs().max().item()
    if not gap <= 1e-3 * (1.0 + theirs.abs().max().item()):
        raise UserError(f"{where}: architecture {causal_lm.config.model_type!r} computes its logits beyond the LM head "
                        f"of the last hidden state (probe differs by {gap:.3g}); homerlhf's log-probs cannot follow it")


class PolicyModel:
    """The shared 4-bit base with its adapters and value head, and the forwards PPO needs.

    Every forward takes ``input_ids``/``attention_mask`` of shape (B, P + T) (left-padded prompt,
    right-padded response) and ``response_len`` T, and returns per-response-token tensors (B, T).
    ``temperature`` is the sampling temperature all log-probs are taken at; ``stop_ids`` the stop
    set (:func:`homerlhf.models.generation.stop_token_ids`), read before anything can change the
    checkpoint's generation config.
    """

    def __init__(self, model, value_head: Optional[ValueHead], tokenizer, *, shared_adapter: bool,
                 logprob_chunk_size: int, temperature: float = 1.0,
                 kernel_settings: Optional[cuda_kernels.KernelSettings] = None):
        self.model = model  # peft PeftModel
        self.value_head = value_head  # None: no critic (GRPO/RLOO)
        self.tokenizer = tokenizer
        self.shared_adapter = shared_adapter
        self.logprob_chunk_size = logprob_chunk_size
        self.temperature = temperature
        self.kernel_settings = kernel_settings  # what from_config set (cuda_kernels.set_for_policy)
        inner = model.get_base_model()
        self.backbone = getattr(inner, inner.base_model_prefix)  # the decoder, LoRA injected in place
        self.lm_head = inner.get_output_embeddings()
        self.logit_transform = output_logit_transform(inner.config)
        self.stop_ids = stop_token_ids(tokenizer, inner.generation_config)
        self.static_decoder = StaticDecoder(inner)  # generate(decoder="static")

    @classmethod
    def from_config(cls, cfg: RunConfig, model_path: str, tokenizer=None) -> "PolicyModel":
        from peft import get_peft_model

        tokenizer = tokenizer or load_tokenizer(
            model_path, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision
        )
        base = load_base(model_path, cfg)
        quant = cfg.quant
        base = prepare_frozen_base(base, load_in_4bit=quant.load_in_4bit, upcast=quant.upcast_non_quantized,
                                   checkpointing=cfg.training.gradient_checkpointing)
        if base.get_output_embeddings().weight.dtype != torch.float32:
            install_fp32_logits(base)  # a 16-bit head: fp32 logits for sampling and scoring alike
        kernels = kernels_for(cfg, base.device)  # TF32 and SDPA backends, on and off (process-wide)
        check_logits_path(base, model_path)
        model = get_peft_model(base, peft_lora_config(cfg.actor.lora), adapter_name=ACTOR)
        if cfg.has_critic and not cfg.critic.shared_adapter:
            model.add_adapter(CRITIC, peft_lora_config(cfg.critic.lora))
        model.set_adapter(ACTOR)
        adapters_to_fp32(p for n, p in model.named_parameters() if "lora_" in n)
        hidden = base.config.get_text_config().hidden_size
        value_head = ValueHead(hidden, cfg.critic.value_head_init_std).to(base.device) if cfg.has_critic else None
        return cls(
            model,
            value_head,
            tokenizer,
            shared_adapter=cfg.critic.shared_adapter or not cfg.has_critic,
            logprob_chunk_size=cfg.ppo.logprob_chunk_size,
            temperature=cfg.rollout.temperature,
            kernel_settings=kernels,
        )

    # -- parameters ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Rows of the LM head: the ids a log-softmax runs over."""
        return int(self.model.get_base_model().config.get_text_config().vocab_size)

    @property
    def has_critic(self) -> bool:
        return self.value_head is not None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA parameters of one adapter (by name in the module path: ``lora_A.<adapter>``)."""
        marker = f".{adapter}."
        return [p for n, p in self.model.named_parameters() if "lora_" in n and marker in n]

    def actor_parameters(self) -> list[nn.Parameter]:
        return self.adapter_parameters(ACTOR)

    def critic_parameters(self) -> list[nn.Parameter]:
        """The critic LoRA (none when shared) and the value head; nothing without a critic."""
        if not self.has_critic:
            return []
        lora = [] if self.shared_adapter else self.adapter_parameters(CRITIC)
        return lora + list(self.value_head.parameters())

    def train(self, mode: bool = True) -> None:
        """The update's mode: the forward of eval mode, with activation checkpointing.

        PPO's ratio compares the update's forward with the rollout's, taken in eval mode; anything
        random in training mode (LoRA dropout whatever ``actor.lora.dropout`` says, attention
        dropout, router jitter) would move it off 1 before any step. So every module stays in eval
        mode except those that checkpoint activations, which HF does only in training mode.
        (SFT and RM train through TRL and keep their dropout.)
        """
        self.model.eval()
        if self.has_critic:
            self.value_head.eval()
        if mode:
            for module in self.model.modules():
                if getattr(module, "gradient_checkpointing", False) is True:
                    module.training = True

    def eval(self) -> None:
        self.train(False)

    @contextmanager
    def use_adapter(self, adapter: str) -> Iterator[None]:
        """Make ``adapter`` the one forwards go through (peft also makes it the trainable one).

        It stays active after the block: a backward that follows the forward must still see its
        adapter's parameters as trainable.
        """
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)
        yield

    # -- forwards -----------------------------------------------------------------------------
    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Final hidden states (B, L, H) of the backbone with the active adapter(s)."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.last_hidden_state

    def _logprobs(self, hidden: Tensor, input_ids: Tensor, response_len: int) -> tuple[Tensor, Tensor]:
        targets = input_ids[:, input_ids.shape[1] - response_len :]
        return chunked_logprobs(self.lm_head, response_hidden(hidden, response_len), targets, self.logprob_chunk_size,
                                temperature=self.temperature, transform=self.logit_transform)

    def actor_logprobs(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Tensor, Tensor]:
        """(logprobs, entropy) of the response tokens under the actor at ``temperature``, each (B, T)."""
        with self.use_adapter(ACTOR):
            hidden = self.hidden_states(input_ids, attention_mask)
            return self._logprobs(hidden, input_ids, response_len)

    def critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """V(prompt + response[:t]) for each response position t: (B, T) fp32."""
        with self.use_adapter(ACTOR if self.shared_adapter else CRITIC):
            hidden = self.hidden_states(input_ids, attention_mask)
            return self.value_head(response_hidden(hidden, response_len))

    def actor_logprobs_and_values(
        self, input_ids: Tensor, attention_mask: Tensor, response_len: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(logprobs, entropy, values), each (B, T): one forward when the adapter is shared; values are
        zeros without a critic."""
        if not self.has_critic:
            logprobs, entropy = self.actor_logprobs(input_ids, attention_mask, response_len)
            return logprobs, entropy, torch.zeros_like(logprobs, dtype=torch.float32)
        if not self.shared_adapter:
            logprobs, entropy = self.actor_logprobs(input_ids, attention_mask, response_len)
            return logprobs, entropy, self.critic_values(input_ids, attention_mask, response_len)
        with self.use_adapter(ACTOR):
            hidden = self.hidden_states(input_ids, attention_mask)
            logprobs, entropy = self._logprobs(hidden, input_ids, response_len)
            return logprobs, entropy, self.value_head(response_hidden(hidden, response_len))

    @torch.no_grad()
    def reference_logprobs(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """Log-probs (B, T) under the base with every adapter off, at ``temperature``: the KL reference."""
        with self.model.disable_adapter():
            hidden = self.hidden_states(input_ids, attention_mask)
            return self._logprobs(hidden, input_ids, response_len)[0]

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, generation_config, recorder=None,
                 logits_processor=None, decoder: str = "hf") -> Tensor:
        """Sample with the actor. prompt_ids/mask: (B, P) left-padded. Returns (B, T) response ids.

        ``generation_config``: a complete one from
        :func:`homerlhf.models.generation.build_generation_config`; nothing of the checkpoint's own
        generation config is used. Positions after a row's stop token hold the pad id.
        ``recorder``: a :class:`homerlhf.models.generation.BehaviourLogprobs` to run as a logits processor,
        first, on the raw logits; ``logits_processor``: then e.g. a
        :class:`homerlhf.models.sampling.PerSampleSampler`. ``decoder``: "hf" (HF ``generate``) or
        "static" (:mod:`homerlhf.models.static_decode`, the same samples; HF ``generate`` where it cannot run).
        """
        if generation_config.temperature != self.temperature:
            raise ValueError(f"sampling at temperature {generation_config.temperature} but log-probs are "
                             f"taken at {self.temperature}: build both from the same config")
        with self.use_adapter(ACTOR), checkpoint_defaults_off(self.model.get_base_model(), generation_config):
            processors = [p for p in (recorder, logits_processor) if p is not None]
            if decoder == "static":
                out = self.static_decoder.generate(prompt_ids, prompt_mask, generation_config, processors)
                if out is not None:
                    return out
            extra = {"logits_processor": processors} if processors else {}
            out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                      generation_config=generation_config, **extra)
        return out[:, prompt_ids.shape[1] :]

    # -- saving -------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> None:
        """Adapters in peft format (``out_dir/actor``, ``out_dir/critic``) and ``value_head.safetensors``
        (the actor alone without a critic)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        adapters = [ACTOR] if self.shared_adapter else [ACTOR, CRITIC]
        self.model.save_pretrained(str(out), selected_adapters=adapters)
        if not self.has_critic:
            return
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  str(out / "value_head.safetensors"))

    def load_value_head(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        self.value_head.load_state_dict(load_file(str(path), device=str(self.device)))
