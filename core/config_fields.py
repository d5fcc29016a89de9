"""The field helper every config dataclass uses: a default plus the help text `tars config` prints."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def f(default: Any, help: str, lo: float | None = None, hi: float | None = None, choices: tuple[str, ...] = (),
      **kw):
    """A dataclass field with help text (mutable defaults are copied); lo/hi: the range a number must lie in
    (inclusive); choices: the values a text setting may take. Both are checked when a config is loaded
    (core.config_values.from_dict)."""
    meta = {"help": help, **({"lo": lo} if lo is not None else {}), **({"hi": hi} if hi is not None else {}),
            **({"choices": tuple(choices)} if choices else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
