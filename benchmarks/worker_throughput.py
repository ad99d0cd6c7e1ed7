"""Throughput of the llama.cpp ref worker, and how much CPU scoring overlaps GPU-side work.

1. tokens/s for the same model and inputs: through the HTTP worker (a subprocess, JSON over
   127.0.0.1) and bare llama.cpp in-process (the worker's own packed-batch engine, no HTTP), side by
   side with their ratio; plus llama-cpp-python's high-level ``Llama.eval``, one sequence at a time.
2. The overlap figure: iteration wall time vs the sum and the max of GPU-side and CPU-side busy
   time, measured twice: in a loop that submits each chunk to the worker and then does torch work
   while the worker scores; and in the trainer's own rollout stage (``collect_experience``: actor
   generation and log-probs/values on the tiny NF4 model, ref + reward workers; CPU-side busy is the
   compute time the workers report in ``/health``). ``--metrics RUN_DIR/metrics.jsonl`` also prints
   a finished run's stage timings.

    python benchmarks/worker_throughput.py [--model HF_DIR|builtin:tiny-llama] [--threads 2]

Prints figures; never a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from homerlhf.workers.bench import best_seconds  # best of `repeat` calls after a warm-up


def make_inputs(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(response_len)] for _ in range(n)]
    return prompts, responses


def throughput(gguf: Path, prompts, responses, threads: int, ctx: int, repeat: int) -> dict:
    from llama_cpp import Llama

    from homerlhf.workers.backends import connect
    from homerlhf.workers.engine import Engine
    from homerlhf.workers.process import WorkerProcess

    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    pairs = list(zip(prompts, responses))

    engine = Engine("ref", gguf, threads=threads, ctx=ctx)
    bare_s = best_seconds(lambda: engine.logprobs(pairs), repeat)
    del engine

    llm = Llama(str(gguf), logits_all=True, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def one_by_one():
        for p, r in pairs:
            llm.reset()
            llm.eval(p + r)

    single_s = best_seconds(one_by_one, repeat)
    llm.close()

    backend = connect("ref", process=WorkerProcess("ref", gguf, threads=threads, ctx=ctx))
    try:
        http_s = best_seconds(lambda: backend.logprobs(prompts, responses), repeat)
    finally:
        backend.close()
    return {"tokens": tokens, "bare_s": bare_s, "http_s": http_s, "single_s": single_s}


def overlap_loop(gguf: Path, prompts, responses, threads: int, ctx: int, chunk: int, torch_ms: float) -> dict:
    """Per chunk: submit to the worker, then torch work for ``torch_ms``; wait for all at the end.

    CPU-side busy time is the time the worker takes to score all chunks alone (measured first)."""
    import torch

    from homerlhf.workers.backends import connect
    from homerlhf.workers.process import WorkerProcess

    backend = connect("ref", process=WorkerProcess("ref", gguf, threads=threads, ctx=ctx))
    a = torch.randn(256, 256)
    try:
        backend.logprobs(prompts[:chunk], responses[:chunk])  # warm-up
        t0 = time.perf_counter()
        for start in range(0, len(prompts), chunk):
            backend.logprobs(prompts[start:start + chunk], responses[start:start + chunk])
        cpu_busy = time.perf_counter() - t0
        gpu_busy = 0.0
        started = time.perf_counter()
        futures = []
        for start in range(0, len(prompts), chunk):
            futures.append(backend.submit_logprobs(prompts[start:start + chunk], responses[start:start + chunk]))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < torch_ms / 1000:
                a = torch.tanh(a @ a / 256)
            gpu_busy += time.perf_counter() - t0
        for future in futures:
            future.result()
        wall = time.perf_counter() - started
    finally:
        backend.close()
    return {"wall_s": wall, "gpu_busy_s": gpu_busy, "cpu_busy_s": cpu_busy}


def trainer_rollout_overlap(model_dir: str, work: Path, batch_size: int, chunk: int, threads: int) -> None:
    """The trainer's own rollout stage (``collect_experience``) with llama.cpp ref and reward workers.

    GPU-side busy: generation + old log-probs/values (the trainer's stage timings); CPU-side busy:
    the compute time the two workers report in ``/health`` (``busy_s``)."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel, load_tokenizer
    from homerlhf.ppo.backends import Backends
    from homerlhf.ppo.collect import Prompts, collect_experience
    from homerlhf.ppo.meters import Meters
    from homerlhf.stages.ppo import load_prompt_ids
    from homerlhf.tiny import build_sequence_classifier
    from homerlhf.workers.backends import llamacpp_reference, llamacpp_reward

    rm_dir = build_sequence_classifier(work / "tiny-rm", arch="llama", seed=1)
    cfg = load_config("cpu-tiny", None, [
        f"model.name_or_path={model_dir}", f"reward.model={rm_dir}", f"rollout.batch_size={batch_size}",
        f"rollout.chunk_size={chunk}", f"ppo.mini_batch_size={chunk}", f"ppo.micro_batch_size={chunk}",
        f"ref.threads={threads}", f"reward.threads={threads}",
    ])
    tokenizer = load_tokenizer(model_dir)
    policy = PolicyModel.from_config(cfg, model_dir, tokenizer=tokenizer)
    prompts = load_prompt_ids(cfg, tokenizer)[:batch_size]
    reference = llamacpp_reference(cfg, model_dir, tokenizer, work / "run")
    reward = llamacpp_reward(cfg, tokenizer, work / "run")
    try:
        collect_experience(policy, Prompts(prompts[:chunk]), cfg, Backends(reference, reward))  # warm-up
        busy0 = reference.health()["busy_s"] + reward.health()["busy_s"]
        meters = Meters()
        started = time.perf_counter()
        collect_experience(policy, Prompts(prompts), cfg, Backends(reference, reward), meters=meters)
        wall = time.perf_counter() - started
        ref_busy, rm_busy = reference.health()["busy_s"], reward.health()["busy_s"]
    finally:
        reference.close()
        reward.close()
    times = meters.times
    gpu = times.generation + times.scoring
    cpu = ref_busy + rm_busy - busy0
    print(f"\ntrainer rollout stage (collect_experience, {batch_size} prompts in chunks of {chunk}, NF4 tiny Llama on {cfg.card.device}):")
    print(f"  GPU-side busy {gpu:.3f} s (generation {times.generation:.3f} + log-probs/values {times.scoring:.3f}), "
          f"CPU-side busy {cpu:.3f} s (ref + reward workers), wait after the last chunk {times.reference_reward_wait:.3f} s")
    print(f"  iteration wall {wall:.3f} s vs sum {gpu + cpu:.3f} s and max {max(gpu, cpu):.3f} s")


def trainer_overlap(metrics: Path) -> None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time_generation_s" in r]
    if not rows:
        print(f"{metrics}: no stage timings (time_generation_s) found")
        return
    print(f"\ntrainer stage timings from {metrics} ({len(rows)} iterations, mean):")
    mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in
            ("time_generation_s", "time_scoring_s", "time_reference_reward_wait_s", "time_iteration_s")}
    gpu = mean["time_generation_s"] + mean["time_scoring_s"]
    wait = mean["time_reference_reward_wait_s"]
    print(f"  GPU-side (generation + old log-probs/values) {gpu:8.3f} s")
    print(f"  waiting for ref/reward after the last chunk  {wait:8.3f} s  (0 = CPU scoring fully hidden)")
    print(f"  iteration wall                               {mean['time_iteration_s']:8.3f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF causal LM dir or builtin:<name> (default: a tiny Llama built here)")
    parser.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=16, help="samples per submit in the overlap loop")
    parser.add_argument("--torch-ms", type=float, default=0.0, help="GPU-side work per chunk (0: as long as a chunk's scoring)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trainer-batch", type=int, default=8, help="prompts in the trainer rollout measurement")
    parser.add_argument("--trainer-chunk", type=int, default=4, help="chunk size in the trainer rollout measurement")
    parser.add_argument("--metrics", type=Path, default=None, help="a trainer's metrics.jsonl for its stage timings")
    args = parser.parse_args(argv)

    from homerlhf.workers.gguf import export_ref

    tmp = Path(tempfile.mkdtemp(prefix="homerlhf-bench-"))
    model = args.model
    if model is None:
        from homerlhf.tiny import build_causal_lm

        model = str(build_causal_lm(tmp / "tiny-llama", arch="llama"))
    gguf = export_ref(model, tmp / "ref.gguf", outtype=args.outtype)
    from homerlhf.workers.engine import read_gguf_info

    vocab = read_gguf_info(gguf).tokenizer_size
    ctx = args.prompt_len + args.response_len
    prompts, responses = make_inputs(args.samples, args.prompt_len, args.response_len, vocab)

    r = throughput(gguf, prompts, responses, args.threads, ctx, args.repeat)
    print(f"model {model} ({args.outtype}), {args.samples} sequences x {ctx} tokens, {args.threads} threads, best of {args.repeat}")
    print(f"{'path':<46}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'bare llama.cpp, packed batches, in-process':<46}{r['bare_s']:>10.3f}{r['tokens'] / r['bare_s']:>12.0f}")
    print(f"{'HTTP worker (subprocess, JSON, 16 seq/request)':<46}{r['http_s']:>10.3f}{r['tokens'] / r['http_s']:>12.0f}")
    print(f"{'llama-cpp-python Llama.eval, one sequence each':<46}{r['single_s']:>10.3f}{r['tokens'] / r['single_s']:>12.0f}")
    print(f"HTTP worker / bare llama.cpp throughput ratio: {r['bare_s'] / r['http_s']:.2f}")

    torch_ms = args.torch_ms or 1000 * r["http_s"] * args.chunk / args.samples
    o = overlap_loop(gguf, prompts, responses, args.threads, ctx, args.chunk, torch_ms)
    print(f"\noverlap loop: {args.samples // args.chunk} chunks, {torch_ms:.0f} ms torch work per chunk while the worker scores")
    print(f"  GPU-side busy {o['gpu_busy_s']:.3f} s, CPU-side busy {o['cpu_busy_s']:.3f} s")
    print(f"  iteration wall {o['wall_s']:.3f} s vs sum {o['gpu_busy_s'] + o['cpu_busy_s']:.3f} s and max "
          f"{max(o['gpu_busy_s'], o['cpu_busy_s']):.3f} s (wall near max = full overlap; near sum = none)")
    print("  note: on a CPU-only machine the 'GPU-side' torch work competes with llama.cpp for the same cores")
    try:
        import homerlhf.ppo.collect  # noqa: F401  the trainer's rollout stage, when it is built
    except ImportError:
        print("\n(the PPO trainer is not available: trainer rollout overlap skipped)")
    else:
        if args.model is None:
            trainer_rollout_overlap(model, tmp, args.trainer_batch, args.trainer_chunk, args.threads)
        else:
            print("\n(trainer rollout overlap runs on the tiny model only: omit --model)")
    if args.metrics:
        trainer_overlap(args.metrics)


if __name__ == "__main__":
    sys.exit(main())
