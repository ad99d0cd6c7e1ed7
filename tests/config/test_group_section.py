"""The ``group`` section (GRPO / RLOO) and its keys' old names in ``ppo``, still read with one warning line."""

from __future__ import annotations

import logging

import pytest
import yaml

from homerlhf.config import from_yaml_file, load_config, to_yaml
from homerlhf.errors import UserError

NEW = ["algorithm=grpo", "group.size=4", "group.dr_grpo=true", "group.kl_in=loss", "group.loss_aggregation=token_mean"]
OLD = ["algorithm=grpo", "ppo.group_size=4", "ppo.dr_grpo=true", "ppo.kl_in=loss", "ppo.loss_aggregation=token_mean"]


def test_the_old_names_read_as_the_new_ones_with_one_warning_line(caplog):
    with caplog.at_level(logging.WARNING, logger="homerlhf.config.group"):
        new = load_config("cpu-tiny", overrides=NEW)
        assert caplog.records == []  # the new names: nothing to say
        old = load_config("cpu-tiny", overrides=OLD)
    assert old == new
    assert (new.group.size, new.group.dr_grpo, new.group.kl_in, new.group.loss_aggregation) == (4, True, "loss",
                                                                                                 "token_mean")
    assert new.kl_in_loss and new.loss_aggregation == "token_mean"
    [record] = caplog.records
    message = record.getMessage()
    assert "\n" not in message and message.startswith("warning: renamed config keys")
    for old_key, new_key in zip(OLD[1:], NEW[1:]):
        assert f"{old_key.split('=')[0]} -> {new_key.split('=')[0]}" in message


def test_a_saved_config_of_the_old_names_loads_and_is_written_back_in_the_new_ones(tmp_path, caplog):
    """A run dir's config.yaml (every key dumped) from before the section existed: --resume and export read it."""
    data = yaml.safe_load(to_yaml(load_config("cpu-tiny", overrides=NEW)))
    data["ppo"].update({"group_size": data["group"]["size"], "dr_grpo": True, "kl_in": "loss",
                        "loss_aggregation": "token_mean"})
    del data["group"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING, logger="homerlhf.config.group"):
        cfg = from_yaml_file(tmp_path / "config.yaml")
    assert cfg == load_config("cpu-tiny", overrides=NEW) and len(caplog.records) == 1
    written = yaml.safe_load(to_yaml(cfg))
    assert "group_size" not in written["ppo"] and written["group"]["size"] == 4


def test_a_key_under_both_names_is_refused_in_one_line():
    with pytest.raises(UserError) as info:
        load_config("cpu-tiny", overrides=["algorithm=grpo", "group.size=4", "ppo.group_size=2"])
    assert str(info.value) == ("invalid config: ppo.group_size and group.size are both set: ppo.group_size is the old "
                               "name of group.size; keep only it")


def test_group_settings_are_refused_for_ppo_under_their_names():
    with pytest.raises(UserError, match="group.kl_in=loss, group.dr_grpo and group.loss_aggregation are for algorithm"):
        load_config("cpu-tiny", overrides=["group.dr_grpo=true"])
    with pytest.raises(UserError, match="algorithm rloo needs group.size >= 2"):
        load_config("cpu-tiny", overrides=["algorithm=rloo"])
