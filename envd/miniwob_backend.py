"""`miniwob/<task>`: the 128 MiniWoB++ tasks (PyPI `miniwob`, gymnasium ids `miniwob/<task>-v1`) on headless
Debian Chromium, offline.

One session = one chromedriver + one Chromium in a bubblewrap sandbox of their own (envd/miniwob_chromium.py: no
network, chromedriver reached through a Unix socket) with a private home (profile, crash-handler database, cache),
all killed on close. Reward and episode end are MiniWoB's own: reward is
time-decayed (`info.raw_reward` holds the undecayed value, `info.success` = raw reward > 0), a task that runs out
of time ends with reward -1. Actions (core.action.Action) are mapped onto MiniWoB's action space by
envd.miniwob_actions; observations are the element list as text, the task-area screenshot as PNG (none, and not
captured, in a session created with envd's `screenshots=0`: envd.base), and the task area's size.

Options (CreateSession: the session's defaults; Reset: max_steps, episode_time_s and data_mode for that episode only):
  action_space    MiniWoB preset: all_supported (default), shi17, liu18, humphreys22
  max_steps       steps after which the episode is truncated (default 0: only MiniWoB's time limit ends it)
  episode_time_s  the task's time limit, over which the reward decays (MiniWoB: 10 s for most tasks; 0: the task's)
  data_mode       MiniWoB data mode, "train" (default) or "test"
  boxes           1 (default): each element line ends with its box, @(left,top widthxheight) in screenshot pixels;
                  0: without (a text policy that acts by ref, click(target='[5]'), reads half the tokens)
  max_text_chars  character budget of the element-list text (default 3000; envd.miniwob_actions.render prunes it,
                  and cuts it at the budget with a line saying how many elements were left out)
  command_timeout_s  deadline of each WebDriver command (default 30, at most 600)
(episode_time_s at most 86400, max_text_chars at most 1000000: options come from clients)
"""
from __future__ import annotations

import functools
import http.server
import logging
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import weakref
from typing import Any

from envd import miniwob_chromium, scratch
from envd.base import Action, ActionError, Env, Outcome, Resources, Screenshot, StepResult, refuse_unknown
from envd.browser_input import _bool
from envd.miniwob_actions import Translator, flatten_dom, render, resolve_target
from envd.sandbox_limits import uids_in_use
from envd.miniwob_oracle import oracle_action
from envd.png import encode_rgb
from envd.miniwob_chromium import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS, ChromiumProcess  # noqa: F401
from envd.miniwob_instance import instance_class, wait_for_task_page

PRESETS = ("all_supported", "shi17", "liu18", "humphreys22")
_ID = re.compile(r"^miniwob/(.+)-v(\d+)$")
log = logging.getLogger("envd")


def configure_offline() -> None:
    """Point the miniwob package at the Debian browser and driver, so nothing (Selenium Manager) looks for them on
    the network. The package insists that both variables are set or neither."""
    if not os.environ.get("MINIWOB_CHROME_BINARY") and not os.environ.get("MINIWOB_CHROMEDRIVER"):
        os.environ["MINIWOB_CHROME_BINARY"], os.environ["MINIWOB_CHROMEDRIVER"] = CHROMIUM, CHROMEDRIVER


@functools.cache
def _gym():
    import gymnasium
    import miniwob

    gymnasium.register_envs(miniwob)
    return gymnasium


def task_names() -> list[str]:
    """Every MiniWoB task registered with gymnasium (128 in miniwob 1.1.0), without the `-v1` suffix."""
    return sorted({m.group(1) for env_id in _gym().registry if (m := _ID.match(env_id))})


@functools.cache
def _hooked(env_cls: type) -> type:
    """The task's gymnasium env class, launching its browser through ChromiumInstance."""
    instance_cls = instance_class()

    def __init__(self, *, browser: ChromiumProcess, **kwargs):
        self._browser = browser
        env_cls.__init__(self, **kwargs)

    def _hard_reset_instance(self):
        if getattr(self, "instance", None):
            self.instance.close()
        self.instance = instance_cls(index=0, browser=self._browser, **self.instance_kwargs)
        self.instance.start()

    return type(f"Tars{env_cls.__name__}", (env_cls,), {"__init__": __init__, "_hard_reset_instance": _hard_reset_instance})


_pages_lock = threading.Lock()
_pages_socket: str | None = None


def peer_uid(conn: socket.socket) -> int:
    """The uid (in this daemon's user namespace) of the process at the other end of Unix socket `conn`."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def flight_socket() -> str:
    """FlightWoB pages need http:// (the package refuses file:// for them): one static file server per process, on
    a Unix socket in this process's scratch that the sessions' sandboxes relay 127.0.0.1:8000 to (no TCP port on the
    host). It serves the package's public pages only. Mode 0666, as a sandbox's uid must connect; the server then
    answers only peers (SO_PEERCRED) of the daemon's own uid or a uid it gave a sandbox now (a root daemon's), and
    closes any other user's connection unanswered."""
    global _pages_socket
    with _pages_lock:
        if _pages_socket is None:
            import socketserver

            class Quiet(http.server.SimpleHTTPRequestHandler):
                def log_message(self, *args):
                    pass

            class Server(socketserver.ThreadingUnixStreamServer):
                def verify_request(self, request, client_address) -> bool:
                    return peer_uid(request) in (os.getuid(), *uids_in_use())

            path = str(scratch.root() / "miniwob-pages.sock")
            server = Server(
                path, functools.partial(Quiet, directory=miniwob_chromium.pages_dir(None)))
            server.daemon_threads = True
            os.chmod(path, 0o666)
            threading.Thread(target=server.serve_forever, name="miniwob-pages", daemon=True).start()
            _pages_socket = path
        return _pages_socket


# ---- the env ------------------------------------------------------------------------------------------------

# Ceilings: options come from clients. An infinite or huge time (command_timeout_s=inf, 1e12; episode_time_s=inf)
# raised OverflowError deep in Selenium or the int() of milliseconds (INTERNAL, not INVALID_ARGUMENT), and a large
# finite command_timeout_s let one hung WebDriver command hold an envd worker for days.
MAX_COMMAND_TIMEOUT_S, MAX_EPISODE_TIME_S, MAX_TEXT_CHARS = 600.0, 86_400.0, 1_000_000


def _int_opt(options: dict[str, str], name: str, default: int, low: int = 0, high: int | None = None) -> int:
    try:
        v = int(options.get(name, default))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={options.get(name)!r} is not an integer") from None
    if v < low or (high is not None and v > high):
        raise ValueError(f"{name} must be >= {low}" + (f" and <= {high}" if high is not None else "") + f", got {v}")
    return v


def _float_opt(options: dict[str, str], name: str, default: float, high: float) -> float:
    try:
        v = float(options.get(name, default))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={options.get(name)!r} is not a number") from None
    if not 0 <= v <= high:   # NaN and infinities too
        raise ValueError(f"{name} must be in [0, {high:g}], got {v}")
    return v


OPTIONS = ("action_space", "max_steps", "episode_time_s", "data_mode", "boxes", "max_text_chars", "command_timeout_s")


def _episode_options(options: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if options.get("episode_time_s"):
        out["episode_ms"] = int(_float_opt(options, "episode_time_s", 0.0, MAX_EPISODE_TIME_S) * 1000)
    if "data_mode" in options:
        if options["data_mode"] not in ("train", "test"):
            raise ValueError(f"data_mode={options['data_mode']!r}: expected train or test")
        out["data_mode"] = options["data_mode"]
    if "max_steps" in options:
        out["max_steps"] = _int_opt(options, "max_steps", 0)
    return out


def parse_options(options: dict[str, str]) -> dict[str, Any]:
    """The session options (the module docstring lists them): the one parser of CreateSession, Reset and
    registry.check_options. ValueError names a bad or unknown one; nothing is started."""
    refuse_unknown("miniwob", options, OPTIONS)
    preset = options.get("action_space", "all_supported")
    if preset not in PRESETS:
        raise ValueError(f"action_space={preset!r}: expected one of {PRESETS}")
    try:
        boxes = _bool(options.get("boxes", "1"))
    except ValueError as e:
        raise ValueError(f"boxes: {e}") from None
    return {"action_space": preset, "max_steps": _int_opt(options, "max_steps", 0), "boxes": boxes,
            "max_text_chars": _int_opt(options, "max_text_chars", 3000, low=200, high=MAX_TEXT_CHARS),
            "command_timeout_s": _float_opt(options, "command_timeout_s", 30.0, MAX_COMMAND_TIMEOUT_S) or 30.0,
            **_episode_options(options)}


class MiniWoBEnv(Env):
    """One MiniWoB task in its own Chromium."""

    # An estimate for the host budget: chromedriver and a Chromium of its own (browser, GPU, renderer processes).
    # Memory: 2.3x what a session measures (docs/benchmarks.md: 166 MB PSS per extra session, 323 MB for the
    # first, `tars bench env`); the earlier 1024 MB let a 24 GB host hold only 18 sessions, fewer than the
    # miniwob preset's 8 episodes in flight plus the 32 idle sessions it keeps for reuse. Disk: its private
    # directory (profile, crash database; a fresh one holds 2-3 MiB) with the disk cache bounded to 32 MiB.
    claim = Resources(pids=64, memory_mb=384, disk_mb=64)

    def __init__(self, task: str, options: dict[str, str] | None = None):
        options = dict(options or {})
        gym = _gym()
        env_id = f"miniwob/{task}-v1"
        if env_id not in gym.registry:
            raise KeyError(f"unknown env id 'miniwob/{task}': not a MiniWoB task (see ListEnvs)")
        opts = parse_options(options)
        preset = opts["action_space"]
        self.task, self.env_id = task, f"miniwob/{task}"
        self.max_steps, self.max_text_chars, self.boxes = opts["max_steps"], opts["max_text_chars"], opts["boxes"]
        timeout = opts["command_timeout_s"]
        # Validated now (bad options fail CreateSession, not the first Reset) and kept: every Reset starts from them.
        self._defaults = {"max_steps": self.max_steps, "data_mode": "train", **_episode_options(options)}
        configure_offline()
        from gymnasium.envs.registration import load_env_creator

        spec = gym.spec(env_id)
        kwargs = dict(spec.kwargs or {}, action_space_config=preset, data_mode=options.get("data_mode", "train"))
        flight = task.startswith("flight.")
        kwargs["base_url"] = miniwob_chromium.FLIGHT_URL if flight else miniwob_chromium.PAGES_URL
        self._dir = tempfile.mkdtemp(prefix="tars-miniwob-", dir=scratch.root())
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # also at interpreter exit if close() never ran
        self.browser = ChromiumProcess(self._dir, timeout, flight_socket() if flight else "",
                                       memory_mb=miniwob_chromium.MEMORY_BOUND_MB)
        try:
            self.gym = _hooked(load_env_creator(spec.entry_point))(browser=self.browser, **kwargs)
        except BaseException:
            self.close()
            raise
        inst = self.gym.unwrapped.instance
        self.width, self.height = int(inst.task_width), int(inst.task_height)
        self.translator = Translator(self.gym.action_space_config, self.gym.action_space, self.width, self.height)
        self.action_space = (f"MiniWoB {preset} on a {self.width}x{self.height} screen: click(target='[ref]'|'text' | "
                             "start_box='(x,y)'), left_double, drag, type(content), hotkey(key), scroll(up|down), wait()")
        self._last: StepResult | None = None
        self._elements: list = []
        self._utterance, self._fields = "", {}
        self._steps, self._done = 0, True

    # ---- episodes ------------------------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        # A Reset's options hold for its episode only, over the session's (CreateSession's) defaults. All are
        # checked as at CreateSession; those of the session itself (action_space, boxes, ...) keep its values.
        options = dict(options or {})
        parse_options(options)
        opts = {**self._defaults, **_episode_options(options)}
        inst = self.gym.unwrapped.instance
        # The task page is loaded afresh: a reused page keeps what its task does not regenerate (an open datepicker,
        # typed text, scroll positions, focus, hover styles), so the episode would differ from a new session's.
        inst.driver.get(inst.url)
        wait_for_task_page(inst.driver, inst.url, self.browser.command_timeout_s)
        self.max_steps = opts["max_steps"]
        self.gym.unwrapped.set_data_mode(opts["data_mode"])
        if opts.get("episode_ms"):  # a page global: the reload above put back the task's own limit
            inst.driver.execute_script(f"core.EPISODE_MAX_TIME = {opts['episode_ms']};")
        obs, info = self.gym.reset(seed=int(seed), options={"record_screenshots": self.screenshots})
        self._utterance, self._fields = obs["utterance"], dict(obs["fields"])
        self._steps, self._done = 0, False
        self._last = self._result(obs, info, 0.0, False)
        return self._last

    def step(self, action: Action) -> StepResult:
        if self._done:
            raise ActionError("the episode is over; reset first")
        # Translate (and check against the action space) before anything runs: a rejected action changes nothing.
        actions = self.translator.translate(action, self._elements)
        reward, done = 0.0, False
        for a in actions:
            obs, reward, done, _, info = self.gym.step(a)
            if done:
                break
        self._steps += 1
        truncated = not done and self.max_steps > 0 and self._steps >= self.max_steps
        self._done = done or truncated
        self._last = self._result(obs, info, float(reward), done, truncated)
        if self._done:
            self._park()
        return self._last

    def _park(self) -> None:
        """An ended episode's page goes to about:blank until the next Reset loads the task again (everything after
        the end is answered from self._last). A task page left open keeps its timers and reward display running
        (8 sessions idle after an ended episode: 0.34-0.77 CPU-s per 10 s, parked 0.15-0.37, alternating runs),
        which a pool of sessions kept for reuse (actor.keep_sessions) pays on every idle one. A page that does not go is left as it is: Reset reloads it."""
        try:
            self.gym.unwrapped.instance.driver.get("about:blank")
        except Exception as e:  # a dead browser: the next Reset says so
            log.debug("miniwob/%s: parking the page failed: %s", self.task, e)

    def observe(self) -> StepResult:
        if self._last is None:
            raise ActionError("reset the environment first")
        if self._done:
            return self._last
        inst = self.gym.unwrapped.instance
        meta, obs, extra = inst.read(use_cached_fields=True, empty_when_done=True)
        if obs is None:  # ran out of time since the last step: the next step reports it (with MiniWoB's reward)
            return self._result(inst.get_empty_observation(), meta, 0.0, True, record=False)
        return self._result(obs, {**meta, **extra}, 0.0, False)

    # ---- rendering -----------------------------------------------------------------------------------------
    def _result(self, obs: dict, info: dict, reward: float, done: bool, truncated: bool = False,
                record: bool = True) -> StepResult:
        elements = flatten_dom(info["root_dom"]) if not done and info.get("root_dom") is not None else []
        if record:
            self._elements = elements
        if done:
            body = f"(episode over: {info.get('reason') or 'done'}; reward {float(info.get('env_reward') or 0):.3f})"
        else:
            body = render(elements, self.max_text_chars, self.width, self.height, self.boxes) or "(no elements)"
        text = f"instruction: {self._utterance}\n{body}"
        shots = []
        if self.screenshots:
            shot = obs["screenshot"]
            h, w = int(shot.shape[0]), int(shot.shape[1])
            png = encode_rgb(shot.astype("uint8", copy=False).tobytes(), w, h)
            shots.append(Screenshot(data=png, width=w, height=h))
        raw = float(info.get("raw_reward") or 0.0)
        outcome = Outcome.TERMINATED if done else Outcome.TRUNCATED if truncated else Outcome.RUNNING
        meta = {"success": raw > 0, "raw_reward": raw, "env_reward": float(info.get("env_reward") or 0.0),
                "reason": info.get("reason"), "task": self.task}
        if "elapsed" in info:
            meta["elapsed_s"] = round(float(info["elapsed"]), 3)
        return StepResult(text=text, instruction=self._utterance, reward=reward, outcome=outcome,
                          images=shots, info=meta, width=self.width, height=self.height,
                          step=self._steps)

    # ---- helpers -------------------------------------------------------------------------------------------
    def oracle_action(self) -> Action:
        """The scripted oracle's next action (envd.miniwob_oracle; NotImplementedError for tasks it cannot do)."""
        if self._done or self._last is None:
            raise ActionError("no running episode; reset first")
        return oracle_action(self.task, self._utterance, self._fields, self._elements)

    def ground(self, target: str) -> tuple[float, float] | None:
        """The centre of the element `target` names on the last observed page (screen pixels), or None."""
        try:
            return resolve_target(self._elements or [], target).center
        except ActionError:
            return None

    @property
    def pids(self) -> set[int]:
        """The browser sandbox's init (chromedriver and Chromium run under it), for tests and accounting."""
        return {self.browser.pid} if getattr(self, "browser", None) and self.browser.pid else set()

    def close(self) -> None:
        gym = getattr(self, "gym", None)
        self.gym = None
        if gym is not None:
            try:
                gym.unwrapped.instance.close()
            except Exception:
                pass
        try:
            if getattr(self, "browser", None) is not None:
                self.browser.stop()
        finally:
            if getattr(self, "_dir", None):
                shutil.rmtree(self._dir, ignore_errors=True)


def make(task: str, options: dict[str, str] | None = None) -> MiniWoBEnv:
    return MiniWoBEnv(task, options)
