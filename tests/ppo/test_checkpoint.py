"""Checkpoints: complete round trip into a real PolicyModel, atomicity, pruning, resume checks
(the logs cut back on resume: test_resuming.py; random states: test_rng.py)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.ppo import checkpoint as C
from homerlhf.ppo import resuming as R
from homerlhf.ppo.kl import AdaptiveKLController
from homerlhf.ppo.running import RunningMoments


@pytest.fixture(scope="module")
def cfg():
    return load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "quant.load_in_4bit=false"])


@pytest.fixture(scope="module")
def policy(cfg, tiny_llama_dir):
    from homerlhf.models.policy import PolicyModel

    return PolicyModel.from_config(cfg, str(tiny_llama_dir))


def _params(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.actor_parameters() + policy.critic_parameters()]


def _save(run_dir, iteration, policy, cfg, opts, keep=3, **live):
    state = C.RunState(policy, opts, counters={"data_cursor": iteration * 7}, **live)
    return C.save_checkpoint(run_dir, iteration, state, cfg, keep=keep)


def test_round_trip_restores_weights_optimizer_controllers_and_rng(policy, cfg, tmp_path):
    torch.manual_seed(1)
    for p in policy.actor_parameters() + policy.critic_parameters():
        p.data.normal_()
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    loss = sum((p ** 2).sum() for p in policy.actor_parameters())
    loss.backward()
    opt.step()
    kl, moments = AdaptiveKLController(0.1, 6.0, 100), RunningMoments()
    kl.update(9.0, 10)
    moments.update(torch.tensor([1.0, 2.0, 4.0]))
    gen = torch.Generator().manual_seed(5)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')

    ckpt = _save(tmp_path, 3, policy, cfg, {"actor": opt}, stateful={"kl": kl, "moments": moments},
                 generators={"shuffle": gen})
    want = _params(policy)
    want_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    want_draws = (random.random(), np.random.rand(), torch.rand(3), torch.rand(2, generator=gen))

    for p in policy.actor_parameters() + policy.critic_parameters():
        p.data.zero_()
    opt2 = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    kl2, moments2, gen2 = AdaptiveKLController(0.1, 6.0, 100), RunningMoments(), torch.Generator()
    state = C.load_checkpoint(ckpt, C.RunState(policy, {"actor": opt2}, {"kl": kl2, "moments": moments2},
                                               {"shuffle": gen2}))

    assert max((a - b).abs().max().item() for a, b in zip(want, _params(policy))) == 0.0
    for key, value in want_opt.items():
        assert torch.equal(opt2.state_dict()["state"][0][key], value)
    assert (kl2.value, moments2.mean, moments2.m2, moments2.count) == (kl.value, moments.mean, moments.m2, moments.count)
    got_draws = (random.random(), np.random.rand(), torch.rand(3), torch.rand(2, generator=gen2))
    assert got_draws[:2] == want_draws[:2]
    assert torch.equal(got_draws[2], want_draws[2]) and torch.equal(got_draws[3], want_draws[3])
    assert state["iteration"] == 3 and state["trainer"] == {"data_cursor": 21}
    assert state["logs"] == {"metrics.jsonl": len('{"iteration": 1}\n'), "samples.jsonl": 0}
    assert C.is_complete(ckpt, verify_hashes=True)
    assert R.saved_config(ckpt) == cfg


def test_optimizer_states_load_beside_their_parameters_and_steps_stay_on_the_cpu(tmp_path):
    """Saved from one device, loaded for parameters on another (``meta`` stands in for the GPU): the
    moments go beside the parameters, AdamW's step counters stay on the CPU as a fresh optimizer's."""
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(params, lr=0.1)
    params[0].grad = torch.ones(3)
    opt.step()
    torch.save({"actor": opt.state_dict()}, tmp_path / "optimizers.pt")
    elsewhere = [torch.nn.Parameter(torch.ones(3, device="meta"))]
    fresh = torch.optim.AdamW(elsewhere, lr=0.1)
    C.load_optimizers(tmp_path / "optimizers.pt", {"actor": fresh})
    state = fresh.state[elsewhere[0]]
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == "cpu" and float(state["step"]) == 1.0


def test_keeps_last_k_and_resaving_an_iteration_replaces_it(policy, cfg, tmp_path):
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    for it in (1, 2, 3, 4):
        _save(tmp_path, it, policy, cfg, {"actor": opt}, keep=2)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["iter_000003", "iter_000004"]
    _save(tmp_path, 4, policy, cfg, {"actor": opt}, keep=2)
    # Nothing else is left behind: no temp or replaced directories.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_000003", "iter_000004"]


def test_interrupted_save_never_looks_complete(policy, cfg, tmp_path):
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    good = _save(tmp_path, 1, policy, cfg, {"actor": opt})

    class Crash(Exception):
        pass

    original = torch.save

    def save_then_crash(obj, path, *a, **k):  # dies after the adapters are on disk, like a kill -9
        original(obj, path, *a, **k)
        raise Crash

    torch.save = save_then_crash
    try:
        with pytest.raises(Crash):
            _save(tmp_path, 2, policy, cfg, {"actor": opt})
    finally:
        torch.save = original
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert any(name.startswith(".tmp-iter_000002") for name in leftovers)
    assert C.latest_complete_checkpoint(tmp_path) == good
    assert R.find_resume_checkpoint(tmp_path) == good

    # A directory with the right name but a file cut short is not complete either.
    broken = tmp_path / "checkpoints" / "iter_000009"
    shutil.copytree(good, broken)
    with open(broken / "optimizers.pt", "r+b") as fh:
        fh.truncate(10)
    assert not C.is_complete(broken)
    assert C.latest_complete_checkpoint(tmp_path) == good
    # Resuming does not pass over it in silence: the file is named, and the checkpoint to fall back to.
    with pytest.raises(UserError, match=r"iter_000009: optimizers.pt is 10 bytes, its MANIFEST.json says \d+ "
                                        r"\(cut short .* to continue from iter_000001$"):
        R.find_resume_checkpoint(tmp_path)
    # A newest checkpoint whose manifest is gone or unreadable was damaged after its rename (they are
    # written under .tmp- names): refused naming the manifest, not passed over for an older one.
    (broken / C.MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match=r"iter_000009: MANIFEST.json is missing or unreadable .* "
                                        r"\(mv \S+iter_000009 \S+iter_000009.damaged\) .* from iter_000001$"):
        R.find_resume_checkpoint(tmp_path)
    shutil.rmtree(broken)
    (good / C.MANIFEST).unlink()
    assert C.latest_complete_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match="MANIFEST.json is missing .* no earlier checkpoint is intact"):
        R.find_resume_checkpoint(tmp_path)
    shutil.rmtree(good)
    with pytest.raises(UserError, match="no complete checkpoint"):
        R.find_resume_checkpoint(tmp_path)


def _flip_byte(path) -> None:
    """One byte changed in place, the size kept: what no size check sees."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_changed_cut_or_missing_file_is_named_with_the_checkpoint_to_fall_back_to(policy, cfg, tmp_path):
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    first, second, third = (_save(tmp_path, it, policy, cfg, {"actor": opt}) for it in (1, 2, 3))
    _flip_byte(third / "actor" / "adapter_model.safetensors")
    assert C.is_complete(third) and not C.is_complete(third, verify_hashes=True)
    with pytest.raises(UserError) as info:
        C.verify_checkpoint(third)
    assert str(info.value) == (f"checkpoint {third}: actor/adapter_model.safetensors does not match its "
                               "MANIFEST.json sha256 (changed after it was written); use iter_000002 instead")
    C.verify_checkpoint(third, ("critic/", "optimizers.pt"))  # only the files a caller loads are checked
    with pytest.raises(UserError) as info:
        R.find_resume_checkpoint(tmp_path)
    assert str(info.value).startswith(f"checkpoint {third}: actor/adapter_model.safetensors does not match")
    assert str(info.value).endswith(f"(mv {third} {tmp_path}/iter_000003.damaged) and run "
                                    f"`homerlhf train --resume {tmp_path}` again to continue from iter_000002")
    before = _params(policy)
    with pytest.raises(UserError, match="actor/adapter_model.safetensors does not match"):
        C.load_checkpoint(third, C.RunState(policy))
    assert all(torch.equal(a, b) for a, b in zip(before, _params(policy)))  # refused before any weight loaded

    # The fallback is the newest earlier checkpoint that is intact itself; a cut-short file is named by its size.
    with open(second / "optimizers.pt", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(UserError, match="use iter_000001 instead$"):
        C.verify_checkpoint(third)
    with pytest.raises(UserError) as info:  # both damaged ones move, or the next resume stops at the second
        R.find_resume_checkpoint(tmp_path)
    assert str(info.value).endswith(f"move them out of the way (mv {second} {tmp_path}/iter_000002.damaged && "
                                    f"mv {third} {tmp_path}/iter_000003.damaged) and run "
                                    f"`homerlhf train --resume {tmp_path}` again to continue from iter_000001")
    with pytest.raises(UserError, match=r"optimizers.pt is 10 bytes, its MANIFEST.json says \d+ \(cut short"):
        C.verify_checkpoint(second)
    (first / "rng.pt").unlink()
    with pytest.raises(UserError, match="rng.pt is missing"):
        C.verify_checkpoint(first)
    with pytest.raises(UserError, match="no earlier checkpoint is intact$"):
        C.verify_checkpoint(third)
    with pytest.raises(UserError, match="restore the file from a backup, or start the run again with --overwrite$"):
        R.find_resume_checkpoint(tmp_path)


def test_resume_compatibility_names_the_key(cfg):
    from homerlhf.config.loader import validate

    data = cfg.model_dump(mode="json")
    C.check_resume_compatible(cfg, validate({**data, "ppo": {**data["ppo"], "iterations": 99}}), "runs/x")
    for key, value in [("actor.lora.r", 4), ("critic.lora.target_modules", ["q_proj"]),
                       ("model.name_or_path", "other"), ("quant.load_in_4bit", True),
                       ("critic.shared_adapter", True)]:
        new = json.loads(json.dumps(data))
        node = new
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
        with pytest.raises(UserError, match=f"config key '{key}' differs") as info:
            C.check_resume_compatible(cfg, validate(new), "runs/x")
        assert "\n" not in str(info.value)
        assert C.config_fingerprint(cfg) != C.config_fingerprint(validate(new))


def test_a_checkpoint_never_holds_a_worker_token(policy, cfg, tmp_path):
    with_token = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"url": "http://cpu-box:8601",
                                                                                "token": "s3cret-tok"})})
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    ckpt = _save(tmp_path, 1, policy, with_token, {"actor": opt})
    for path in ckpt.rglob("*"):
        if path.is_file():
            assert b"s3cret-tok" not in path.read_bytes(), path.name
    saved = R.saved_config(ckpt)
    assert saved.reward.token == "<redacted>" and saved.reward.url == "http://cpu-box:8601"
