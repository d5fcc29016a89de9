"""Config values into their fields' types: YAML (a preset, a --config file) and `--set key=value` text.

A `--set` value is kept as the text it is (Text) until its field is known: a text field (type str) takes it as it
is (`--set actor.judge_mode=off` is "off", `envd.auth_token=0x1F` is "0x1F"); any other field reads it as YAML
(`actor.env_ids=[a, b]`, `learner.lr=1e-3`), and text that is not YAML is a ConfigError. In a YAML file, a text
field given another YAML type (`judge_mode: off` is the boolean false in YAML, `0755` a number) is a ConfigError that
says to quote it: read as it was, its text would change silently. After the types: a number outside its field's
range (f(..., lo=, hi=), or gt= for a bound it may not equal), a float that is not finite (nan, .inf) or a text not
among its field's choices (f(..., choices=)) is a ConfigError too. A boolean is not a number here (to Python,
True == 1): `actors: true` or `--set actor.concurrency=true` is a ConfigError, and a boolean field takes true / false
(or the text forms _coerce lists), 0 or 1, nothing else.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import yaml


EXIT_USER = 2  # the exit status of a command that ended with a UserError (tars.cli; the supervisor of `tars up`)


class UserError(ValueError):
    """A mistake in what the user asked for (a path, a value, a task id): `tars` prints the message as one line and
    exits with status 2, with no traceback (tars.cli.main). Raise it, or a subclass, only before work starts."""


class ConfigError(UserError):
    """A config value, key, preset or file that cannot be used."""


class Text(str):
    """The text of a `--set` value, not yet read: its field's type decides how (module docstring)."""


class _UniqueKeys(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last silently, so a second
    `learner:` section in a --config file dropped every setting of the first. A `<<` merge may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping (line {key_node.start_mark.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a mapping with a key given twice is a yaml.YAMLError (a config or suite file)."""
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass


def _yaml(text: str, where: str) -> Any:
    """`--set` text read as YAML; ConfigError (one line) when it is not YAML."""
    try:
        return yaml.safe_load(str(text))
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{where}: {str(text)!r} is not a valid YAML value ({why})") from None


def _not_text(where: str, value: Any) -> ConfigError:
    key = where.rsplit(".", 1)[-1]
    kind = {bool: "the boolean", int: "the number", float: "the number", list: "the list", dict: "the mapping"}
    what = "an empty (null) value" if value is None else f"{kind.get(type(value), type(value).__name__)} {value!r}"
    return ConfigError(f"{where}: YAML read this value as {what}, not text (YAML reads off/on/yes/no as booleans and "
                       f"0755, 0x1F as numbers): quote the value as written, {key}: \"...\" ({key}: \"\" for empty)")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if tp is str:
        if not isinstance(value, str):
            raise _not_text(where, value)
        return str(value)  # a plain str, Text or not
    if isinstance(value, Text):
        value = "" if value == "" else _yaml(value, where)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: {value!r} is not a boolean")
        if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise ConfigError(f"{where}: {value!r} is not a boolean (true | false, or 0 | 1)")
    if tp in (int, float):
        if isinstance(value, bool):  # a bool is an int to Python: `actors: true` would run 1 actor
            raise ConfigError(f"{where}: {value!r} is a boolean, not {tp.__name__}")
        try:
            return tp(value) if not (tp is int and isinstance(value, float) and not value.is_integer()) else _fail(where, value, tp)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {value!r} is not {tp.__name__}") from None
    if tp is list or origin is list:
        if isinstance(value, str):
            value = _yaml(value, where) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list")
        return value
    if tp is dict or origin is dict:
        if isinstance(value, str):
            value = _yaml(value, where)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return _read_texts(value, where)
    return value


def _read_texts(d: dict, where: str) -> dict:
    """A mapping field's entries that `--set` put in by key (`actor.chat_template_kwargs.enable_thinking=false`),
    read as YAML as the whole mapping would be (`...kwargs={enable_thinking: false}`): the entry's type is unknown, so
    it is not text by default (a Text left in would stay the string "false", and YAML could not save it)."""
    return {k: ("" if v == "" else _yaml(v, f"{where}.{k}")) if isinstance(v, Text)
            else _read_texts(v, f"{where}.{k}") if isinstance(v, dict) else v for k, v in d.items()}


def _fail(where, value, tp):
    raise ConfigError(f"{where}: {value!r} is not {tp.__name__}")


def _check(fl: dataclasses.Field, v: Any, where: str) -> None:
    """A given value against its field's range (lo=, hi=) and choices (core.config_fields.f); a float must be finite
    (NaN passes every comparison, so every range check)."""
    lo, hi, choices = fl.metadata.get("lo"), fl.metadata.get("hi"), fl.metadata.get("choices")
    lo_open = fl.metadata.get("lo_open", False)  # f(..., gt=): v > lo
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where} = {v!r}: must be a finite number")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and (
            (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi)):
        rng = (f"in {'(' if lo_open else '['}{lo}, {hi}]" if lo is not None and hi is not None
               else f"{'>' if lo_open else '>='} {lo}" if lo is not None else f"<= {hi}")
        raise ConfigError(f"{where} = {v!r}: must be {rng}")
    if choices and v not in choices:
        raise ConfigError(f"{where} = {v!r}: must be one of {' | '.join(choices)}")


def from_dict(cls, d: dict, where: str = ""):
    hints = typing.get_type_hints(cls)
    names = {fl.name for fl in dataclasses.fields(cls)}
    unknown = set(d) - names
    moved = {k: getattr(cls, "MOVED", {})[k] for k in sorted(unknown) if k in getattr(cls, "MOVED", {})}
    if moved:  # a key of an older layout: say where it lives now
        where_ = f"{where}." if where else ""
        raise ConfigError("renamed config key(s): " + ", ".join(f"{where_}{k} is now {v}" for k, v in moved.items()))
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)} in {where or cls.__name__}")
    kw = {k: _coerce(hints[k], v, f"{where}.{k}".lstrip(".")) for k, v in d.items()}
    for fl in dataclasses.fields(cls):
        if fl.name in kw:
            _check(fl, kw[fl.name], f"{where}.{fl.name}".lstrip("."))
    return cls(**kw)


def apply_override(d: dict, key: str, value: str) -> None:
    """`--set key=value` into the config mapping d, the value kept as Text until its field reads it."""
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"{key}: {p} is not a section")
    cur[parts[-1]] = Text(value)
