"""One case of ``homerlhf check``, run and measured: its settings, the run, the plan of what it ran and
its figures (:func:`run_case`); a failure is a result, never a stop (:func:`guarded`).

Models are random weights of published shapes (the planner's builtin table), built on the GPU and
saved with the tiny tokenizer (:mod:`homerlhf.check.runs`, kept in :func:`~homerlhf.check.runs.models_dir`
for the next run): nothing is downloaded. The process is capped at each preset's card
(``set_per_process_memory_fraction``). The reference is the policy's base with its adapters off and
the reward an in-process function (no llama.cpp anywhere). Peaks are compared with the plan of the
iteration measured (:mod:`homerlhf.check.case_plan`); flags are restored and cuBLAS workspaces freed
between cases; the sampled-vs-scored log-prob gap is measured (:mod:`homerlhf.check.measures`). A
preference case (``dpo``, ``kto``) runs its stage instead (:mod:`homerlhf.check.preference_case`).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from homerlhf.check.case_plan import case_plans, compared_steps, comparison, described, iteration_assumptions, planned_decoder
from homerlhf.check.cases import COMMON, CRITIC_MODEL, PREFERENCE, PREFERENCE_COMMON, Case
from homerlhf.check.cli_case import cli_case
from homerlhf.check.measures import checkpointing_of, current_flags, kernel_settings, recording_trainer, restore_flags
from homerlhf.check.preference_case import preference_case
from homerlhf.check.runs import (build_random_checkpoint, build_reward_adapter, cap_memory, checkpoint_dir, differences,
                                 measured_iterations, optimizer_steps, random_prompts, release_memory, snapshot)

REWARD_FN = '''def reward(response_ids):
    """Share of even ids: spread over the samples of random weights (a GRPO group needs some)."""
    return sum(1 for t in response_ids if t % 2 == 0) / max(len(response_ids), 1)
'''
# rollout.decoder=static: the loop a GPU run samples with (``auto`` there), eager on the CPU.
SMOKE = ("card.device=cpu", "quant.compute_dtype=fp32", "rollout.batch_size=4", "rollout.chunk_size=2",
         "rollout.max_prompt_len=16", "rollout.max_new_tokens=3", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
         "rollout.decoder=static")
# A preference case's in the CPU smoke (METHOD: dpo or kto): 4 rows per forward, of up to 48 tokens.
PREFERENCE_SMOKE = ("card.device=cpu", "quant.compute_dtype=fp32", "METHOD.batch_size=2", "METHOD.grad_accum=1",
                    "METHOD.max_len=48")
# The CPU smoke's model: the case's architecture (type, tied embeddings, biases) at a tiny size.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16)
TIME_KEYS = ("time_generation_s", "time_scoring_s", "time_reference_reward_wait_s", "time_advantages_s",
             "time_update_s", "time_iteration_s")


@dataclass
class Run:
    """This invocation: its mode, scratch dir, the models built so far and the files cases name."""

    smoke: bool
    tmp: Path
    models: dict[str, Path] = field(default_factory=dict)
    files: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.files = {"reward_fn": str(self.tmp / "rewards.py"), "reward_adapter": str(self.tmp / "reward-adapter"),
                      "critic_model": str(self.model_dir(CRITIC_MODEL, build=False))}

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def iterations(self, case: Case) -> int:
        return 1 if self.smoke else case.iterations

    def overrides(self, case: Case) -> list[str]:
        if case.kind in PREFERENCE:
            smoke = tuple(o.replace("METHOD", case.kind) for o in PREFERENCE_SMOKE)
            return list(PREFERENCE_COMMON + case.overrides + (smoke if self.smoke else ()) + case.keep)
        listed = COMMON + case.overrides + (SMOKE if self.smoke else ()) + case.keep
        return [o.format(**self.files) for o in listed]

    def model_dir(self, name: str, build: bool = True) -> Path:
        """``name``'s random checkpoint (its architecture at a tiny size in the CPU smoke; on a GPU in
        ``runs.models_dir()``), built once (``build`` False: only where it is or will be)."""
        from dataclasses import replace

        from homerlhf.memory.shapes import builtin_shape

        shape = replace(builtin_shape(name), **TINY) if self.smoke else builtin_shape(name)
        path = checkpoint_dir(shape, self.tmp / name.replace("/", "--"), device=self.device)
        if build and name not in self.models:
            if not self.smoke:
                cap_memory(None)  # a card's cap from the case before must not stop the build
            self.models[name] = build_random_checkpoint(shape, path, device=self.device)
        return path


def write_files(run: Run) -> None:
    """The reward function's file."""
    Path(run.files["reward_fn"]).write_text(REWARD_FN)


def new_trainer(cfg, model_dir: Path, run_dir):
    """The case's policy (NF4), reference and reward as the PPO stage builds them, and its trainer
    (``measures.recording_trainer``: it also keeps the sampled behaviour log-probs)."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.stages.scorers import build_reference, build_reward

    policy = PolicyModel.from_config(cfg, str(model_dir))
    reference = build_reference(cfg, policy, str(model_dir), run_dir)
    reward = build_reward(cfg, policy.tokenizer, run_dir, policy)
    prompts = random_prompts(policy.tokenizer, cfg.rollout.batch_size, cfg.rollout.max_prompt_len)
    return recording_trainer(cfg, policy, reference, reward, prompts, run_dir)


def close(trainer) -> None:
    trainer.backends.reward.close()
    trainer.backends.reference.close()
    trainer.meters.memory.close()
    if trainer.writer is not None:
        trainer.writer.close()


def train_case(case: Case, cfg, model_dir: Path, run: Run) -> dict:
    trainer = new_trainer(cfg, model_dir, None)
    try:
        return {**measured_iterations(trainer, run.iterations(case)),
                "kernel_settings": kernel_settings(trainer.policy, cfg, run.device),
                "activation_checkpointing": checkpointing_of(trainer.policy)}
    finally:
        close(trainer)


def resume_case(case: Case, cfg, model_dir: Path, run: Run) -> dict:
    """An iteration and a checkpoint; a new trainer resumed from it must hold the same state, then run on."""
    run_dir = run.tmp / case.name
    trainer = new_trainer(cfg, model_dir, run_dir)
    try:
        first = measured_iterations(trainer, run.iterations(case))
        ckpt, saved = trainer.checkpoint(), snapshot(trainer)
    finally:
        close(trainer)
    del trainer
    release_memory()  # the resumed trainer starts as a new process would: no cuBLAS workspace
    trainer = new_trainer(cfg, model_dir, run_dir)
    try:
        trainer.resume(ckpt)
        differ = differences(saved, snapshot(trainer))
        if differ:
            raise AssertionError(f"the resumed state differs from the saved one in {len(differ)} entries: "
                                 f"{', '.join(differ[:4])}")
        result = measured_iterations(trainer, 1)
        result["kernel_settings"] = kernel_settings(trainer.policy, cfg, run.device)
        result["activation_checkpointing"] = checkpointing_of(trainer.policy)
    finally:
        close(trainer)
    result.update(resumed_from=Path(ckpt).name, state_equal=True, state_entries=len(saved),
                  resumed_states=not all(first["step_skipped"]))  # the checkpoint holds states after a taken step
    return result


def resolved_as_train(cfg, shape, say=print):
    """``cfg`` with its ``auto`` settings resolved as ``homerlhf train`` resolves them on a CUDA card
    (:func:`homerlhf.stages.autoplan.resolve_auto`), so the policy runs the settings its plan assumes.
    A CPU-smoke config (``card.device=cpu``) is decided as on the card, then trained on the CPU."""
    from homerlhf.stages.autoplan import resolve_auto

    card = cfg.card
    on_card = cfg.model_copy(update={"card": card.model_copy(update={"device": "cuda"})})
    return resolve_auto(on_card, shape=shape, say=say).model_copy(update={"card": card})


def case_entry(case: Case, run: Run, cfg, cap: float, shape, overrides: list[str]) -> dict:
    """What the report says of ``case`` before it runs: its preset, model, settings and estimates."""
    from homerlhf.memory.planner import plan

    return {"case": case.name, "kind": case.kind, "preset": case.preset, "model": case.model, "cap_gib": cap,
            "estimate_s": case.estimate_s, "estimate_h200_s": case.estimate_h200_s, "iterations": run.iterations(case),
            "overrides": overrides, "settings": plan(cfg, shape, cap, with_suggestion=False).settings}


def run_case(case: Case, run: Run) -> dict:
    """One case: settings, the run, the plan of what it ran and its figures (see the module docstring)."""
    from homerlhf.config import load_config
    from homerlhf.memory.shapes import resolve_shape

    if case.kind in PREFERENCE:
        return preference_case(case, run)
    started = time.perf_counter()
    overrides = run.overrides(case)
    model_dir = run.model_dir(case.model, build=False)
    cfg = load_config(case.preset, overrides=[f"model.name_or_path={model_dir}", *overrides])  # before any build
    run.model_dir(case.model)
    adapter = Path(run.files["reward_adapter"])
    if "{reward_adapter}" in " ".join(case.overrides) and not adapter.is_dir():
        build_reward_adapter(model_dir, adapter, run.device)
    if "{critic_model}" in " ".join(case.overrides):
        run.model_dir(CRITIC_MODEL)  # the critic's own base: random weights, the same (tiny) tokenizer
    shape, decided = resolve_shape(str(model_dir)), []
    cfg = resolved_as_train(cfg, shape, decided.append)  # after the builds: the plan reads every model's shape
    cap = float(cfg.card.gpu_gib)
    entry = case_entry(case, run, cfg, cap, shape, overrides)
    entry["decided"] = decided
    if not run.smoke:
        cap_memory(cap)
        import torch

        torch.cuda.reset_peak_memory_stats()
    if case.kind == "cli":
        result = cli_case(case, [f"model.name_or_path={model_dir}", *overrides], cap, run)
        result["kernel_settings"] = kernel_settings(None, cfg, run.device)
    else:
        result = (resume_case if case.kind == "resume" else train_case)(case, cfg, model_dir, run)
    entry["optimizer_steps"] = optimizer_steps(result["rows"])
    if cfg.quant.compute_dtype == "fp16" and not entry["optimizer_steps"]["taken"]:
        raise AssertionError(f"the fp16 loss scaler skipped all {entry['optimizer_steps']['steps']} optimizer "
                             f"steps (loss scale {entry['optimizer_steps']['loss_scale']}): no update was tested")
    steps, resumed = compared_steps(result, case.kind)
    assumed = iteration_assumptions(steps, planned_decoder(result.get("decoder"), cfg.rollout.decoder, run.device),
                                    resumed)
    entry["plan"], chosen = case_plans(cfg, shape, cap, assumed)
    entry["plan_assumptions"] = {name: described(a, cfg) for name, a in assumed.items()}
    last = result["rows"][-1]
    entry.update(result, comparison=comparison(chosen, result["measured_gib"]),
                 seconds={k: last.get(k) for k in TIME_KEYS},
                 tokens_per_s={k: v for k, v in last.items() if k.startswith("tokens_per_s_")})
    entry["wall_s"] = round(time.perf_counter() - started, 1)
    return entry


def guarded(case: Case, run: Run) -> dict:
    """:func:`run_case`, its failure a result (the error's last line, the traceback) rather than a stop."""
    from homerlhf.memory.oom import is_oom

    started, flags = time.perf_counter(), current_flags()  # the precision / kernel flags before the case
    try:
        return run_case(case, run)
    except Exception as exc:  # noqa: BLE001 - one case's failure is a result; the next case still runs
        text = str(exc).strip().splitlines()
        return {"case": case.name, "kind": case.kind, "preset": case.preset, "model": case.model,
                "estimate_s": case.estimate_s, "overrides": run.overrides(case),
                "error": f"{'OOM' if is_oom(exc) else type(exc).__name__}: {text[-1] if text else ''}",
                "traceback": traceback.format_exc(), "wall_s": round(time.perf_counter() - started, 1)}
    finally:
        restore_flags(flags)  # a bf16 case's TF32 must not run the next (upcast) case's fp32 matmuls
        release_memory()
