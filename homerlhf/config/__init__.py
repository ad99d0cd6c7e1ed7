"""The typed run config, preset loading, overrides and validation."""

from homerlhf.config.loader import (
    NO_PROMPTS,
    REDACTED,
    check_device,
    check_train,
    from_yaml_file,
    load_config,
    preset_names,
    presets_dir,
    redacted_dump,
    to_yaml,
)
from homerlhf.config.schema import RunConfig

__all__ = ["NO_PROMPTS", "REDACTED", "RunConfig", "check_device", "check_train", "from_yaml_file", "load_config",
           "preset_names", "presets_dir", "redacted_dump", "to_yaml"]
