"""The byte counts of the plan's pieces against real bitsandbytes and torch objects."""

from __future__ import annotations

import pytest
import torch

from homerlhf.memory.components import adam_state_bytes, nf4_bytes_per_param


def test_nf4_bytes_match_bitsandbytes():
    import bitsandbytes.functional as F

    weight = torch.randn(512, 1024)
    for double_quant in (True, False):
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
        if double_quant:
            stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
        assert stored == pytest.approx(weight.numel() * nf4_bytes_per_param(double_quant), rel=1e-9)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_optimizer_state_bytes_match_the_real_optimizers(optimizer):
    import bitsandbytes as bnb

    make = {"adamw": torch.optim.AdamW, "adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    # A LoRA A (16 x 896), B (4864 x 16) and a value head (1 x 896, under the 8-bit size floor).
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(16, 896), (4864, 16), (1, 896)]]
    opt = make[optimizer](params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning) if optimizer.startswith("paged") else _nothing():
        opt.step()
    real = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")
    assert adam_state_bytes([p.numel() for p in params], optimizer) == real


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("compute_dtype", ["fp16", "fp32"])
def test_trainable_weights_are_counted_as_the_fp32_tensors_the_policy_holds(compute_dtype, tiny_llama_dir):
    # Under fp16 compute too (T4): LoRA and value head are fp32, so are their grads and Adam moments.
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=[f"quant.compute_dtype={compute_dtype}", "ref.backend=adapter_off",
                                             "reward.backend=hf"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    planned = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}

    def held(params):
        return sum(p.numel() * p.element_size() for p in params)

    assert {p.dtype for p in policy.actor_parameters() + policy.critic_parameters()} == {torch.float32}
    assert planned["LoRA actor"] == held(policy.actor_parameters())
    assert planned["LoRA critic"] + planned["value head"] == held(policy.critic_parameters())


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_trainable_components_match_the_loaded_policy(tiny_llama_dir, algorithm):
    """What the plan holds for adapters, value head and optimizers is what the real policy trains:
    GRPO loads no critic LoRA, no value head and no critic optimizer."""
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=[f"algorithm={algorithm}", "group.size=2", "ref.backend=adapter_off",
                                             "reward.backend=hf"])
    comps = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    assert comps["LoRA actor"] == 4 * sum(p.numel() for p in policy.actor_parameters())
    critic = sum(p.numel() for p in policy.critic_parameters())
    planned_critic = comps.get("LoRA critic", 0) + comps.get("value head", 0)
    assert planned_critic == 4 * critic
    assert (critic == 0) == (algorithm == "grpo")
    assert any(name.startswith("optimizer states critic") for name in comps) == (algorithm == "ppo")


def test_an_adapter_reward_adds_its_lora_and_head_and_no_base(tiny_llama_dir, tiny_lora_rm_dir):
    """reward.backend=adapter: the plan holds the bytes the loaded reward adapter really holds (its
    LoRA and score head, fp32), and on Qwen2.5-7B the hand-counted figure; no base weights."""
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import BUILTIN_SHAPES, resolve_shape
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.reward_adapter import RewardAdapter

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=adapter",
                                             f"reward.model={tiny_lora_rm_dir}"])
    planned = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    scorer = RewardAdapter(policy.model, tiny_lora_rm_dir / "adapter", policy.tokenizer.pad_token_id)
    held = sum(p.numel() * p.element_size() for n, p in policy.model.named_parameters() if ".reward." in n)
    held += sum(p.numel() * p.element_size() for p in scorer.head.parameters())
    assert planned["LoRA reward + score head"] == held

    # Qwen2.5-7B, rm.lora r=16 on all 7 linears: r * (in + out) per layer = 16 * (2 * (3584 + 3584) +
    # 2 * (3584 + 512) + 3 * (3584 + 18944)) = 16 * 90,112, x 28 layers = 40,370,176 params, fp32;
    # + the 3,584-wide head.
    cfg_7b = load_config("4090", overrides=["reward.backend=adapter", "reward.model=runs/rm"])
    comps = {c.name: c.bytes for c in persistent_components(cfg_7b, BUILTIN_SHAPES["Qwen/Qwen2.5-7B"], Assumptions())}
    assert comps["LoRA reward + score head"] == 40_370_176 * 4 + 3_584 * 4
    without = persistent_components(load_config("4090"), BUILTIN_SHAPES["Qwen/Qwen2.5-7B"], Assumptions())
    assert set(comps) - {c.name for c in without} == {"LoRA reward + score head"}


def _allocator_peak(fn) -> int:
    """The most bytes CPU tensors made inside ``fn`` held at once: the profiler's allocator events."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(open(f"{tmp}/trace.json").read())["traceEvents"]
    return max([e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"] + [0])


@pytest.mark.parametrize("upcast", [True, False])
def test_the_mlp_transient_matches_the_allocator_under_lora_and_with_adapters_off(tmp_path, upcast):
    """A Qwen2 MLP of a 4-bit base (bf16 compute) with peft LoRA on every linear, run without grad on
    4 x 256 tokens. With the fp32 upcast (fp32 residual, a = 4): its peak is 4 a I per token
    (act(gate), the base output's defensive clone, LoRA B's output times its scale, their sum); with
    the adapters off, 3 a I (act(gate), up, their product). bf16 end to end (a = 2): act(gate) and the
    clone at 2 bytes, LoRA B's fp32 output and it scaled, and LoRA's fp32 copy of the input: 12 I + 4 h.
    I = 1024. The weights are small (64 x 1024), so their dequantized copies stay under 0.1% of these.
    Depends on the CPU's kernels (bf16, adapters off): a bf16 matmul's staging differs between oneDNN
    with AMX and AVX-512/AVX2 kernels, so that case adds what the same matmul allocates here (below)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

    from homerlhf.memory.components import forward_layer_transient_per_token
    from homerlhf.memory.shapes import shape_from_config
    from homerlhf.models.precision import prepare_frozen_base

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, device_map="cpu",
                                                 dtype=torch.bfloat16)
    model = get_peft_model(prepare_frozen_base(model, load_in_4bit=True, upcast=upcast, checkpointing=False),
                           LoraConfig(r=8, target_modules="all-linear"))
    model.eval()
    mlp = model.get_base_model().model.layers[0].mlp
    a = 4 if upcast else 2
    x = torch.randn(4, 256, 64, dtype=torch.float32 if upcast else torch.bfloat16)  # the normed residual stream
    with torch.no_grad():
        mlp(x)  # warm-up
        lora = _allocator_peak(lambda: mlp(x))
        with model.disable_adapter():
            base = _allocator_peak(lambda: mlp(x))
    shape = shape_from_config(config.to_dict(), "probe", "local")
    per_token = {flag: forward_layer_transient_per_token(shape, a, 2, flag) - 2 * a * 64 for flag in (True, False)}
    tokens = 4 * 256
    assert per_token[True] == (4 * 4 * 1024 if upcast else 12 * 1024 + 4 * 64)  # the MLP dominates at these sizes
    assert per_token[False] == 3 * a * 1024
    assert lora == pytest.approx(tokens * per_token[True], rel=1e-3)
    if upcast:
        assert base == pytest.approx(tokens * per_token[False], rel=1e-3)
    else:
        # The plan's 3 a I is the peak once act(gate) * up is made. While up_proj runs, act(gate) is
        # held beside the matmul's own allocations and the dequantized weight (1024 x 64 bf16), and
        # what a CPU's bf16 matmul allocates depends on its kernels: measured on a 2-core AMD EPYC
        # (Zen 4, AVX-512 BF16, no AMX; torch 2.13 default and ATEN_CPU_CAPABILITY=avx2 kernels) it
        # writes bf16 directly (the peak is 3 a I, 6,291,456 bytes); on a 2-core Xeon with AMX oneDNN
        # writes the output in fp32 first, then rounds it (4 bytes more per element: 8,519,680). A
        # GPU's bf16 GEMM writes bf16 (not measured here). So the same matmul alone on this CPU says
        # which: its peak is its output plus whatever staging these kernels use.
        weight = torch.randn(1024, 64, dtype=torch.bfloat16)
        matmul = _allocator_peak(lambda: torch.nn.functional.linear(x, weight))
        while_up = tokens * a * 1024 + matmul + weight.numel() * weight.element_size()
        assert base == pytest.approx(max(tokens * per_token[False], while_up), rel=1e-3), (base, matmul)
