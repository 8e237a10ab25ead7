"""A run's config as TOML: read from a file and `section.key=value` command-line overrides, each
value checked against its key's type, and written back (`<run_dir>/config.toml`).

Generic over the root dataclass whose fields are the sections (spmd_rl.config.run_config.Config, which
spmd_rl.config.run_config's `load_config` passes in): this module knows no section, so the config module
can use it without an import circle.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from typing import Any, TypeVar

from spmd_rl.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")


def load(root: type[T], path: str | None = None, overrides: list[str] | None = None) -> T:
    """A `root` config from a TOML file (optional) and `section.key=value` overrides."""
    raw: dict[str, Any] = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist: pass an existing TOML file to --config")
        with open(path, "rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    for item in overrides or []:
        key, value = _split_override(item, root)
        section, name, *path = key.split(".")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {item!r}: {section!r} is a section, not a value")
        if not path:
            raw[section][name] = _parse_override_value(value)
            continue
        # section.key.entry[.entry...]: one entry of a table-valued key (rollout.engine_kwargs)
        sections = typing.get_type_hints(root)
        hint = typing.get_type_hints(sections[section]).get(name) if section in sections else None
        if hint is not None and typing.get_origin(hint) is not dict:
            raise ConfigError(f"override key {key!r} must be section.key (e.g. actor.lr): only table keys "
                              f"(rollout.engine_kwargs) take section.key.entry")
        table = raw[section]
        for i, part in enumerate([name, *path[:-1]]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {item!r}: {'.'.join([section, name, *path][:i + 2])} is "
                                  f"{table!r}, not a table")
        table[path[-1]] = _parse_override_value(value)
    return from_dict(root, raw)


def from_dict(root: type[T], raw: dict[str, Any]) -> T:
    """A `root` config from TOML tables: every key known, every value of its key's type."""
    cfg = root()
    sections = typing.get_type_hints(root)
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown config section [{section}]{_did_you_mean(section, list(sections))}: "
                              f"valid sections are {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
        target = getattr(cfg, section)
        hints = typing.get_type_hints(type(target))
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in hints:
                raise ConfigError(f"unknown config key {key!r}{_did_you_mean(key, all_keys(root))}; see "
                                  "docs/config.md for all keys")
            setattr(target, name, _coerce(key, value, hints[name]))
    return cfg


def all_keys(root: type) -> list[str]:
    """Every "section.key" of `root`."""
    return [f"{section}.{name}" for section, cls in typing.get_type_hints(root).items()
            for name in typing.get_type_hints(cls)]


def _did_you_mean(wrong: str, known: list[str]) -> str:
    """" (did you mean a, b?)" naming at most three entries of `known` ("section.key"s, or section
    names) close to `wrong`: a close spelling in its section, the same key in another section, the
    same first letters; "" when none is."""
    section, _, name = wrong.rpartition(".")
    mine = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    close = [mine[n] for n in difflib.get_close_matches(name, list(mine), n=3, cutoff=0.75)]
    close += [k for k in known if k.rpartition(".")[2] == name]
    close += [k for n, k in mine.items() if n.startswith(name[:3])]
    close = list(dict.fromkeys(close))[:3]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _split_override(item: str, root: type) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. actor.lr=1e-6)")
    key, value = item.split("=", 1)
    key = key.strip().lstrip("-")
    if key.count(".") < 1 or not all(key.split(".")):
        hint = _did_you_mean(key, all_keys(root)) or " (e.g. actor.lr)"
        raise ConfigError(f"override key {key!r} must be section.key{hint}")
    return key, value.strip()


def _parse_override_value(text: str) -> Any:
    """TOML value syntax (1e-6, true, [1, 2], "x"); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # `bool | Auto`: the first type that takes the value
        for arg in typing.get_args(hint):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {_one_of([w for a in typing.get_args(hint) for w in _expected(a)])}, "
                          f"got {value!r}")
    if origin is typing.Literal:
        if isinstance(value, str) and value in typing.get_args(hint):
            return value
        raise ConfigError(f"{key} must be {_one_of(_expected(hint))}, got {value!r}")
    if origin is dict:  # a table of TOML values handed on as they are (rollout.engine_kwargs)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}: write {key}={{name=value}} or "
                              f"{key}.name=value on the command line, a [{key}] table in the config file")
        return {k: _table_value(f"{key}.{k}", v) for k, v in value.items()}
    if origin is list:  # the rule is stated in docs/config.md's header (spmd_rl/config/reference.py)
        (item_type,) = typing.get_args(hint)
        if isinstance(value, str) and (value.lstrip().startswith("[") or "," in value):
            raise ConfigError(f"{key} = {value!r} is not a list: {list_syntax(key, item_type)}")
        if not isinstance(value, (list, dict)):  # one value: a list of one ("" none)
            value = [value] if value != "" else []
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}: {list_syntax(key, item_type)}")
        return [_coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r} (quote it)")
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover


def _expected(hint: Any) -> list[str]:
    """A type's values in words, for a refusal."""
    if typing.get_origin(hint) is typing.Literal:
        return [f'"{v}"' for v in typing.get_args(hint)]
    return {bool: ["true", "false"], int: ["an integer"], float: ["a number"], str: ["a string"]}.get(hint, [str(hint)])


def _one_of(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def list_syntax(key: str, item_type: type) -> str:
    """How a list is written on the command line, for `key`'s messages."""
    example = '["a.parquet", "b.parquet"]' if item_type is str else "[1, 2]"
    return f"write a TOML list, quoted for the shell: {key}='{example}' (one value alone needs no brackets)"


def _table_value(key: str, value: Any) -> Any:
    """A copy of a value inside a table key: TOML's strings, numbers, booleans, lists and tables
    (no dates and times: nothing takes them, and config.toml would not keep them)."""
    if isinstance(value, dict):
        return {k: _table_value(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, list):
        return [_table_value(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(f"{key} = {value!r}: a date or time is not a value here; quote it as a string")



def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def to_toml(cfg: Any, notes: dict[str, str] | None = None) -> str:
    """The resolved config as TOML (saved into the run directory); `notes`: a comment after the
    value of each "section.key" it names."""
    notes = notes or {}

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table, so the section's later keys stay in the section
            return "{" + ", ".join(f"{k if _BARE_KEY.fullmatch(k) else fmt(k)} = {fmt(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" + (f"  # {notes[f'{section}.{k}']}" if f"{section}.{k}" in notes else "")
                  for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)
