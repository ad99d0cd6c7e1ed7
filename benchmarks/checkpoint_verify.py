"""What checking a checkpoint against its MANIFEST costs, next to loading the same files.

For each checkpoint, side by side: the seconds ``homerlhf.ppo.checkpoint:verify_checkpoint`` takes
(every size, then every sha256; its per-process memo of hashes cleared before each try), the seconds
to load the same files as ``--resume`` does (safetensors ``load_file`` for ``.safetensors``,
``torch.load(weights_only=True)`` for ``.pt``, a plain read for the JSON and YAML), and the ratio.

- ``tiny``: a real checkpoint of the cpu-tiny demo's size (the builtin tiny Llama, hidden 128, 4
  layers; LoRA r 8 on every linear layer for the actor and the critic, the value head, AdamW
  states), written by ``save_checkpoint``;
- ``lora-40m``: a synthetic one of a 7B LoRA's size: the actor adapter of Qwen2.5-7B's shape (28
  layers, r 16 on all linear layers: 40.4M fp32 parameters, 162 MB of safetensors) and its AdamW
  moments (``optimizers.pt``, 323 MB).

Every file is read once before timing, so both columns read from the page cache: the figures are
the CPU's cost, not the disk's (from a cold disk both grow by the same read). Best of ``--repeat``.
Prints figures; never a test.

    python benchmarks/checkpoint_verify.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-7B: hidden, key/value width, MLP width, layers; a LoRA of rank 16 on every linear layer.
HIDDEN, KV, MLP, LAYERS, RANK = 3584, 512, 18944, 28, 16
PROJECTIONS = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
               "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, MLP), "mlp.up_proj": (HIDDEN, MLP),
               "mlp.down_proj": (MLP, HIDDEN)}


def tiny_checkpoint(root: Path) -> Path:
    """A real checkpoint of the cpu-tiny demo's shape, as the trainer writes it."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.checkpoint import RunState, save_checkpoint
    from homerlhf.tiny import build_causal_lm

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "quant.load_in_4bit=false"])
    policy = PolicyModel.from_config(cfg, str(build_causal_lm(root / "model", arch="llama", seed=0)))
    optimizers = {"actor": torch.optim.AdamW(policy.actor_parameters(), lr=1e-3),
                  "critic": torch.optim.AdamW(policy.critic_parameters(), lr=1e-3)}
    for opt in optimizers.values():  # one step, so the moments exist
        params = [p for group in opt.param_groups for p in group["params"]]
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
    return save_checkpoint(root / "tiny-run", 1, RunState(policy, optimizers, counters={"data_cursor": 0}), cfg)


def lora_40m_checkpoint(root: Path) -> Path:
    """A checkpoint directory holding a 7B-sized actor adapter and its AdamW moments, sealed by the
    same manifest writer as a real one."""
    from safetensors.torch import save_file

    from homerlhf.ppo.manifest import write_manifest

    ckpt = root / "lora-run" / "checkpoints" / "iter_000001"
    (ckpt / "actor").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for name, (d_in, d_out) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, d_in, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, RANK, generator=generator)
    save_file(tensors, str(ckpt / "actor" / "adapter_model.safetensors"))
    (ckpt / "actor" / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": 2 * RANK}))
    state = {i: {"step": torch.tensor(1.0), "exp_avg": t * 1e-3, "exp_avg_sq": t * t * 1e-6}
             for i, t in enumerate(tensors.values())}
    optimizer = {"state": state, "param_groups": [{"lr": 1e-4, "params": list(state)}]}
    torch.save({"actor": optimizer}, ckpt / "optimizers.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": 1}))
    write_manifest(ckpt, 1)
    return ckpt


def load_files(ckpt: Path, names: list[str]) -> None:
    from safetensors.torch import load_file

    for rel in names:
        path = ckpt / rel
        if path.suffix == ".safetensors":
            load_file(str(path))
        elif path.suffix == ".pt":
            torch.load(path, map_location="cpu", weights_only=True)
        else:
            path.read_bytes()


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(name: str, ckpt: Path, repeat: int) -> dict:
    from homerlhf.ppo import manifest
    from homerlhf.ppo.checkpoint import verify_checkpoint

    names = sorted(manifest.read_manifest(ckpt)["files"])
    size = sum((ckpt / rel).stat().st_size for rel in names)
    load_files(ckpt, names)  # into the page cache

    def verify():
        manifest._HASHES.clear()  # hash every file again, as a fresh process does
        verify_checkpoint(ckpt)

    verify_s, load_s = best_of(repeat, verify), best_of(repeat, lambda: load_files(ckpt, names))
    return {"name": name, "files": len(names), "mb": size / 1e6, "verify_s": verify_s, "load_s": load_s}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = [measure("tiny", tiny_checkpoint(root), args.repeat),
                measure("lora-40m", lora_40m_checkpoint(root), args.repeat)]
    print(f"{'checkpoint':<10} {'files':>5} {'MB':>8} {'verify s':>9} {'load s':>8} {'verify/load':>11} "
          f"{'sha256 MB/s':>11}")
    for r in rows:
        print(f"{r['name']:<10} {r['files']:>5} {r['mb']:>8.1f} {r['verify_s']:>9.4f} {r['load_s']:>8.4f} "
              f"{r['verify_s'] / r['load_s']:>11.2f} {r['mb'] / r['verify_s']:>11.0f}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {torch.get_num_threads()} thread; "
          "files in the page cache, best of", args.repeat)


if __name__ == "__main__":
    main()
