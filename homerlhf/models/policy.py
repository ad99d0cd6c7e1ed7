"""The policy: one frozen 4-bit base shared by a LoRA ``actor``, a LoRA ``critic`` and a value head.

The base is loaded once in NF4 (bitsandbytes, double quant) and frozen. Two peft adapters sit on it;
``set_adapter`` picks which one a forward uses, and ``disable_adapter()`` gives the untouched base,
which is the reference model when ``ref.backend == "adapter_off"``. The value head is a small fp32
``Linear(hidden, 1)`` on the critic's final hidden state. With ``critic.shared_adapter`` there is a
single adapter (named ``actor``) and one forward gives both log-probs and values; with ``critic.model``
the critic is on a base of its own (:mod:`homerlhf.models.critic_model`). Dtypes: :mod:`homerlhf.models.precision`.

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

from homerlhf.config.schema import RunConfig
from homerlhf.models import cuda_kernels
from homerlhf.models.critic_model import CRITIC, CriticModel, ValueHead, check_same_tokenizer
from homerlhf.models.generation import checkpoint_defaults_off, stop_token_ids
from homerlhf.models.logprobs import chunked_logprobs, output_logit_transform, position_ids_from_mask, response_hidden
from homerlhf.models.lm_head import install_fp32_logits
from homerlhf.models.precision import adapters_to_fp32, prepare_frozen_base
from homerlhf.models.static_decode import StaticDecoder

# The base's loaders live below this module and critic_model's; re-exported here for their old importers.
from homerlhf.models.base_loading import (  # noqa: F401
    ACTOR, _DTYPES, check_logits_path, compute_dtype, keep_cpu_4bit_differentiable, kernels_for, load_base,
    load_tokenizer, moe_layout, peft_lora_config, quantization_config,
)

class PolicyModel:
    """The shared 4-bit base with its adapters and value head, and the forwards PPO needs.

    Adapters and value head are fp32 under every compute dtype; the base's other weights, hidden states
    and KV cache are in the compute dtype (fp32 under ``quant.upcast_non_quantized``), and a 16-bit LM
    head returns fp32 logits to every reader (:mod:`homerlhf.models.lm_head`).

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
        self.critic_model: Optional[CriticModel] = None  # critic.model: the critic's own base, LoRA and head
        # ppo.router_aux_loss_coef of a mixture of experts: the weighted load-balancing loss of the actor's last
        # forward with grad, taken by the update (take_router_aux_loss); 0 leaves it uncomputed.
        self.router_aux_coef = 0.0
        self.router_aux_loss: Optional[Tensor] = None

    @classmethod
    def from_config(cls, cfg: RunConfig, model_path: str, tokenizer=None) -> "PolicyModel":
        """``critic.model``: the critic on a base of its own (:mod:`homerlhf.models.critic_model`), its
        tokenizer checked against the policy's before any weight of either is read."""
        from peft import get_peft_model

        tokenizer = tokenizer or load_tokenizer(
            model_path, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision
        )
        own_critic = cfg.has_critic and cfg.critic.model is not None
        critic_src = check_same_tokenizer(tokenizer, model_path, cfg.critic.model, cfg) if own_critic else None
        base = load_base(model_path, cfg)
        quant = cfg.quant
        base = prepare_frozen_base(base, load_in_4bit=quant.load_in_4bit, upcast=quant.upcast_non_quantized,
                                   checkpointing=cfg.training)
        if base.get_output_embeddings().weight.dtype != torch.float32:
            install_fp32_logits(base)  # a 16-bit head: fp32 logits for sampling and scoring alike
        kernels = kernels_for(cfg, base.device)  # TF32 and SDPA backends, on and off (process-wide)
        check_logits_path(base, model_path)
        layout = moe_layout(model_path, cfg)
        model = get_peft_model(base, peft_lora_config(cfg.actor.lora, layout=layout), adapter_name=ACTOR)
        if cfg.has_critic and not cfg.critic.shared_adapter and not own_critic:
            model.add_adapter(CRITIC, peft_lora_config(cfg.critic.lora, layout=layout))
        model.set_adapter(ACTOR)
        adapters_to_fp32(p for n, p in model.named_parameters() if "lora_" in n)
        critic = CriticModel.from_config(cfg, critic_src, base.config.get_text_config().vocab_size,
                                         tokenizer) if own_critic else None
        hidden = base.config.get_text_config().hidden_size
        value_head = critic.value_head if critic else (
            ValueHead(hidden, cfg.critic.value_head_init_std).to(base.device) if cfg.has_critic else None)
        policy = cls(model, value_head, tokenizer,
                     shared_adapter=cfg.critic.shared_adapter or not cfg.has_critic,
                     logprob_chunk_size=cfg.ppo.logprob_chunk_size, temperature=cfg.rollout.temperature,
                     kernel_settings=kernels)
        policy.critic_model = critic
        policy.router_aux_coef = cfg.ppo.router_aux_loss_coef if layout is not None else 0.0
        return policy

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
        if self.critic_model is not None:
            return self.critic_model.parameters()
        lora = [] if self.shared_adapter else self.adapter_parameters(CRITIC)
        return lora + list(self.value_head.parameters())

    def peft_model_of(self, adapter: str):
        """The peft model that holds ``adapter``: the critic's own with ``critic.model``, else the policy's."""
        return self.critic_model.model if adapter == CRITIC and self.critic_model is not None else self.model

    def checkpoint_activations(self, on: bool = True) -> None:
        """Every module in eval mode (no dropout), and with ``on`` those set to checkpoint activations
        (``training.gradient_checkpointing``) in training mode, the only mode HF checkpoints in.

        The update calls it with ``on`` and the rollout without: PPO's ratio compares the update's
        forward with the rollout's, so nothing random (LoRA or attention dropout, router jitter) may
        move it off 1 before a step. (SFT and RM train through TRL and keep their dropout.)
        """
        self.model.eval()
        if self.has_critic:
            self.value_head.eval()
        if self.critic_model is not None:
            self.critic_model.checkpoint_activations(on)
        if on:
            for module in self.model.modules():
                if getattr(module, "gradient_checkpointing", False) is True:
                    module.training = True

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
            if self.router_aux_coef and torch.is_grad_enabled():
                hidden = self._hidden_and_router_aux(input_ids, attention_mask)
            else:
                hidden = self.hidden_states(input_ids, attention_mask)
            return self._logprobs(hidden, input_ids, response_len)

    def _hidden_and_router_aux(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The actor's hidden states, its routers' load-balancing loss (transformers' own function of the
        model) kept weighted in ``router_aux_loss``."""
        import sys

        inner = self.model.get_base_model()
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            position_ids=position_ids_from_mask(attention_mask), output_router_logits=True)
        config = inner.config.get_text_config()
        balance = sys.modules[type(inner).__module__].load_balancing_loss_func
        aux = balance(out.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask)
        self.router_aux_loss = self.router_aux_coef * aux
        return out.last_hidden_state

    def take_router_aux_loss(self) -> Optional[Tensor]:
        """The weighted router loss of the last actor forward with grad (None without one), once."""
        aux, self.router_aux_loss = self.router_aux_loss, None
        return aux

    def critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """V(prompt + response[:t]) for each response position t: (B, T) fp32."""
        if self.critic_model is not None:
            return self.critic_model.values(input_ids, attention_mask, response_len)
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
        self.model.save_pretrained(str(out), selected_adapters=[a for a in adapters if a in self.model.peft_config])
        if self.critic_model is not None:  # critic.model: its LoRA from its own base, in the same place
            self.critic_model.model.save_pretrained(str(out), selected_adapters=[CRITIC])
        if not self.has_critic:
            return
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  str(out / "value_head.safetensors"))

    def load_value_head(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        self.value_head.load_state_dict(load_file(str(path), device=str(self.device)))
