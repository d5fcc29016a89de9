"""Safe parser for UI-TARS model outputs, and the coordinate maths that goes with it.

    Thought: The Save button is at the top right.
    Action: click(start_box='<|box_start|>(912,40)<|box_end|>')

The text comes from a policy under RL, so it is adversarial by construction: it is never evaluated (no eval, exec
or ast), only scanned once, left to right, by hand-written code plus a few regexes that cannot backtrack
catastrophically. Any input string either parses or raises ParseError, never anything else; the actor turns a
ParseError into a format penalty instead of a crash.

Grammar (a superset of what ui-tars' parse_action_to_structure_output accepts for these actions):
    output  := [thought] ["Action:"] call (ws ["Action:"] call)*
    call    := NAME "(" [NAME "=" STRING ("," NAME "=" STRING)* [","]] ")"
    STRING  := '...' | "..."   with \\n \\t \\r \\\\ \\' \\" escapes; other backslashes stay as written
Reasoning in `<think>...</think>` (Qwen-style thinking, UI-TARS-desktop strips it) is dropped before parsing: every
leading block, a `</think>` whose opening was in the prompt, and the tag of a leading `<think>` that never closes.
The typed text of type(content='...') / finished(content='...') runs, as in ui-tars, to the last `')` of the call
(the call ends where a line starts another action or an "Action:" label, or at the end of the text), so quotes the
model forgot to escape are recovered: type(content='Students', parents' and teachers' survey 2024\n'). It ends
earlier at a "', target='...'" written after the text (type(content='ls\n', target='terminal')) and at a "')"
followed on the same line by another call (never at an escaped \'). A typed text ending in a written-out backslash-n
submits, as a real newline does (UI-TARS' executors treat both as Enter).
Coordinates: '<point>x y</point>', '(x,y)', '<|box_start|>(x,y)<|box_end|>', '<bbox>x1 y1 x2 y2</bbox>' and
4-number boxes '(x1,y1,x2,y2)' or '(x1,y1),(x2,y2)' (-> their centre). Points stay in the model's coordinate space; `to_screen` maps them.
"""
from __future__ import annotations

import math
import re

from core.action import ACTION_TYPES, CLICKS as _CLICKS, Action, ActionError, Point
from core.vlm import smart_resize  # noqa: F401  (re-exported: the parser's callers map coordinates with it)

DIRECTIONS = ("up", "down", "left", "right")
# UI-TARS emits one action a turn, rarely a few; a long run of calls is degenerate output, and stopping early also
# bounds the work (and the env steps) one answer can cause.
MAX_ACTIONS = 16

_START_KEYS = ("start_box", "point", "start_point")   # synonyms across UI-TARS versions (1.0 boxes, 1.5 points)
_END_KEYS = ("end_box", "end_point")
# Which keyword arguments each action takes; anything else is a format error (a signal the policy should get).
_ALLOWED = {
    **{a: (*_START_KEYS, "target") for a in _CLICKS},
    "drag": (*_START_KEYS, *_END_KEYS),
    "hotkey": ("key", "target"),     # target: our text-addressed extension (envd focuses it, or picks the app)
    "type": ("content", "target"),
    "scroll": (*_START_KEYS, "direction", "target"),
    "wait": ("target",),
    "finished": ("content",),
    "call_user": ("content",),
}
# Tokens an engine may leave on the end of a decode; they are not part of the answer.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "[EOS]", "</s>")

# Every regex below is either anchored at a line start or made of single character classes, so each match attempt
# is bounded by the line or run it looks at and a whole search is linear in the input.
_ACTION_AT_LINE = re.compile(r"^[ \t]*Action[ \t]*[:：]", re.M)
_ACTION_ANY = re.compile(r"Action[ \t]*[:：]")
_ACTION_LABEL = re.compile(r"Action[ \t]*[:：]")
_CALL_AT_LINE = re.compile(r"^[ \t]*(?:" + "|".join(ACTION_TYPES) + r")[ \t]*\(", re.M)
_CALL_AT_START = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*[ \t]*\(")
_THOUGHT_LABEL = re.compile(r"\s*Thought[ \t]*[:：]")
_SUMMARY_LABEL = re.compile(r"^[ \t]*Action_Summary[ \t]*[:：]", re.M)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WS = re.compile(r"\s*")
_PLAIN = {"'": re.compile(r"[^\\']*"), '"': re.compile(r'[^\\"]*')}
_NUM = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_NUM_SPLIT = re.compile(r"[\s,，]+")
_BRACKETS = str.maketrans("()[]", "    ")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}
_ESCAPE = re.compile(r"\\(.)", re.S)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# Arguments whose single-quoted value is free text that runs to the last "')" of the call (ui-tars' rule).
_FREE_TEXT = {("type", "content"), ("finished", "content")}
# Where free text ends early: a "')" followed on the same line by another call, and a target written after the text.
_CALL_AFTER = re.compile(r"'\)[ \t]+(?:" + "|".join(ACTION_TYPES) + r")[ \t]*\(")
_TARGET_AFTER = re.compile(r"'[ \t]*,[ \t]*target[ \t]*=[ \t]*\Z")


class ParseError(ValueError):
    """The model's text is not a well-formed action; str(e) is a short reason."""


def on_screen(a: Action, mode: str, screen_w: float, screen_h: float, image_w: int | None = None,
              image_h: int | None = None, **resize: int) -> Action:
    """A copy of a parsed action with point/end_point mapped from model coordinates by `to_screen`."""
    return a.map_points(lambda p: to_screen(p, mode, screen_w, screen_h, image_w, image_h, **resize))


# ---------------------------------------------------------------------------------------------- text -> actions
def parse_response(text: str) -> tuple[str, list[Action]]:
    """Model output -> (thought, actions). Raises ParseError (and only ParseError) when it is not well formed."""
    if not isinstance(text, str):
        raise ParseError(f"expected str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:   # a lone surrogate: no env could type it, no wire could carry it
        raise ParseError("output is not valid unicode") from None
    body = _strip_think(_unwrap(text))
    if not body.strip():
        raise ParseError("empty output")
    pre, start = _split(body)
    # UI-TARS 1.0 also wrote "Reflection: ...\nAction_Summary: ..."; like ui-tars, the summary is the thought.
    m = _THOUGHT_LABEL.match(pre) or _SUMMARY_LABEL.search(pre)
    thought = (pre[m.end():] if m else pre).strip()
    actions = _calls(body, start)
    if not actions:
        raise ParseError("no action after 'Action:'")
    return thought, actions


def _unwrap(text: str) -> str:
    """Drop end-of-turn tokens and a ``` fence around the whole answer (the prompt shows the format fenced)."""
    lo, hi = 0, len(text)
    changed = True
    while changed:   # indices, not slicing: a long run of end tokens must not cost quadratic copying
        changed = False
        while hi > lo and text[hi - 1].isspace():
            hi -= 1
        for tok in _END_TOKENS:
            if text.endswith(tok, lo, hi):
                hi -= len(tok)
                changed = True
    while lo < hi and text[lo].isspace():
        lo += 1
    if text.startswith("```", lo, hi):   # the opening fence may carry a language tag: drop its whole line
        nl = text.find("\n", lo, hi)
        lo = hi if nl < 0 else nl + 1
    if text.endswith("```", lo, hi):
        hi -= 3
    return text[lo:hi]


def _strip_think(text: str) -> str:
    """The answer without its reasoning: leading <think>...</think> blocks go, a </think> whose <think> was in the
    prompt (nothing but reasoning before it, no "Action:") takes what is before it along, and a leading <think> that
    never closes loses only its tag (what follows may still hold Thought/Action). Linear: str.find only."""
    lo = 0
    close = text.find(_THINK_CLOSE)
    if close >= 0 and text.find(_THINK_OPEN, 0, close) < 0 and not _ACTION_ANY.search(text, 0, close):
        lo = close + len(_THINK_CLOSE)
    closed = True   # False once no </think> is left: later openings only lose their tag (no rescanning)
    while True:
        lo = _WS.match(text, lo).end()
        if not text.startswith(_THINK_OPEN, lo):
            return text[lo:]
        close = text.find(_THINK_CLOSE, lo + len(_THINK_OPEN)) if closed else -1
        closed = close >= 0
        lo = lo + len(_THINK_OPEN) if close < 0 else close + len(_THINK_CLOSE)


def _split(body: str) -> tuple[str, int]:
    """(thought text, index where the first call starts)."""
    # An "Action:" at a line start wins over one inside a sentence of the thought ("... the next Action: ...");
    # the first one wins over later ones, which can only be inside typed content or a second action.
    m = _ACTION_AT_LINE.search(body)
    if m:
        return body[:m.start()], m.end()
    m = _CALL_AT_LINE.match(body)   # a bare call, e.g. type(content='Action: x'): its content is not a label
    if m:
        return "", 0
    m = _ACTION_ANY.search(body)
    if m:
        return body[:m.start()], m.end()
    # No "Action:" label: the action is the first line that starts with a known call; the rest before it is thought.
    m = _CALL_AT_LINE.search(body)
    if m:
        return body[:m.start()], m.start()
    # Still nothing: if the whole answer looks like a call, parse it anyway so the error names what is wrong.
    if _CALL_AT_START.match(body):
        return "", 0
    raise ParseError("no 'Action:' and no action call found")


def _calls(s: str, i: int) -> list[Action]:
    out: list[Action] = []
    n = len(s)
    while True:
        i = _WS.match(s, i).end()
        if i >= n:
            return out
        if out:   # a repeated "Action:" label between actions is tolerated
            m = _ACTION_LABEL.match(s, i)
            if m:
                i = _WS.match(s, m.end()).end()
        if len(out) >= MAX_ACTIONS:
            raise ParseError(f"more than {MAX_ACTIONS} actions")
        a, i = _call(s, i)
        out.append(a)


def _call(s: str, i: int) -> tuple[Action, int]:
    start = i
    m = _IDENT.match(s, i)
    if not m:
        raise ParseError(f"expected an action call, got {_peek(s, i)}")
    name = m.group()
    if name not in _ALLOWED:
        raise ParseError(f"unknown action {name[:40]!r}")
    i = _WS.match(s, m.end()).end()
    if not s.startswith("(", i):
        raise ParseError(f"expected '(' after {name}")
    i += 1
    args: dict[str, str] = {}
    while True:
        i = _WS.match(s, i).end()
        if s.startswith(")", i):
            i += 1
            break
        m = _IDENT.match(s, i)
        if not m:
            raise ParseError(f"{name}: expected an argument name, got {_peek(s, i)}")
        key = m.group()
        i = _WS.match(s, m.end()).end()
        if not s.startswith("=", i):
            raise ParseError(f"{name}: expected '=' after {key[:40]!r}")
        i = _WS.match(s, i + 1).end()
        if i >= len(s) or s[i] not in "'\"":
            raise ParseError(f"{name}: the value of {key[:40]!r} must be a quoted string")
        value, i = (_free_text(s, i + 1) if (name, key) in _FREE_TEXT and s[i] == "'" else None) or \
            _string(s, i + 1, s[i])
        if key in args:
            raise ParseError(f"{name}: {key!r} given twice")
        args[key] = value
        i = _WS.match(s, i).end()
        if s.startswith(",", i):
            i += 1
        elif s.startswith(")", i):
            i += 1
            break
        else:
            raise ParseError(f"{name}: expected ',' or ')', got {_peek(s, i)}")
    return _build(name, args, s[start:i]), i


def _free_text(s: str, i: int) -> tuple[str, int] | None:
    """A free-text value whose opening ' is at i-1, ui-tars' way: it runs to the last "')" before the call's end
    (the next line that starts an action call or an "Action:" label, else the end of the text); returns (value,
    index of that quote + 1, i.e. at the ')'), or None when there is no "')" (the strict reading then says why)."""
    ends = [m.start() for m in (_CALL_AT_LINE.search(s, i), _ACTION_AT_LINE.search(s, i)) if m]
    limit = min(ends, default=len(s))
    m = _CALL_AFTER.search(s, i, limit)   # type(content='a') click(...) on one line: the text ends before the click
    while m and _escaped(s, i, m.start()):   # ... unless that quote is escaped (\') click(...): text, as written
        m = _CALL_AFTER.search(s, m.start() + 1, limit)
    j = s.rfind("')", i, m.start() + 2 if m else limit)
    if j < 0:
        return None
    q = s.rfind("'", i, j)   # type(content='ls\n', target='terminal'): the text ends before ", target='"
    if q >= 0:
        t = _TARGET_AFTER.search(s[i:q])
        if t and not _escaped(s, i, i + t.start()):
            j = i + t.start()
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), s[i:j]), j + 1


def _escaped(s: str, lo: int, k: int) -> bool:
    """Whether the character at k is escaped: an odd run of backslashes (at or after lo) right before it."""
    n = k
    while n > lo and s[n - 1] == "\\":
        n -= 1
    return (k - n) % 2 == 1


def _string(s: str, i: int, q: str) -> tuple[str, int]:
    """Read a quoted string whose opening quote is at i-1; returns (value, index after the closing quote).

    A quote only closes the string when the next non-space character is ',' or ')' (or the text ends): models
    often forget to escape an apostrophe in typed text (type(content='it's')), and this reading recovers it at no
    ambiguity for well-formed calls. Each character is looked at a bounded number of times, so this is linear.
    """
    plain, n, parts = _PLAIN[q], len(s), []
    while True:
        j = plain.match(s, i).end()
        parts.append(s[i:j])
        if j >= n:
            raise ParseError("unterminated string")
        if s[j] == "\\":
            if j + 1 >= n:
                raise ParseError("unterminated string")
            c = s[j + 1]
            parts.append(_ESCAPES.get(c, "\\" + c))
            i = j + 2
            continue
        k = _WS.match(s, j + 1).end()
        if k >= n or s[k] in ",)":
            return "".join(parts), j + 1
        parts.append(q)   # an unescaped quote inside the text
        i = j + 1


def _build(name: str, args: dict[str, str], raw: str) -> Action:
    allowed = _ALLOWED[name]
    for k in args:
        if k not in allowed:
            raise ParseError(f"{name}: unexpected argument {k[:40]!r}")
    starts = [k for k in _START_KEYS if k in args]
    ends = [k for k in _END_KEYS if k in args]
    if len(starts) > 1 or len(ends) > 1:
        raise ParseError(f"{name}: more than one start or end point")
    point = parse_point(args[starts[0]]) if starts else None
    end_point = parse_point(args[ends[0]]) if ends else None
    target = args.get("target", "").strip()
    key = content = direction = ""
    if name in _CLICKS and point is None and not target:
        raise ParseError(f"{name}: needs start_box/point or target")
    if name == "drag" and (point is None or end_point is None):
        raise ParseError("drag: needs a start and an end point")
    if name == "hotkey":
        key = args.get("key", "").strip()
        if not key:
            raise ParseError("hotkey: needs key")
    if name == "type":
        if "content" not in args:
            raise ParseError("type: needs content")
        content = args["content"]   # verbatim: leading spaces and the trailing "\n" (submit) mean something
        if content.endswith("\\n"):   # a written-out "\\n" at the end submits too, as in UI-TARS' executors
            content = content[:-2] + "\n"
    if name in ("finished", "call_user"):
        content = args.get("content", "")
    if name == "scroll":
        direction = args.get("direction", "").strip().lower()
        if direction not in DIRECTIONS:
            raise ParseError(f"scroll: direction must be one of {DIRECTIONS}")
    try:
        return Action(type=name, point=point, end_point=end_point, content=content, key=key, direction=direction,
                      target=target, raw=raw)
    except ActionError as e:   # cannot happen for what the checks above let through; still only ParseError out
        raise ParseError(str(e)) from None


def parse_point(value: str) -> Point:
    """One coordinate argument -> (x, y) in model space; a 4-number box gives its centre."""
    v = value.strip()
    for pre, post in (("<|box_start|>", "<|box_end|>"),):
        if v.startswith(pre):
            v = v[len(pre):]
            if v.endswith(post):
                v = v[:-len(post)]
            v = v.strip()
    for pre, post in (("<point>", "</point>"), ("<bbox>", "</bbox>"), ("(", ")"), ("[", "]")):
        if v.startswith(pre) and v.endswith(post) and len(v) >= len(pre) + len(post):
            v = v[len(pre):len(v) - len(post)]
            break
    # '(x1,y1),(x2,y2)' (Qwen2-VL's two-point box) and stray brackets: only the numbers count.
    toks = [t for t in _NUM_SPLIT.split(v.translate(_BRACKETS).strip()) if t]
    if len(toks) not in (2, 4):
        raise ParseError(f"a point needs 2 numbers (or a box 4), got {len(toks)}")
    nums = []
    for t in toks:
        # Non-negative decimals only; the length cap keeps float() cheap and rejects absurd values early.
        if len(t) > 24 or not _NUM.fullmatch(t):
            raise ParseError(f"bad coordinate {t[:24]!r}")
        nums.append(float(t))
    if not all(math.isfinite(x) for x in nums):
        raise ParseError("bad coordinate")
    if len(nums) == 4:
        return ((nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2)
    return (nums[0], nums[1])


def _peek(s: str, i: int) -> str:
    return repr(s[i:i + 20]) if i < len(s) else "end of text"


# ---------------------------------------------------------------------------------------------- coordinates
def to_screen(point: Point, mode: str, screen_w: float, screen_h: float, image_w: int | None = None,
              image_h: int | None = None, *, factor: int = 28, min_pixels: int = 56 * 56,
              max_pixels: int = 14 * 14 * 4 * 1280) -> Point:
    """Model coordinates -> screen pixels (floats; only a point on the far edge of the model's range is pulled onto
    the last pixel: one outside it is the env's to reject).

    mode "relative": UI-TARS 1.0 / Qwen2-VL style, 0..1000 in each axis whatever the image size.
    mode "absolute": UI-TARS 1.5 / Qwen2.5-VL style, pixels of the image the model saw, i.e. the screenshot
    (image_w x image_h, default the screen size) after smart_resize; pass the processor's max_pixels if it is not
    the Qwen2-VL default (UI-TARS 1.5 deployments often use 16384*28*28).
    """
    x, y = float(point[0]), float(point[1])
    rw, rh = _model_range(mode, screen_w, screen_h, image_w, image_h, factor, min_pixels, max_pixels)
    # A point on the far edge of the model's own range (x == 1000, or the resized width) lands on the screen's last
    # pixel, not one past it; beyond its range it stays off screen for the env to reject.
    return _edge(x / rw * screen_w, x <= rw, screen_w), _edge(y / rh * screen_h, y <= rh, screen_h)


def from_screen(point: Point, mode: str, screen_w: float, screen_h: float, image_w: int | None = None,
                image_h: int | None = None, *, factor: int = 28, min_pixels: int = 56 * 56,
                max_pixels: int = 14 * 14 * 4 * 1280) -> Point:
    """Screen pixels -> model coordinates, the inverse of `to_screen` (for a demonstrator writing what the model
    should answer): to_screen(from_screen(p)) == p for a point on the screen."""
    rw, rh = _model_range(mode, screen_w, screen_h, image_w, image_h, factor, min_pixels, max_pixels)
    return float(point[0]) / screen_w * rw, float(point[1]) / screen_h * rh


def _model_range(mode: str, screen_w: float, screen_h: float, image_w: int | None, image_h: int | None, factor: int,
                 min_pixels: int, max_pixels: int) -> tuple[float, float]:
    """The model's coordinate range (width, height) in a mode: 1000 x 1000, or the smart-resized image's size."""
    if mode == "relative":
        return 1000.0, 1000.0
    if mode == "absolute":
        rh, rw = smart_resize(int(image_h or screen_h), int(image_w or screen_w), factor, min_pixels, max_pixels)
        return float(rw), float(rh)
    raise ValueError(f"mode must be 'relative' or 'absolute', got {mode!r}")


def _edge(v: float, inside: bool, size: float) -> float:
    return math.nextafter(size, 0.0) if inside and v >= size > 0 else v
