"""The field helper every config dataclass uses: a default plus the help text `tars config` prints."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def f(default: Any, help: str, **kw):
    """A dataclass field with help text (mutable defaults are copied)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)
