"""One UI-TARS action, the same value from the actor's parser to envd's backends.

The parser (actor/parsing.py) produces it, the actor's env client sends it (`to_proto`), envd decodes it once
(`from_proto`) and hands it to the backend, which reads its attributes. `actor.tiny.format_action` writes it back
as text, and scripted policies (the builtin oracle, envd.hints) return it. Two encodings exist and only two:
the wire message tars.v1.Action (`to_proto` / `from_proto`) and a plain dict for JSON and msgpack records
(`to_dict` / `from_dict`: a trajectory turn's parsed action, a hint in a step's info).

The type holds what is true of every action whatever the backend: a known type, points of two finite numbers,
string fields. What an action needs to be applicable (a click's point or target, a drag's end point, a point inside
the screen: `check_on_screen`, a key the backend knows) is each backend's to check: only it knows its screen and its
action space.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

ACTION_TYPES = ("click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait", "finished", "call_user")
CLICKS = ("click", "left_double", "right_single")
# The model's text travels with the action for logs only; a bound keeps a degenerate answer off the wire.
MAX_RAW = 4096

Point = tuple[float, float]
_TEXT = ("content", "key", "direction", "target")


class ActionError(ValueError):
    """The action is malformed or not applicable here; whoever raised it changed nothing."""


def _point(p: Any, what: str) -> Point | None:
    if p is None:
        return None
    if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) != 2:
        raise ActionError(f"{what} must be [x, y] (two numbers), got {p!r}")
    try:
        x, y = float(p[0]), float(p[1])
    except (TypeError, ValueError, OverflowError):
        raise ActionError(f"{what} must be two numbers, got {p!r}") from None
    if not (math.isfinite(x) and math.isfinite(y)):  # NaN compares false with every bound a backend checks
        raise ActionError(f"{what} must be two finite numbers, got {[x, y]}")
    return x, y


@dataclass(frozen=True)
class Action:
    type: str
    point: Point | None = None        # screen pixels once on the wire (the parser's are model coordinates)
    end_point: Point | None = None    # drag only
    content: str = ""                 # type / finished / call_user; a trailing "\n" on `type` means "press Enter"
    key: str = ""                     # hotkey, e.g. "ctrl c"
    direction: str = ""               # scroll: up|down|left|right
    target: str = ""                  # our text-addressed extension: element label or ref
    raw: str = ""                     # the model's text, for logs

    def __post_init__(self) -> None:
        if self.type not in ACTION_TYPES:
            raise ActionError(f"unknown action type {self.type!r}; expected one of {ACTION_TYPES}")
        # Points are normalised to float pairs, so a list from JSON and a tuple from the parser are the same value.
        object.__setattr__(self, "point", _point(self.point, "point"))
        object.__setattr__(self, "end_point", _point(self.end_point, "end_point"))
        for name in (*_TEXT, "raw"):
            if not isinstance(getattr(self, name), str):
                raise ActionError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")

    @property
    def submit(self) -> bool:
        return self.type == "type" and self.content.endswith("\n")

    def check_on_screen(self, width: float, height: float) -> None:
        """ActionError unless every point set lies on a width x height screen: 0 <= x < width, 0 <= y < height."""
        for what, p in (("point", self.point), ("end_point", self.end_point)):
            if p is not None and not (0 <= p[0] < width and 0 <= p[1] < height):
                raise ActionError(f"{what} {list(p)} is outside the {width:g}x{height:g} screen")

    def map_points(self, fn: Callable[[Point], Point]) -> Action:
        """A copy with point and end_point (where set) passed through `fn` (e.g. model -> screen coordinates)."""
        return replace(self, point=None if self.point is None else fn(self.point),
                       end_point=None if self.end_point is None else fn(self.end_point))

    # ---- the wire: tars.v1.Action -----------------------------------------------------------------------------
    def to_proto(self):
        from core.v1 import env_pb2

        return env_pb2.Action(type=self.type, point=list(self.point or ()), end_point=list(self.end_point or ()),
                              content=self.content, key=self.key, direction=self.direction, target=self.target,
                              raw=self.raw[:MAX_RAW])

    @classmethod
    def from_proto(cls, a) -> Action:
        """tars.v1.Action -> Action; ActionError when it breaks the invariants (an empty or unknown type, a point
        that is not two numbers). proto3 has no unset: an empty repeated point is no point."""
        return cls(type=a.type, point=tuple(a.point) if len(a.point) else None,
                   end_point=tuple(a.end_point) if len(a.end_point) else None, content=a.content, key=a.key,
                   direction=a.direction, target=a.target, raw=a.raw)

    # ---- records: JSON / msgpack --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """{"type": ..., "point": [x, y], ...}: unset fields and `raw` left out (a record keeps the text apart)."""
        d: dict[str, Any] = {"type": self.type}
        if self.point is not None:
            d["point"] = list(self.point)
        if self.end_point is not None:
            d["end_point"] = list(self.end_point)
        for name in _TEXT:
            if getattr(self, name):
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Action:
        """The inverse of `to_dict` (raw accepted too); ActionError for anything that is not such a dict."""
        if not isinstance(d, dict):
            raise ActionError(f"an action must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise ActionError(f"unknown action field(s) {extra}")
        if "type" not in d:
            raise ActionError("an action needs a type")
        return cls(**d)
