"""The typed run config, preset loading, overrides and validation."""

from homerlhf.config.loader import (
    check_device,
    from_yaml_file,
    load_config,
    preset_names,
    presets_dir,
    to_yaml,
)
from homerlhf.config.schema import RunConfig

__all__ = ["RunConfig", "check_device", "from_yaml_file", "load_config", "preset_names", "presets_dir", "to_yaml"]
