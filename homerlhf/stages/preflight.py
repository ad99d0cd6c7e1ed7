"""Check first: before any weight is read, each role's backend can serve its model's architecture.

Only ``config.json`` files are read, and a reward function's file imported (a builtin name is known
without building it; a hub id is looked up in the local cache only). A hub id that is not in the cache
is checked no further while the hub answers (its download says what went wrong), and refused at once
when the hub cannot be reached (:func:`homerlhf.models.registry.check_available`): the download would
fail only after its retries. ``reward.backend: adapter`` also reads the weight files' headers and a few
bytes per tensor (:mod:`homerlhf.models.fingerprint`), of builtin models once built. Each refusal is
one line naming the architecture, what is supported and the switch that works:
``ref.backend=adapter_off`` for the reference, ``reward.backend=hf`` for the reward model. The
trackers of ``logging.report_to`` are looked up (not imported): one that is not installed is a line
naming the pip command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from homerlhf.errors import UserError
from homerlhf.tracking.settings import check_installed

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import RunConfig

BUILTIN = "builtin:"
REF_SWITCH = "set ref.backend=adapter_off (the policy base with its adapters off is the reference)"
REWARD_SWITCH = "set reward.backend=hf (the reward model runs in-process with transformers)"
ENGINE_SWITCH = "set rollout.engine=hf (the actor samples with its own generate)"
_SWITCHES = {"ref": REF_SWITCH, "reward": REWARD_SWITCH, "rollout": ENGINE_SWITCH}
_SERVERS = {"ref": "ref worker", "reward": "reward worker", "rollout": "rollout engine"}


def _hub_cached_config(repo_id: str, revision: Optional[str]) -> Optional[Path]:
    from homerlhf.models.registry import hub_cached

    return hub_cached(repo_id, revision)  # a file lookup in the local cache only: never a network request


def model_config(name: str, revision: Optional[str] = None) -> Optional[dict]:
    """``config.json`` of a model name (a reward run dir: its ``model/``; a ``.gguf`` file: from its header),
    or None when unknown offline."""
    if name.startswith(BUILTIN):
        from homerlhf.models.registry import builtin_config

        known = builtin_config(name)  # a registered model with its own config (builtin:gemma3-270m)
        if known is not None:
            return known
        # homerlhf.tiny models: Llama, or Qwen2 for tiny-qwen2
        model_type = "qwen2" if name == f"{BUILTIN}tiny-qwen2" else "llama"
        archs = ["LlamaForSequenceClassification"] if name == f"{BUILTIN}demo-rm" else ["LlamaForCausalLM"]
        return {"model_type": model_type, "architectures": archs}
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from homerlhf.models.gguf_import import gguf_config, gguf_header

        return gguf_config(gguf_header(path))
    for candidate in (path / "config.json", path / "model" / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    if path.exists():
        return None
    cached = _hub_cached_config(name, revision)
    return json.loads(cached.read_text()) if cached else None


def is_reward_export(name: str) -> bool:
    """An exported reward dir, or a reward run dir that holds one: nothing left to export."""
    path = Path(name).expanduser()
    return (path / "manifest.json").is_file() or (path / "gguf" / "manifest.json").is_file()


def check_exportable(config: dict, where: str, role: str, seq_len: int) -> None:
    """The llama.cpp ``role`` worker (or, role ``rollout``, the rollout engine) can serve ``config``: a
    GGUF family exists and computes as HF does."""
    from homerlhf.workers.gguf.registry import FAMILIES, SUPPORTED_ARCHS, family_for

    switch = _SWITCHES[role]
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"{where}: architecture {model_type!r} cannot be served by the llama.cpp {_SERVERS[role]} "
                        f"(GGUF export supports {', '.join(SUPPORTED_ARCHS)}); {switch}")
    try:
        family = family_for(config, where)
    except UserError as exc:
        raise UserError(f"{exc}; {switch}") from None
    window = family.exact_context(config)
    if window is not None and seq_len > window:
        raise UserError(
            f"{where}: {model_type}'s sliding window of {window} tokens is not applied by llama.cpp's "
            f"{family.gguf_arch} graph, and sequences here reach {seq_len} tokens (rollout.max_prompt_len + "
            f"rollout.max_new_tokens); lower them to {window} or less, or {switch}")


def check_gguf_reference(path: Path) -> None:
    """A ``ref.model`` GGUF exists and holds an architecture llama.cpp (as gguf-py knows it) runs."""
    import gguf

    from homerlhf.workers.engine import read_gguf_info

    if not path.is_file():
        raise UserError(f"ref.model {path} does not exist; give an existing .gguf file")
    arch = read_gguf_info(path).architecture
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise UserError(f"ref.model {path}: architecture {arch!r} is not one llama.cpp runs; {REF_SWITCH}")


def check_reference_vocabulary(cfg: "RunConfig", tokenizer, model_path: str) -> None:
    """A ``ref.model`` .gguf scores the policy's ids: checked once the tokenizer is loaded, before the weights."""
    name = cfg.ref.model or ""
    if cfg.ref.backend != "llamacpp" or cfg.ref.url or not name.endswith(".gguf"):
        return
    from homerlhf.workers.engine import read_gguf_info
    from homerlhf.workers.vocab import check_same_vocabulary

    config = model_config(model_path) or {}
    rows = int((config.get("text_config") or config).get("vocab_size") or len(tokenizer))
    path = Path(name).expanduser()
    check_same_vocabulary(read_gguf_info(path, all_tokens=True).tokens, tokenizer, rows, f"ref.model {path}")


def _check_policy(cfg: "RunConfig") -> Optional[dict]:
    from homerlhf.models.registry import check_available, resolve_model
    from homerlhf.models.support import check_loadable

    name = cfg.model.name_or_path
    if name.endswith(".gguf"):  # a GGUF model file: its header read, nothing imported yet
        from homerlhf.models.gguf_import import check_causal_gguf

        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"model.name_or_path: GGUF file {name} does not exist (check the path)")
        config = check_causal_gguf(path, f"model.name_or_path {name}", cfg.model.trust_remote_code)
        check_chat_template(name, "model.name_or_path")
        return config
    if not name.startswith(BUILTIN):
        resolve_model(name)  # a local path that does not exist: said now, not as an unknown model by the planner
    config = model_config(name, cfg.model.revision)
    if config is not None:
        check_loadable(config, name, "causal-lm", cfg.model.trust_remote_code)
    else:
        check_available(name, "model.name_or_path", cfg.model.revision)
    check_chat_template(name, "model.name_or_path")
    return config


TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # beside tokenizer_config.json (transformers >= 4.43)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def chat_template_missing(name: str) -> Optional[str]:
    """Where ``name``'s tokenizer was looked in, when it carries no chat template (a local model dir with
    tokenizer files, a run dir's ``model/``, or a ``.gguf`` file); None when it has one, or nothing here
    tells (a hub id, a builtin model, a dir without tokenizer files: their loading says more)."""
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from homerlhf.models.gguf_import import gguf_chat_template, gguf_header

        return None if gguf_chat_template(gguf_header(path)) else "no tokenizer.chat_template in the GGUF"
    if not path.is_dir():
        return None
    inside = ""
    if not (path / TOKENIZER_FILES[0]).is_file() and (path / "model" / TOKENIZER_FILES[0]).is_file():
        path, inside = path / "model", "in its model/: "  # a run dir: its model/
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    if any((path / f).is_file() for f in TEMPLATE_FILES):
        return None
    config_file = path / TOKENIZER_FILES[0]
    if config_file.is_file():
        try:
            if json.loads(config_file.read_text()).get("chat_template"):
                return None
        except (ValueError, OSError):
            return None  # an unreadable tokenizer config: the tokenizer's loading says what is wrong
    return inside + "no chat_template in tokenizer_config.json, no chat_template.jinja"


def check_chat_template(name: str, key: str) -> None:
    """The policy's tokenizer carries a chat template: RL and preference training render every prompt
    with it, and the model answers in that turn format ever after."""
    where = chat_template_missing(name)
    if where is not None:
        raise UserError(
            f"{key}: {name}'s tokenizer has no chat template ({where}), so the prompts would reach it as plain "
            "'Human: ... Assistant:' text; set one (a chat_template.jinja in the model dir, e.g. its family's "
            "instruct template) or use a chat model (an -Instruct/-it checkpoint)")


def _check_reference(cfg: "RunConfig", policy_config: Optional[dict], seq_len: int) -> None:
    name = cfg.ref.model or cfg.model.name_or_path
    if name.endswith(".gguf"):
        check_gguf_reference(Path(name).expanduser())
        return
    config = policy_config if not cfg.ref.model else model_config(name)
    if config is not None:
        check_exportable(config, name, "ref", seq_len)
    elif cfg.ref.model:
        from homerlhf.models.registry import check_available

        check_available(name, "ref.model")


def _check_reward(key: str, rc, seq_len: int, trust_remote_code: bool) -> None:
    """One reward of the run (``cfg.reward`` or a component): its function loads, or its model serves."""
    from homerlhf.models.support import check_loadable

    if rc.backend == "function":
        from homerlhf.ppo.reward_functions import load_reward_function

        load_reward_function(rc.function, f"{key}.function")
        return
    if rc.backend == "adapter" and not rc.url:
        _check_builtin_adapter(key, rc.model or "")
    if rc.url or rc.backend == "adapter":  # an adapter's base is checked once the policy is resolved
        return
    from homerlhf.models.registry import check_available

    name = rc.model or ""
    config = model_config(name) if name else None
    if config is None:
        if name:
            check_available(name, f"{key}.model")
        return
    if rc.backend == "hf":
        check_loadable(config, name, "sequence-classifier", trust_remote_code)
    elif not is_reward_export(name):
        check_exportable(config, name, "reward", seq_len)


def _check_builtin_adapter(key: str, name: str) -> None:
    """A ``builtin:`` reward model registered without ``adapter`` among its backends is refused as one
    before it is built (its registration says what it is)."""
    from homerlhf.models.registry import builtin_reward_backends
    from homerlhf.models.reward_adapter import OTHER_BACKENDS

    kinds = builtin_reward_backends(name)
    if kinds is not None and "adapter" not in kinds:
        raise UserError(f"{key}.model {name} is a reward model of its own (it runs on {' or '.join(kinds)}), not a "
                        f"LoRA on the policy's base: {key}.backend=adapter needs one trained with rm.method=qlora or "
                        f"lora (`homerlhf reward --set rm.method=qlora`), {OTHER_BACKENDS}")


def check_run(cfg: "RunConfig") -> None:
    """A PPO run names its prompts, every role (policy, reference, reward) can load or serve its model,
    and every tracker of ``logging.report_to`` is installed."""
    from homerlhf.config import NO_PROMPTS

    if not cfg.data.prompts:
        raise UserError(NO_PROMPTS)
    check_installed(cfg.logging)
    seq_len = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
    policy_config = _check_policy(cfg)
    if cfg.ref.backend == "llamacpp" and not cfg.ref.url:
        _check_reference(cfg, policy_config, cfg.ref.ctx or seq_len)
    for key, rc in cfg.reward.all_rewards():
        _check_reward(key, rc, rc.ctx or seq_len, cfg.model.trust_remote_code)
    if cfg.rollout.engine == "llamacpp" and policy_config is not None:
        check_exportable(policy_config, cfg.model.name_or_path, "rollout", seq_len)
    check_reward_adapters(cfg)
    check_memory(cfg)


def host_ram_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / 1024**3


def check_memory(cfg: "RunConfig", ram_gib: Optional[float] = None) -> None:
    """The run fits this machine by the memory plan (:func:`homerlhf.memory.planner.plan`), else one line
    naming what it needs and what to change. On a GPU preset: the plan's peak against the card, refused
    only when it is over (a tight plan runs); the suggestion, when the planner has one, is the fix. On a
    CPU preset: the trainer's peak plus the llama.cpp reference worker (the policy's own weights) against the
    host's RAM (``ram_gib``, default this machine's); a reward worker's model may be of another size and is
    not counted. A model whose config.json is not on this machine (a hub id to download) is not checked."""
    from homerlhf.memory.planner import plan
    from homerlhf.memory.render import shape_for

    if model_config(cfg.model.name_or_path, cfg.model.revision) is None:
        return
    try:
        shape = shape_for(cfg)
    except UserError:
        return
    name = cfg.model.name_or_path
    if cfg.card.device != "cpu" and cfg.card.gpu_gib > 0:
        planned = plan(cfg, shape)
        if planned.status != "over":
            return
        fix = " ".join(f"--set {a}" for a in planned.suggestion.set_args) if planned.suggestion is not None else ""
        raise UserError(f"{name} does not fit {cfg.card.name} ({cfg.card.gpu_gib:g} GiB) by the memory plan: peak "
                        f"{planned.peak_gib:.2f} GiB in {planned.peak.name}; "
                        + (f"add {fix}, or " if fix else "") +
                        "choose a smaller model or a larger card (`homerlhf plan` shows each component)")
    ram = host_ram_gib() if ram_gib is None else float(ram_gib)
    planned = plan(cfg, shape, gpu_gib=0, with_suggestion=False)
    ref_gib = sum(c.bytes for c in planned.workers.get("ref", [])) / 1024**3
    if planned.peak_gib + ref_gib > ram:
        raise UserError(f"{name} does not fit this machine's memory by the plan: the trainer's peak "
                        f"{planned.peak_gib:.2f} GiB ({planned.peak.name}) and the reference worker's "
                        f"{ref_gib:.2f} GiB exceed the {ram:.1f} GiB of RAM; choose a smaller "
                        "model, shorter rollout.max_new_tokens / rollout.chunk_size, or a GPU preset on a machine "
                        "with a card (`homerlhf plan` shows each component)")


def check_auto_choices(before: "RunConfig", after: "RunConfig") -> None:
    """What ``auto`` chose (``after``, :mod:`homerlhf.stages.autoplan`) that :func:`check_run` could not
    check on ``before``: a reference, reward or engine backend picked (a llama.cpp export of the policy)."""
    seq_len = after.rollout.max_prompt_len + after.rollout.max_new_tokens
    chosen = before.ref.backend == "auto" != after.ref.backend, before.rollout.engine == "auto" != after.rollout.engine
    rewards = [(key, rc) for (key, was), (_, rc) in zip(before.reward.all_rewards(), after.reward.all_rewards())
               if was.backend == "auto" != rc.backend]
    if not (any(chosen) or rewards):
        return
    policy_config = model_config(after.model.name_or_path, after.model.revision)
    if chosen[0] and after.ref.backend == "llamacpp" and not after.ref.url:
        _check_reference(after, policy_config, after.ref.ctx or seq_len)
    for key, rc in rewards:
        _check_reward(key, rc, rc.ctx or seq_len, after.model.trust_remote_code)
    if chosen[1] and after.rollout.engine == "llamacpp" and policy_config is not None:
        check_exportable(policy_config, after.model.name_or_path, "rollout", seq_len)
    if any(rc.backend == "adapter" for _, rc in rewards):
        check_reward_adapters(after)


def _local_model_dir(name: str, revision: Optional[str] = None) -> Optional[Path]:
    """The local directory of a model name (a builtin one built, as the run would), or None for a
    hub id not in the local cache."""
    if name.startswith(BUILTIN):
        from homerlhf.models.registry import resolve_model

        return Path(resolve_model(name))
    path = Path(name).expanduser()
    if path.exists():
        return path
    cached = _hub_cached_config(name, revision)
    return cached.parent if cached else None


def check_reward_adapters(cfg: "RunConfig") -> None:
    """Each ``backend: adapter`` reward was trained on the policy's own base (config and weights
    fingerprint, :func:`homerlhf.models.reward_adapter.check_same_base`); a model not on this
    machine yet is checked when the run builds that reward."""
    from homerlhf.models.reward_adapter import check_same_base

    adapters = [rc for _, rc in cfg.reward.all_rewards() if rc.backend == "adapter"]
    policy_dir = _local_model_dir(cfg.model.name_or_path, cfg.model.revision) if adapters else None
    for rc in adapters:
        reward_dir = _local_model_dir(rc.model or "")
        if policy_dir is not None and reward_dir is not None:
            check_same_base(reward_dir, policy_dir)


def check_reward_stage(cfg: "RunConfig", base: str) -> None:
    """``homerlhf reward`` from ``base``: a sequence classifier transformers has, and, with
    ``rm.export_gguf``, one the GGUF export takes: checked before training, not after. Its trackers are installed."""
    from homerlhf.models.support import check_loadable

    check_installed(cfg.logging)

    config = model_config(base, cfg.model.revision)
    if config is None:
        return
    check_loadable(config, base, "sequence-classifier", cfg.model.trust_remote_code)
    if cfg.rm.export_gguf:
        from homerlhf.workers.gguf.registry import family_for

        try:
            family_for(config, base)
        except UserError as exc:
            raise UserError(f"{exc}; set rm.export_gguf=false and use the reward model with reward.backend=hf") from None


def check_sft_stage(cfg: "RunConfig", base: str) -> None:
    """``homerlhf sft`` from ``base``: a causal LM transformers has; its trackers are installed."""
    from homerlhf.models.support import check_loadable

    check_installed(cfg.logging)

    config = model_config(base, cfg.model.revision)
    if config is not None:
        check_loadable(config, base, "causal-lm", cfg.model.trust_remote_code)
