"""Predicted vs measured seconds per phase of a PPO iteration, on this machine's CPU.

For each model, ``homerlhf bench`` measures its throughputs (full mode, every thread share), the time
model (:mod:`homerlhf.memory.timing`) predicts each phase for each placement, and the real trainer
(``RLTrainer.step``, real llama.cpp workers, the NF4 policy) runs the same iterations. Models:

- ``cpu-tiny``: the embedded preset's settings on ``builtin:tiny-llama`` (the shape of the demo's
  SFT model, random init: its responses run to full length, as the time model counts them);
- ``qwen3-0.6b-6l``: Qwen3-0.6B's shape (hidden 1024, 16/8 heads, vocabulary 151,936, tied) trimmed
  to 6 layers, random init, with the real Qwen3 tokenizer (tests/fixtures): 250 M parameters.

Placements: ref and reward on llama.cpp workers; ref ``adapter_off`` + reward worker; ref
``adapter_off`` + reward ``hf`` (in process, the trainer's device). Measured per phase: generation
and update (the trainer's stage timings), reference and reward (each call's service time:
llama.cpp requests over HTTP, or the in-process forward), old log-probs / values (the scoring stage
minus the in-sequence ref/reward work), the iteration (rollout stage + advantages + update).
Each placement runs ``--iterations`` after one warm-up iteration; the figures are their mean.

    python benchmarks/iteration_time.py [--models cpu-tiny,qwen3-0.6b-6l] [--iterations 2] [--force-bench]

Prints figures; never a test. The machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import lzma
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = [("llamacpp", "llamacpp"), ("adapter_off", "llamacpp"), ("adapter_off", "hf")]
COMMON = ["ref.from_nf4=true"]
MODELS = {
    "cpu-tiny": {"overrides": []},  # the preset's batch 32, chunk 16, 48 + 24 tokens, 2 epochs
    "qwen3-0.6b-6l": {"overrides": [
        "rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_prompt_len=32", "rollout.max_new_tokens=16",
        "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "ppo.epochs=1", "ppo.logprob_chunk_size=16",
        "ref.outtype=f16", "reward.outtype=f16"]},
}


# ---- models -------------------------------------------------------------------------------------------
def qwen3_tokenizer_dir(out: Path) -> Path:
    src = ROOT / "tests" / "fixtures" / "tokenizers" / "qwen3"
    out.mkdir(parents=True, exist_ok=True)
    for packed in src.glob("*.json.xz"):
        (out / packed.name.removesuffix(".xz")).write_bytes(lzma.decompress(packed.read_bytes()))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out


def build_models(name: str, work: Path) -> tuple[Path, Path]:
    """(policy dir, reward dir): random-init causal LM and sequence classifier of ``name``'s shape."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen3Config

    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.tiny import build_sequence_classifier

    if name == "cpu-tiny":
        policy = resolve_model_dir("builtin:tiny-llama")
        reward = work / "tiny-rm"
        if not (reward / "config.json").exists():
            build_sequence_classifier(reward, arch="llama", seed=1, tokenizer_dir=policy)
        return policy, reward
    tok_dir = qwen3_tokenizer_dir(work / "qwen3-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    dirs = []
    for kind, cls in (("policy", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)):
        out = work / f"qwen3-6l-{kind}"
        if not (out / "config.json").exists():
            torch.manual_seed(0)
            cfg = Qwen3Config.from_dict({**config.to_dict(), "num_labels": 1}) if kind == "reward" else config
            cls.from_config(cfg, dtype=torch.float32).save_pretrained(out)
            tokenizer.save_pretrained(out)
            if kind == "policy":
                shutil.copy(tok_dir / "generation_config.json", out / "generation_config.json")
        dirs.append(out)
    return dirs[0], dirs[1]


# ---- timing the backends ------------------------------------------------------------------------------
class Timed:
    """A reference or reward backend whose calls are timed: in the caller's thread when the backend
    computes there (``adapter_off``), else in a thread of its own, one request at a time (as the
    backends do). ``seconds``: service time of every call; ``sync_seconds``: the in-sequence part."""

    def __init__(self, inner, sync: bool):
        self.inner, self.sync = inner, sync
        self.seconds = self.sync_seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1)

    def _call(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        if self.sync:
            self.sync_seconds += elapsed
        return out

    def _run(self, fn, *args) -> Future:
        if not self.sync:
            return self._pool.submit(self._call, fn, *args)
        future: Future = Future()
        future.set_result(self._call(fn, *args))
        return future

    def submit_logprobs(self, prompts, responses):
        return self._run(self.inner.logprobs, prompts, responses)

    def submit_score(self, prompts, responses, rows=None):
        return self._run(self.inner.score_samples, prompts, responses, rows)

    def close(self):
        self._pool.shutdown()
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def measure(cfg, policy_dir: Path, prompts, iterations: int) -> dict[str, float]:
    """Mean seconds per phase over ``iterations`` real PPO iterations (after one warm-up)."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import Backends
    from homerlhf.ppo.trainer import RLTrainer
    from homerlhf.stages.ppo import trainer_threads
    from homerlhf.stages.scorers import build_reference, build_reward

    with tempfile.TemporaryDirectory(prefix="iteration-time-") as tmp, trainer_threads(cfg):
        policy = PolicyModel.from_config(cfg, str(policy_dir))
        ref = Timed(build_reference(cfg, policy, str(policy_dir), Path(tmp)), sync=cfg.ref.backend == "adapter_off")
        inner = build_reward(cfg, policy.tokenizer, Path(tmp))
        reward = Timed(inner, sync=inner.shares_policy or inner.on_trainer_cpu)  # as submit_score does
        try:
            trainer = RLTrainer(cfg, policy, Backends(ref, reward), prompts)
            trainer.step()  # warm-up: buffers, the workers' first decode
            totals = dict.fromkeys(("generation", "reference", "reward", "policy_scoring", "update", "iteration"), 0.0)
            for _ in range(iterations):
                ref.seconds = ref.sync_seconds = reward.seconds = reward.sync_seconds = 0.0
                row = trainer.step()
                totals["generation"] += row["time_generation_s"]
                totals["reference"] += ref.seconds
                totals["reward"] += reward.seconds
                totals["policy_scoring"] += row["time_scoring_s"] - ref.sync_seconds - reward.sync_seconds
                totals["update"] += row["time_update_s"]
                totals["iteration"] += (row["time_generation_s"] + row["time_scoring_s"] + row["time_update_s"]
                                        + row["time_reference_reward_wait_s"] + row["time_advantages_s"])
        finally:
            ref.close()
            reward.close()
    return {k: v / iterations for k, v in totals.items()}


# ---- the table ----------------------------------------------------------------------------------------
def run_model(name: str, work: Path, iterations: int, force_bench: bool) -> list[dict]:
    from homerlhf.config import load_config
    from homerlhf.memory.render import shape_for
    from homerlhf.memory.threads import physical_cores
    from homerlhf.memory.timing import Placement, iteration_time
    from homerlhf.workers.bench import bench, describe

    policy_dir, reward_dir = build_models(name, work)
    base = MODELS[name]["overrides"] + COMMON + [f"model.name_or_path={policy_dir}", f"reward.model={reward_dir}"]
    cfg0 = load_config("cpu-tiny", None, base)
    shape = shape_for(cfg0)
    t0 = time.perf_counter()
    rates, _, measured = bench(cfg0, shape, force=force_bench)
    print(f"\n## {name}: {shape.total_params / 1e6:.0f} M parameters, vocabulary {shape.vocab_size:,}; "
          f"bench {'measured in ' + format(time.perf_counter() - t0, '.0f') + ' s' if measured else 'from the cache'}")
    for line in describe(rates):
        print(f"  {line}")
    ro = cfg0.rollout
    vocab_lo, vocab_hi = (3, 500) if shape.vocab_size < 1000 else (1000, 150000)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_lo, vocab_hi) for _ in range(ro.max_prompt_len)] for _ in range(ro.batch_size)]
    rows = []
    for ref_backend, reward_backend in PLACEMENTS:
        cfg = load_config("cpu-tiny", None, base + [f"ref.backend={ref_backend}", f"reward.backend={reward_backend}"])
        predicted = iteration_time(cfg, rates, Placement(ref_backend, reward_backend, "hf"),
                                   cores=physical_cores(), logical=os.cpu_count())
        got = measure(cfg, policy_dir, prompts, iterations)
        rows.append({"model": name, "placement": f"ref {ref_backend}, reward {reward_backend}",
                     "predicted": {**predicted.phases, "iteration": predicted.total_s}, "measured": got,
                     "threads": predicted.threads})
        print_rows(rows[-1:])
    return rows


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"\n{row['model']} | {row['placement']} | threads {row['threads']}")
        print(f"  {'phase':<16} {'predicted s':>12} {'measured s':>11} {'ratio':>7}")
        for phase in ("generation", "reference", "reward", "policy_scoring", "update", "iteration"):
            p, m = row["predicted"][phase], row["measured"][phase]
            ratio = p / m if m > 0 else float("nan")
            flag = "" if 0.75 <= ratio <= 1.25 else "  <- outside +-25%"
            print(f"  {phase:<16} {p:>12.3f} {m:>11.3f} {ratio:>7.2f}{flag}")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--force-bench", action="store_true", help="measure the throughputs again")
    parser.add_argument("--work", default=None, help="where to build the models (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="iteration-time-models-"))
    print(f"load average before: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} logical CPUs")
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, work, args.iterations, args.force_bench)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    print("\n| model | placement | phase | predicted s | measured s | ratio |\n|---|---|---|---:|---:|---:|")
    for row in rows:
        for phase in ("generation", "reference", "reward", "policy_scoring", "update", "iteration"):
            p, m = row["predicted"][phase], row["measured"][phase]
            print(f"| {row['model']} | {row['placement']} | {phase} | {p:.3f} | {m:.3f} | {p / m if m else float('nan'):.2f} |")
    for name in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == name]
        fastest_p = min(mine, key=lambda r: r["predicted"]["iteration"])["placement"]
        fastest_m = min(mine, key=lambda r: r["measured"]["iteration"])["placement"]
        print(f"{name}: predicted fastest '{fastest_p}', measured fastest '{fastest_m}'"
              + ("" if fastest_p == fastest_m else "  <- differ"))


if __name__ == "__main__":
    main()
