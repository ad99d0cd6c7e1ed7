"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # extra="forbid": an unknown key is an error, never silently ignored.
    # frozen=True: the config is never mutated during a run.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
