"""Log-probs under bf16 compute on the CPU: what the sampler recorded against what the trainer scores.

    python benchmarks/bf16_logprobs.py [--prompts 4] [--new 12]

A tiny Llama whose LM head is scaled up (logits up to ~10, as a trained LM's; random weights, built
here), loaded as a run loads it (NF4 base, LoRA actor + critic, cpu-tiny settings), three ways side by
side: ``quant.upcast_non_quantized=true`` (fp32 embeddings, LM head, norms, hidden states), bf16 end to
end (the GPU presets' default: fp32 logits from the bf16 head), and bf16 end to end with the head's
own bf16 output instead (what the fp32 logits replace). For each it prints:

- behaviour - old: HF generate's recorded log-probs of the sampled tokens (the incremental decode
  with a KV cache) against the full forward's that scoring computes (max and mean |difference|,
  and the k3 KL behaviour || old per token);
- step-0 KL: the adapter-off reference's log-probs against the actor's (LoRA B = 0);
- first ratio: the update's new log-probs against the old ones on the same micro-batch split, with
  the adapters trained off zero (max |ratio - 1|; 0 means exactly 1 everywhere).
"""

from __future__ import annotations

import argparse
import tempfile


def build(out: str) -> None:
    from homerlhf.tiny import build_causal_lm

    build_causal_lm(out, hidden=64, layers=2, head_scale=20.0)  # the tests' peaked_policy_dir


def measure(model_dir: str, upcast: bool, fp32_logits: bool, prompts: int, new: int) -> dict:
    import torch

    from homerlhf.config import load_config
    from homerlhf.data.builtin import all_examples
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.collect import Prompts, collect_experience, score_with_policy
    from homerlhf.ppo.engines import HFEngine
    from homerlhf.ppo.trainer import seed_everything

    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", "quant.compute_dtype=bf16",
        f"quant.upcast_non_quantized={str(upcast).lower()}", f"rollout.batch_size={prompts}",
        f"rollout.chunk_size={prompts}", f"rollout.max_new_tokens={new}", f"ppo.mini_batch_size={prompts}",
        f"ppo.micro_batch_size={prompts}"])
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, model_dir)
    if not fp32_logits:
        policy.lm_head.__class__ = torch.nn.Linear  # the head's own 16-bit output, upcast after
    tok = policy.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True, tokenize=True)
           for ex in all_examples()[:prompts]]
    ids = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
    reward = CallableReward(lambda p, r: float(len(r)))
    torch.manual_seed(1)
    batch = HFEngine(policy).generate(ids, cfg.rollout)
    old, _, _ = score_with_policy(policy, batch)
    mask = batch.response_mask.bool()
    gap = (batch.behaviour_logprobs - old)[mask]
    start, _ = collect_experience(policy, Prompts(ids), cfg, Backends(AdapterOffReference(policy), reward))
    kl0 = (start.old_logprobs - start.ref_logprobs)[start.response_mask.bool()].abs().max()
    for p in policy.actor_parameters() + policy.critic_parameters():
        torch.nn.init.normal_(p, std=0.05)
    exp, _ = collect_experience(policy, Prompts(ids), cfg, Backends(AdapterOffReference(policy), reward))
    policy.checkpoint_activations(True)
    new_lp, _ = policy.actor_logprobs(*exp.sequences(), exp.response_len)
    rmask = exp.response_mask.bool()
    ratio = (torch.exp(new_lp - exp.old_logprobs)[rmask] - 1).abs().max()
    return {"max": gap.abs().max().item(), "mean": gap.abs().mean().item(),
            "k3": (torch.exp(-gap) - 1 + gap).mean().item(), "tokens": int(mask.sum()), "kl0": kl0.item(),
            "ratio": ratio.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp)
        rows = [("fp32 upcast", True, True), ("bf16 end to end", False, True), ("bf16, bf16 head output", False, False)]
        print(f"{'setting':<24} {'behaviour-old max':>17} {'mean':>9} {'k3 KL':>9} {'step-0 KL max':>13} "
              f"{'|ratio-1| max':>13}")
        for name, upcast, fp32 in rows:
            m = measure(tmp, upcast, fp32, args.prompts, args.new)
            print(f"{name:<24} {m['max']:17.3g} {m['mean']:9.3g} {m['k3']:9.2g} {m['kl0']:13.3g} {m['ratio']:13.3g}"
                  f"  ({m['tokens']} tokens)")


if __name__ == "__main__":
    main()
