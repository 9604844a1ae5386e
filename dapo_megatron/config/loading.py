"""Reading a run's configuration: defaults ← a YAML file (with an optional ``base:`` chain) ← dotted command-line
overrides, each value checked against the schema's type hints (:mod:`dapo_megatron.config.schema`) and the whole
validated; and writing the resolved config back as YAML."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from dapo_megatron.config.errors import ConfigError
from dapo_megatron.config.schema import DAPOConfig


# Checked by hand, not with pydantic or OmegaConf: these ~65 lines keep the schema plain dataclasses, refuse "1" and
# true as integers, and name the dotted key (and, for a typo, the known keys). pydantic reaches that strictness on
# stdlib dataclasses only through a JSON round trip (its strict Python mode wants dataclass instances, not mappings)
# and would become a core dependency; OmegaConf has no Literal and converts "1" to 1.
def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check/convert one value against a type hint; raise ConfigError naming the key."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{key}: may not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {options}")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{key}: must be one of {list(get_args(hint))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_hint,) = get_args(hint)
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(hint, value, key)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, where a float needs a dot: `1e-6` and `-1e-4` arrive as strings
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")


def _build(cls: type, values: dict, prefix: str = ""):
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}" + (f" (known: {', '.join(sorted(known))})"))
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` → (``a.b``, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml_tree(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML file as a nested dict. A top-level ``base: other.yaml`` (relative to this file) is read first and
    this file's keys override it — how the ablation configs each change one switch of a shared setup."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save the file "
                          f"as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    tree = loaded or {}
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a file name, got {base!r}")
    return _merge(_read_yaml_tree(path.parent / base, _seen + (path,)), tree)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DAPOConfig:
    """Defaults ← YAML file ← dotted overrides, validated."""
    tree = _read_yaml_tree(Path(path)) if path is not None else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return _build(DAPOConfig, tree).validate()


def config_to_dict(config: DAPOConfig) -> dict:
    """The config the run runs with: every value as set, and the objective's own defaults where it left a setting
    null (``algorithm.objective_defaults_applied``) — what a resume compares and ``config.yaml`` records."""
    tree = dataclasses.asdict(config)
    tree["algorithm"].update(config.algorithm.objective_defaults_applied)
    return tree


def objective_defaults_note(config: DAPOConfig) -> str | None:
    """One line naming the settings ``algorithm.policy_loss``'s own defaults filled, or None."""
    applied = config.algorithm.objective_defaults_applied
    if not applied:
        return None
    listed = ", ".join(f"algorithm.{key}={value}" for key, value in applied.items())
    return f"algorithm.policy_loss={config.algorithm.policy_loss} applied its paper's {listed} (not set in the config)"


def save_config(config: DAPOConfig, path: str | Path) -> None:
    note = objective_defaults_note(config)
    header = f"# {note}\n" if note else ""
    Path(path).write_text(header + yaml.safe_dump(config_to_dict(config), sort_keys=False))
