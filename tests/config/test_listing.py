"""`homerlhf config`'s rows: every setting of the schema once, its type as a user writes the value, the
preset's value, and a description of one line, at most 30 words."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from homerlhf.config import RunConfig, load_config, preset_names
from homerlhf.config.listing import MAX_WORDS, render, settings, type_name


def leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted leaf keys of a schema, walked from its classes (not from a config's values)."""
    out = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        kind = info.annotation
        out += leaves(kind, key + ".") if isinstance(kind, type) and issubclass(kind, BaseModel) else [key]
    return out


def test_every_leaf_of_the_schema_is_listed_once_in_schema_order():
    keys = [row.key for row in settings(load_config("cpu-tiny"))]
    assert keys == leaves(RunConfig)
    assert len(keys) >= 150 and "rollout.async" in keys and "data.prompts" in keys


@pytest.mark.parametrize("preset", sorted(preset_names()))
def test_every_description_is_one_line_of_at_most_30_words(preset):
    long = {row.key: len(row.description.split()) for row in settings(load_config(preset))
            if not row.description or "\n" in row.description or len(row.description.split()) > MAX_WORDS}
    assert long == {}


def test_values_are_the_presets_and_types_read_as_written():
    rows = {row.key: row for row in settings(load_config("4090", overrides=["ppo.kl_coef=0.07"]))}
    assert (rows["ppo.iterations"].value, rows["ppo.kl_coef"].value, rows["data.prompts"].value) == (200, 0.07, None)
    assert {row.key: row.value for row in settings(load_config("cpu-tiny"))}["data.prompts"] == "builtin:demo"
    assert rows["ppo.kl_estimator"].type == "k1 | k3"
    assert rows["rollout.generation_chunk"].type == "int | auto or null"
    assert rows["logging.report_to"].type == "list of tensorboard | trackio | wandb | mlflow | none or null"
    assert rows["reward.components"].type.startswith("list of {backend, model, url, token")
    assert type_name(bool) == "bool" and rows["data.prompts"].type == "str or null"


def test_render_aligns_and_shows_null_and_empty():
    rows = list(settings(load_config("4090")))
    lines = render(rows)
    assert len(lines) == len(rows)
    by_key = dict(zip((r.key for r in rows), lines))
    assert by_key["data.prompts"].split()[:3] == ["data.prompts", "str", "or"] and " null " in by_key["data.prompts"]
    start = by_key["ppo.kl_coef"].index("0.05")
    assert by_key["ppo.epochs"].index(" 1 ") + 1 == start  # the value column lines up
