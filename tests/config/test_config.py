from pathlib import Path

import pytest
import yaml

from homerlhf.config import RunConfig, from_yaml_file, load_config, preset_names, presets_dir, to_yaml
from homerlhf.config.loader import apply_overrides
from homerlhf.errors import UserError

EXPECTED = {"4090", "3090", "4080", "4060ti-16g", "3060-12g", "t4-colab", "a100-80g", "cpu-tiny"}


def preset_files():
    return sorted(Path(p.name) for p in presets_dir().iterdir() if p.name.endswith(".yaml"))


def test_all_eight_presets_present():
    assert set(preset_names()) == EXPECTED
    assert {p.stem for p in preset_files()} == EXPECTED


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: p.stem)
def test_preset_validates_and_round_trips(path: Path, tmp_path):
    cfg = load_config(path.stem)
    assert cfg.preset == path.stem
    if path.stem == "cpu-tiny":
        assert cfg.card.device == "cpu"
    else:
        assert cfg.card.device == "cuda" and cfg.card.gpu_gib > 0
        assert "/" in cfg.model.name_or_path  # a hub id
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert from_yaml_file(out) == cfg


def test_user_yaml_then_overrides_win(tmp_path):
    user = tmp_path / "run.yaml"
    user.write_text(yaml.safe_dump({"ppo": {"kl_coef": 0.1, "gamma": 0.9}}))
    cfg = load_config("cpu-tiny", user, ["ppo.kl_coef=0.05", "rollout.max_new_tokens=5"])
    assert cfg.ppo.kl_coef == 0.05
    assert cfg.ppo.gamma == 0.9
    assert cfg.rollout.max_new_tokens == 5


def test_config_is_frozen():
    cfg = load_config("cpu-tiny")
    with pytest.raises(Exception):
        cfg.ppo.kl_coef = 1.0


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["ppo.kl_coef=abc"], "ppo.kl_coef"),
        (["ppo.nope=1"], "unknown config key 'ppo.nope'"),
        (["rollout.top_p=2"], "rollout.top_p"),
        (["rollout.top_p=0.9"], "rollout.top_p=0.9, rollout.top_k=0: training rollouts must sample the full"),
        (["rollout.top_k=5"], "set rollout.top_p=1.0 and rollout.top_k=0"),
        (["rollout.engine=hf", "rollout.async=true"], "rollout.async needs rollout.engine=llamacpp"),
        (["ppo.kl_estimator=k2"], "ppo.kl_estimator"),
        (["ppo.micro_batch_size=3"], "multiple of ppo.micro_batch_size"),
        (["ppo"], "section.key=value"),
        (["rollout.engine=llamacpp", "rollout.async=true", "reward.backend=adapter", "reward.model=rm"],
         "reward.backend 'adapter' scores on the policy's modules"),
        (["distributed.fsdp=true", "quant.compute_dtype=bf16"],  # cpu-tiny upcasts
         "set quant.upcast_non_quantized=false with distributed.fsdp"),
        (["quant.upcast_non_quantized=maybe"], "quant.upcast_non_quantized"),
    ],
)
def test_bad_values_name_the_key(overrides, fragment):
    with pytest.raises(UserError) as err:
        load_config("cpu-tiny", None, overrides)
    msg = str(err.value)
    assert fragment in msg
    assert "\n" not in msg


def test_rollout_async_is_read_and_written_as_async(tmp_path):
    from homerlhf.config import to_yaml
    from homerlhf.config.loader import from_yaml_file

    cfg = load_config("cpu-tiny", None, ["rollout.engine=llamacpp", "rollout.async=true"])
    assert cfg.rollout.async_ is True
    text = to_yaml(cfg)
    assert "  async: true\n" in text and "async_" not in text
    (tmp_path / "c.yaml").write_text(text)
    assert from_yaml_file(tmp_path / "c.yaml").rollout.async_ is True
    assert load_config("cpu-tiny").rollout.async_ is False


def test_unknown_preset_lists_the_choices():
    with pytest.raises(UserError, match="unknown preset 'nope'.*cpu-tiny"):
        load_config("nope")


def test_bad_yaml_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config("cpu-tiny", bad)
    with pytest.raises(UserError, match="not found"):
        load_config("cpu-tiny", tmp_path / "missing.yaml")


def test_override_values_parse_as_yaml():
    data = apply_overrides({}, ["a.b=1", "a.c=true", "a.d=[x, y]", "a.e=hello"])
    assert data == {"a": {"b": 1, "c": True, "d": ["x", "y"], "e": "hello"}}


def test_defaults_validate():
    RunConfig()


def test_sft_and_rm_share_one_description_per_field_and_keep_their_defaults():
    from homerlhf.config.schema import RewardTrainConfig, SFTConfig, TRLStageConfig

    shared = TRLStageConfig.model_fields
    assert set(SFTConfig.model_fields) == set(shared)  # SFT's LoRA settings are actor.lora
    assert set(RewardTrainConfig.model_fields) - set(shared) == {"eval_data", "lora", "center_rewards_coef", "export_gguf"}
    for name, field in shared.items():
        assert field.description
        assert SFTConfig.model_fields[name].description == RewardTrainConfig.model_fields[name].description == field.description
    # The defaults each stage had before they shared a base.
    common = dict(base=None, method="qlora", epochs=1.0, max_steps=None, batch_size=4, grad_accum=4, max_len=1024,
                  warmup_ratio=0.03)
    assert SFTConfig().model_dump() == dict(common, data="builtin:demo-sft", lr=2e-4)
    assert RewardTrainConfig().model_dump() == dict(
        common, data="builtin:demo-pairs", lr=1e-4, eval_data=None, center_rewards_coef=None, export_gguf=True,
        lora=dict(r=16, alpha=32, dropout=0.0, target_modules="all-linear", experts=False),
    )
    with pytest.raises(UserError, match="rm.lr"):
        load_config("cpu-tiny", overrides=["rm.lr=0"])


def test_reward_functions_and_components_are_named_for_their_metrics():
    cfg = load_config("cpu-tiny", overrides=[
        "reward.backend=function", "reward.function=rewards.py:exact_answer",
        "reward.components=[{backend: llamacpp, model: 'builtin:demo-rm', weight: 0.5}, "
        "{backend: function, function: 'builtin:reverse', name: check, weight: 2}, "
        "{backend: function, function: 'builtin:reverse-positions', weight: 0.25}]"])
    assert [(key, r.metric_name, r.weight) for key, r in cfg.reward.all_rewards()] == [
        ("reward", "exact_answer", 1.0), ("reward.components[0]", "rm", 0.5), ("reward.components[1]", "check", 2.0),
        ("reward.components[2]", "reverse_positions", 0.25)]


@pytest.mark.parametrize("overrides, fragment", [
    (["reward.components=[{backend: llamacpp, model: m}]"], "two rewards are named 'rm' (metric reward_rm)"),
    (["reward.name=mean"], "may not be named 'mean'"),
    (["reward.components=[{backend: function}]"], "reward.components[0].backend 'function' needs reward.components[0].function"),
    (["reward.components=[{backend: hf}]"], "reward.components[0].model is required"),
    (["ref.backend=function"], "ref.backend 'function' is not available"),
])
def test_bad_reward_settings_name_the_reward(overrides, fragment):
    with pytest.raises(UserError) as info:
        load_config("cpu-tiny", overrides=overrides)
    assert fragment in str(info.value)


def test_config_yaml_redacts_the_token_of_every_reward_component():
    from homerlhf.config import to_yaml

    cfg = load_config("cpu-tiny", overrides=[
        "reward.components=[{backend: llamacpp, model: builtin:demo-rm, name: rm2, url: 'http://127.0.0.1:9', token: secret-c}]"])
    text = to_yaml(cfg)
    assert "secret-c" not in text and "token: <redacted>" in text


@pytest.mark.parametrize("tokens, rows, width, columns", [
    (4096, 64, 512, 64),  # the 4090 preset's block: 8 pieces of 64 columns
    (4096, 224, 512, 18),  # 4096 // 224: pieces of 18 columns, the last of 512 - 28 x 18 = 8
    (4096, 8, 512, None),  # 8 x 512 = 4096 tokens: not more than the budget, one forward
    (4096, 16, 48, None),  # cpu-tiny's chunk (16 x 48): one forward, the demo's numbers as before
    (4096, 5000, 2, 1),  # more rows than the budget has tokens: a column at a time
    (0, 64, 512, None),  # 0: one forward
    (None, 64, 512, None),  # null: one forward
])
def test_prefill_columns_split_a_block_of_more_than_prefill_tokens(tokens, rows, width, columns):
    rollout = load_config("cpu-tiny", overrides=[f"rollout.prefill_tokens={'null' if tokens is None else tokens}"]).rollout
    assert rollout.prefill_columns(rows, width) == columns


def test_the_cpu_tiny_blocks_are_prefilled_in_one_forward():
    """cpu-tiny keeps one prefill forward (prefill_tokens 0), so the demos' samples do not move: its
    training blocks (16 or 32 x 48) are under the default 4096 tokens anyway, but the verifiable
    demo's evaluation samples 256 rows at once; the GPU presets take the default."""
    rollout = load_config("cpu-tiny").rollout
    assert rollout.prefill_tokens == 0 and rollout.prefill_columns(256, 48) is None
    assert load_config("4090").rollout.prefill_tokens == 4096
