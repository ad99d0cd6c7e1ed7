"""The value head, and the critic on a base of its own (``critic.model``).

By default the critic is a LoRA on the policy's shared 4-bit base (:mod:`homerlhf.models.policy`).
With ``critic.model`` it has a base of its own, usually much smaller than the actor's (InstructGPT's
6B value function for every policy; DeepSpeed-Chat's 350M critic beside a 1.3B actor): any causal LM
with the **policy's tokenizer**, or a reward model whose score head then initialises the value head.
Only its decoder is loaded (:func:`load_backbone`), checkpointed as the policy's base, with its own
LoRA (``critic.lora``) and an fp32 value head on its final hidden state. It reads the actor's token
ids, so its tokenizer must be the actor's, compared from the tokenizer files alone before any weight
is read (:func:`check_same_tokenizer`); its embedding may be smaller than the actor's head, whose ids
past it it reads as a filler id (:meth:`CriticModel.embeddable`). docs/ppo_details.md has the details.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from homerlhf.errors import UserError
from homerlhf.models.logprobs import position_ids_from_mask, response_hidden

CRITIC = "critic"


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


def critic_source(name: str) -> str:
    """Where ``critic.model`` loads from: a local model dir (a reward run dir: its ``model/``), or a hub id
    (its tokenizer and config fetched alone first, its weights only by the loader)."""
    from homerlhf.models.registry import resolve_model

    resolved = resolve_model(name)
    path = Path(resolved).expanduser()
    if not path.exists():
        return resolved  # a hub id: transformers fetches what each step reads
    for candidate in (path, path / "model"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    raise UserError(f"critic.model {name}: no config.json in {path} (nor in {path / 'model'}); give a HF model dir, "
                    "a reward run dir, a hub id or builtin:<name>")


def read_config(source: str, trust_remote_code: bool = False) -> dict:
    """``config.json`` of a local dir, or of a hub id (that file alone)."""
    path = Path(source) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).to_dict()
    except (OSError, ValueError) as exc:
        raise UserError(f"critic.model {source}: cannot read its config: {str(exc).strip().splitlines()[0][:200]} "
                        "(give a HF model dir, a reward run dir, a hub id or builtin:<name>)") from None


def is_sequence_classifier(config: dict) -> bool:
    """Whether a ``config.json`` is a reward model's (a ``*ForSequenceClassification``)."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def _special(tokenizer) -> dict:
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    return {**ids, "all": sorted(tokenizer.all_special_tokens)}


def tokenizer_difference(policy_tok, critic_tok) -> Optional[str]:
    """What differs between two tokenizers (vocabulary, special tokens, chat template), or None."""
    a, b = policy_tok.get_vocab(), critic_tok.get_vocab()
    if a != b:
        only = sorted(set(a) ^ set(b)) or sorted(t for t in a if a[t] != b[t])
        return f"their vocabularies differ ({len(a)} vs {len(b)} tokens; first difference {only[0]!r})"
    sa, sb = _special(policy_tok), _special(critic_tok)
    if sa != sb:
        key = next(k for k in sa if sa[k] != sb[k])
        return f"their special tokens differ ({key}: {sa[key]!r} vs {sb[key]!r})"
    if policy_tok.chat_template != critic_tok.chat_template:
        return "their chat templates differ"
    return None


def check_same_tokenizer(policy_tok, policy_name: str, critic_name: str, cfg) -> str:
    """Refuse, in one line naming both models, a ``critic.model`` whose tokenizer is not the policy's;
    read from tokenizer files and ``config.json`` alone. Returns where the critic loads from."""
    from homerlhf.models.base_loading import load_tokenizer
    from homerlhf.models.support import check_loadable

    source = critic_source(critic_name)
    config = read_config(source, cfg.model.trust_remote_code)
    kind = "sequence-classifier" if is_sequence_classifier(config) else "causal-lm"
    check_loadable(config, f"critic.model {critic_name}", kind, cfg.model.trust_remote_code)
    critic_tok = load_tokenizer(source, trust_remote_code=cfg.model.trust_remote_code)
    diff = tokenizer_difference(policy_tok, critic_tok)
    if diff is not None:
        raise UserError(f"critic.model {critic_name} does not share the tokenizer of the policy {policy_name}: {diff}; "
                        "the critic reads the actor's token ids, so give a model of the policy's tokenizer (its family) "
                        "or unset critic.model")
    rows = int((config.get("text_config") or config).get("vocab_size") or 0)
    if rows and rows < len(policy_tok):
        raise UserError(f"critic.model {critic_name} embeds {rows} token ids but the policy's tokenizer "
                        f"({policy_name}) has {len(policy_tok)}; give a model of the policy's family")
    return source


def score_head(source: str, config: dict) -> Optional[tuple[Tensor, Optional[Tensor]]]:
    """A sequence classifier's score head (weight (1, H), bias or None), read from its safetensors files
    once the loader has them (a hub id: its snapshot in the cache), or None for a causal LM."""
    from safetensors import safe_open

    from homerlhf.models.registry import resolve_model_dir

    if not is_sequence_classifier(config):
        return None
    if int(config.get("num_labels", len(config.get("id2label") or {}) or 1)) != 1:
        raise UserError(f"critic.model {source}: a sequence classifier of {config.get('num_labels')} labels; a reward "
                        "model (num_labels 1) or a causal LM can be the critic")
    for file in sorted(Path(resolve_model_dir(source)).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            keys = [k for k in fh.keys() if k.split(".")[-2:-1] == ["score"]]
            if keys:
                found = {k.rsplit(".", 1)[-1]: fh.get_tensor(k) for k in keys}
                return found["weight"], found.get("bias")
    raise UserError(f"critic.model {source}: a sequence classifier without a score.weight in its safetensors files; "
                    "save the reward model with safetensors (save_pretrained does by default)")


def filler_id(critic_rows: int, actor_rows: int, tokenizer) -> Optional[int]:
    """What the critic reads for an actor id it cannot embed (``>= critic_rows``; none when the actor's head
    has no more rows than the critic's embedding): a filler row past the tokenizer's tokens, as the actor's
    id is, or the pad token where the critic has no such row."""
    if actor_rows <= critic_rows:
        return None
    return critic_rows - 1 if critic_rows > len(tokenizer) else tokenizer.pad_token_id


class CriticModel:
    """The critic's own frozen base with its LoRA (``model``, a peft model) and value head. ``filler``: the
    id that stands in for actor ids past the critic's embedding (:func:`filler_id`; None: there are none)."""

    def __init__(self, model, value_head: ValueHead, source: str, filler: Optional[int] = None):
        self.model = model
        self.value_head = value_head
        self.source = source
        self.backbone = model.get_base_model()  # AutoModel: the decoder itself, LoRA injected in place
        self.rows = self.backbone.get_input_embeddings().num_embeddings
        self.filler = filler

    @classmethod
    def from_config(cls, cfg, source: str, actor_rows: int = 0, tokenizer=None) -> "CriticModel":
        """Load ``source`` (checked by :func:`check_same_tokenizer`) as ``cfg.quant`` says, with ``critic.lora``
        and a value head: the reward model's score head where ``source`` is one, else ``critic.value_head_init_std``.
        ``actor_rows``: the rows of the actor's LM head, the ids it can sample; ``tokenizer``: the policy's."""
        from peft import get_peft_model

        from homerlhf.models.base_loading import moe_layout, peft_lora_config
        from homerlhf.models.precision import adapters_to_fp32, prepare_frozen_base

        if moe_layout(source, cfg) is not None:
            raise UserError(f"critic.model {source}: a mixture of experts; the critic on a base of its own is a dense "
                            "model (or leave critic.model unset: the critic on the policy's own base)")
        base = load_backbone(source, cfg)
        # The run's checkpointing, as the policy's base: every n-th of its own layers, their inputs offloaded.
        base = prepare_frozen_base(base, load_in_4bit=cfg.quant.load_in_4bit, upcast=cfg.quant.upcast_non_quantized,
                                   checkpointing=cfg.training)
        model = get_peft_model(base, peft_lora_config(cfg.critic.lora, task_type=None), adapter_name=CRITIC)
        adapters_to_fp32(p for n, p in model.named_parameters() if "lora_" in n)
        head = ValueHead(base.config.get_text_config().hidden_size, cfg.critic.value_head_init_std)
        score = score_head(source, read_config(source, cfg.model.trust_remote_code))
        if score is not None:  # a reward model: its score head is the value head's start
            with torch.no_grad():
                head.linear.weight.copy_(score[0].float())
                head.linear.bias.copy_(score[1].float() if score[1] is not None else torch.zeros(1))
        rows = base.get_input_embeddings().num_embeddings
        return cls(model, head.to(base.device), source, filler_id(rows, actor_rows, tokenizer))

    def parameters(self) -> list[nn.Parameter]:
        """What the critic's optimizer steps: its LoRA and the value head."""
        return [p for n, p in self.model.named_parameters() if "lora_" in n] + list(self.value_head.parameters())

    def embeddable(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` with every id past the critic's embedding replaced by :attr:`filler` (on a GPU an
        embedding indexed past its rows is a device-side assert, fatal to the process)."""
        if self.filler is None:
            return input_ids
        return torch.where(input_ids < self.rows, input_ids, self.filler)

    def values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """V(prompt + response[:t]) for each response position t: (B, T) fp32."""
        out = self.backbone(input_ids=self.embeddable(input_ids), attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        return self.value_head(response_hidden(out.last_hidden_state, response_len))

    def checkpoint_activations(self, on: bool) -> None:
        """Eval mode but, with ``on``, for the modules that checkpoint activations (as the policy's)."""
        self.model.eval()
        self.value_head.eval()
        for module in self.model.modules() if on else ():
            if getattr(module, "gradient_checkpointing", False) is True:
                module.training = True


def load_backbone(source: str, cfg):
    """The decoder of ``source`` (``AutoModel``: a causal LM's or a sequence classifier's, no head), in 4-bit
    or at the compute dtype as ``cfg.quant`` says, on the card's device, frozen."""
    from transformers import AutoModel

    from homerlhf.models.base_loading import compute_dtype, keep_cpu_4bit_differentiable, quantization_config

    device = cfg.card.device
    try:
        model = AutoModel.from_pretrained(
            source, quantization_config=quantization_config(cfg.quant, device),
            device_map={"": torch.cuda.current_device()} if device == "cuda" else "cpu",
            dtype=compute_dtype(cfg.quant, device), trust_remote_code=cfg.model.trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load critic.model {source}: {str(exc).splitlines()[0]} "
                        "(give a HF model dir, a reward run dir, a hub id or builtin:<name>)") from None
    for param in model.parameters():
        param.requires_grad_(False)
    keep_cpu_4bit_differentiable(model)
    return model
