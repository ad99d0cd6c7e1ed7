"""The typed run config: one pydantic tree, validated at load and frozen for the whole run.

Every field has a one-line description (at most 30 words; the why goes in docs/); ``homerlhf config``,
``homerlhf train --help-config`` and the Gradio app read them from here. The rollout section is
:mod:`homerlhf.config.rollout`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from homerlhf.config.adapters import ActorConfig, CriticConfig, LoraConfig  # noqa: F401 (re-exported)
from homerlhf.config.rollout import RolloutConfig
from homerlhf.config.section import Section
from homerlhf.config.training import TrainingConfig
from homerlhf.config.preference import DPOTrainConfig, KTOTrainConfig
from homerlhf.config.distributed import DistributedConfig
from homerlhf.config.group import GroupConfig, read_old_names
from homerlhf.config.audit import AuditConfig, GuardsConfig


# extra="forbid" (an unknown key is an error) and frozen (never mutated during a run): Section's.
_Section = Section


class CardConfig(_Section):
    """The machine the preset is planned for."""

    name: str = Field("cpu", description="Card name shown in plans, e.g. 'RTX 4090'.")
    gpu_gib: float = Field(0.0, ge=0, description="GPU memory in GiB (0 for CPU-only).")
    device: Literal["cuda", "cpu"] = Field("cuda", description="Where the actor and critic train.")


class ModelConfig(_Section):
    name_or_path: str = Field(
        "builtin:demo-sft", description="Hub id, local HF model dir, or builtin:<name> (tiny models built from code).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off: safer).")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")


class QuantConfig(_Section):
    load_in_4bit: bool = Field(True, description="Load the shared base in 4-bit with bitsandbytes.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too.")
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Matmul dtype: auto = bf16 on CUDA, fp32 on CPU."
    )
    upcast_non_quantized: bool = Field(
        False, description="With a 4-bit base, keep embeddings, LM head and norms (and so activations) in fp32, at twice "
        "their bytes; off: all in compute_dtype (docs/memory.md).")
    expert_chunk_mib: float = Field(
        256, gt=0, description="Mixture of experts on a 4-bit base: the most MiB of routed expert weights dequantized "
        "at once (at least one expert).")


class PPOConfig(_Section):
    """The clipped-ratio update all three algorithms run, its critic's settings (PPO) and the KL penalty."""

    iterations: int = Field(100, ge=1, description="Iterations (rollout, then update) of the run, whatever its algorithm.")
    epochs: int = Field(1, ge=1, description="Passes over each iteration's experience.")
    mini_batch_size: int = Field(16, ge=1, description="Samples per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Samples per forward/backward (gradient accumulation).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip_range: float = Field(0.2, gt=0, description="Policy ratio clip epsilon.")
    clip_range_value: float = Field(0.2, gt=0, description="Value clip epsilon.")
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss (shared adapter only).")
    kl_coef: float = Field(0.05, ge=0, description="Initial KL penalty coefficient.")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="Per-token KL estimator in the reward.")
    adaptive_kl: bool = Field(False, description="Adapt kl_coef towards target_kl (Ziegler et al.).")
    target_kl: float = Field(6.0, gt=0, description="Target sequence KL for the adaptive controller.")
    kl_horizon: int = Field(10000, ge=1, description="Horizon of the adaptive KL controller.")
    early_stop_kl: Optional[float] = Field(
        None, gt=0, description="Stop the epochs of an iteration once approx_kl exceeds this."
    )
    whiten_advantages: bool = Field(True, description="Whiten advantages over the batch.")
    score_norm: bool = Field(
        True,
        description="Normalise scores by their running mean/std, so clip_range_value and kl_coef mean the "
        "same for any reward model's scale.",
    )
    score_clip: Optional[float] = Field(None, gt=0, description="Clip (normalised) scores to +-this.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")
    logprob_chunk_size: int = Field(64, ge=1, description="Sequence positions per log-prob chunk.")
    router_aux_loss_coef: float = Field(
        0.0, ge=0, description="Mixture of experts: weight of its routers' load-balancing loss (transformers' own) in "
        "the actor's loss; 0: off, the routing left alone (docs/moe.md).")


class BackendConfig(_Section):
    """Where the reference or reward model runs."""

    backend: Literal["llamacpp", "adapter_off", "adapter", "hf", "function", "auto"] = Field(
        "llamacpp", description="llamacpp: a CPU worker; adapter_off: the policy base, adapters off (ref); adapter: a "
        "reward LoRA on that base; hf: in process; function: yours; auto: the fastest that fits (docs/time.md).")
    model: Optional[str] = Field(
        None, description="Model for this role (ref: default = the policy base; reward: required)."
    )
    url: Optional[str] = Field(None, description="Use a running worker at this URL instead of spawning one.")
    token: Optional[str] = Field(
        None, description="Bearer token of a remote worker; never written to disk (config.yaml and checkpoints "
        "say <redacted>). Prefer HOMERLHF_REF_TOKEN / HOMERLHF_REWARD_TOKEN or token_file.")
    token_file: Optional[str] = Field(None, description="File holding the remote worker's bearer token (mode 0600).")
    outtype: Literal["f32", "f16", "bf16", "q8_0"] = Field("f16", description="GGUF export type.")
    from_nf4: bool = Field(True, description="Ref: export the dequantized NF4 base (KL-consistent).")
    threads: int = Field(
        0, ge=0, description="llama.cpp threads (0: an even share of the physical cores with the run's other local "
        "worker and the trainer on CPU).")
    ctx: int = Field(0, ge=0, description="llama.cpp context (0: prompt + response length).")
    f32_kv_cache: bool = Field(False, description="F32 KV cache (exact, slower) instead of F16.")


class RewardComponentConfig(BackendConfig):
    """One reward of a run: a reward model or a function, with its weight in the total score."""

    function: Optional[str] = Field(
        None, description="backend function: path/to/file.py:function_name (from that file only), or builtin:reverse."
    )
    weight: float = Field(1.0, description="Weight of this reward in the total score (total = sum of weight * reward).")
    name: Optional[str] = Field(
        None, pattern=r"^[a-z][a-z0-9_]*$",
        description="Its metric is reward_<name> (default: the function's name, or 'rm' for a reward model).",
    )

    @property
    def metric_name(self) -> str:
        if self.name:
            return self.name
        if self.backend == "function" and self.function:
            return self.function.rsplit(":", 1)[-1].lower().replace("-", "_")
        return "rm"


class RewardConfig(RewardComponentConfig):
    """The run's reward: this one (``backend``/``model``/``function``) plus ``components``, weighted."""

    components: list[RewardComponentConfig] = Field(
        [], description="More rewards added to this one, each {backend, model or function, weight, name}.",
    )

    def all_rewards(self) -> list[tuple[str, RewardComponentConfig]]:
        """``(config key, reward)`` of this reward and each component, in order."""
        return [("reward", self)] + [(f"reward.components[{i}]", c) for i, c in enumerate(self.components)]


class DataConfig(_Section):
    prompts: Optional[str] = Field(
        None, description="RL prompts (`train --data`): a .jsonl/.json/.csv/.parquet file, a folder of them, a hub id "
        "or builtin:<name>. No default: the GPU presets need yours.")
    prompts_from_pairs: bool = Field(
        False, description="Take the prompts of preference pairs given as data.prompts (off: pairs there are refused "
        "as a likely mix-up).")
    split: str = Field("train", description="Dataset split.")
    prompt_column: Optional[str] = Field(None, description="Column holding the prompt (override detection).")
    chosen_column: Optional[str] = Field(None, description="Column holding the chosen reply.")
    rejected_column: Optional[str] = Field(None, description="Column holding the rejected reply.")
    messages_column: Optional[str] = Field(None, description="Column holding a message list.")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="Too-long rows: truncate (prompts: cut inside the last user message, dropped if even "
        "that cannot fit; sft: the completion's end; rm: the start) or drop.",
    )
    max_rows: Optional[int] = Field(None, ge=1, description="Use at most this many rows.")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Held-out fraction (reward stage).")


# Fields whose defaults differ between the two TRL stages, each described once.
TrainData = Annotated[str, Field(
    description="Training data: builtin:<name>, hub id or local file (sft: prompt/completion rows; rm: preference pairs)."
)]
PeakLR = Annotated[float, Field(
    gt=0, description="Peak learning rate of what trains (the adapter and the RM's score head; every weight with method full)."
)]


class TRLStageConfig(_Section):
    """What the two TRL stages (``sft``, ``rm``) share. The LoRA settings are ``actor.lora`` for SFT,
    which trains the policy as PPO's actor does after it, and ``rm.lora`` for the reward model."""

    base: Optional[str] = Field(None, description="Model this stage starts from (default: model.name_or_path).")
    data: TrainData
    method: Literal["qlora", "lora", "full"] = Field(
        "qlora",
        description="qlora: LoRA (sft: actor.lora; rm: rm.lora, plus the score head) on a 4-bit base; "
        "lora: the same on a full-precision base; full: all weights (tiny models).",
    )
    epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: Optional[int] = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    lr: PeakLR
    batch_size: int = Field(4, ge=1, description="Rows (sft: sequences; rm: pairs) per forward/backward.")
    grad_accum: int = Field(4, ge=1, description="Micro-batches per optimizer step.")
    max_len: int = Field(
        1024, ge=8,
        description="Tokens per sequence (prompt + reply); longer sft rows lose the completion's end, longer rm "
        "pairs are cut inside the prompt (docs/data.md).",
    )
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps with linear warm-up.")


class SFTConfig(TRLStageConfig):
    """``homerlhf sft``: supervised fine-tuning with TRL's SFTTrainer (loss on completions only)."""

    data: TrainData = "builtin:demo-sft"
    lr: PeakLR = 2e-4


class RewardTrainConfig(TRLStageConfig):
    """``homerlhf reward``: a Bradley-Terry reward model with TRL's RewardTrainer."""

    data: TrainData = "builtin:demo-pairs"
    lr: PeakLR = 1e-4
    eval_data: Optional[str] = Field(
        None, description="Held-out preference dataset (default: a data.eval_fraction split of rm.data by prompt; "
        "a builtin held-out set is used only with its own task's training data)."
    )
    lora: LoraConfig = LoraConfig()
    center_rewards_coef: Optional[float] = Field(
        None, ge=0, description="Penalty on mean reward squared, keeps scores centred (None: off)."
    )
    export_gguf: bool = Field(True, description="Export the trained RM for the llama.cpp worker (OUT/gguf).")


TrackerName = Literal["tensorboard", "trackio", "wandb", "mlflow", "none"]


class LoggingConfig(_Section):
    report_to: Optional[list[TrackerName]] = Field(
        None, description="Trackers every stage logs to: tensorboard, trackio, wandb, mlflow or none (a list, or "
        "comma-separated). None: tensorboard when installed. Offline, under the run dir, by default (README).")
    tensorboard: Optional[bool] = Field(
        None, description="Old switch, read only while report_to is unset: false = no tracker, true = TensorBoard.")
    project: str = Field("homerlhf", description="Project (W&B, Trackio) or experiment (MLflow) the runs go to.")
    run_name: Optional[str] = Field(None, description="Run name in the trackers (default: the run dir's name "
                                    "and its start time).")
    samples_per_iteration: int = Field(4, ge=0, description="Sample generations logged per iteration (the batch's first).")
    samples_top_bottom: int = Field(
        2, ge=0, description="Also log each iteration's k best- and k worst-scored samples (rank top / bottom in samples.jsonl).")
    samples_max_mb: float = Field(
        100.0, gt=0, description="Stop writing samples.jsonl past this many MiB, with one warning (metrics go on).")
    progress: bool = Field(True, description="Show a progress bar.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value):
        """'wandb,mlflow' -> ['wandb', 'mlflow']; 'none' alone or not at all."""
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if isinstance(items, list) and "none" in items and len(items) > 1:
            raise ValueError(f"logging.report_to: 'none' means no tracker, so it cannot go with others ({items})")
        return items


class CheckpointConfig(_Section):
    every: int = Field(10, ge=1, description="Checkpoint every N iterations (and at stop).")
    keep: int = Field(3, ge=1, description="Keep the last K checkpoints.")


class RunConfig(_Section):
    """A whole run. Loaded from a preset, then a user YAML, then --set overrides."""

    preset: str = Field("cpu-tiny", description="The preset this config started from.")
    algorithm: Literal["ppo", "grpo", "rloo"] = Field(
        "ppo", description="ppo: actor + critic (GAE); grpo / rloo: critic-free, advantages from group.size "
        "samples per prompt (no critic adapter or value head is loaded)."
    )
    description: str = Field("", description="One line about the preset.")
    seed: int = Field(0, description="Seed for python, numpy and torch.")
    output_dir: str = Field("runs/latest", description="Run directory.")
    card: CardConfig = CardConfig()
    model: ModelConfig = ModelConfig()
    quant: QuantConfig = QuantConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    rollout: RolloutConfig = RolloutConfig()
    ppo: PPOConfig = PPOConfig()
    group: GroupConfig = GroupConfig()
    ref: BackendConfig = BackendConfig()
    reward: RewardConfig = RewardConfig(backend="llamacpp", model="builtin:demo-rm", from_nf4=False)
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()
    rm: RewardTrainConfig = RewardTrainConfig()
    dpo: DPOTrainConfig = DPOTrainConfig()
    kto: KTOTrainConfig = KTOTrainConfig()
    training: TrainingConfig = TrainingConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    audit: AuditConfig = AuditConfig()
    guards: GuardsConfig = GuardsConfig()

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return read_old_names(data)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))  # every one found, not only the first
        return self

    def _problems(self) -> list[str]:
        out = []
        if self.ppo.mini_batch_size > self.rollout.batch_size:
            out.append(f"ppo.mini_batch_size ({self.ppo.mini_batch_size}) must be <= rollout.batch_size "
                       f"({self.rollout.batch_size})")
        if self.ppo.mini_batch_size % self.ppo.micro_batch_size:
            out.append(f"ppo.mini_batch_size ({self.ppo.mini_batch_size}) must be a multiple of "
                       f"ppo.micro_batch_size ({self.ppo.micro_batch_size})")
        out += self._group_problems()
        quant = self.quant
        half = quant.compute_dtype in ("bf16", "fp16") or (quant.compute_dtype, self.card.device) == ("auto", "cuda")
        if self.distributed.fsdp and quant.upcast_non_quantized and quant.load_in_4bit and half:
            out.append("quant.upcast_non_quantized=true makes a 16-bit base's weights two dtypes, and FSDP shards "
                       "one dtype per layer; set quant.upcast_non_quantized=false with distributed.fsdp")
        if self.ref.backend in ("hf", "function", "adapter"):
            out.append(f"ref.backend '{self.ref.backend}' is not available; use 'llamacpp', 'adapter_off' or 'auto'")
        if self.ref.backend == "auto" and self.ref.url:
            out.append("ref.backend 'auto' with ref.url: a remote worker is llamacpp; set ref.backend=llamacpp")
        for key, reward in self.reward.all_rewards():
            out += _reward_problems(key, reward)
            if reward.backend == "auto" and (key != "reward" or self.reward.components):
                out.append(f"{key}.backend 'auto' places one reward model; with reward.components name each "
                           "reward's backend")
            if reward.backend == "adapter" and self.rollout.async_:
                out.append(f"{key}.backend 'adapter' scores on the policy's modules, which rollout.async updates "
                           "meanwhile; set rollout.async=false or use a llamacpp/hf reward")
        names = [reward.metric_name for _, reward in self.reward.all_rewards()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            out.append(f"two rewards are named {twice[0]!r} (metric reward_{twice[0]}); give each a distinct name")
        if "mean" in names:
            out.append("a reward may not be named 'mean' (reward_mean is the KL-shaped reward's metric); rename it")
        return out

    def _group_problems(self) -> list[str]:
        group, out = self.group.size, []
        if self.algorithm != "ppo" and group < 2:
            out.append(f"algorithm {self.algorithm} needs group.size >= 2 (samples per prompt), got {group}")
        if self.algorithm != "ppo" and self.critic.warmup_iterations:
            out.append(f"critic.warmup_iterations warms up PPO's critic, and algorithm {self.algorithm} trains none; "
                       "set critic.warmup_iterations=0 or algorithm=ppo")
        if self.algorithm != "ppo" and self.critic.model:
            out.append(f"critic.model is the base of PPO's critic, and algorithm {self.algorithm} trains none; "
                       "unset critic.model or set algorithm=ppo")
        if self.rollout.batch_size % group:
            out.append(f"rollout.batch_size ({self.rollout.batch_size}) must be a multiple of group.size "
                       f"({group}): each prompt is sampled group.size times")
        if self.algorithm == "ppo" and (self.group.kl_in == "loss" or self.group.dr_grpo or self.group.loss_aggregation):
            out.append("group.kl_in=loss, group.dr_grpo and group.loss_aggregation are for algorithm grpo/rloo; "
                       "set algorithm: grpo (or rloo) or leave them unset")
        return out

    @property
    def has_critic(self) -> bool:  # PPO trains a critic; GRPO and RLOO load none
        return self.algorithm == "ppo"

    @property
    def kl_in_loss(self) -> bool:
        """True when the KL to the reference is a loss term (k3) rather than a reward penalty."""
        return (self.group.kl_in or ("loss" if self.algorithm == "grpo" else "reward")) == "loss"

    @property
    def loss_aggregation(self) -> str:
        """How the actor's per-token losses become one number (PPO and RLOO: ``token_mean``)."""
        grpo = "constant" if self.group.dr_grpo else "seq_mean_token_mean"
        return self.group.loss_aggregation or (grpo if self.algorithm == "grpo" else "token_mean")


def _reward_problems(key: str, reward: RewardComponentConfig) -> list[str]:
    """What is wrong with one reward's settings (each a line)."""
    out = []
    if reward.backend == "adapter_off":
        out.append(f"{key}.backend 'adapter_off' makes no sense; use 'llamacpp', 'adapter', 'hf' or 'function'")
    if reward.backend == "auto" and reward.url:
        out.append(f"{key}.backend 'auto' with {key}.url: a remote worker is llamacpp; set {key}.backend=llamacpp")
    if reward.backend == "adapter" and reward.url:
        out.append(f"{key}.backend 'adapter' runs on the policy's base, not at {key}.url; drop the url or use 'llamacpp'")
    if reward.backend == "function" and not reward.function:
        out.append(f"{key}.backend 'function' needs {key}.function: path/to/file.py:function_name")
    if reward.function and reward.backend != "function":
        out.append(f"{key}.function is set but {key}.backend is '{reward.backend}'; set {key}.backend=function")
    if reward.backend != "function" and not reward.model and not reward.url:
        out.append(f"{key}.model is required (a reward run dir, HF dir or hub id) unless {key}.url is set "
                   f"or {key}.backend is function")
    return out
