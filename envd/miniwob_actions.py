"""MiniWoB++ observations as text, and UI-TARS actions as MiniWoB actions (pure functions; no browser needed).

Text observation (`render`, the one place it is built): one line per element a policy can see and act on or read
(leaves and form controls), in document order:
    [6] button "Ok" @(2,74 34x21)
    [5] input_text value="abc" focused @(17,64 128x21)
    t "91YPF" @(29,59 30x11)              <- a run of text inside a larger element (click it by its text)
`[6]` is MiniWoB's element ref, stable within an episode. Text runs get no ref: MiniWoB renumbers them on every
read of the page. Coordinates are screenshot pixels (the task area, 160x210 for most tasks). Pruned, so that a page
costs few tokens: elements of no size, wholly outside the visible task area (counted in one line: scrolling brings
them in), and decorations (textless, valueless, id-less leaves that are no form control and too small to be a target:
resize handles, spacers) are not listed; at most 2 classes are shown (the most specific: none that is a prefix of
another), only for elements without text; the listing stops at a character budget with a line saying how many
elements were left out.

Action mapping (UI-TARS -> MiniWoB's ActionTypes; every produced action is checked against the task's action
space before anything runs, so a rejected action changes nothing):
    click(point)            CLICK_COORDS             click(target)  CLICK_ELEMENT (a text run: CLICK_COORDS at it)
    left_double(point|target) DBLCLICK_COORDS        drag(point, end_point)  MOUSEDOWN, MOVE (midway), MOUSEUP
    type(content[, target]) TYPE_TEXT in chunks of the space's text limit, "\\n" -> PRESS_KEY <Enter>;
                            with a target: FOCUS_ELEMENT_AND_TYPE_TEXT first
    hotkey(key)             PRESS_KEY ("ctrl a" -> "C-a", "enter" -> "<Enter>"); keys outside the task's allowed list
                            are rejected
    scroll(point, up|down)  SCROLL_UP_COORDS / SCROLL_DOWN_COORDS
    wait()                  NONE
    right_single, scroll left/right, finished, call_user: MiniWoB has no such action -> ActionError.
A `target` is a ref ("[6]", "ref=6", "#6") or an element's exact text ("Ok"); a bare number is first matched as text
(buttons labelled "3" exist) and then as a ref.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from envd.base import Action, ActionError, typed_content

# Characters one type() may carry (~1.7 ms each through Selenium on a loaded 2-core host): 20,000 took 35 s, so a
# longer one ran past envd.step_timeout_s (60 s) as INFRA_ERROR and kept its worker thread typing long after.
MAX_TYPE = 4096
_FORM_TAGS = ("input", "button", "select", "textarea", "a", "label", "option")


@dataclass(frozen=True)
class Element:
    ref: int                  # > 0: a DOM element; < 0: a run of text (renumbered on every read)
    tag: str                  # "button", "input_text", "t" (text run), ...
    text: str                 # own text (leaves only), "" otherwise
    value: Any                # inputs: str, or bool for checkbox/radio; None otherwise
    left: float
    top: float
    width: float
    height: float
    parent: int = 0
    id: str = ""
    classes: str = ""
    focused: bool = False
    tampered: bool = False    # clicked/typed into in this episode
    leaf: bool = True

    @property
    def center(self) -> tuple[float, float]:
        return self.left + self.width / 2, self.top + self.height / 2

    @property
    def listed(self) -> bool:
        """Shown to the policy: leaves and form controls; plain containers only add length."""
        return self.leaf or self.tag.startswith(_FORM_TAGS)


def flatten_dom(root) -> list[Element]:
    """MiniWoB's DOMElement tree as a flat list in document order."""
    out: list[Element] = []

    def walk(e) -> None:
        out.append(Element(
            ref=int(e.ref), tag=e.tag, text=(e.text or "").strip(), value=e.value,
            left=float(e.left), top=float(e.top), width=float(e.width), height=float(e.height),
            parent=int(e.parent.ref) if e.parent is not None else 0, id=e.id or "",
            classes=e.classes if isinstance(e.classes, str) else "", focused=bool(e.focused),
            tampered=bool(e.tampered), leaf=e.is_leaf,
        ))
        for c in e.children:
            walk(c)

    walk(root)
    return out


def _quote(s: str, limit: int = 80) -> str:
    s = " ".join(s.split())
    return '"' + (s if len(s) <= limit else s[:limit - 1] + "…").replace('"', "'") + '"'


def _telling_classes(classes: str, n: int = 2) -> list[str]:
    """The first n classes that are not a prefix of another one ("ui-icon" says less than "ui-icon-closethick")."""
    cs = list(dict.fromkeys(classes.split()))
    return [c for c in cs if not any(o != c and o.startswith(c) for o in cs)][:n]


def render_element(e: Element, box: bool = True) -> str:
    parts = [f"[{e.ref}] {e.tag}" if e.ref > 0 else "t"]
    if e.text:
        parts.append(_quote(e.text))
    if e.id:
        parts.append(f"#{e.id}")
    if not e.text and e.classes and not e.tag.startswith("t"):
        parts.append("." + ".".join(_telling_classes(e.classes)))
    if isinstance(e.value, bool):
        parts.append("checked" if e.value else "unchecked")
    elif e.value not in (None, "") and not e.text:
        parts.append(f"value={_quote(str(e.value))}")
    if e.focused:
        parts.append("focused")
    if box:
        parts.append(f"@({round(e.left)},{round(e.top)} {round(e.width)}x{round(e.height)})")
    return " ".join(parts)


def decoration(e: Element) -> bool:
    """A leaf that says nothing and offers nothing to act on: no text, value or id, no form control, and too small
    to be a target (a resize handle, a spacer, a rule)."""
    return (e.leaf and not e.text and e.value in (None, "") and not e.id and not e.tag.startswith(_FORM_TAGS)
            and (min(e.width, e.height) < 4 or e.width * e.height < 64))


def render(elements: list[Element], max_chars: int, width: float = 0, height: float = 0, boxes: bool = True) -> str:
    """The element lines (pruned: see the module docstring), cut to `max_chars` with a note of how many were left
    out. Elements wholly above or left of the page (hidden-by-offset tricks) are skipped; with the visible area's
    `width` and `height` given, those wholly right of or below it are counted in one line instead of listed."""
    lines, out_of_view = [], 0
    for e in elements:
        if not e.listed or e.width <= 0 or e.height <= 0 or e.left + e.width <= 0 or e.top + e.height <= 0:
            continue
        if (width and e.left >= width) or (height and e.top >= height):
            out_of_view += 1
        elif not decoration(e):
            lines.append(render_element(e, boxes))
    tail = [f"({out_of_view} more elements outside the visible area: scroll to reach them)"] if out_of_view else []
    out, used = [], sum(len(t) + 1 for t in tail)
    for i, line in enumerate(lines):
        if used + len(line) + 1 > max_chars:
            out.append(f"... ({len(lines) - i} more elements not shown)")
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out + tail)


# At most 18 digits: int() of more than 4300 raises ValueError, which envd took for a broken backend (INFRA_ERROR).
_REF = re.compile(r"^\s*(?:\[\s*(-?\d{1,18})\s*\]|ref\s*[=:]\s*(-?\d{1,18})|#\s*(-?\d{1,18}))\s*$", re.IGNORECASE)


def resolve_target(elements: list[Element], target: str) -> Element:
    """The element a `target` names (see the module docstring); ActionError when none does."""
    t = str(target).strip()
    if not t:
        raise ActionError("empty target")
    by_ref = {e.ref: e for e in elements}
    m = _REF.match(t)
    if m:
        ref = int(next(g for g in m.groups() if g is not None))
        if ref not in by_ref:
            raise ActionError(f"no element with ref {ref} on the page")
        return by_ref[ref]
    # Exact text: an element's own text first (a button, a link), then a run of text inside a larger element.
    norm = " ".join(t.split())
    matches = [e for e in elements if e.text and " ".join(e.text.split()) == norm and e.width > 0 and e.height > 0]
    matches.sort(key=lambda e: e.ref < 0)
    if matches:
        return matches[0]
    if re.fullmatch(r"-?\d{1,18}", t) and int(t) in by_ref:
        return by_ref[int(t)]
    raise ActionError(f"no element with ref or text {t!r} on the page")


# ---- keys ------------------------------------------------------------------------------------------------------

_MODIFIERS = {"ctrl": "C-", "control": "C-", "shift": "S-", "alt": "A-", "option": "A-", "meta": "M-",
              "cmd": "M-", "command": "M-", "super": "M-", "win": "M-"}
_NAMED = {
    "enter": "Enter", "return": "Enter", "tab": "Tab", "backspace": "Backspace", "delete": "Delete",
    "del": "Delete", "escape": "Escape", "esc": "Escape", "space": "Space", "pageup": "PageUp",
    "pagedown": "PageDown", "home": "Home", "end": "End", "insert": "Insert", "up": "ArrowUp",
    "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight", "arrowup": "ArrowUp", "arrowdown": "ArrowDown",
    "arrowleft": "ArrowLeft", "arrowright": "ArrowRight", **{f"f{i}": f"F{i}" for i in range(1, 13)},
}


def miniwob_key(key: str) -> str:
    """A UI-TARS hotkey ('ctrl c', 'ctrl+a', 'Enter', 'shift a') in MiniWoB's PRESS_KEY syntax ('C-c', '<Enter>',
    'A'). ActionError when it names no key."""
    k = key.strip()
    parts = ["space"] if key and not k else [k] if k == "+" else [p for p in re.split(r"[\s+]+", k) if p]
    if not parts:
        raise ActionError("hotkey needs a key, e.g. key='ctrl c'")
    *mods, base = parts
    prefixes = []
    for m in mods:
        if m.lower() not in _MODIFIERS:
            raise ActionError(f"unknown modifier {m!r} in hotkey {key!r}")
        prefixes.append(_MODIFIERS[m.lower()])
    if base.lower() in _NAMED:
        base = f"<{_NAMED[base.lower()]}>"
    elif len(base) != 1:
        raise ActionError(f"unknown key {base!r} in hotkey {key!r}")
    if "S-" in prefixes and len(base) == 1 and base.isalpha():
        prefixes.remove("S-")  # MiniWoB spells shift+a as "A"
        base = base.upper()
    order = ["C-", "S-", "A-", "M-"]
    return "".join(sorted(set(prefixes), key=order.index)) + base


# ---- actions ---------------------------------------------------------------------------------------------------

class Translator:
    """UI-TARS actions (core.action.Action) -> lists of MiniWoB action dicts, for one task's ActionSpaceConfig and
    action space."""

    def __init__(self, config, space, width: int, height: int):
        self.config, self.space, self.width, self.height = config, space, width, height
        self.types = [str(getattr(t, "value", t)) for t in config.action_types]

    def _make(self, kind: str, **fields: Any) -> dict:
        if kind not in self.types:
            raise ActionError(f"this task's action space has no {kind} action (it has {self.types})")
        a: dict[str, Any] = {"action_type": self.types.index(kind)}
        defaults = {"coords": np.zeros(2, np.float32) if not self.config.coord_bins else np.zeros(2, np.int64),
                    "ref": 0, "key": 0, "text": " ", "field": 0}
        for name in self.space.spaces:
            if name in fields and not self.space[name].contains(fields[name]):
                # a safety net: the checks before this should have caught it with a clearer reason
                raise ActionError(f"{kind}: {name}={fields[name]!r} is outside this task's action space")
            if name != "action_type":
                a[name] = fields.get(name, defaults[name])
        return a

    def _coords(self, point, what: str) -> np.ndarray:
        try:
            x, y = (float(v) for v in point)
        except (TypeError, ValueError):
            raise ActionError(f"{what} must be [x, y], got {point!r}") from None
        if not (0 <= x <= self.width and 0 <= y <= self.height):
            raise ActionError(f"{what} ({x:g}, {y:g}) is outside the {self.width}x{self.height} screen")
        if self.config.coord_bins:
            bx, by = self.config.coord_bins
            return np.array([min(bx - 1, int(x * bx / self.width)), min(by - 1, int(y * by / self.height))], np.int64)
        return np.array([x, y], np.float32)

    def _point(self, action: Action, elements: list[Element], what: str = "point") -> np.ndarray:
        if action.target:
            return self._coords(resolve_target(elements, action.target).center, f"the centre of {action.target!r}")
        if action.point is None:
            raise ActionError(f"{action.type} needs a {what} [x, y] or a target")
        return self._coords(action.point, what)

    def _typing(self, content: str) -> list[dict]:
        out: list[dict] = []
        n = max(1, int(self.config.text_max_len))
        for i, line in enumerate(content.split("\n")):
            if i > 0:
                out.append(self._key("<Enter>"))
            out += [self._make("TYPE_TEXT", text=line[j:j + n]) for j in range(0, len(line), n)]
        return out

    def _key(self, key: str) -> dict:
        allowed = list(self.config.allowed_keys)
        if key not in allowed:
            raise ActionError(f"key {key!r} is not in this task's allowed keys (e.g. {allowed[:12]} ...)")
        return self._make("PRESS_KEY", key=allowed.index(key))

    def translate(self, action: Action, elements: list[Element]) -> list[dict]:
        kind = action.type
        if kind == "click":
            if action.target:
                e = resolve_target(elements, action.target)
                if e.ref > 0 and "CLICK_ELEMENT" in self.types:
                    out = [self._make("CLICK_ELEMENT", ref=e.ref)]
                else:
                    out = [self._make("CLICK_COORDS", coords=self._coords(e.center, f"the centre of {action.target!r}"))]
            else:
                out = [self._make("CLICK_COORDS", coords=self._point(action, elements))]
        elif kind == "left_double":
            out = [self._make("DBLCLICK_COORDS", coords=self._point(action, elements))]
        elif kind == "drag":
            start = self._point(action, elements)
            if action.end_point is None:
                raise ActionError("drag needs an end_point [x, y]")
            end = self._coords(action.end_point, "end_point")
            out = [self._make("MOUSEDOWN_COORDS", coords=start)]
            if "MOVE_COORDS" in self.types:  # an intermediate move: drag handlers want motion with the button down
                out.append(self._make("MOVE_COORDS", coords=((start + end) / 2).astype(start.dtype)))
            out.append(self._make("MOUSEUP_COORDS", coords=end))
        elif kind == "type":
            content = typed_content(action, MAX_TYPE)
            out = []
            if action.target:
                e = resolve_target(elements, action.target)
                if e.ref <= 0:
                    raise ActionError(f"{action.target!r} is a run of text, not a field to type into")
                first, sep, rest = content.partition("\n")
                if first and "FOCUS_ELEMENT_AND_TYPE_TEXT" in self.types:
                    n = max(1, int(self.config.text_max_len))
                    out.append(self._make("FOCUS_ELEMENT_AND_TYPE_TEXT", ref=e.ref, text=first[:n]))
                    remainder = first[n:] + sep + rest
                else:
                    out.append(self._make("CLICK_ELEMENT", ref=e.ref))
                    remainder = content
                out += self._typing(remainder) if remainder else []
            else:
                out = self._typing(content)
        elif kind == "hotkey":
            key = action.key or action.content
            out = [self._key(miniwob_key(key))]
        elif kind == "scroll":
            direction = action.direction.lower()
            if direction not in ("up", "down"):
                raise ActionError(f"MiniWoB scrolls up or down only, got direction {direction!r}")
            if action.target or action.point is not None:
                at = self._point(action, elements)
            else:
                at = self._coords((self.width / 2, self.height / 2), "the screen centre")
            out = [self._make("SCROLL_UP_COORDS" if direction == "up" else "SCROLL_DOWN_COORDS", coords=at)]
        elif kind == "wait":
            out = [self._make("NONE")]
        else:  # right_single, finished, call_user
            raise ActionError(f"MiniWoB has no {kind} action (its action space: {self.types})")
        return out
