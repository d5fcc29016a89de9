"""Pure helpers of the browser backend: session options, the URL policy, UI-TARS key names and action checks.

Nothing here touches a browser, so all of it is tested directly (tests/test_browser_input.py).
"""
from __future__ import annotations

import ipaddress
import math
import urllib.parse
from dataclasses import dataclass, fields, replace
from typing import Any

from core.action import CLICKS
from envd.base import Action, ActionError, typed_content

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
# Sub-resources a page may always load: they never leave the machine.
_LOCAL_SCHEMES = ("file", "data", "blob", "about")


def _bool(v: str) -> bool:
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def int_in(lo: int, hi: int):
    def parse(v: str) -> int:
        try:
            n = int(str(v).strip())
        except ValueError:
            raise ValueError(f"not an integer: {v!r}") from None
        if not lo <= n <= hi:
            raise ValueError(f"{n} is outside [{lo}, {hi}]")
        return n
    return parse


def _float_in(lo: float, hi: float):
    def parse(v: str) -> float:
        try:
            x = float(str(v).strip())
        except ValueError:
            raise ValueError(f"not a number: {v!r}") from None
        if not (math.isfinite(x) and lo <= x <= hi):
            raise ValueError(f"{x} is outside [{lo}, {hi}]")
        return x
    return parse


def _choice(*allowed: str):
    def parse(v: str) -> str:
        s = str(v).strip().lower()
        if s == "jpg":
            s = "jpeg"
        if s not in allowed:
            raise ValueError(f"{v!r} is not one of {list(allowed)}")
        return s
    return parse


@dataclass(frozen=True)
class BrowserOptions:
    """Session options of the `browser` backend (CreateSession/Reset options, all strings on the wire)."""

    url: str = ""               # page to open: http(s) on loopback or file:// (any URL with allow_any_url)
    html: str = ""              # or an inline page (exclusive with url); neither = about:blank
    allow_any_url: bool = False  # let url, navigation and sub-resources reach any host
    width: int = 1280           # viewport in CSS pixels = screenshot pixels (device scale factor 1)
    height: int = 720
    format: str = "png"         # screenshot format: png | jpeg
    quality: int = 80           # jpeg quality
    instruction: str = ""       # the task in words, passed through to every observation
    verify_js: str = ""         # JS expression evaluated in the page after each step -> {reward, done}
    max_steps: int = 50         # steps after which the episode is truncated
    max_text_chars: int = 8000  # bound of the observation text (url, title, accessibility snapshot)
    boxes: bool = False         # add [box=x,y,w,h] of every node to the accessibility snapshot
    settle_ms: int = 50         # after an action, wait this long, then for the page's load event
    wait_ms: int = 1000         # what wait() waits (real time; games advance their virtual clock instead)
    scroll_px: int = 400        # pixels per scroll() action
    timeout_s: float = 30.0     # deadline of one backend call on the browser (launch excluded)

    _PARSERS = {
        "url": str, "html": str, "allow_any_url": _bool, "width": int_in(64, 4096), "height": int_in(64, 4096),
        "format": _choice("png", "jpeg"), "quality": int_in(1, 100), "instruction": str, "verify_js": str,
        "max_steps": int_in(1, 100_000), "max_text_chars": int_in(256, 1_000_000), "boxes": _bool,
        "settle_ms": int_in(0, 10_000), "wait_ms": int_in(0, 60_000), "scroll_px": int_in(1, 10_000),
        "timeout_s": _float_in(1.0, 600.0),
    }

    @classmethod
    def parse(cls, options: dict[str, str]) -> "BrowserOptions":
        """Options from the wire; ValueError (-> INVALID_ARGUMENT) names the bad one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for k, v in options.items():
            try:
                kw[k] = cls._PARSERS[k](v)
            except ValueError as e:
                raise ValueError(f"option {k}: {e}") from None
        o = cls(**kw)
        if o.url and o.html:
            raise ValueError("give url or html, not both")
        if o.url:
            check_url(o.url, o.allow_any_url, top_level=True)
        return o


def _loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_allowed(url: str, allow_any: bool) -> bool:
    """Whether a page of this session may load `url` (a navigation or a sub-resource)."""
    try:
        u = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    if u.scheme in _LOCAL_SCHEMES:
        return True
    if u.scheme in ("http", "https", "ws", "wss"):
        return allow_any or _loopback(u.hostname or "")
    return allow_any and u.scheme in ("ftp",)


def check_url(url: str, allow_any: bool, top_level: bool = False) -> None:
    """ValueError unless `url` is an allowed page to open (http(s) on loopback or file://; any with allow_any)."""
    u = urllib.parse.urlsplit(url)
    if top_level and u.scheme not in ("http", "https", "file", "about"):
        raise ValueError(f"url {url!r}: only http(s)://, file:// and about: pages can be opened")
    if not url_allowed(url, allow_any):
        raise ValueError(f"url {url!r} is not on loopback (127.0.0.1/localhost) and allow_any_url is off")


# ---- keys ------------------------------------------------------------------------------------------------------

_KEYS = {
    "ctrl": "Control", "control": "Control", "shift": "Shift", "alt": "Alt", "option": "Alt",
    "cmd": "Meta", "command": "Meta", "meta": "Meta", "win": "Meta", "super": "Meta",
    "enter": "Enter", "return": "Enter", "tab": "Tab", "esc": "Escape", "escape": "Escape", "space": "Space",
    "backspace": "Backspace", "delete": "Delete", "del": "Delete", "insert": "Insert",
    "home": "Home", "end": "End", "pageup": "PageUp", "pagedown": "PageDown", "capslock": "CapsLock",
    "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight",
    "arrowup": "ArrowUp", "arrowdown": "ArrowDown", "arrowleft": "ArrowLeft", "arrowright": "ArrowRight",
    "plus": "+", "minus": "-",
}
_KEYS.update({f"f{i}": f"F{i}" for i in range(1, 13)})
_MODIFIERS = ("Control", "Shift", "Alt", "Meta")


def playwright_keys(key: str) -> str:
    """A UI-TARS hotkey ('ctrl a', 'ctrl+shift+t', 'Up', 'enter') as a Playwright chord ('Control+a').

    ActionError for an empty chord, an unknown key name, or a chord whose non-modifier keys are more than one.
    """
    tokens = key.strip().split()
    if len(tokens) == 1 and "+" in tokens[0] and tokens[0] != "+":
        tokens = [t for t in tokens[0].split("+") if t]
    if not tokens:
        raise ActionError("hotkey needs a key, e.g. key='ctrl a' or key='enter'")
    names = []
    for t in tokens:
        name = _KEYS.get(t.lower())
        if name is None:
            # One character of Playwright's keyboard layout (US: printable ASCII); it refused any other ("Unknown key:
            # é"), which ended the session as INFRA_ERROR. Type such text with type() instead.
            if len(t) != 1 or not " " < t <= "~":
                raise ActionError(f"unknown key {t!r} in hotkey {key!r} (keys are names like 'enter' or one ASCII "
                                  "character; type other text with type())")
            name = t
        names.append(name)
    mains = [n for n in names if n not in _MODIFIERS]
    if len(mains) > 1:
        raise ActionError(f"hotkey {key!r} presses {len(mains)} non-modifier keys together; send them one by one")
    names.sort(key=lambda n: n not in _MODIFIERS)  # modifiers first, as Playwright expects
    return "+".join(names)


# ---- actions ---------------------------------------------------------------------------------------------------

POINTED = CLICKS
DIRECTIONS = ("up", "down", "left", "right")


def check_point(p: Any, width: int, height: int, what: str = "point") -> tuple[float, float]:
    """A finite [x, y] inside the viewport, else ActionError."""
    if not isinstance(p, (list, tuple)) or len(p) != 2:
        raise ActionError(f"{what} must be [x, y], got {p!r}")
    try:
        x, y = float(p[0]), float(p[1])
    except (TypeError, ValueError):
        raise ActionError(f"{what} must be two numbers, got {p!r}") from None
    if not (math.isfinite(x) and math.isfinite(y) and 0 <= x < width and 0 <= y < height):
        raise ActionError(f"{what} {[x, y]} is outside the {width}x{height} viewport")
    return x, y


# Characters one type() may carry: Playwright presses each key (~2.5 ms a key on a loaded 2-core host), so 20,000
# ran past the 30 s call deadline and ended the session as INFRA_ERROR; 4096 take ~10 s.
MAX_TYPE = 4096


@dataclass(frozen=True)
class Checked:
    """An action that passed check_action, with what the page input needs worked out."""
    action: Action    # the direction lower-cased; everything else as sent
    keys: str = ""    # a hotkey's Playwright chord


def check_action(a: Action, width: int, height: int) -> Checked:
    """Check an action against this viewport before anything touches the page (so a bad one changes nothing)."""
    t = a.type
    if a.point is not None:
        check_point(a.point, width, height)
    if t in POINTED and a.point is None and not a.target:
        raise ActionError(f"{t} needs a point [x, y] or a target label")
    keys = ""
    if t == "drag":
        if a.point is None or a.end_point is None:
            raise ActionError("drag needs point and end_point")
        check_point(a.end_point, width, height, "end_point")
    elif t == "hotkey":
        keys = playwright_keys(a.key or a.content)
    elif t == "type":
        typed_content(a, MAX_TYPE)
    elif t == "scroll":
        d = a.direction.lower()
        if d not in DIRECTIONS:
            raise ActionError(f"scroll direction must be one of {list(DIRECTIONS)}, got {a.direction!r}")
        a = replace(a, direction=d)
    return Checked(a, keys)
