"""A PPO run over several processes (``accelerate launch``): who starts the workers, who owns the
run directory, and what keeps a process from outliving its launcher.

- **Workers.** The reference and reward llama.cpp workers are started by one process and reached by
  the others over HTTP: by each host's first process for the processes on its host
  (``distributed.workers: per_node``, the default) or by process 0 for all (``shared``; the workers
  bind 127.0.0.1, so one host, unless you start them yourself and set ``ref.url`` / ``reward.url``).
  The owner hands each worker's URL and bearer token to the others through the process group's
  ``all_gather_object``: in memory, never on a command line or on disk (the owner's 0600 token
  file aside). Backends that are not a single llama.cpp worker (``adapter_off`` reference, ``hf``
  reward, reward functions, weighted rewards) are built by every process as configured.
- **Run directory.** Process 0 claims it (or finds the checkpoint to resume) and writes
  ``config.yaml``, metrics and checkpoints; the others read it only.
- **Lifetime.** Each process exits once its launcher is gone (``kill -9`` of ``accelerate launch``
  leaves nothing running: the owner's workers watch their owner in turn).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from homerlhf.config import RunConfig
from homerlhf.errors import UserError
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.models.sharding import check_trainable_sharded
from homerlhf.ppo.distributed import Ranks, check_data_parallel


def check_processes(cfg: RunConfig, world: int) -> None:
    """A run over ``world`` processes can be one, before anything loads: the global batch splits into whole
    prompt groups per process, the asynchronous mode runs in one process, nothing is sharded."""
    check_trainable_sharded(cfg)
    check_data_parallel(cfg.rollout.batch_size, cfg.group.size, world)
    if cfg.rollout.async_ and world > 1:
        raise UserError("rollout.async runs in one process; drop it or launch without data parallelism")


def watch_launcher(ranks: Ranks) -> None:
    """Exit this process when the process that launched it is gone (data parallel only)."""
    if ranks.distributed:
        from homerlhf.workers.server import watch_parent

        watch_parent(os.getppid())


def worker_owner(cfg: RunConfig, ranks: Ranks) -> int:
    """The rank that starts the workers this rank uses."""
    return 0 if cfg.distributed.workers == "shared" else ranks.node_main


def endpoint(backend) -> Optional[tuple[str, Optional[str]]]:
    """``(url, token)`` of a backend that is one llama.cpp worker; None for any other backend."""
    from homerlhf.workers.backends import LlamaCppReference, LlamaCppReward

    if isinstance(backend, (LlamaCppReference, LlamaCppReward)) and backend.client.url:
        return backend.client.url, backend.client.token
    return None


def connect_to(role: str, where: tuple[str, Optional[str]], cfg: RunConfig, tokenizer):
    """A backend on another rank's worker at ``where`` (url, token)."""
    from homerlhf.workers.backends import connect
    from homerlhf.workers.vocab import tokenizer_fingerprint

    url, token = where
    return connect(role, url=url, token=token, fingerprint=tokenizer_fingerprint(tokenizer),
                   temperature=cfg.rollout.temperature)


def build_scorers(cfg: RunConfig, policy, model_path: str, run_dir: Path, ranks: Ranks, stack,
                  reward: Optional[RewardBackend] = None) -> tuple[ReferenceBackend, RewardBackend]:
    """The run's reference and reward backends, closed by ``stack`` (an ``ExitStack``); data parallel,
    the worker owner's (:func:`worker_owner`) llama.cpp workers serve the other ranks too."""
    from homerlhf.stages.scorers import build_reference, build_reward

    owner = worker_owner(cfg, ranks)
    reference = shared = None
    if reward is not None:
        stack.callback(reward.close)
    if ranks.rank == owner:
        reference = build_reference(cfg, policy, model_path, run_dir)
        stack.callback(reference.close)
        if reward is None:
            reward = build_reward(cfg, policy.tokenizer, run_dir, policy)
            stack.callback(reward.close)
        shared = (endpoint(reference), endpoint(reward))
    if ranks.distributed:
        shared = ranks.gather(shared)[owner]
    if reference is None:
        reference = (connect_to("ref", shared[0], cfg, policy.tokenizer) if shared[0]
                     else build_reference(cfg, policy, model_path, run_dir))
        stack.callback(reference.close)
    if reward is None:
        reward = (connect_to("reward", shared[1], cfg, policy.tokenizer) if shared[1]
                  else build_reward(cfg, policy.tokenizer, run_dir, policy))
        stack.callback(reward.close)
    return reference, reward


# -- launching ------------------------------------------------------------------------------------
def launched() -> bool:
    """True inside a process started by ``accelerate launch`` / torchrun."""
    return "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A free TCP port on this host for the process group's rendezvous (accelerate's default, 29500,
    collides with any other run on the host)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(cfg: RunConfig, cli_args: list[str], port: int) -> tuple[list[str], dict[str, str]]:
    """``accelerate launch`` of ``homerlhf <cli_args>`` on ``cfg.distributed.gpus`` processes on this
    host (DDP: ``--multi_gpu``), and its environment. On a CPU card the processes use gloo
    (``ACCELERATE_USE_CPU``; accelerate's own ``--cpu`` multi-process mode wants mpirun)."""
    import sys

    n = cfg.distributed.gpus
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
           "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = dict(os.environ)
    if cfg.card.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    return cmd + ["-m", "homerlhf.cli", *cli_args], env


def relaunch(cfg: RunConfig, cli_args: list[str]) -> None:
    """Replace this process by ``accelerate launch`` of the same command on ``distributed.gpus``
    processes (exec: the launcher keeps this pid, so a signal to it reaches the run)."""
    if cfg.card.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.distributed.gpus:
            raise UserError(f"--gpus {cfg.distributed.gpus} but {torch.cuda.device_count()} CUDA GPU(s) are visible; "
                            "pass --gpus with at most that many (or check CUDA_VISIBLE_DEVICES)")
    check_processes(cfg, cfg.distributed.gpus)  # one line here, not one from each process launched
    cmd, env = launch_command(cfg, cli_args, free_port())
    sys_flush()
    os.execvpe(cmd[0], cmd, env)


def sys_flush() -> None:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
