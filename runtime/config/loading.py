"""TOML in, a checked ``Config`` out (every key known and of its type), and back to a dict."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

from runtime.config.checks import validate
from runtime.config.sections import Config, ConfigError


def _check_type(key: str, value: object, hint: object) -> object:
    if typing.get_origin(hint) is tuple:  # tuple[str, ...]: a TOML list of strings, kept immutable
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config key '{key}' must be a list of strings, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = hint if isinstance(hint, type) else None
    if expected is None or isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"config key '{key}' must be {name}, got {type(value).__name__} {value!r}")
    return value


def _optional_section(hint: object) -> object:
    """``Section | None`` (a table that may be absent) as ``Section``; other hints unchanged."""
    args = typing.get_args(hint)
    if len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if dataclasses.is_dataclass(inner):
            return inner
    return hint


def _build(cls: type, table: dict, prefix: str) -> object:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown config key '{dotted}' (known: {', '.join(sorted(known))})")
        hint = _optional_section(hints[key])
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{dotted}' must be a table")
            values[key] = _build(hint, value, f"{dotted}.")
        else:
            values[key] = _check_type(dotted, value, hint)
    return cls(**values)


def parse_config(table: dict, base_dir: Path | None = None) -> Config:
    """Build a Config from a parsed TOML table; relative model paths resolve against ``base_dir``."""
    config = _build(Config, table, "")
    assert isinstance(config, Config)
    if not config.model.path:
        raise ConfigError("config key 'model.path' is required (a folder holding an MLX model)")
    path = Path(config.model.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        candidate = (base_dir / path).resolve()
        # Configs in configs/ name repo paths relative to the repo root or to themselves.
        path = candidate if candidate.exists() else path.resolve()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(path)))
    validate(config)
    return config


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return parse_config(table, base_dir=path.parent)


def config_to_dict(config: Config) -> dict:
    """Plain-dict form, for handing the config to the worker process (absent sections left out)."""
    return {key: value for key, value in dataclasses.asdict(config).items() if value is not None}
