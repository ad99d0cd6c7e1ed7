"""Batch-vs-single fp32 log-prob differences of a tiny random Llama (hidden 128, MLP 384, 4 layers,
vocab 512) on this CPU: the kernel-path effect the tolerances bound."""
import json, os, platform, subprocess, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(cfg).eval()
g = torch.Generator().manual_seed(1)
lens = [30, 41, 52, 63]
seqs = [torch.randint(0, 512, (n,), generator=g) for n in lens]
out = {"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
       "flags_amx": "amx_tile" in open("/proc/cpuinfo").read(), "torch": torch.__version__,
       "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}

def single(s):
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=s[None]).logits[0, :-1].float(), -1)
    return lp.gather(-1, s[1:, None])[:, 0].double()

def batch(ss, pad_left=False):
    w = max(map(len, ss)); ids = torch.zeros(len(ss), w, dtype=torch.long); m = torch.zeros_like(ids)
    for i, s in enumerate(ss):
        ids[i, :len(s)] = s; m[i, :len(s)] = 1
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, attention_mask=m).logits[:, :-1].float(), -1)
    return [lp[i, :len(s) - 1].gather(-1, s[1:, None])[:, 0].double() for i, s in enumerate(ss)]

for threads in (1, 2, 8):
    torch.set_num_threads(threads)
    a = [single(s) for s in seqs]; b = batch(seqs)
    tok = max((x - y).abs().max().item() for x, y in zip(a, b))
    sums = max(abs(x.sum().item() - y.sum().item()) for x, y in zip(a, b))
    mag = max(x.abs().sum().item() for x in a)
    out[f"t{threads}"] = {"max_token_diff": tok, "max_sum_diff": sums, "largest_sum_abs": mag,
                          "bound_sum": 1.19e-7 * 384 * mag}
print(json.dumps(out, indent=1))
