"""The typed run config, preset loading, overrides and validation."""

from homerlhf.config.loader import (
    REDACTED,
    check_device,
    from_yaml_file,
    load_config,
    preset_names,
    presets_dir,
    redacted_dump,
    to_yaml,
)
from homerlhf.config.schema import RunConfig

__all__ = ["REDACTED", "RunConfig", "check_device", "from_yaml_file", "load_config", "preset_names", "presets_dir",
           "redacted_dump", "to_yaml"]
