"""Strict dataclass configs loaded from YAML plus `key=value` overrides.

One dataclass tree per entry point. An unknown key is an error naming the key and the
file; a value of the wrong type names the field. No hydra-style composition: what the
YAML says, plus the command-line overrides, is the whole config.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def option(help: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A config field with its help text in `metadata["help"]` (as TRL's configs do); the
    help is what `--help-config` prints and docs/config-reference.md is generated from."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the file."""

    key_path: str | None = None   # the dotted key it is about (an unknown or mistyped one), when known


def in_range(name: str, value: float, low: float | None = None, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False) -> None:
    """A ValueError unless `value` is a finite number within [low, high] (an open end
    excluded), e.g. in_range("train.lr", lr, 0, low_open=True) for lr > 0; a config's
    validate() calls it for every numeric setting."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    bad = ((low is not None and (value <= low if low_open else value < low))
           or (high is not None and (value >= high if high_open else value > high)))
    if bad:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
        raise ValueError(f"{name} must be {lo}{' and ' if lo and hi else ''}{hi}, got {value}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `3e-4` (no dot) as a string; accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected float, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected int, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected bool (true/false), got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected str, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def _build(cls: type[T], data: dict, where: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
        e = ConfigError(f"{where}: unknown key {k!r} ({f'did you mean {near[0]!r}? ' if near else ''}"
                        f"valid keys: {', '.join(sorted(fields))})")
        e.key_path = f"{where}.{k}" if where else str(k)
        raise e
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        try:
            kwargs[name] = _coerce(value, hints[name], key)
        except ConfigError as e:
            if e.key_path is None:
                e.key_path = key
            raise
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing required key {missing[0]!r}")
    try:
        obj = cls(**kwargs)  # some configs check themselves in __post_init__
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. train.max_steps=10)")
    key, raw = text.split("=", 1)
    # YAML parsing gives `true`, `3`, `1e-4`, `[a, b]` their natural types.
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    for ov in overrides:
        path, value = parse_override(ov)
        node = data
        for part in path[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ConfigError(f"{source}: override {ov!r}: {part!r} is not a section")
            node = node[part]
        node[path[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Fill `cls` from a YAML file and `key=value` overrides; errors name key and file."""
    data: dict = {}
    source = "<overrides>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder, not a YAML file")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    data = apply_overrides(data, overrides or [], source)
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        msg = str(e)
        msg = msg[2:] if msg.startswith(": ") else msg.lstrip(".")
        ov = _override_of(e.key_path, overrides or [])
        if ov is not None:   # the command line's mistake, not the file's
            on = f" (on top of {source})" if path is not None else ""
            raise ConfigError(f"command-line override {ov!r}{on}: {msg}") from None
        raise ConfigError(f"{source}: {msg}") from None


def _override_of(key_path: str | None, overrides: list[str]) -> str | None:
    """The last override that set `key_path`, a section above it or a key below it."""
    if not key_path:
        return None
    for ov in reversed(overrides):
        key = ov.split("=", 1)[0].strip()
        if key == key_path or key_path.startswith(key + ".") or key.startswith(key_path + "."):
            return ov
    return None


def checked(cfg, source: str):
    """`cfg` after every section's validate() (load_config runs them; a config changed
    with dataclasses.replace must pass them too), or a ConfigError naming `source`."""
    def walk(obj, where: str):
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{where}.{f.name}" if where else f.name)
            check = getattr(obj, "validate", None)
            if callable(check):
                try:
                    check()
                except ValueError as e:
                    raise ConfigError(f"{source}: {where + ': ' if where else ''}{e}") from None
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{where}.{k}")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")
    walk(cfg, "")
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) of every field of a config tree, nested sections
    flattened to dotted keys; a `dict[str, Section]` field lists the section's keys
    under `<key>.<name>`. The help text is each field's `metadata["help"]`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        help_ = f.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            rows.append((key, tp.__name__, "", help_))
            rows.extend(config_rows(tp, key + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        shown = str(tp).replace("typing.", "") if typing.get_origin(tp) else _type_name(tp)
        rows.append((key, shown, default, help_))
        args = typing.get_args(tp)
        if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            rows.extend(config_rows(args[1], key + ".<name>."))
        elif typing.get_origin(tp) in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
            rows.extend(config_rows(args[0], key + "[]."))
    return rows


def describe_fields(cls: type, prefix: str = "") -> list[str]:
    """One line per key: `key: type = default  help` (what `--help-config` prints)."""
    return [f"{k}: {t}" + (f" = {d}" if d else "") + (f"\n    {h}" if h else "")
            for k, t, d, h in config_rows(cls, prefix)]
