"""homerlhf/models/base_loading.py: every loader of a 4-bit base that trains keeps its layers differentiable.

bitsandbytes >= 0.50, on a CPU with AVX512-BF16 (Intel Xeon, AMD Zen 4), repacks a ``Linear4bit``'s weight
for good the first time it runs in eval mode without grad, into a bf16 kernel with no backward. A later
training forward then drops the gradient through the base and, on a layer with a bias, fails in place.
The first test checks the switch that prevents it on every CPU; the second shows the harm on those CPUs.
"""

import pytest
import torch

from homerlhf.config import load_config
from tolerances import fp32_bound

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.nn import Linear4bit  # noqa: E402


def loaders(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from homerlhf.models.base_loading import load_base
    from homerlhf.models.critic_model import load_backbone
    from homerlhf.models.sharding import _lora_model
    from homerlhf.stages.common import load_model

    cfg = load_config("cpu-tiny")
    return {
        "policy base": lambda: load_base(model_dir, cfg),
        "critic backbone": lambda: load_backbone(model_dir, cfg),
        "stage qlora (SFT, DPO, KTO)": lambda: load_model(AutoModelForCausalLM, model_dir, cfg, "qlora"),
        "stage qlora reward model": lambda: load_model(AutoModelForSequenceClassification, model_dir, cfg, "qlora",
                                                       num_labels=1),
        "data-parallel smoke": lambda: _lora_model(model_dir, "cpu", torch.float32),
    }


@pytest.mark.parametrize("name", ["policy base", "critic backbone", "stage qlora (SFT, DPO, KTO)",
                                  "stage qlora reward model", "data-parallel smoke"])
def test_no_loader_leaves_a_4bit_layer_free_to_repack_for_inference(tiny_qwen2_dir, name):
    model = loaders(str(tiny_qwen2_dir))[name]()
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert layers, "the base is 4-bit"
    assert all(not getattr(m, "support_avx512bf16_for_cpu", False) for m in layers)


def test_an_eval_pass_then_a_training_pass_gives_the_gradient_of_a_fresh_model(tiny_qwen2_dir):
    """As a DPO step does: the reference in eval mode without grad, then the policy's forward and
    backward. The LoRA gradient of the first layer equals that of a model that never ran the eval pass:
    the same computation, so within the fp32 bound (tests/tolerances.py) of the gradient's size."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homerlhf.stages.common import load_model

    cfg = load_config("cpu-tiny")
    ids = torch.arange(3, 19).unsqueeze(0) % 500

    def first_layer_grad(eval_first: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = get_peft_model(load_model(AutoModelForCausalLM, str(tiny_qwen2_dir), cfg, "qlora"),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.01)
        if eval_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        return next(p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_A" in n)

    fresh, after_eval = first_layer_grad(False), first_layer_grad(True)
    assert fresh.abs().sum() > 0
    torch.testing.assert_close(after_eval, fresh, rtol=0, atol=fp32_bound(fresh.abs().max().item(), floor=0))
