"""`<role>.megatron.override_transformer_config` applied to the `TransformerConfig` arguments megarl
builds, checked against megatron-core's own `TransformerConfig` dataclass (the installed version's
fields are the contract: `dataclasses.fields(TransformerConfig)`).

What megarl derives from its keys and the model (the architecture from config.json, the layout,
the dtype, the engine's own settings) may be repeated with the same value but not changed: a
different value is refused naming where megarl's comes from. megarl's fusion defaults for the
device (`model.fusion_flags`) are defaults only: an override replaces them.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
from typing import Any, Iterable, Mapping

from megarl.config.errors import ConfigError


def transformer_config_fields() -> dict[str, dataclasses.Field]:
    """Name -> field of the installed megatron-core's `TransformerConfig`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name: f for f in dataclasses.fields(TransformerConfig)}


def unknown_names(overrides: Mapping[str, Any], prefix: str, fields: Iterable[str],
                  config_class: str = "TransformerConfig") -> list[str]:
    """One message per override name that is none of `fields`, the field names of megatron-core's
    `config_class` (`prefix`: the overrides' key path)."""
    fields = sorted(fields)
    messages = []
    for name in overrides:
        if name not in fields:
            near = difflib.get_close_matches(str(name), fields, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            messages.append(f"{prefix}.{name}: not a field of megatron-core's {config_class}{hint}")
    return messages


def _read_value(name: str, value: Any, field: dataclasses.Field, prefix: str) -> Any:
    """`value` for `field`: a string for an enum field (e.g. attention_backend=flash, as verl writes it)
    names a member of the enum of the field's default."""
    kind = type(field.default) if isinstance(field.default, enum.Enum) else None
    if kind is None or not isinstance(value, str):
        return value
    if value not in kind.__members__:
        raise ConfigError(f"{prefix}.{name}={value}: not one of {', '.join(kind.__members__)}")
    return kind[value]


def apply_overrides(kwargs: Mapping[str, Any], overrides: Mapping[str, Any], *, prefix: str,
                    fields: Mapping[str, dataclasses.Field], derived: Mapping[str, Any],
                    sources: Mapping[str, str]) -> dict[str, Any]:
    """`kwargs` (megarl's TransformerConfig arguments) with `overrides` on top. `prefix`: the overrides'
    key path; `fields`: `transformer_config_fields()`; `derived`: the arguments megarl derives (a
    subset of `kwargs`), which an override may repeat but not change; `sources`: name -> the key a
    derived value comes from (others: the model's config.json or megarl's engine). Raises a
    ConfigError listing every unknown name and every change of a derived value."""
    problems = unknown_names(overrides, prefix, fields)
    out = dict(kwargs)
    for name, value in overrides.items():
        if name not in fields:
            continue
        value = _read_value(name, value, fields[name], prefix)
        if name in derived and derived[name] != value:
            source = sources.get(name, "the model's config.json or megarl's engine")
            problems.append(f"{prefix}.{name}={value} conflicts with {name}={derived[name]}, which megarl sets "
                            f"from {source}")
        out[name] = value
    if problems:
        raise ConfigError("invalid transformer overrides:\n" + "\n".join(f"  - {p}" for p in problems))
    return out
