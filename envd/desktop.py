"""`desktop`: a real X desktop per session: Xvfb, real applications (xterm and xedit by default), input through
xdotool, screenshots through mss.

Per session: `Xvfb :N -screen 0 WxHx24 -nolisten tcp` on a free display number (the lock file /tmp/.XN-lock decides,
created by envd: envd/xserver.py), in a bubblewrap sandbox of its own (no network, no host file but the system's
read-only directories, its cookie and its socket directory; on a root daemon a uid of its own), a private
MIT-MAGIC-COOKIE in the session's XAUTHORITY file, and the apps, xterm's shell included, in ONE bubblewrap sandbox per
episode (envd/desktop_apps.py, on the terminal's command line, envd/bwrap.py): no network, no host file but the
system's read-only directories, the workspace at /workspace (their cwd and HOME), the X socket and a copy of the
cookie bound in, the limits of DESKTOP_LIMITS, and on a root daemon an unprivileged uid of its own. The tools envd
runs itself (xdotool, xwininfo, mss) stay outside. Closing or resetting kills the sandboxes' inits and waits until
their namespaces are empty; Xvfb and the sandbox get SIGKILL if the daemon dies. There is no window manager:
keyboard input goes to the window under the pointer, so click a window before typing into it.

The desktop has no task of its own: reward is 0, `finished`/`call_user` end the episode (terminated), `max_steps`
truncates it. Options: width, height (default 1024x768), apps (comma list from APPS, default "xterm,xedit"),
workspace (in-process only, never over RPC: a directory to share with other sessions; default a fresh temp dir,
emptied on every reset), max_steps (0 = none), settle_s (pause before the screenshot after an action, default 0.15),
instruction (text shown as the task), command_timeout_s (deadline of each X tool call, default 10).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any

from envd import scratch
from envd.base import Action, ActionError, Env, Outcome, Screenshot, StepResult, refuse_unknown, typed_content
from envd.desktop_apps import DESKTOP_LIMITS, AppSandbox, xvfb_claim
from envd.png import encode_rgb
from envd.proctree import kill_session
from envd.workspace_archive import rmtree
from envd.xserver import XServer

APPS = ("xterm", "xedit", "xcalc", "xclock")
SCROLL_CLICKS = 3          # wheel clicks per scroll action
TYPE_DELAY_MS = 8
MAX_TYPE = 1024            # characters one type() may carry (~8 s of keystrokes at TYPE_DELAY_MS)
_BUTTONS = {"up": 4, "down": 5, "left": 6, "right": 7}

_env_lock = threading.Lock()       # XAUTHORITY is read from the process environment when mss connects


# ---- keys ------------------------------------------------------------------------------------------------------

_MODIFIERS = {"ctrl": "ctrl", "control": "ctrl", "shift": "shift", "alt": "alt", "option": "alt", "meta": "super",
              "cmd": "super", "command": "super", "super": "super", "win": "super"}
_NAMES = {"enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape", "backspace": "BackSpace",
          "tab": "Tab", "delete": "Delete", "del": "Delete", "space": "space", "up": "Up", "down": "Down",
          "left": "Left", "right": "Right", "arrowup": "Up", "arrowdown": "Down", "arrowleft": "Left",
          "arrowright": "Right", "pageup": "Page_Up", "pagedown": "Page_Down", "home": "Home", "end": "End",
          "insert": "Insert", **{f"f{i}": f"F{i}" for i in range(1, 13)}}
_PUNCT = {"+": "plus", "-": "minus", "=": "equal", ",": "comma", ".": "period", "/": "slash", ";": "semicolon",
          "'": "apostrophe", "[": "bracketleft", "]": "bracketright", "\\": "backslash", "`": "grave", " ": "space"}
_libx11 = None
# Keysyms the X server acts on itself: Xvfb exits at Terminate_Server (status 0) whatever its modifiers, and a
# policy's hotkey then ended the session as INFRA_ERROR (an episode thrown away instead of scored).
_SERVER_KEYSYMS = {"terminate_server"}


def _is_keysym(name: str) -> bool:
    global _libx11
    if _libx11 is None:
        path = ctypes.util.find_library("X11") or "libX11.so.6"
        _libx11 = ctypes.CDLL(path)
        _libx11.XStringToKeysym.argtypes = [ctypes.c_char_p]
        _libx11.XStringToKeysym.restype = ctypes.c_ulong
    return _libx11.XStringToKeysym(name.encode()) != 0


def xdotool_key(key: str) -> str:
    """'ctrl c' / 'ctrl+c' / 'Enter' -> xdotool's 'ctrl+c' / 'Return'. ActionError for names X does not know."""
    k = key.strip()
    parts = ["space"] if key and not k else [k] if k == "+" else [p for p in re.split(r"[\s+]+", k) if p]
    if not parts:
        raise ActionError("hotkey needs a key, e.g. key='ctrl c'")
    out = []
    for i, p in enumerate(parts):
        low = p.lower()
        if low in _SERVER_KEYSYMS:
            raise ActionError(f"hotkey {key!r} would stop the X server")
        if i < len(parts) - 1 and low in _MODIFIERS:
            out.append(_MODIFIERS[low])
        elif low in _NAMES:
            out.append(_NAMES[low])
        elif p in _PUNCT:
            out.append(_PUNCT[p])
        elif (len(p) == 1 and p.isprintable()) or (re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", p) and _is_keysym(p)):
            out.append(p)
        else:
            raise ActionError(f"unknown key {p!r} in hotkey {key!r}")
    return "+".join(out)


# ---- the env -------------------------------------------------------------------------------------------------

def _opt(options: dict[str, str], name: str, default, kind=int, low=None, high=None):
    try:
        v = kind(options.get(name, default))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={options.get(name)!r} is not a valid {kind.__name__}") from None
    if (low is not None and not v >= low) or (high is not None and not v <= high):   # NaN is outside too
        raise ValueError(f"{name}={v} is outside [{low}, {high}]")
    return v


OPTIONS = ("width", "height", "apps", "workspace", "max_steps", "settle_s", "instruction", "command_timeout_s")


def parse_options(options: dict[str, str]) -> dict[str, Any]:
    """The session options (the module docstring lists them): the one parser of the factory, Reset and
    registry.check_options. ValueError names a bad or unknown one; nothing is started."""
    refuse_unknown("desktop", options, OPTIONS)
    apps = [a.strip() for a in str(options.get("apps", "xterm,xedit")).split(",") if a.strip()]
    if not apps or any(a not in APPS for a in apps):
        raise ValueError(f"apps={options.get('apps')!r}: choose from {APPS}")
    return {"width": _opt(options, "width", 1024, int, 200, 4096),
            "height": _opt(options, "height", 768, int, 200, 4096), "apps": apps,
            "max_steps": _opt(options, "max_steps", 0, int, 0),
            "settle_s": _opt(options, "settle_s", 0.15, float, 0.0, 10.0),
            "command_timeout_s": _opt(options, "command_timeout_s", 10.0, float, 0.5, 120.0),
            "instruction": str(options.get("instruction", "")), "workspace": str(options.get("workspace", ""))}


_WINDOW = re.compile(r'^\s+(0x[0-9a-f]+) "(.*)": \((?:"([^"]*)" "([^"]*)")?\)\s+(\d+)x(\d+)\+(-?\d+)\+(-?\d+)')


X_TOOLS = ("Xvfb", "xdotool", "xwininfo")     # the X server and envd's own X clients


def missing_x_tools(apps=()) -> list[str]:
    """The X programs a desktop (with `apps`) needs that are not installed (the sandbox's: envd/xserver.py)."""
    return [a for a in (*X_TOOLS, *apps) if shutil.which(a) is None]


class DesktopEnv(Env):
    """One Xvfb desktop with real apps."""

    def __init__(self, name: str = "", options: dict[str, str] | None = None):
        options = dict(options or {})
        if name:
            raise KeyError(f"unknown env id 'desktop/{name}': the desktop backend is just 'desktop'")
        self.env_id = "desktop"
        opts = parse_options(options)
        self.width, self.height, self.apps = opts["width"], opts["height"], opts["apps"]
        # The app sandbox's limits, plus Xvfb's sandbox's for this screen size.
        self.claim = DESKTOP_LIMITS.host_claim() + xvfb_claim(self.width, self.height)
        missing = missing_x_tools(self.apps)
        if missing:
            raise RuntimeError(f"desktop needs {missing} installed (scripts/setup.sh --dev)")
        self.max_steps, self.settle_s, self.timeout_s = opts["max_steps"], opts["settle_s"], opts["command_timeout_s"]
        self.instruction = opts["instruction"]
        self.action_space = (f"{self.width}x{self.height} X desktop: click/left_double/right_single(start_box='(x,y)' "
                             "| target=window title), drag, type(content), hotkey(key), scroll(direction), wait(), "
                             "finished()")
        self._dir = tempfile.mkdtemp(prefix="tars-desktop-", dir=scratch.root())
        weakref.finalize(self, rmtree, self._dir)  # also at interpreter exit if close() never ran
        self._owns_workspace = not options.get("workspace")
        self.workspace = os.path.abspath(options.get("workspace") or os.path.join(self._dir, "home"))
        os.makedirs(self.workspace, exist_ok=True)
        self.apps_sandbox: AppSandbox | None = None
        self._shot = None
        self._steps, self._done, self._last = 0, True, None
        try:
            self.x = XServer(self._dir, self.width, self.height, timeout_s=self.timeout_s)
            self.apps_sandbox = AppSandbox(self._dir, self.workspace, self.x, owns_workspace=self._owns_workspace)
            import mss

            with _env_lock:  # mss (libxcb) reads XAUTHORITY from the environment while it connects
                saved = os.environ.get("XAUTHORITY")
                os.environ["XAUTHORITY"] = self.x.auth
                try:
                    self._shot = mss.MSS(display=self.x.display)
                finally:
                    if saved is None:
                        os.environ.pop("XAUTHORITY", None)
                    else:
                        os.environ["XAUTHORITY"] = saved
        except BaseException:
            self.close()
            raise

    # ---- processes -------------------------------------------------------------------------------------------
    @property
    def display(self) -> str:
        return self.x.display

    def _check_x(self) -> None:
        if not self.x.alive():
            raise RuntimeError(f"the X server {self.x.display} exited (code {self.x.proc.poll()})")

    def _app_argv(self, app: str, i: int) -> list[str]:
        # No window manager: tile the apps in columns so none hides another.
        cw, x0 = self.width // len(self.apps), (self.width // len(self.apps)) * i
        if app == "xterm":  # geometry in characters of the default 6x13 font
            cols, rows = max(20, min(120, cw // 6 - 2)), max(5, min(50, self.height // 13 - 2))
            return ["xterm", "-title", "xterm", "-geometry", f"{cols}x{rows}+{x0}+0", "-e", "/bin/bash", "--noprofile",
                    "--norc"]
        return [app, "-geometry", f"{cw - 10}x{min(self.height - 10, 600)}+{x0}+0"]

    def _stop_apps(self) -> None:
        """Kill every app and everything they started (xterm's shell and its jobs): their sandbox is emptied."""
        self.apps_sandbox.stop()

    def _start_apps(self) -> None:
        log = os.path.join(self._dir, "apps.log")
        self.apps_sandbox.start([self._app_argv(app, i) for i, app in enumerate(self.apps)], log,
                                process_group=self.x.pid, timeout_s=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while len(self.windows()) < len(self.apps):
            self._check_x()
            if not self.apps_sandbox.alive or time.monotonic() > deadline:
                raise RuntimeError(f"apps did not show their windows: {self.apps} (see {log})")
            time.sleep(0.05)

    # ---- X tools -------------------------------------------------------------------------------------------------
    def _run(self, *argv: str) -> str:
        try:
            r = subprocess.run(argv, env=self.x.env, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{argv[0]} took longer than {self.timeout_s:g}s on {self.x.display}") from None
        if r.returncode != 0:
            self.x.wait_exit(1.0)  # a tool that lost the display may have seen the X server's socket close as it died
            self._check_x()
            raise RuntimeError(f"{' '.join(argv[:3])} failed ({r.returncode}): {r.stderr.strip()[:300]}")
        return r.stdout

    def windows(self) -> list[dict[str, Any]]:
        """The visible, named top-level windows: title, class, geometry."""
        visible = set(self._run("xdotool", "search", "--onlyvisible", "--maxdepth", "1", "--name", "").split())
        out = []
        for line in self._run("xwininfo", "-root", "-children").splitlines():
            m = _WINDOW.match(line)
            if m and m.group(2) and str(int(m.group(1), 16)) in visible:
                out.append({"id": m.group(1), "title": m.group(2), "class": m.group(4) or "",
                            "x": int(m.group(7)), "y": int(m.group(8)), "w": int(m.group(5)), "h": int(m.group(6))})
        return out

    def _point(self, action: Action, key: str = "point") -> tuple[int, int]:
        if key == "point" and action.target:
            for w in self.windows():
                if w["title"] == action.target.strip():
                    return w["x"] + w["w"] // 2, w["y"] + w["h"] // 2
            raise ActionError(f"no window titled {action.target!r}")
        p = action.point if key == "point" else action.end_point
        try:
            x, y = (math.floor(float(v)) for v in p)   # the pixel the point lies in (1919.6 is in 1919, not 1920)
        except (TypeError, ValueError, OverflowError):
            raise ActionError(f"{action.type} needs {key} [x, y], got {p!r}") from None
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise ActionError(f"{key} ({x}, {y}) is outside the {self.width}x{self.height} screen")
        return x, y

    # ---- episodes --------------------------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        options = dict(options or {})
        opts = parse_options(options)   # all checked as at CreateSession; screen, apps, timings stay the session's
        self.max_steps = opts["max_steps"] if "max_steps" in options else self.max_steps
        self.instruction = opts["instruction"] if "instruction" in options else self.instruction
        self._check_x()
        self._stop_apps()
        if self._owns_workspace:  # a fresh episode starts in an empty home; a shared workspace is not ours to wipe
            rmtree(self.workspace)   # whatever permissions the sandbox left on it
            os.makedirs(self.workspace, exist_ok=True)
        self._start_apps()
        self._run("xdotool", "mousemove", str(self.width // 2), str(self.height // 2))
        self._steps, self._done = 0, False
        self._last = self._observe(0.0, Outcome.RUNNING)
        return self._last

    def step(self, action: Action) -> StepResult:
        if self._done or self._last is None:
            raise ActionError("the episode is over; reset first" if self._last else "reset the environment first")
        kind = action.type
        self._check_x()
        commands = self._commands(kind, action)  # validated in full before any input reaches the desktop
        try:
            for argv in commands:
                self._run("xdotool", *argv)
        except RuntimeError:
            # xdotool could not reach the display: if the X server is dying (a SIGKILL is not instant), say so
            # rather than report xdotool's symptom.
            self.x.wait_exit(1.0)
            self._check_x()
            raise
        self._steps += 1
        outcome = Outcome.RUNNING
        if kind in ("finished", "call_user"):
            outcome = Outcome.TERMINATED
        elif (self.max_steps and self._steps >= self.max_steps) or (self.apps_sandbox.breach and self._owns_workspace):
            outcome = Outcome.TRUNCATED   # a hybrid judges its shared workspace's quota itself
        self._done = outcome != Outcome.RUNNING
        if commands and self.settle_s:
            time.sleep(self.settle_s)  # let the apps redraw before the screenshot
        self._last = self._observe(0.0, outcome)
        return self._last

    def _commands(self, kind: str, action: Action) -> list[list[str]]:
        if kind in ("click", "left_double", "right_single"):
            x, y = self._point(action)
            button, repeat = ("3", "1") if kind == "right_single" else ("1", "2" if kind == "left_double" else "1")
            return [["mousemove", str(x), str(y), "click", "--repeat", repeat, "--delay", "60", button]]
        if kind == "drag":
            (x0, y0), (x1, y1) = self._point(action), self._point(action, "end_point")
            mx, my = (x0 + x1) // 2, (y0 + y1) // 2
            return [["mousemove", str(x0), str(y0), "mousedown", "1", "sleep", "0.05", "mousemove", str(mx), str(my),
                     "sleep", "0.05", "mousemove", str(x1), str(y1), "sleep", "0.05", "mouseup", "1"]]
        if kind == "type":
            content = typed_content(action, MAX_TYPE)
            if "\x00" in content:   # no argv can carry it: subprocess raised ValueError, taken for a broken desktop
                raise ActionError("content may not hold a NUL character")
            # One xdotool call per chunk, each well inside command_timeout_s (one call for a whole line timed out):
            # an eighth of it at the nominal delay, as a loaded host types slower (a chunk of a quarter, 0.34 s idle
            # at 2 s, took over 2 s with three test and training jobs on the 2-core host: an infra error).
            chunk = max(1, int(self.timeout_s * 1000 / TYPE_DELAY_MS / 8))
            out: list[list[str]] = []
            for i, line in enumerate(content.split("\n")):
                if i:
                    out.append(["key", "Return"])
                out += [["type", "--delay", str(TYPE_DELAY_MS), "--", line[j:j + chunk]]
                        for j in range(0, len(line), chunk)]
            return out
        if kind == "hotkey":
            return [["key", "--delay", "30", xdotool_key(action.key or action.content)]]
        if kind == "scroll":
            direction = action.direction.lower()
            if direction not in _BUTTONS:
                raise ActionError(f"scroll direction must be one of {list(_BUTTONS)}, got {direction!r}")
            x, y = self._point(action) if action.point is not None or action.target else (self.width // 2, self.height // 2)
            return [["mousemove", str(x), str(y), "click", "--repeat", str(SCROLL_CLICKS), "--delay", "30",
                     str(_BUTTONS[direction])]]
        return []  # wait, finished, call_user: no input

    # ---- observation -----------------------------------------------------------------------------------------
    def screenshot(self) -> Screenshot:
        self._check_x()
        # mss waits for the server's reply with no deadline, and a sandboxed app may grab the server (XGrabServer,
        # a few lines of ctypes in the xterm): the grab then waited forever, its worker thread and the session (its
        # close waits for the call) lost for good. Past command_timeout_s the X server is killed: the reply fails.
        expired = threading.Event()
        timer = threading.Timer(self.timeout_s, lambda: (expired.set(), self.x.kill()))
        timer.daemon = True
        timer.start()
        try:
            img = self._shot.grab(self._shot.monitors[0])
        except Exception:
            if not expired.is_set():
                raise
        finally:
            timer.cancel()
            timer.join(5)          # the callback, if it runs, only sends a signal
        if expired.is_set():
            raise RuntimeError(f"the screenshot of {self.x.display} took longer than {self.timeout_s:g}s (an app "
                               "holding the X server?): the X server was killed")
        w, h = img.size
        return Screenshot(data=encode_rgb(img.rgb, w, h, level=1), width=w, height=h)

    def _observe(self, reward: float, outcome: Outcome) -> StepResult:
        wins = self.windows()
        lines = [f"desktop {self.width}x{self.height}, home /workspace (on the host {self.workspace})", "windows:"]
        if self.apps_sandbox.breach:
            lines.insert(1, f"[the {self.apps_sandbox.breach}: every app was stopped]")
        lines += [f'  "{w["title"]}" ({w["class"]}) @({w["x"]},{w["y"]} {w["w"]}x{w["h"]})' for w in wins]
        if not wins:
            lines.append("  (none)")
        shots = [self.screenshot()] if self.screenshots else []
        return StepResult(text="\n".join(lines), instruction=self.instruction, reward=reward, outcome=outcome,
                          images=shots, width=self.width, height=self.height, step=self._steps,
                          info={"success": False, "display": self.x.display, "windows": len(wins)})

    def observe(self) -> StepResult:
        if self._last is None:
            raise ActionError("reset the environment first")
        return self._observe(0.0, self._last.outcome)

    def snapshot(self) -> bytes:
        raise NotImplementedError("desktop sessions cannot be snapshotted: their state is a live X server and "
                                  "running programs, which cannot be serialised")

    def restore(self, state: bytes) -> StepResult:
        raise NotImplementedError("desktop sessions cannot be restored: there are no desktop snapshots")

    @property
    def pids(self) -> set[int]:
        x, apps = getattr(self, "x", None), getattr(self, "apps_sandbox", None)
        return ({x.pid} if x is not None else set()) | (apps.pids if apps is not None else set())

    def close(self) -> None:
        shot, self._shot = getattr(self, "_shot", None), None
        if shot is not None:
            try:
                shot.close()
            except Exception:
                pass
        x, apps = getattr(self, "x", None), getattr(self, "apps_sandbox", None)
        roots = {x.pid} if x is not None else set()
        if apps is not None:
            left = apps.pids
            try:
                apps.release()      # the sandbox's init killed and waited for: no app runs after this
            except RuntimeError:
                roots |= left       # still there 5 s on: the sweep below goes after its processes by pid
        if x is not None:
            x.close(roots)                  # its sandbox emptied, the session's group swept, lock and link gone
        elif roots:
            kill_session(0, roots)
        if getattr(self, "_dir", None):
            rmtree(self._dir)  # the owned workspace lives inside it


def make(name: str = "", options: dict[str, str] | None = None) -> DesktopEnv:
    return DesktopEnv(name, options)
