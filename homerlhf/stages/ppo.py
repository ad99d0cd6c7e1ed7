"""The PPO stage: resolve models, build the reference and reward backends, run the trainer.

The backends and the rollout engine are built by :mod:`homerlhf.stages.scorers` (data parallel:
:func:`homerlhf.stages.data_parallel.build_scorers` decides which process starts the workers).

``run_ppo`` owns the run directory: it refuses to write over an earlier run unless told to, writes
the resolved config (``config.yaml``), and always closes the backends (their worker processes)
whatever happens in between.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from homerlhf.config import NO_PROMPTS, RunConfig, to_yaml
from homerlhf.data.load import load_prompts
from homerlhf.data.tokens import tokenize_prompts_indexed
from homerlhf.errors import UserError
from homerlhf.memory.oom import free_memory
from homerlhf.memory.threads import run_thread_shares
from homerlhf.models.policy import PolicyModel, load_tokenizer
from homerlhf.models.registry import resolve_model
from homerlhf.ppo.backends import Backends, RewardBackend
from homerlhf.ppo.checkpoint import check_resume_compatible
from homerlhf.ppo.distributed import current_ranks
from homerlhf.ppo.resuming import find_resume_checkpoint, saved_config
from homerlhf.ppo.stopping import StopRequested
from homerlhf.ppo.trainer import RLTrainer, seed_everything
from homerlhf.stages.autoplan import resolve_for_run
from homerlhf.stages.common import claim_run_dir
from homerlhf.stages.data_parallel import build_scorers, check_processes, watch_launcher
from homerlhf.stages.preflight import check_auto_choices, check_reference_vocabulary, check_run
from homerlhf.stages.scorers import build_engine
from homerlhf.tracking.settings import TRACKER_DIRS, tracking_line
from homerlhf.workers import llama_log

LLAMA_LOG = "llama.log"  # llama.cpp's own warnings and errors of the run's process (the workers: workers/*.log)
# Files whose presence means a directory already holds a PPO run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")


def prepare_run_dir(run_dir: Path, overwrite: bool) -> Path:
    """An empty-of-runs ``run_dir``; an earlier run there is an error unless ``overwrite``."""
    return claim_run_dir(run_dir, RUN_MARKERS, overwrite,
                         f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, "
                         "--overwrite to replace it, or choose another --out",
                         removals=("samples.jsonl", LLAMA_LOG, *TRACKER_DIRS))


def load_prompt_ids(cfg: RunConfig, tokenizer) -> list[list[int]]:
    """The configured prompt dataset, chat-templated and tokenised to ``rollout.max_prompt_len`` at
    most (over-long prompts cut inside their last user message or dropped, as ``data.overlong``
    says; the load report is printed when any was)."""
    return load_prompt_rows(cfg, tokenizer)[0]


def read_prompts(cfg: RunConfig):
    """``data.prompts`` read and normalised, not tokenised: ``(records, report)``. A missing or empty
    file, or pairs given as prompts, is a one-line error here, before any weight loads or file is written."""
    if not cfg.data.prompts:
        raise UserError(NO_PROMPTS)
    return load_prompts(cfg.data.prompts, cfg.data, keep_rows=True)


def load_prompt_rows(cfg: RunConfig, tokenizer, loaded=None, quiet: bool = True) -> tuple[list[list[int]], list[dict]]:
    """The prompts' token ids (as :func:`load_prompt_ids`) and, indexed alike, their dataset rows
    (every column) for the reward. ``loaded``: what :func:`read_prompts` returned (else read now);
    ``quiet``: the load report only when a prompt was cut or dropped (else always: the run's data line)."""
    records, report = loaded if loaded is not None else read_prompts(cfg)
    kept = tokenize_prompts_indexed(records, tokenizer, cfg.rollout.max_prompt_len, overlong=cfg.data.overlong,
                                    report=report)
    if report.n_truncated or report.n_dropped or not quiet:
        print(f"data: {report.summary()}")
    return [ids for _, ids in kept], [records[i]["row"] for i, _ in kept]


@contextlib.contextmanager
def trainer_threads(cfg: RunConfig, processes_here: int = 1):
    """torch's CPU threads for a trainer on CPU: its share of the physical cores next to the local
    workers, split over the ``processes_here`` trainer processes on this host (restored afterwards; a
    GPU trainer's are left alone)."""
    share = run_thread_shares(cfg).trainer
    share = max(1, share // processes_here) if share else share
    before = torch.get_num_threads()
    if share:
        torch.set_num_threads(share)
    try:
        yield share
    finally:
        torch.set_num_threads(before)


def _claim_run(cfg: RunConfig, out_dir, resume, overwrite: bool, ranks) -> tuple[Path, Optional[Path]]:
    """The run dir and the checkpoint to resume from (None for a new run). A new run's dir is claimed
    by process 0 alone; the others learn its path."""
    if resume is None:
        return ranks.broadcast(prepare_run_dir(Path(out_dir or cfg.output_dir), overwrite) if ranks.is_main
                               else None), None
    if overwrite:
        raise UserError("--resume continues a run and --overwrite replaces it; pass only one of them")
    if out_dir is not None and Path(out_dir).resolve() != Path(resume).resolve():
        raise UserError(f"--resume continues in {resume} itself; drop --out {out_dir}")
    ckpt = find_resume_checkpoint(Path(resume))
    check_resume_compatible(saved_config(ckpt), cfg, Path(resume))
    return Path(resume), ckpt


def run_ppo(cfg: RunConfig, out_dir: Optional[str | Path] = None, resume: Optional[str | Path] = None,
            overwrite: bool = False, *, reward: Optional[RewardBackend] = None,
            stop=None) -> dict[str, Any]:
    """Run PPO as configured; returns ``{"run_dir", "metrics", "checkpoint", "stopped", "iteration"}``.

    ``resume``: a run dir to continue from its newest complete checkpoint (``cfg`` must be
    compatible with the checkpoint's: see ``homerlhf.ppo.checkpoint.INCOMPATIBLE_KEYS``).
    ``stop``: a ``StopRequested``; by default SIGINT/SIGTERM set one while the trainer runs.

    ``reward``: a ready reward backend (e.g. ``CallableReward``) instead of the configured one.

    Under ``accelerate launch`` (several processes) each process runs this with the same arguments:
    see :mod:`homerlhf.stages.data_parallel` for what process 0 does alone.
    """
    result = _run_ppo(cfg, out_dir, resume, overwrite, reward, stop)
    free_memory()  # the policy's 4-bit layers are reference cycles: collected now, the card is free for what follows
    return result


def _run_ppo(cfg: RunConfig, out_dir, resume, overwrite: bool, reward: Optional[RewardBackend], stop) -> dict[str, Any]:
    check_run(cfg)  # what the config names, before any weight is read, run dir written or shape planned on
    loaded = read_prompts(cfg)  # the prompts: a bad file is one line before anything is written
    placed = resolve_for_run(cfg, resume, reward_given=reward is not None)  # auto placement and generation chunk
    check_auto_choices(cfg, placed)  # what auto chose: a llama.cpp export of the policy for the engine or reference
    cfg = placed
    ranks = current_ranks()
    check_processes(cfg, ranks.world)
    watch_launcher(ranks)
    run_dir, ckpt = _claim_run(cfg, out_dir, resume, overwrite, ranks)
    cfg = cfg.model_copy(update={"output_dir": str(run_dir)})
    if ranks.is_main:
        print(tracking_line(cfg.logging, run_dir))
    seed_everything(cfg.seed)

    model_path = resolve_model(cfg.model.name_or_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
    prompts, rows = load_prompt_rows(cfg, tokenizer, loaded, quiet=not ranks.is_main)
    check_reference_vocabulary(cfg, tokenizer, model_path)
    policy = PolicyModel.from_config(cfg, model_path, tokenizer=tokenizer)

    with contextlib.ExitStack() as stack:
        # llama.cpp's warnings in this process (the engine's, a reference on the GPU): the run dir, not the terminal
        stack.callback(llama_log.log_to, llama_log.log_to(run_dir / LLAMA_LOG))
        stack.enter_context(trainer_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        reference, reward = build_scorers(cfg, policy, model_path, run_dir, ranks, stack, reward)
        engine = build_engine(cfg, policy, model_path, run_dir)
        stack.callback(engine.close)
        stop = stop if stop is not None else StopRequested()
        trainer = RLTrainer(cfg, policy, Backends(reference, reward, engine), prompts, run_dir, rows=rows, ranks=ranks)
        trainer.stop = stop
        if ckpt is not None:
            trainer.resume(ckpt)
        # Written once everything loaded: a bad model path must not leave a dir that looks like a run.
        if ranks.is_main:
            (run_dir / "config.yaml.tmp").write_text(to_yaml(cfg))
            (run_dir / "config.yaml.tmp").replace(run_dir / "config.yaml")
        with stop:  # SIGINT/SIGTERM: finish the phase, checkpoint; the ExitStack then stops the workers
            metrics = trainer.train()
        ranks.barrier()  # the workers' owner stops them only once no rank needs them
    return {"run_dir": run_dir, "metrics": metrics, "checkpoint": trainer.last_checkpoint,
            "stopped": trainer.stopped, "iteration": trainer.iteration}
