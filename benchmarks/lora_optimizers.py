#!/usr/bin/env python3
"""The actor's optimizer for LoRA-sized states: torch AdamW (foreach, fused) beside bitsandbytes' 8-bit
AdamW (paged and not), on the LoRA matrices of a real shape, side by side (a benchmark, not a test).

    python3 benchmarks/lora_optimizers.py [--model Qwen/Qwen2.5-7B] [--preset 4090] [--steps 5] [--threads 1]

For every LoRA matrix the preset's actor adapter puts on the model (``actor.lora``: rank, targets; the
shape from the planner's builtin table, nothing downloaded) an fp32 parameter with a random gradient,
then per optimizer: the bytes of its states after a step (beside the planner's
``homerlhf.memory.components:adam_state_bytes``), the median seconds of ``--steps`` steps after a
warm-up one (bitsandbytes' again with its update kernels replaced by nothing: the host's own part of
its step, one parameter at a time, which a GPU does not take off it) and the ``torch.cuda.synchronize()`` calls a step would make on a GPU: bitsandbytes 0.50's
``Optimizer8bit.step`` calls ``bitsandbytes.utils.sync_gpu(p)`` after every parameter, and once more
at the end when paged (``bitsandbytes/optim/optimizer.py``); counted here by wrapping it (on the CPU it
returns at once). CPU seconds say what the host spends per step, not what a GPU would.
"""

from __future__ import annotations

import argparse
import statistics
import time


def lora_params(model: str, preset: str):
    """The actor's LoRA matrices (A: r x in, B: out x r, every targeted linear of every layer), fp32,
    each with a random gradient; and the config."""
    import torch

    from homerlhf.config import load_config
    from homerlhf.memory.shapes import builtin_shape

    cfg = load_config(preset, overrides=[f"model.name_or_path={model}"])
    shape, lora = builtin_shape(model), cfg.actor.lora
    linears = [lin for lin in shape.layer_linears()
               if lora.target_modules == "all-linear" or lin.name in set(lora.target_modules)]
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(shape.num_layers):
        for lin in linears:
            for rows, cols in ((lora.r, lin.in_features), (lin.out_features, lora.r)):
                p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen) * 0.01)
                p.grad = torch.randn(rows, cols, generator=gen) * 1e-3
                params.append(p)
    return cfg, shape, params


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if hasattr(v, "element_size"))


def measure(name: str, make, params, steps: int) -> dict:
    import bitsandbytes.optim.optimizer as bnb_optimizer

    syncs = []
    real = bnb_optimizer.sync_gpu

    def counted(t):
        syncs.append(1)
        return real(t)

    bnb_optimizer.sync_gpu = counted
    try:
        optimizer = make(params)
        optimizer.step()  # creates the states
        before = len(syncs)
        seconds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - t0)
    finally:
        bnb_optimizer.sync_gpu = real
    return {"optimizer": name, "state_bytes": state_bytes(optimizer), "step_s": statistics.median(seconds),
            "syncs_per_step": (len(syncs) - before) / steps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B")
    ap.add_argument("--preset", default="4090")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    import warnings

    import torch

    from homerlhf.memory.components import adam_state_bytes
    from homerlhf.ppo.update import build_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    cfg, shape, params = lora_params(args.model, args.preset)
    lr, wd = cfg.actor.lr, 0.0
    makers = {
        "adamw (torch, foreach)": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, foreach=True),
        "adamw (torch, fused)": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, fused=True),
        "adamw_8bit (bitsandbytes)": lambda ps: build_optimizer("adamw_8bit", ps, lr, wd),
        "paged_adamw_8bit (bitsandbytes)": lambda ps: build_optimizer("paged_adamw_8bit", ps, lr, wd),
    }
    print(f"{args.model}, preset {args.preset}: actor LoRA r {cfg.actor.lora.r} ({cfg.actor.lora.target_modules}), "
          f"{len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.1f} M parameters; torch threads "
          f"{torch.get_num_threads()}")
    table(makers, params, args.steps, adam_state_bytes)
    # The host's own part of a bitsandbytes step, which a GPU does not take off it: the same steps with
    # its update kernels replaced by nothing (on the CPU they are torch arithmetic, on a GPU one launch
    # each), so what is left is its Python per parameter: configs, prefetch, contiguity, dispatch.
    import bitsandbytes.functional as F

    kernels = {name: getattr(F, name) for name in ("optimizer_update_8bit_blockwise", "optimizer_update_32bit")}
    for name in kernels:
        setattr(F, name, lambda *a, **k: None)
    try:
        print("\nbitsandbytes' host part (its update kernels replaced by nothing):")
        for name in ("adamw_8bit (bitsandbytes)", "paged_adamw_8bit (bitsandbytes)"):
            r = measure(name, makers[name], params, args.steps)
            print(f"{name:<34} {r['step_s'] * 1e3:8.1f} ms a step, {r['step_s'] / len(params) * 1e6:6.1f} us a tensor, "
                  f"{r['syncs_per_step']:.0f} device syncs a step on a GPU")
    finally:
        for name, fn in kernels.items():
            setattr(F, name, fn)


def table(makers: dict, params, steps: int, adam_state_bytes) -> None:
    numels = [p.numel() for p in params]
    print(f"{'optimizer':<34} {'state MiB':>10} {'planned MiB':>12} {'CPU ms/step':>12} {'vs fused':>9} "
          f"{'GPU syncs/step':>15}")
    rows = [measure(name, make, params, steps) for name, make in makers.items()]
    fused = next(r for r in rows if "fused" in r["optimizer"])
    for r in rows:
        planned = adam_state_bytes(numels, "adamw" if "torch" in r["optimizer"] else "paged_adamw_8bit")
        print(f"{r['optimizer']:<34} {r['state_bytes'] / 2**20:10.1f} {planned / 2**20:12.1f} "
              f"{r['step_s'] * 1e3:12.1f} {r['step_s'] / fused['step_s']:8.1f}x {r['syncs_per_step']:15.0f}")


if __name__ == "__main__":
    main()
