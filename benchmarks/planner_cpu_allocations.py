"""The memory planner against the CPU allocator: bytes torch holds at each PPO phase's peak, on CPU.

    python benchmarks/planner_cpu_allocations.py [--dtype bf16] [--upcast] [--intermediate 2816] [--algorithm ppo]
        [--prefill-tokens N] [--layers 4 --every-n 2] [--experts 8 --top-k 2 [--lora-experts]]

Builds a small Qwen2-shaped model (random weights), loads it as a run does (NF4 base, LoRA actor +
critic, compute dtype ``--dtype`` end to end, or with ``--upcast`` (``quant.upcast_non_quantized``) the
fp32 embeddings, LM head, norms and residual stream of ``prepare_model_for_kbit_training``), and runs
two PPO iterations with homerlhf's trainer (adapter-off reference, an in-process reward, prompts of
full length) under the profiler, which records every CPU allocation and free. Per phase of the second
iteration it prints the most bytes alive at once beside the planner's allocated bytes for the same
settings (HF generate's cache; the actor's 8-bit optimizer unpaged, as on a CPU). ``--experts``: a Qwen3-MoE
instead, every layer's MLP that many 4-bit experts of width ``--intermediate``. The Python-level
tensors (peft's LoRA layers, transformers' cache and masks, the sampler, the optimizers, the kept
gradients) are the ones a GPU run makes; GPU kernels' workspaces and the caching allocator are not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("intermediate", 2816), ("layers", 2), ("heads", 8), ("kv-heads", 2),
                          ("head-dim", 64), ("vocab", 16384), ("prompt", 128), ("new", 32), ("chunk", 16),
                          ("micro", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="quant.compute_dtype")
    ap.add_argument("--upcast", action="store_true", help="quant.upcast_non_quantized=true: the fp32 residual stream")
    ap.add_argument("--algorithm", default="ppo", choices=["ppo", "grpo"])
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="rollout.prefill_tokens (default: the config's): e.g. 512 prefills 16 x 128 in pieces of 32 columns")
    ap.add_argument("--experts", type=int, default=0,
                    help="a Qwen3-MoE of this many experts per layer (--intermediate: each expert's), 4-bit")
    ap.add_argument("--top-k", type=int, default=2, help="with --experts: experts routed per token")
    ap.add_argument("--lora-experts", action="store_true", help="with --experts: actor.lora.experts=true")
    ap.add_argument("--every-n", type=int, default=None,
                    help="training.checkpoint_every_n_layers (default: every layer): e.g. 2 with --layers 4 checkpoints layers 0 and 2")
    return ap.parse_args()


class LabelledPhases:
    """A stand-in ``PhaseMeter`` that marks each phase in the profiler's trace instead of measuring."""

    kind = "cpu_allocator"

    @contextlib.contextmanager
    def phase(self, name):
        from torch.profiler import record_function

        with record_function(f"phase:{name}"):
            yield

    def peaks(self):
        return {}

    def reset(self):
        pass

    def close(self):
        pass


def build(args, out: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from homerlhf.tiny import build_tokenizer

    tok = build_tokenizer()
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id)
    if args.experts:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**common, intermediate_size=args.intermediate, moe_intermediate_size=args.intermediate,
                                num_experts=args.experts, num_experts_per_tok=args.top_k)
    else:
        config = Qwen2Config(**common, intermediate_size=args.intermediate)
    torch.manual_seed(0)
    # Saved in fp32: loading it in the compute dtype then copies every weight into the allocator the
    # profiler counts. A bf16 checkpoint loaded in bf16 stays memory-mapped from its file, outside that
    # allocator (weights on a GPU never are): the embeddings and LM head would go uncounted.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return config


def phase_peaks(events) -> dict[str, int]:
    """Most bytes alive (the allocator's running total) inside each phase of the second iteration."""
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(("phase:", "iteration 1"))]
    start = next(e["ts"] for e in spans if e["name"] == "iteration 1")
    peaks: dict[str, int] = {}
    for e in spans:
        if e["name"].startswith("phase:") and e["ts"] >= start:
            inside = [v for t, v in mem if e["ts"] <= t <= e["ts"] + e["dur"]]
            peaks[e["name"][6:]] = max(peaks.get(e["name"][6:], 0), max(inside, default=0))
    return peaks


def main() -> None:
    args = parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions
    from homerlhf.memory.planner import plan
    from homerlhf.memory.shapes import shape_from_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer

    with tempfile.TemporaryDirectory() as tmp:
        config = build(args, tmp)
        c = args.chunk
        cfg = load_config("4090", None, [
            f"model.name_or_path={tmp}", "card.device=cpu", f"quant.compute_dtype={args.dtype}",
            f"quant.upcast_non_quantized={str(args.upcast).lower()}",
            f"rollout.chunk_size={c}", f"rollout.batch_size={2 * c}", f"rollout.generation_chunk={c}",
            f"rollout.max_prompt_len={args.prompt}", f"rollout.max_new_tokens={args.new}",
            f"ppo.mini_batch_size={c}", f"ppo.micro_batch_size={args.micro}", "ppo.epochs=1",
            "actor.optimizer=adamw_8bit", "ref.backend=adapter_off", "reward.backend=hf", "reward.model=in-process",
            f"algorithm={args.algorithm}", *(["group.size=4"] if args.algorithm != "ppo" else []),
            "logging.tensorboard=false", "logging.progress=false",
            *([f"rollout.prefill_tokens={args.prefill_tokens}"] if args.prefill_tokens is not None else []),
            *([f"training.checkpoint_every_n_layers={args.every_n}"] if args.every_n is not None else []),
            *(["actor.lora.experts=true"] if args.lora_experts else [])])
        planned = plan(cfg, shape_from_config(config.to_dict(), "probe", "local"), 0, with_suggestion=False,
                       assumptions=Assumptions(decoder="hf"))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            policy = PolicyModel.from_config(cfg, tmp)
            prompts = torch.randint(8, 512, (2 * c, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
            trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(lambda p, r: len(r) / 32)),
                                 prompts)
            trainer.meters.memory = LabelledPhases()
            for i in range(2):
                with record_function(f"iteration {i}"):
                    trainer.step()
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as fh:
            measured = phase_peaks(json.load(fh)["traceEvents"])
    experts = f", {args.experts} experts (top {args.top_k}{', LoRA on them' if args.lora_experts else ''})" if args.experts else ""
    print(f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate {args.intermediate}{experts}, "
          f"compute {args.dtype}{' (fp32 upcast)' if args.upcast else ' end to end'}, {args.algorithm}, chunk {c} x ({args.prompt} + {args.new}), micro-batch {args.micro}, "
          f"prefill {_prefill(cfg.rollout.prefill_columns(c, args.prompt))}, "
          f"checkpointing {cfg.training.checkpointed_layers(config.num_hidden_layers)} of {config.num_hidden_layers} layers")
    for phase in planned.phases:
        got = measured.get(phase.name, 0)
        print(f"{phase.name:<11} planned {phase.allocated_bytes / 2**20:8.2f} MiB  measured {got / 2**20:8.2f} MiB  "
              f"ratio {got / phase.allocated_bytes:.3f}  ({phase.moment})")


def _prefill(columns) -> str:
    return "in one forward" if columns is None else f"in pieces of {columns} columns"


if __name__ == "__main__":
    main()
