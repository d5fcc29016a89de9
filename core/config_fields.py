"""The field helper every config dataclass uses: a default plus the help text `tars config` prints."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def f(default: Any, help: str, lo: float | None = None, hi: float | None = None, choices: tuple[str, ...] = (),
      gt: float | None = None, **kw):
    """A dataclass field with help text (mutable defaults are copied); lo/hi: the range a number must lie in
    (inclusive); gt: an exclusive lower bound instead of lo (a timeout or a scale that 0 would break: gt=0), kept as
    lo with lo_open; choices: the values a text setting may take. All are checked when a config is loaded
    (core.config_values.from_dict)."""
    if gt is not None:
        if lo is not None:
            raise TypeError("f(): lo or gt, not both")
        lo = gt
    meta = {"help": help, **({"lo": lo} if lo is not None else {}), **({"hi": hi} if hi is not None else {}),
            **({"lo_open": True} if gt is not None else {}), **({"choices": tuple(choices)} if choices else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
