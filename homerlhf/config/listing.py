"""Every setting of the run config, read from the schema: its dotted key, type, value (a preset's, or what
``--config``/``--set`` made it) and one-line description, for ``homerlhf config`` and ``homerlhf train
--help-config``."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Union

from pydantic import BaseModel

MAX_WORDS = 30  # a description says what the key does; why and how much go in docs/


@dataclass(frozen=True)
class Setting:
    key: str
    type: str
    value: Any
    description: str

    @property
    def shown_value(self) -> str:
        return json.dumps(self.value) if not isinstance(self.value, str) else self.value or '""'


def type_name(annotation: Any) -> str:
    """A field's type as a user writes its value: ``int``, ``float or null``, ``ppo | grpo | rloo``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(named) + (" or null" if type(None) in args else "")
    if origin is list:
        inner = args[0] if args else Any
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return "list of {" + ", ".join(_field_names(inner)) + "}"
        return f"list of {type_name(inner)}"
    return getattr(annotation, "__name__", str(annotation))


def _field_names(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def settings(section: BaseModel, prefix: str = "") -> Iterator[Setting]:
    """Every leaf setting of ``section`` (a RunConfig or one of its sections), in schema order."""
    for name, info in type(section).model_fields.items():
        key = prefix + (info.alias or name)
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from settings(value, key + ".")
            continue
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            value = [item.model_dump(mode="json", by_alias=True, exclude_defaults=True) for item in value]
        yield Setting(key, type_name(info.annotation), value, info.description or "")


CAPS = (40, 24, 24)  # column widths past which a cell pushes its line out instead of widening every line


def render(rows: list[Setting]) -> list[str]:
    """Aligned lines: key, type, value, description (one line a setting)."""
    cells = [(r.key, r.type, r.shown_value) for r in rows]
    width = [min(cap, max((len(c[i]) for c in cells), default=0)) for i, cap in enumerate(CAPS)]
    return [f"{k:<{width[0]}}  {t:<{width[1]}}  {v:<{width[2]}}  {r.description}".rstrip()
            for (k, t, v), r in zip(cells, rows)]
