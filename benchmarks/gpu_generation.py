#!/usr/bin/env python3
"""Rollout tokens/s on one GPU: HF generate at chunk 16, HF generate at the planned chunk and the
captured static loop (``rollout.decoder: static``) at the planned chunk, side by side with ratios;
whether the loop samples what HF samples; and a PPO iteration on the 4090 preset with each.

    python3 benchmarks/gpu_generation.py --out gpu_generation.json   # one GPU; ~3.5 min on an H200 (estimated:
                                                                      # scripts/gpu_session.sh's header)
    python3 benchmarks/gpu_generation.py --cpu                       # the demo's model and preset on the CPU
    python3 benchmarks/gpu_generation.py --cpu-smoke                 # the plumbing, on CPU, in seconds

For each model of ``--models`` (names from the planner's builtin table; nothing is downloaded) the
architecture is built from its published shape with random bf16 weights on the GPU and saved with
the tiny tokenizer (``homerlhf.check.runs.build_random_checkpoint``), then loaded through
``PolicyModel`` in NF4 with the actor/critic LoRA of the preset, as a run loads it; the process is
capped at ``--cap-gib`` (the 4090's 24 GiB). Prompts are random in-vocabulary ids of full length.
``--cpu``: the tiny Llama of the demo's shape (``builtin:tiny-llama``, random weights) with the
cpu-tiny preset, the loop run eagerly, at chunk 16 like HF generate, and ``--rounds`` interleaved
rounds of both (medians of wall and CPU seconds: a shared machine's load drifts between settings).

- Rates: each setting samples ``--measure-tokens`` and a quarter of that; the difference gives the
  seconds per decode step, the rest the fixed cost of a call (prefill). tokens/s = rows / (seconds per
  step). An untimed warm-up call at the longer length comes first: the loop builds its session there
  (the cache for the longest call, warm-up and capture) and every timed call replays that one
  captured step (each setting reports ``sessions_built`` in its timed calls, 0, and its
  ``captured_replays``, 0 when eager). The same attention path on both sides: the prompts are
  unpadded, so HF generate's sdpa gets no mask in a decode step and runs its GQA kernel, and the loop
  folds each KV head's query group (``homerlhf.models.decode_attention``): neither repeats K/V to every
  query head in a decode step (``kv_repeated_decode_layer_passes``: 0 when like for like). A prefill
  of more than ``rollout.prefill_tokens`` runs in column pieces, and every piece after the first has a
  mask, so HF's sdpa repeats K/V there, in both decoders alike (``kv_repeated_prefill_layer_passes``:
  (pieces - 1) x layers, 28 / 84 / 84 for a 28-layer model at 16 / 32 / 32 rows of 512 tokens, part of
  the fixed cost); ``kv_repeated_layer_passes`` is their sum.
- Agreement: the same prompts and per-sample seeds through HF generate and the loop: the share of rows
  whose tokens are all equal, the common prefix (bf16 kernels may differ between the two loops, and one
  flipped token changes the rest of the row), behaviour log-probs of both vs each other on that prefix,
  and the loop's behaviour log-probs vs the trainer's recomputed old log-probs (``is_weight_mean``).
- Iteration (``--iteration-models``): one PPO iteration (after a warm-up one) of ``--batch`` prompts
  with the loop at the planned chunk, reference ``adapter_off`` and a reward function in process (the
  preset's llama.cpp workers are not part of what is measured); HF generate's iteration at chunk 16 is
  predicted from it (its generation seconds replaced by HF's measured rate), or measured with
  ``--measure-hf-iteration`` (a 7B iteration with HF generate took 58-60 s on an H200).

The planned chunk is ``homerlhf.memory.chunks.planned_generation_chunk`` (imported when needed);
``--chunk N`` overrides it. JSON goes to ``--out`` (default ``$OUT/gpu_generation.json`` when ``$OUT``
is set). Figures only: nothing here fails on a slow result; a row with an error prints FAIL and
the exit status is 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # generation_rates, beside this file
from generation_rates import agreement, interleaved, rate  # noqa: E402
# Settings per mode; a flag given on the command line wins. GPU: the 4090 preset's 7B setting
# (512 + 256 tokens; the iteration of 32 prompts measured on an H200 before: docs/time.md).
PROFILES = {
    "gpu": dict(models="Qwen/Qwen2.5-1.5B,Qwen/Qwen2.5-7B", preset="4090", prompt_len=512, new_tokens=256,
                measure_tokens=64, batch=32, hf_chunk=16, chunk=None, agree_rows=8, agree_tokens=32,
                iteration_models="Qwen/Qwen2.5-7B", iteration_steps=2, rounds=0),
    # The demo's preset and model shape (builtin:tiny-llama) on the CPU, the eager loop against HF generate.
    "cpu": dict(models="builtin-tiny", preset="cpu-tiny", prompt_len=48, new_tokens=56, measure_tokens=56, batch=32,
                hf_chunk=16, chunk=16, agree_rows=16, agree_tokens=56, iteration_models="", iteration_steps=2,
                rounds=8),
    # The plumbing only: a 2-layer tiny Llama, a few tokens (tests/ppo/test_gpu_generation.py).
    "cpu_smoke": dict(models="builtin-tiny", preset="cpu-tiny", prompt_len=8, new_tokens=4, measure_tokens=4, batch=4,
                      hf_chunk=2, chunk=4, agree_rows=2, agree_tokens=4, iteration_models="builtin-tiny",
                      iteration_steps=1, rounds=1),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="Comma-separated builtin-table names.")
    ap.add_argument("--preset")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="Per-process GPU memory cap (GiB) and plan budget.")
    ap.add_argument("--chunk", type=int, help="Generation chunk for the planned settings (GPU default: the planner's).")
    ap.add_argument("--hf-chunk", type=int, help="The baseline HF generate chunk (the presets' 16).")
    ap.add_argument("--prompt-len", type=int, help="rollout.max_prompt_len; prompts are this long.")
    ap.add_argument("--new-tokens", type=int, help="rollout.max_new_tokens of the iteration.")
    ap.add_argument("--measure-tokens", type=int, help="New tokens per timed generation.")
    ap.add_argument("--batch", type=int, help="Prompts per PPO iteration.")
    ap.add_argument("--agree-rows", type=int, help="Rows of the agreement check.")
    ap.add_argument("--agree-tokens", type=int, help="New tokens of the agreement check.")
    ap.add_argument("--iteration-models", help="Models whose PPO iteration is run ('' none).")
    ap.add_argument("--iteration-steps", type=int, help="PPO iterations run; the last is reported (the first "
                    "creates optimizer states).")
    ap.add_argument("--measure-hf-iteration", action="store_true", help="Also run HF generate's iteration at --hf-chunk.")
    ap.add_argument("--rounds", type=int, help="Interleaved rounds of HF generate and the loop at the planned chunk "
                    "(medians: robust to a machine whose load drifts; 0: none).")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    ap.add_argument("--cpu", action="store_true", help="On the CPU: the demo's preset and model shape, eager loop.")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny builtin model on CPU, eager loop, a few tokens.")
    ap.add_argument("--out", type=Path, default=None, help="JSON output.")
    args = ap.parse_args(argv)
    args.mode = "cpu_smoke" if args.cpu_smoke else "cpu" if args.cpu else "gpu"
    for key, value in PROFILES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path(os.environ["OUT"]) / "gpu_generation.json" if os.environ.get("OUT") else Path("gpu_generation.json")
    return args


# -- building and loading --------------------------------------------------------------------------------
def build_checkpoint(name: str, tmp: Path, mode: str) -> Path:
    """A random-weight checkpoint of ``name``'s shape (GPU), or the tiny Llama of the demo's shape (CPU;
    smoke: 2 layers, hidden 64)."""
    if mode != "gpu":
        from homerlhf.tiny import build_causal_lm

        return build_causal_lm(tmp / "tiny", arch="llama", seed=0, **(dict(hidden=64, layers=2) if mode == "cpu_smoke" else {}))
    from homerlhf.check.runs import build_random_checkpoint
    from homerlhf.memory.shapes import resolve_shape

    return build_random_checkpoint(resolve_shape(name), tmp / name.replace("/", "--"), seed=0)


def run_config(args, model_dir: Path, overrides=()):
    from homerlhf.config import load_config

    return load_config(args.preset, overrides=[
        f"model.name_or_path={model_dir}", f"rollout.max_prompt_len={args.prompt_len}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.batch_size={args.batch}",
        "ref.backend=adapter_off", "reward.backend=hf", "reward.model=in-process",
        "logging.tensorboard=false", "logging.progress=false", *overrides])


def planned_chunk(args, cfg, model_dir: Path) -> tuple[int, str]:
    """The generation chunk to compare at, and where it came from."""
    if args.chunk is not None:
        return args.chunk, "--chunk"
    from homerlhf.memory.chunks import planned_generation_chunk
    from homerlhf.memory.shapes import resolve_shape

    return int(planned_generation_chunk(cfg, resolve_shape(str(model_dir)), args.cap_gib)), "planner"


# -- measuring (the rates, interleaved rounds and agreement: generation_rates.py) ---------------------------
def iteration_figures(policy, cfg, prompts, decoder: str, chunk: int, steps: int) -> dict:
    """Seconds of the last of ``steps`` PPO iterations (the first creates optimizer states) with
    ``decoder`` at ``chunk``: reference adapter_off, a reward function in process."""
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything

    chunk = min(chunk, cfg.rollout.batch_size)
    run_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"decoder": decoder, "chunk_size": chunk})})
    seed_everything(0)
    reward = CallableReward(lambda p, r: float(len(r)) / cfg.rollout.max_new_tokens)
    trainer = RLTrainer(run_cfg, policy, Backends(AdapterOffReference(policy), reward), prompts[: cfg.rollout.batch_size])
    rows = [trainer.step() for _ in range(steps)]
    keys = ("time_iteration_s", "time_generation_s", "time_scoring_s", "time_update_s", "rollout_chunk_size",
            "is_weight_mean", "response_length_mean")
    return {"decoder": decoder, "chunk": chunk, "iterations": steps, "first": {k: rows[0].get(k) for k in keys},
            **{k: rows[-1].get(k) for k in keys}}


def predicted_hf_iteration(static_iteration: dict, hf_rate: dict, batch: int, new_tokens: int) -> dict:
    """HF generate's iteration at its chunk: the loop's iteration with its generation seconds replaced
    by HF's, chunks x (fixed + new tokens x seconds per step), from HF's measured rate."""
    chunks = -(-batch // hf_rate["rows"])
    generation = chunks * (hf_rate["fixed_seconds"] + new_tokens * hf_rate["seconds_per_step"])
    total = static_iteration["time_iteration_s"] - static_iteration["time_generation_s"] + generation
    return {"decoder": "hf", "chunk": hf_rate["rows"], "predicted": True, "time_generation_s": round(generation, 3),
            "time_iteration_s": round(total, 3)}


def guarded(fn, *args) -> dict:
    """``fn(*args)``, or the error as a result (an OOM at one setting is a figure, not a crash)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        from homerlhf.memory.oom import is_oom

        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return {"error": f"{'OOM' if is_oom(exc) else type(exc).__name__}: {first}"}
    finally:
        gc.collect()
        _empty_cache()


def _empty_cache(workspaces: bool = False) -> None:
    """Hand cached CUDA blocks back; ``workspaces``: free every cuBLAS workspace first (32 MiB per
    handle and stream on an H200; a model's decode side stream leaves one), only once no captured
    graph is alive (a graph replays with the workspace it was captured with)."""
    import torch

    if torch.cuda.is_available():
        if workspaces:
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def run_model(name: str, args, tmp: Path) -> dict:
    import torch

    from homerlhf.models.policy import PolicyModel

    started = time.perf_counter()
    model_dir = build_checkpoint(name, tmp, args.mode)
    cfg = run_config(args, model_dir, args.extra)
    chunk, source = planned_chunk(args, cfg, model_dir)
    policy = PolicyModel.from_config(cfg, str(model_dir))
    row = {"model": name, "planned_chunk": chunk, "chunk_source": source, "build_load_s": round(time.perf_counter() - started, 1)}
    gen = torch.Generator().manual_seed(0)
    rows_needed = max(chunk, args.hf_chunk, args.batch, args.agree_rows)
    prompts = torch.randint(8, len(policy.tokenizer), (rows_needed, args.prompt_len), generator=gen).tolist()
    settings = {f"hf@{args.hf_chunk}": ("hf", args.hf_chunk), f"hf@{chunk}": ("hf", chunk), f"static@{chunk}": ("static", chunk)}
    row["rates"] = {label: guarded(rate, policy, cfg, decoder, rows, prompts, args.measure_tokens)
                    for label, (decoder, rows) in settings.items()}
    base = row["rates"][f"hf@{args.hf_chunk}"].get("tokens_per_s")
    row["speedup_vs_hf_chunk"] = {label: round(r["tokens_per_s"] / base, 2) for label, r in row["rates"].items()
                                  if base and r.get("tokens_per_s")}
    if args.rounds:
        row["interleaved"] = guarded(interleaved, policy, cfg, prompts, chunk, args.measure_tokens, args.rounds)
    row["agreement"] = guarded(agreement, policy, cfg, prompts, args.agree_rows, args.agree_tokens)
    if name in [m.strip() for m in args.iteration_models.split(",")]:
        row["iteration"] = {"static": guarded(iteration_figures, policy, cfg, prompts, "static", chunk,
                                             args.iteration_steps)}
        hf_rate = row["rates"][f"hf@{args.hf_chunk}"]
        if args.measure_hf_iteration:
            row["iteration"]["hf"] = guarded(iteration_figures, policy, cfg, prompts, "hf", args.hf_chunk,
                                                 args.iteration_steps)
        elif "error" not in row["iteration"]["static"] and "error" not in hf_rate:
            row["iteration"]["hf"] = predicted_hf_iteration(row["iteration"]["static"], hf_rate, args.batch,
                                                            args.new_tokens)
    del policy
    gc.collect()  # bitsandbytes' Params4bit.module -> Linear4bit cycle: only then is the next model's memory free
    _empty_cache(workspaces=True)  # the policy and its captured graphs are gone: its side stream's workspace too
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def failed(row: dict) -> bool:
    """Whether a setting, the agreement check or an iteration of ``row`` ended in an error."""
    parts = [*row["rates"].values(), row.get("agreement", {}), row.get("interleaved", {}), *row.get("iteration", {}).values()]
    return any("error" in part for part in parts)


def summary_line(row: dict) -> str:
    """The model in one line: tokens/s of each setting, then the PPO iteration's seconds by decoder."""
    rates = "; ".join(f"{label} {r['error']}" if "error" in r else f"{label} {r['tokens_per_s'] or 0:.0f} tokens/s"
                      for label, r in row["rates"].items())
    iterations = "; ".join(f"iteration {d} {it['error']}" if "error" in it else
                           f"iteration {d} {it['time_iteration_s']:.1f} s" + (" (predicted)" if it.get("predicted") else "")
                           for d, it in row.get("iteration", {}).items())
    return f"{'FAIL' if failed(row) else 'ok  '} {row['model']}  {row['seconds']:.1f} s; {rates}" + (
        f"; {iterations}" if iterations else "")


def print_model(row: dict) -> None:
    print(f"\n{row['model']}: planned chunk {row['planned_chunk']} ({row['chunk_source']}), built and loaded in "
          f"{row['build_load_s']} s")
    print(f"  {'setting':<14} {'rows':>5} {'ms/step':>9} {'fixed s':>8} {'tokens/s':>9} {'vs hf@chunk':>12} "
          f"{'CPU ms/step':>12} {'K/V rep. decode/prefill':>24} {'replays':>8}")
    for label, r in row["rates"].items():
        if "error" in r:
            print(f"  {label:<14} {r['error']}")
            continue
        print(f"  {label:<14} {r['rows']:5d} {r['seconds_per_step'] * 1e3:9.1f} {r['fixed_seconds']:8.2f} "
              f"{r['tokens_per_s'] or float('nan'):9.1f} {row['speedup_vs_hf_chunk'].get(label, float('nan')):11.2f}x "
              f"{r['cpu_seconds_per_step'] * 1e3:12.1f} "
              f"{str(r['kv_repeated_decode_layer_passes']) + ' / ' + str(r['kv_repeated_prefill_layer_passes']):>24} "
              f"{r['captured_replays']:8d}")
    if "interleaved" in row:
        i = row["interleaved"]
        print(f"  interleaved: {i['error']}" if "error" in i else
              f"  interleaved ({i['rounds']} rounds, {i['rows']} rows x {i['tokens']} tokens, medians): hf {i['hf_wall_s']:.2f} s "
              f"wall / {i['hf_cpu_s']:.2f} s CPU, static {i['static_wall_s']:.2f} / {i['static_cpu_s']:.2f}: static "
              f"{i['static_vs_hf_wall']:.2f}x (wall), {i['static_vs_hf_cpu']:.2f}x (CPU); samples equal: {i['samples_equal']}")
    a = row["agreement"]
    if "error" in a:
        print(f"  agreement: {a['error']}")
    else:
        print(f"  agreement (same seeds, {a['rows']} rows x {a['tokens']} tokens): {a['rows_all_equal']}/{a['rows']} rows "
              f"equal, mean common prefix {a['mean_common_prefix']}, max |behaviour hf - static| on it "
              f"{a['max_behaviour_gap_on_prefix']:.3g}; static behaviour vs trainer old: max |d| "
              f"{a['max_behaviour_vs_old']:.3g}, is_weight_mean {a['is_weight_mean']:.4f}, kl {a['kl_behaviour_old']:.2e}")
    for decoder, it in row.get("iteration", {}).items():
        if "error" in it:
            print(f"  PPO iteration, {decoder}: {it['error']}")
            continue
        how = "predicted from its generation rate" if it.get("predicted") else "measured"
        print(f"  PPO iteration, {decoder} @ chunk {it['chunk']}: {it['time_iteration_s']:.2f} s "
              f"(generation {it['time_generation_s']:.2f} s), {how}")
    its = row.get("iteration", {})
    if all(k in its and "error" not in its[k] for k in ("hf", "static")):
        print(f"  iteration speedup: {its['hf']['time_iteration_s'] / its['static']['time_iteration_s']:.2f}x")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    args.extra = ["ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "ppo.epochs=1"] if args.cpu_smoke else []
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "gpu" and not torch.cuda.is_available():
        print("error: gpu_generation.py needs a CUDA GPU and none is visible (--cpu-smoke runs the plumbing on CPU)",
              file=sys.stderr)
        sys.exit(2)
    if args.mode == "gpu":
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib / total))
    import transformers

    report = {"device": torch.cuda.get_device_name(0) if args.mode == "gpu" else "cpu", "mode": args.mode,
              "torch_threads": torch.get_num_threads(), "cap_gib": args.cap_gib,
              "torch": torch.__version__, "transformers": transformers.__version__, "preset": args.preset,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "measure_tokens": args.measure_tokens,
              "batch": args.batch, "models": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="homerlhf-gpugen-") as tmp:
        for name in [n.strip() for n in args.models.split(",") if n.strip()]:
            row = run_model(name, args, Path(tmp))
            report["models"].append(row)
            report["seconds"] = round(time.perf_counter() - started, 1)
            args.out.write_text(json.dumps(report, indent=2))  # partial results survive a later crash
            print_model(row)
            print(summary_line(row), flush=True)
    failures = [row["model"] for row in report["models"] if failed(row)]
    print(f"\nwrote {args.out} ({report['seconds']} s)" + (f"; FAIL: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
