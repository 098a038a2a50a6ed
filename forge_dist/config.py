"""TOML configs with command-line overrides, for every script (benchmarks, training).

A script declares its defaults as a dict, reads ``--config FILE`` (TOML, standard library)
and then ``--set key=value`` overrides (dotted keys reach into tables; values parse as TOML
scalars, falling back to strings).  Unknown keys are errors, never silently ignored.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A config file or override that does not fit the script's declared keys."""


def _same_type(default: Any, value: Any) -> bool:
    """A value may replace a default of the same type (an int where a float is expected)."""
    if default is None:  # no default to compare with
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return type(default) is type(value)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _merge(base: Dict[str, Any], new: Dict[str, Any], where: str) -> None:
    for key, value in new.items():
        if key not in base:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {sorted(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key!r} must be a table")
            _merge(base[key], value, f"{where}.{key}")
        elif not _same_type(base[key], value):
            raise ConfigError(f"{where}: {key!r} expects a {type(base[key]).__name__} like "
                              f"its default {base[key]!r}, got {value!r}")
        else:
            base[key] = value


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load(defaults: Dict[str, Any], path: Optional[str] = None,
         overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """``defaults`` updated by the TOML file at ``path`` and then by ``key=value`` strings."""
    cfg = copy.deepcopy(defaults)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: no such file {path!r}")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"--config: {path} is not UTF-8 text: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--config: {path} is not valid TOML: {err}") from None
        _merge(cfg, data, str(p))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set: expected key=value, got {item!r}")
        key, text = item.split("=", 1)
        nested: Dict[str, Any] = {}
        cursor = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = _parse_value(text.strip())
        _merge(cfg, nested, "--set")
    return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and repeatable ``--set key=value`` to a parser."""
    parser.add_argument("--config", default=None, help="TOML file with settings")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one setting (repeatable)")


def env_positive_int(name: str, default: Optional[int] = None) -> Optional[int]:
    """The positive integer in environment variable ``name`` (``default`` when unset or
    empty); anything else raises a ``ValueError`` naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}")
    return value


def env_reader(name: str) -> Callable[[], Optional[str]]:
    """A function returning ``os.environ.get(name)`` for per-call switches: it reads the
    dict behind ``os.environ`` (CPython's ``_data``, kept in step by every assignment) with
    the key encoded once, where ``os.environ.get`` encodes the key and goes through the
    Mapping machinery on every call (about 1 us, several times per layer call).  A test that
    replaces ``os.environ`` itself is read the public way."""
    encode = getattr(os.environ, "encodekey", None)
    decode = getattr(os.environ, "decodevalue", None)
    key = encode(name) if encode is not None else name

    def read() -> Optional[str]:
        data = getattr(os.environ, "_data", None)
        if type(data) is dict and decode is not None:
            raw = data.get(key)
            return None if raw is None else decode(raw)
        return os.environ.get(name)
    return read
