"""Step-0 KL between the NF4 actor and its llama.cpp reference, per GGUF type and KV cache.

For each actor compute dtype (fp32: the CPU path; bf16: what the GPU presets compute in) the base is
loaded exactly as the policy loads it (``homerlhf.models.policy.load_base``: NF4, double quant) and
exported with ``--from-nf4`` under the same ``quant:`` settings as f32 / f16 / bf16 / q8_0. Each
export is read by llama.cpp with an F16 and an F32 KV cache. Per row: mean and max over positions of
the per-token KL(actor || ref) in nats (whole distributions, float64), the GGUF size, and through
the real worker (a subprocess over HTTP, the same KV cache) its resident memory and tokens/s.

At step 0 the actor is the base with LoRA B = 0: exactly these logits.

    python benchmarks/ref_kl.py                            # the tiny Llama built from code
    python benchmarks/ref_kl.py --shape Qwen/Qwen2.5-0.5B  # random init of a real shape (memory table)

Random-init weights give flatter distributions than a trained checkpoint, so absolute KLs are
smaller than a real model's; the ordering of the types is the point. Prints figures; never a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def build_shape(name: str, out: Path, seed: int = 0) -> Path:
    """A random-init model of a real shape (``homerlhf.memory.shapes`` table) with the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from homerlhf.memory.shapes import builtin_shape
    from homerlhf.tiny import build_tokenizer

    shape = builtin_shape(name)
    if shape is None:
        raise SystemExit(f"unknown shape {name!r}; see homerlhf.memory.shapes.BUILTIN_SHAPES")
    config = AutoConfig.for_model(
        shape.model_type, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=4096)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def actor_logits(model_dir: Path, cfg, ids: list[list[int]]) -> list[np.ndarray]:
    """(T, V) float64 logits per sequence of the NF4 base, loaded as the policy loads it."""
    import torch

    from homerlhf.models.policy import load_base

    model = load_base(str(model_dir), cfg).eval()
    out = []
    with torch.no_grad():
        for seq in ids:
            out.append(model(torch.tensor([seq])).logits[0].double().numpy())
    del model
    return out


def llama_cpp_logits(gguf: Path, ids: list[list[int]], f32_kv: bool, threads: int) -> list[np.ndarray]:
    from llama_cpp import Llama

    n_ctx = max(len(s) for s in ids)
    kv = dict(type_k=0, type_v=0) if f32_kv else {}
    llm = Llama(str(gguf), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                n_threads_batch=threads, verbose=False, **kv)
    out = []
    try:
        for seq in ids:
            llm.reset()
            llm.eval(seq)
            out.append(np.array(llm.scores[: len(seq)], dtype=np.float64))
    finally:
        llm.close()
    return out


def kl_per_token(actor: list[np.ndarray], ref: list[np.ndarray]) -> np.ndarray:
    """KL(actor || ref) at every position, nats: sum_v p_a(v) (log p_a(v) - log p_r(v))."""
    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    kls = []
    for a, r in zip(actor, ref):
        la, lr = log_softmax(a), log_softmax(r)
        kls.append((np.exp(la) * (la - lr)).sum(-1))
    return np.concatenate(kls)


def worker_figures(gguf: Path, ids: list[list[int]], f32_kv: bool, threads: int) -> tuple[float, float]:
    """(resident memory in GiB, tokens/s) of the real ref worker scoring ``ids`` (best of 2)."""
    import psutil

    from homerlhf.workers.backends import connect
    from homerlhf.workers.process import WorkerProcess

    half = len(ids[0]) // 2
    prompts, responses = [s[:half] for s in ids], [s[half:] for s in ids]
    backend = connect("ref", process=WorkerProcess("ref", gguf, ctx=max(len(s) for s in ids), threads=threads,
                                                   f32_kv_cache=f32_kv))
    try:
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            backend.logprobs(prompts, responses)
            best = min(best, time.perf_counter() - start)
        rss = psutil.Process(backend.health()["pid"]).memory_info().rss / 2**30
    finally:
        backend.close()
    return rss, sum(map(len, ids)) / best


def measure(model_dir: Path, compute: str, ids, args, tmp: Path) -> list[dict]:
    from homerlhf.config import load_config
    from homerlhf.workers.gguf import export_ref

    cfg = load_config("cpu-tiny", overrides=[f"quant.compute_dtype={compute}", f"model.name_or_path={model_dir}"])
    started = time.perf_counter()
    actor = actor_logits(model_dir, cfg, ids)
    print(f"  actor ({compute} compute) logits in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for outtype in args.outtypes:
        gguf = export_ref(str(model_dir), tmp / f"ref-{compute}-{outtype}.gguf", outtype=outtype, from_nf4=True,
                          quant=cfg.quant, device="cpu")
        for f32_kv in (False, True):
            kl = kl_per_token(actor, llama_cpp_logits(gguf, ids, f32_kv, args.threads))
            rss, tps = worker_figures(gguf, ids, f32_kv, args.threads) if not args.no_worker else (float("nan"),) * 2
            row = {"compute": compute, "outtype": outtype, "kv": "F32" if f32_kv else "F16",
                   "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "gguf_mib": gguf.stat().st_size / 2**20,
                   "worker_rss_gib": rss, "worker_tokens_per_s": tps}
            rows.append(row)
            print(f"  {outtype:>5} KV {row['kv']}: KL mean {row['kl_mean']:.2e} max {row['kl_max']:.2e} nats/token, "
                  f"{row['gguf_mib']:.1f} MiB, worker {rss:.2f} GiB, {tps:.0f} tokens/s", flush=True)
        gguf.unlink()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF causal LM dir (default: the tiny Llama built here)")
    parser.add_argument("--shape", default=None, help="random init of this table shape, e.g. Qwen/Qwen2.5-0.5B")
    parser.add_argument("--compute", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--outtypes", nargs="+", default=list(OUTTYPES), choices=OUTTYPES)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-worker", action="store_true", help="skip the worker's RSS and tokens/s")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="homerlhf-refkl-"))
    if args.shape:
        model_dir = build_shape(args.shape, tmp / "model")
    elif args.model:
        model_dir = Path(args.model)
    else:
        from homerlhf.tiny import build_causal_lm

        model_dir = build_causal_lm(tmp / "tiny-llama", arch="llama", seed=0)
    rng = np.random.default_rng(0)
    ids = [[2, *rng.integers(3, 500, args.length - 1).tolist()] for _ in range(args.sequences)]
    print(f"model {args.shape or model_dir}: {args.sequences} sequences x {args.length} tokens, {args.threads} threads")
    rows = []
    for compute in args.compute:
        rows += measure(model_dir, compute, ids, args, tmp)
    print("\n| actor compute | GGUF type | KV cache | KL mean (nats/token) | KL max | GGUF MiB | worker RSS GiB | worker tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['compute']} | {r['outtype']} | {r['kv']} | {r['kl_mean']:.1e} | {r['kl_max']:.1e} | "
              f"{r['gguf_mib']:.1f} | {r['worker_rss_gib']:.2f} | {r['worker_tokens_per_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
