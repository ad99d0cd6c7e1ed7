"""Preset discovery, YAML loading, dotted overrides and one-line validation errors."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import yaml
from pydantic import ValidationError

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError

if TYPE_CHECKING:
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11


def presets_dir() -> Traversable:
    """The ``homerlhf.presets`` package holding one ``<name>.yaml`` per preset, as a resource folder
    (a plain directory in a checkout or an unpacked wheel; read it through the Traversable API)."""
    return files("homerlhf.presets")


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in presets_dir().iterdir() if p.name.endswith(".yaml"))


def _read_yaml(path: Path | Traversable, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path} (check the path)") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{what} {path} is not valid YAML{where}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must be a mapping of keys to values, got {type(data).__name__}")
    return data


def load_preset_dict(name: str) -> dict[str, Any]:
    if name not in preset_names():
        raise UserError(f"unknown preset '{name}'; choose one of: {', '.join(preset_names())}")
    data = _read_yaml(presets_dir() / f"{name}.yaml", "preset")
    data.setdefault("preset", name)
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` wins; nested mappings merge key by key."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"ppo.kl_coef=0.05"`` -> (["ppo", "kl_coef"], 0.05); the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"--set '{item}' must look like section.key=value, e.g. --set ppo.kl_coef=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        nested: Any = value
        for part in reversed(path):
            nested = {part: nested}
        data = deep_merge(data, nested)
    return data


def _error_line(err: dict) -> str:
    """One validation error: key, what was given, what is allowed."""
    key = ".".join(str(p) for p in err["loc"]) or "config"
    given = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown config key '{key}' (check spelling; `homerlhf config` lists every key)"
    msg = err["msg"]
    if kind == "value_error":
        return f"invalid config: {msg.removeprefix('Value error, ')}"
    if isinstance(given, (dict, list)):
        return f"config key '{key}': {msg}"
    return f"config key '{key}': got {given!r}; {msg[0].lower() + msg[1:]}"


def format_validation_error(exc: ValidationError) -> str:
    """Every error found, in one line (``; `` between them)."""
    return "; ".join(dict.fromkeys(_error_line(err) for err in exc.errors()))


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None


def load_config(
    preset: str = "cpu-tiny",
    config_file: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
) -> RunConfig:
    """Preset YAML, then the user's YAML, then dotted overrides; validated once."""
    data = load_preset_dict(preset)
    if config_file is not None:
        data = deep_merge(data, _read_yaml(Path(config_file), "config file"))
    data = apply_overrides(data, overrides)
    return validate(data)


# What config.yaml and checkpoints hold instead of a worker's bearer token.
REDACTED = "<redacted>"


def redacted_dump(config: RunConfig) -> dict:
    """``config`` as plain data, every worker token replaced by :data:`REDACTED`: what may be written."""
    data = config.model_dump(mode="json")
    for section in (data["ref"], data["reward"], *data["reward"].get("components", [])):
        if section.get("token"):
            section["token"] = REDACTED
    return data


def to_yaml(config: RunConfig) -> str:
    """The YAML of ``config`` as it may be written to disk: worker tokens redacted."""
    return yaml.safe_dump(redacted_dump(config), sort_keys=False)


def from_yaml_file(path: str | Path) -> RunConfig:
    return validate(_read_yaml(Path(path), "config file"))


def device_problem(config: RunConfig) -> Optional[str]:
    """A GPU preset on a machine without CUDA, said in one line; None when the device is there."""
    if config.card.device != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (f"preset '{config.preset}' needs a CUDA GPU ({config.card.name}) and none is visible; "
            "use --preset cpu-tiny on this machine")


def check_device(config: RunConfig) -> None:
    """A GPU preset on a machine without CUDA: one clear line."""
    problem = device_problem(config)
    if problem:
        raise UserError(problem)


DATA_FILES = (".jsonl", ".json", ".csv", ".parquet")  # what homerlhf.data.read reads as one file
NO_PROMPTS = ("no prompts to train on: pass --data PROMPTS (a .jsonl, .json, .csv or .parquet file, a folder of "
              "them or a hub id; docs/data.md), or set data.prompts")


def check_train(config: RunConfig) -> None:
    """What a train run's config lacks, before anything loads: its prompts and its device, every problem
    found in one line."""
    prompts = config.data.prompts
    problems = [NO_PROMPTS] if not prompts else []
    if prompts and Path(prompts).suffix.lower() in DATA_FILES and not Path(prompts).expanduser().is_file():
        problems.append(f"dataset file not found: {prompts} (check the path)")
    problems += [p for p in (device_problem(config),) if p]
    if problems:
        raise UserError("; ".join(problems))
