"""Build an ExperimentConfig from defaults, YAML files and dotted command-line overrides.

Order, later wins: schema defaults -> YAML file (after the files in its `defaults:` list) ->
overrides `a.b.c=value` in command-line order. Values are parsed as YAML (`[a, b]` is a list,
`null` is None, `1e-6` is read as a float where the schema wants one). `${a.b}` inside a string
is replaced by the value at `a.b` after all merging. Every problem found is reported at once,
each line naming the key path and where its value came from.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.config.errors import ConfigError
from megarl.config.schema import ExperimentConfig
from megarl.config.verl_compat import (VERL_TRANSFORMER_DEFAULTS, check_value, map_verl_values, pop_verl_keys,
                                       resolve_verl_groups, verl_key, warn_key)
from megarl.config.verl_groups import apply_groups, split_groups
from megarl.config.verl_sft import sft_override

_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")
_DEFAULTS_KEY = "defaults"  # a YAML file's list of base files, merged before the file itself


# --------------------------------------------------------------------------------------------
# Schema introspection
# --------------------------------------------------------------------------------------------
def _fields(cls) -> dict[str, Any]:
    """Field name -> resolved type annotation, for a dataclass type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _strip_optional(tp):
    """(inner type, allows None)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_free_dict(tp) -> bool:
    return typing.get_origin(_strip_optional(tp)[0]) is dict


def schema_paths(cls=ExperimentConfig, prefix: str = "") -> list[str]:
    """Every leaf key path of the schema (free-form dicts count as leaves)."""
    out = []
    for name, tp in _fields(cls).items():
        inner, _ = _strip_optional(tp)
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(inner):
            out.extend(schema_paths(inner, path + "."))
        else:
            out.append(path)
    return out


def _type_at(path: list[str]):
    """(type of the schema node at `path`, index where a free-form dict starts or None).

    Raises KeyError with the first unknown component's index if the path leaves the schema.
    """
    tp: Any = ExperimentConfig
    for i, part in enumerate(path):
        inner, _ = _strip_optional(tp)
        if typing.get_origin(inner) is dict:
            return inner, i
        if not dataclasses.is_dataclass(inner) or part not in _fields(inner):
            raise KeyError(i)
        tp = _fields(inner)[part]
    inner, _ = _strip_optional(tp)
    return inner, (len(path) if typing.get_origin(inner) is dict else None)


def _suggest(path: str) -> str:
    """' (did you mean ...?)' for an unknown key path, or ''."""
    paths = schema_paths()
    close = difflib.get_close_matches(path, paths, n=1, cutoff=0.75)
    if not close:  # the right leaf name in the wrong group, e.g. trainer.adv_estimator
        leaf = path.rsplit(".", 1)[-1]
        close = [p for p in paths if p.rsplit(".", 1)[-1] == leaf][:1]
    if not close:
        leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
        near = difflib.get_close_matches(path.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.8)
        close = [leaves[near[0]]] if near else []
    return f" (did you mean '{close[0]}'?)" if close else ""


# --------------------------------------------------------------------------------------------
# YAML files
# --------------------------------------------------------------------------------------------
def _merge(base: dict, top: dict, origins: dict, source: str, prefix: str = "") -> dict:
    """Deep-merge `top` into a copy of `base`; record `source` for every leaf `top` sets."""
    out = dict(base)
    for key, value in top.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, origins, source, path + ".")
        else:
            out[key] = value
            origins[path] = source
            if isinstance(value, dict):
                for sub in _leaf_paths(value, path + "."):
                    origins[sub] = source
    return out


def _leaf_paths(tree: dict, prefix: str) -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.extend(_leaf_paths(value, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}")
    return out


def read_yaml_experiment(path: str | Path, origins: dict, _stack: tuple = ()) -> dict:
    """Read an experiment file and the base files named in its `defaults:` list (relative
    to the file), merged in order with the file itself on top."""
    path = Path(path)
    if not path.is_file():
        where = f" (included from {_stack[-1]})" if _stack else ""
        raise ConfigError(f"config file not found: {path}{where}")
    resolved = path.resolve()
    if resolved in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, resolved))
        raise ConfigError(f"config include cycle: {chain}")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}:{where}: invalid YAML: {problem}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: an experiment file must be a mapping of config groups, got {type(tree).__name__}")
    bases = tree.pop(_DEFAULTS_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: '{_DEFAULTS_KEY}' must be a list of YAML file paths")
    merged: dict = {}
    for base in bases:
        base_tree = read_yaml_experiment(path.parent / base, origins, (*_stack, resolved))
        merged = _merge(merged, base_tree, {}, "")
    return _merge(merged, tree, origins, str(path))


# --------------------------------------------------------------------------------------------
# Command-line overrides
# --------------------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[list[str], Any, bool]:
    """'a.b.c=value' -> (['a','b','c'], parsed value, is_addition for a leading '+'). Hydra's '++'
    (add the key or override it, whichever applies) is read as '+' inside a free-form dict and as
    a plain override elsewhere (apply_override)."""
    add = text.startswith("+")
    body = text[2:] if text.startswith("++") else text[1:] if add else text
    key, sep, raw = body.partition("=")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*", key):
        hint = " (a YAML experiment file goes after --config)" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}': expected key.path=value (e.g. trainer.nnodes=2){hint}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # e.g. an unquoted string with a colon: keep it verbatim
    return key.split("."), value, add


def apply_override(tree: dict, text: str, origins: dict) -> None:
    """Apply one override to the raw config tree in place; ConfigError if it cannot apply."""
    path, value, add = parse_override(text)
    force = text.startswith("++")
    dotted = ".".join(path)
    try:
        _, free_from = _type_at(path)
    except KeyError as exc:
        bad = ".".join(path[: exc.args[0] + 1])
        hint = " ('+' adds keys only inside free-form dicts such as actor_rollout_ref.model.override_config)" if add else ""
        raise ConfigError(f"override '{text}': unknown key '{bad}'{_suggest(dotted)}{hint}") from None
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None and free_from is not None and i >= free_from:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{text}': '{'.'.join(path[: i + 1])}' holds a value, not a group of keys")
        node = child
    exists = path[-1] in node
    inside_free = free_from is not None and free_from < len(path)
    if add and not inside_free and not force:
        raise ConfigError(
            f"override '{text}': '+' adds keys only inside free-form dicts; "
            f"'{dotted}' is a schema key, so write '{text[1:]}' (Hydra, and so verl, refuses it too: "
            f"\"Could not append to config. An item is already at '{dotted}'\"; '++' sets it either way)"
        )
    # verl's defaults define some keys of a free-form dict (override_transformer_config's recompute_* and
    # attention_backend, engine/megatron.yaml), which verl's scripts then override without '+'
    verl_default = inside_free and path[-2] == "override_transformer_config" and path[-1] in VERL_TRANSFORMER_DEFAULTS
    if inside_free and not exists and not add and not verl_default:
        raise ConfigError(
            f"override '{text}': '{dotted}' does not exist in the free-form dict "
            f"'{'.'.join(path[:free_from])}'; add it with '+{text}'"
        )
    node[path[-1]] = value
    origins[dotted] = f"override '{text}'"
    if isinstance(value, dict):
        for sub in _leaf_paths(value, dotted + "."):
            origins[sub] = f"override '{text}'"


# --------------------------------------------------------------------------------------------
# Interpolation and typed construction
# --------------------------------------------------------------------------------------------
def _lookup(tree: dict, dotted: str):
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _interpolate(tree: dict, node: Any, path: str, errors: list, depth: int = 0) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(tree, v, f"{path}{k}.", errors, depth) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(tree, v, path, errors, depth) for v in node]
    if not isinstance(node, str) or "${" not in node:
        return node
    if depth > 10:
        errors.append(f"{path.rstrip('.')}: interpolation nests too deeply (a cycle?)")
        return node

    def resolve(ref: str):
        try:
            value = _lookup(tree, ref)
        except KeyError:
            errors.append(f"{path.rstrip('.')}: '${{{ref}}}' refers to an unknown key{_suggest(ref)}")
            return None
        return _interpolate(tree, value, path, errors, depth + 1)

    whole = _INTERP.fullmatch(node)
    if whole:  # a lone reference keeps the referred value's type
        return resolve(whole.group(1))
    return _INTERP.sub(lambda m: str(resolve(m.group(1))), node)


def _type_name(tp) -> str:
    inner, optional = _strip_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        name = f"a list of {_type_name(typing.get_args(inner)[0])}"
    elif typing.get_origin(inner) is dict:
        name = "a mapping"
    elif dataclasses.is_dataclass(inner):
        name = "a group of keys"
    else:
        name = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
            inner, getattr(inner, "__name__", str(inner))
        )
    return name + (" or null" if optional else "")


class _Bad(Exception):
    pass


def _coerce(value: Any, tp) -> Any:
    """Convert a parsed YAML value to schema type `tp`; raise _Bad(reason) if impossible."""
    inner, optional = _strip_optional(tp)
    if value is None:
        if optional or inner is Any:
            return None
        raise _Bad("must not be null")
    if inner is Any:
        return value
    origin = typing.get_origin(inner)
    if origin is Literal:
        choices = typing.get_args(inner)
        if value in choices:
            return value
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise _Bad(f"{value!r} is not {_type_name(tp)}{hint}")
    if origin is list:
        item_tp = typing.get_args(inner)[0]
        items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, str) else None
        if items is None:
            raise _Bad(f"{value!r} is not {_type_name(tp)}")
        return [_coerce(v, item_tp) for v in items]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"{value!r} is not a mapping")
        value_tp = typing.get_args(inner)[1]
        coerced = {}
        for key, item in value.items():
            try:
                coerced[str(key)] = _coerce(item, value_tp)
            except _Bad as exc:
                raise _Bad(f"{key}: {exc}") from None
        return coerced
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                if number.is_integer():
                    return int(number)
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise _Bad(f"{value!r} is not {_type_name(tp)}")


def build(cls, tree: dict, prefix: str, origins: dict, errors: list):
    """Construct dataclass `cls` from a raw mapping, appending every problem to `errors`."""
    fields = _fields(cls)
    kwargs = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        where = origins.get(path) or next((o for p, o in origins.items() if p.startswith(path + ".")), "")
        where = f" [from {where}]" if where else ""
        if key not in fields:
            errors.append(f"{path}: unknown key{_suggest(path)}{where}")
            continue
        tp = fields[key]
        inner, optional = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            if value is None and optional:
                kwargs[key] = None
            elif isinstance(value, dict):
                kwargs[key] = build(inner, value, path + ".", origins, errors)
            else:
                errors.append(f"{path}: expected a group of keys, got {value!r}{where}")
            continue
        try:
            kwargs[key] = _coerce(value, tp)
        except _Bad as exc:
            errors.append(f"{path}: {exc}{where}")
    return cls(**kwargs)


def _verl_override(text: str, grouped: dict, source: str | None = None) -> str | None:
    """`text`, or its rewrite for a verl key of megarl.config.verl_compat (None: dropped, or kept in
    `grouped` for resolve_verl_groups), warning once. `source`: where it came from (default: the
    override `text`)."""
    path, value, _ = parse_override(text)
    source = source or f"override '{text}'"
    entry = verl_key(".".join(path))
    if entry is None:
        return text
    if entry.grouped:
        grouped[".".join(path)] = (value, source)
        return None
    check_value(".".join(path), entry, value, source)
    warn_key(".".join(path), entry, source)
    return None if entry.target is None else f"{entry.target}={text.partition('=')[2]}"


def _drop_empty_groups(tree: dict, cls) -> None:
    """Remove the groups that pop_verl_keys emptied and the schema does not have (e.g. verl's `reward:`)."""
    fields = _fields(cls)
    for key in [k for k, v in tree.items() if v == {} and k not in fields]:
        del tree[key]


def load_config(config_file: str | Path | None = None, overrides: list[str] = (),
                verl_sft: bool = False) -> ExperimentConfig:
    """Defaults, then the YAML experiment (if any), then overrides; typed and interpolated.
    `verl_sft`: the overrides are verl's SFT trainer's (megarl.config.verl_sft.sft_override rewrites each).

    Raises ConfigError listing every problem. Semantic checks live in megarl.config.validate.
    """
    origins: dict[str, str] = {}
    grouped: dict[str, tuple[Any, str]] = {}  # verl keys read together (verl_compat.resolve_verl_groups)
    tree = dataclasses.asdict(ExperimentConfig())
    if config_file is not None:
        tree = _merge(tree, read_yaml_experiment(config_file, origins), {}, "")
        pop_verl_keys(tree, origins, grouped)  # verl's keys megarl accepts (megarl.config.verl_compat), one warning each
        _drop_empty_groups(tree, ExperimentConfig)
    errors: list[str] = []
    overrides, groups = split_groups(list(overrides), verl_sft, errors)  # verl's Hydra group choices first
    for text in overrides:
        megarl_text = text
        try:
            for megarl_text in sft_override(text) if verl_sft else [text]:
                rewritten = _verl_override(megarl_text, grouped, f"override '{text}'")
                if rewritten is not None:
                    apply_override(tree, rewritten, origins)
                    if megarl_text != text:  # problems found later name the override as given
                        origins[".".join(parse_override(rewritten)[0])] = f"override '{text}'"
        except ConfigError as exc:
            errors.append(str(exc) if megarl_text == text else f"override '{text}': megarl's {megarl_text}: {exc}")
    errors += apply_groups(tree, groups, origins)
    errors += resolve_verl_groups(tree, grouped, origins)
    map_verl_values(tree, origins)
    tree = _interpolate(tree, tree, "", errors)
    config = build(ExperimentConfig, tree, "", origins, errors)
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))
    return config
