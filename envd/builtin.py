"""Built-in GUI tasks: a fast, pure-Python screen of widgets (menus, buttons, fields, dialogs).

The screen is shown as an accessibility-tree text (and, for coordinate-based policies, every widget has a box on a
640x400 screen, so `click(start_box='(x,y)')` works too). Labels, values and layouts are drawn at random on every
reset, so a policy has to read the instruction and the screen, not memorise positions.

Tasks (env id `builtin/<task>`):
  click   "click Save"                        -> click the button                          (1 step)
  menu    "open File then click Export"       -> open the menu, click the item              (2 steps)
  form    "type alice into Name"              -> focus the field, type the value            (2 steps)
  dialog  "answer Discard then click Save"    -> dismiss the modal dialog, click the button (2 steps)
  mixed   one of the above at random

A click on a wrong button or item ends the episode as a failure (terminated, reward 0); opening a wrong menu or
focusing a wrong field is allowed (the policy can recover). Success gives reward 1.

Options (parse_options; any other name is refused): max_steps (default 6), strict_targets (boolean: a click on a
label not on the screen is an invalid action), step_delay (a simulated slow GUI, envd/latency.py; CreateSession only).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from envd import latency
from envd.base import Action, ActionError, Env, Outcome, StepResult, refuse_unknown

LABELS = [
    "Save", "Open", "Export", "Print", "Close", "Copy", "Paste", "Undo", "Redo", "Cut", "Find", "Replace",
    "Share", "Delete", "Rename", "Upload", "Download", "Refresh", "Search", "Filter", "Sort", "Zoom",
    "Preview", "Publish", "Archive", "Import", "Sync", "Send", "Reply", "Forward", "Attach", "Merge",
]
MENUS = ["File", "Edit", "View", "Tools", "Window", "Insert", "Format", "Account"]
FIELDS = ["Name", "Email", "City", "Phone", "Company", "Country", "Code", "Street"]
VALUES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "oscar", "peggy",
          "trent", "victor", "walter", "zoe"]
DIALOG_TITLES = ["Warning", "Confirm", "Notice", "Alert"]
DIALOG_BUTTONS = ["OK", "Cancel", "Discard", "Retry", "Keep", "Ignore"]
APPS = ["Notes", "Mail", "Photos", "Editor", "Calendar", "Music", "Maps", "Terminal"]
TASKS = ["click", "menu", "form", "dialog", "mixed"]
W, H = 640, 400


@dataclass
class Widget:
    kind: str                 # button | menu | item | field | dialog
    label: str
    box: tuple[int, int, int, int] = (0, 0, 0, 0)
    parent: str = ""          # menu label for items
    value: str = ""           # field content


@dataclass
class Screen:
    task: str
    app: str
    widgets: list[Widget] = field(default_factory=list)
    open_menu: str = ""
    focused: str = ""
    dialog: str = ""          # title of the modal dialog, "" when none
    goal: dict = field(default_factory=dict)
    stage: int = 0
    steps: int = 0
    done: bool = False
    success: bool = False

    def visible(self) -> list[Widget]:
        if self.dialog:
            return [w for w in self.widgets if w.kind == "dialog" or (w.kind == "button" and w.parent == self.dialog)]
        return [w for w in self.widgets if (w.kind != "item" or w.parent == self.open_menu) and w.kind != "dialog" and not (w.kind == "button" and w.parent)]


def _layout(widgets: list[Widget]) -> None:
    """Give each widget a box: menu bar on top, items under their menu, toolbar, fields, dialog centre."""
    x = {"menu": 8, "button": 8}
    menus = {}
    fy = 120
    for w in widgets:
        if w.kind == "menu":
            w.box = (x["menu"], 4, x["menu"] + 70, 24)
            menus[w.label] = w.box
            x["menu"] += 76
        elif w.kind == "button" and not w.parent:
            w.box = (x["button"], 32, x["button"] + 80, 56)
            x["button"] += 86
        elif w.kind == "field":
            w.box = (120, fy, 360, fy + 26)
            fy += 34
    item_y: dict[str, int] = {}
    for w in widgets:
        if w.kind == "item":
            mx = menus[w.parent][0]
            y = item_y.get(w.parent, 26)
            w.box = (mx, y, mx + 110, y + 22)
            item_y[w.parent] = y + 22
    by = 0
    for w in widgets:
        if w.kind == "dialog":
            w.box = (170, 130, 470, 270)
        elif w.kind == "button" and w.parent:
            w.box = (180 + by * 96, 230, 268 + by * 96, 258)
            by += 1


class BuiltinEnv(Env):
    """One session of a built-in task."""

    nonblocking = True  # pure Python over a few dozen widgets: served on envd's event loop

    def __init__(self, task: str, max_steps: int = 6, strict_targets: bool = False):
        if task not in TASKS:
            raise KeyError(f"no builtin task {task!r}; have {TASKS}")
        self.task = task
        self.env_id = f"builtin/{task}"
        self.max_steps = max_steps
        # strict_targets: a click on a label that is not on the screen is rejected (INVALID_ARGUMENT), as
        # ref-addressed browser tools do, instead of being a click on empty space that changes nothing.
        self.strict_targets = strict_targets
        self.action_space = "click(target=LABEL | start_box='(x,y)'), type(content='TEXT'), wait(), finished()"
        self.s: Screen | None = None

    # ---- episode construction ----------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        options = options or {}
        opts = parse_options(options)   # every option checked, as at CreateSession; step_delay stays the session's
        if "max_steps" in options:
            self.max_steps = opts["max_steps"]
        if "strict_targets" in options:
            self.strict_targets = opts["strict_targets"]
        rng = random.Random(seed)
        task = self.task if self.task != "mixed" else rng.choice(TASKS[:-1])
        s = Screen(task=task, app=rng.choice(APPS))
        buttons = rng.sample(LABELS, rng.randint(3, 5))
        menus = rng.sample(MENUS, rng.randint(2, 3))
        rest = [l for l in LABELS if l not in buttons]
        for b in buttons:
            s.widgets.append(Widget("button", b))
        for m in menus:
            s.widgets.append(Widget("menu", m))
            for it in rng.sample(rest, 3):
                rest.remove(it)
                s.widgets.append(Widget("item", it, parent=m))
        if task == "click":
            s.goal = {"button": rng.choice(buttons)}
            instruction = f"click {s.goal['button']}"
        elif task == "menu":
            m = rng.choice(menus)
            item = rng.choice([w.label for w in s.widgets if w.kind == "item" and w.parent == m])
            s.goal = {"menu": m, "item": item}
            instruction = f"open {m} then click {item}"
        elif task == "form":
            for fl in rng.sample(FIELDS, rng.randint(2, 3)):
                s.widgets.append(Widget("field", fl))
            fl = rng.choice([w.label for w in s.widgets if w.kind == "field"])
            s.goal = {"field": fl, "value": rng.choice(VALUES)}
            instruction = f"type {s.goal['value']} into {fl}"
        else:  # dialog
            s.dialog = rng.choice(DIALOG_TITLES)
            s.widgets.append(Widget("dialog", s.dialog))
            answers = rng.sample(DIALOG_BUTTONS, 3)
            for a in answers:
                s.widgets.append(Widget("button", a, parent=s.dialog))
            s.goal = {"answer": rng.choice(answers), "button": rng.choice(buttons)}
            instruction = f"answer {s.goal['answer']} then click {s.goal['button']}"
        s.goal["instruction"] = instruction
        _layout(s.widgets)
        self.s = s
        return self._result(0.0)

    # ---- rendering ---------------------------------------------------------------------------------------
    def render_text(self) -> str:
        s = self._state()
        parts = [f"window {s.app}"]
        for w in s.visible():
            if w.kind == "menu" and w.label == s.open_menu:
                parts.append(f"[menu {w.label} expanded]")
            elif w.kind == "field":
                state = " focused" if w.label == s.focused else ""
                parts.append(f"[field {w.label}{state}" + (f" = {w.value}]" if w.value else "]"))
            else:
                parts.append(f"[{w.kind} {w.label}]")
        return " ".join(parts)

    def _result(self, reward: float) -> StepResult:
        s = self._state()
        outcome = Outcome.RUNNING
        if s.done:
            outcome = Outcome.TERMINATED
        elif s.steps >= self.max_steps:
            outcome, s.done = Outcome.TRUNCATED, True
        elements = [{"kind": w.kind, "label": w.label, "box": list(w.box)} for w in s.visible()]
        return StepResult(
            text=self.render_text(), instruction=s.goal["instruction"], reward=reward, outcome=outcome,
            info={"success": s.success, "task": s.task, "elements": elements}, width=W, height=H, step=s.steps,
        )

    def observe(self) -> StepResult:
        return self._result(0.0)

    # ---- dynamics ----------------------------------------------------------------------------------------
    def _state(self) -> Screen:
        if self.s is None:
            raise ActionError("reset the environment first")
        return self.s

    def _find(self, action: Action) -> Widget | None:
        s = self._state()
        vis = s.visible()
        if action.target:
            t = action.target.strip()
            for w in vis:
                if w.label == t:
                    return w
            return None
        if action.point is None:
            raise ActionError(f"{action.type} needs a target label or a point (x, y)")
        x, y = action.point
        for w in vis:
            if w.kind != "dialog" and w.box[0] <= x <= w.box[2] and w.box[1] <= y <= w.box[3]:
                return w
        return None

    def _fail(self) -> None:
        self.s.done, self.s.success = True, False

    def _win(self) -> float:
        self.s.done, self.s.success = True, True
        return 1.0

    def step(self, action: Action) -> StepResult:
        s = self._state()
        kind = action.type
        if s.done:
            raise ActionError("the episode is over; reset first")
        action.check_on_screen(W, H)   # a point off the screen (negative, past the edge) is no click at all
        # Resolve the target before changing any state: a rejected action leaves the session as it was.
        w = self._find(action) if kind in ("click", "left_double") else None
        if kind in ("click", "left_double") and w is None and action.target and self.strict_targets:
            raise ActionError(f"no element labelled {action.target!r} on the screen")
        s.steps += 1
        reward = 0.0
        g = s.goal
        if kind in ("click", "left_double"):
            if w is None:
                pass  # a click on empty space changes nothing
            elif w.kind == "menu":
                s.open_menu = "" if s.open_menu == w.label else w.label
            elif w.kind == "field":
                s.focused = w.label
            elif s.dialog and w.parent == s.dialog:
                if s.task == "dialog" and w.label == g["answer"]:
                    s.dialog = ""
                else:
                    self._fail()
            elif w.kind == "item":
                reward = self._win() if s.task == "menu" and w.label == g["item"] else (self._fail() or 0.0)
            elif w.kind == "button":
                reward = self._win() if s.task in ("click", "dialog") and w.label == g["button"] else (self._fail() or 0.0)
        elif kind == "type":
            content = action.content.rstrip("\n")
            if s.focused:
                fw = next(w for w in s.widgets if w.kind == "field" and w.label == s.focused)
                fw.value = content
                if s.task == "form":
                    ok = s.focused == g["field"] and content == g["value"]
                    reward = self._win() if ok else (self._fail() or 0.0)
        elif kind == "finished":
            self._fail()  # no built-in task is finished by declaring it
        # wait, hotkey, scroll, drag, right_single, call_user: no effect on this screen
        return self._result(reward)

    # ---- oracle and snapshots ----------------------------------------------------------------------------
    def oracle_action(self) -> Action:
        """The next correct action (scripted demonstrations and tests)."""
        s, g = self._state(), self._state().goal
        if s.task == "click":
            return Action("click", target=g["button"])
        if s.task == "menu":
            return Action("click", target=g["item"] if s.open_menu == g["menu"] else g["menu"])
        if s.task == "form":
            if s.focused == g["field"]:
                return Action("type", content=g["value"])
            return Action("click", target=g["field"])
        return Action("click", target=g["answer"] if s.dialog else g["button"])

    def ground(self, target: str) -> tuple[float, float] | None:
        """The centre of the visible widget labelled `target` (screen pixels), or None."""
        w = self._find(Action("click", target=target))
        return None if w is None else ((w.box[0] + w.box[2]) / 2, (w.box[1] + w.box[3]) / 2)

    def random_action(self, rng: random.Random) -> Action:
        """A plausible but random action on the visible screen (a weak demonstrator)."""
        s = self._state()
        if s.focused and rng.random() < 0.5:
            return Action("type", content=rng.choice(VALUES))
        return Action("click", target=rng.choice(self.clickable()))

    def clickable(self) -> list[str]:
        """Labels of the visible widgets a click can target (all but the dialog frame)."""
        return [w.label for w in self._state().visible() if w.kind != "dialog"]

    def snapshot(self) -> bytes:
        s = self._state()
        d = {"task": self.task, "max_steps": self.max_steps, "screen": {**s.__dict__, "widgets": [w.__dict__ for w in s.widgets]}}
        return json.dumps(d).encode()

    def restore(self, state: bytes) -> StepResult:
        try:
            d = json.loads(state)
            sd = dict(d["screen"])
            sd["widgets"] = [Widget(**{**w, "box": tuple(w["box"])}) for w in sd["widgets"]]
            self.task, self.env_id, self.max_steps = d["task"], f"builtin/{d['task']}", int(d["max_steps"])
            self.s = Screen(**sd)
        except (ValueError, KeyError, TypeError) as e:
            raise ActionError(f"not a builtin snapshot: {e}") from None
        return self._result(0.0)


OPTIONS = ("max_steps", "strict_targets", "step_delay")


def parse_options(options: dict[str, str]) -> dict:
    """The session options (the one parser of the factory, Reset and registry.check_options); ValueError names a
    bad or unknown one. max_steps (default 6), strict_targets (boolean, default off), step_delay (envd/latency.py)."""
    from envd.browser_input import _bool

    refuse_unknown("builtin", options, OPTIONS)
    try:
        max_steps = int(str(options.get("max_steps", 6)).strip())
    except ValueError:
        raise ValueError(f"max_steps={options['max_steps']!r} is not an integer") from None
    if not 1 <= max_steps <= 10**9:
        raise ValueError(f"max_steps={max_steps} is outside [1, 1000000000]")
    try:
        strict = _bool(options.get("strict_targets", "0"))
    except ValueError as e:
        raise ValueError(f"strict_targets: {e}") from None
    spec = str(options.get(latency.OPTION, "")).strip()
    return {"max_steps": max_steps, "strict_targets": strict, "step_delay": latency.DelaySpec(spec) if spec else None}


def make(task: str, options: dict[str, str] | None = None) -> Env:
    opts = parse_options(options or {})
    env = BuiltinEnv(task, max_steps=opts["max_steps"], strict_targets=opts["strict_targets"])
    # step_delay=...: a simulated slow GUI (long-tailed step latency), see envd/latency.py
    return latency.DelayedEnv(env, opts["step_delay"]) if opts["step_delay"] else env
