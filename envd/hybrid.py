"""`hybrid`: a GUI desktop (envd/desktop.py) and a sandboxed terminal (envd/terminal.py) on ONE shared workspace,
in the spirit of UI-TARS-2's GUI-SDK: a file the GUI apps save is visible to the shell and the other way round.
Both halves are sandboxed alike (envd/bwrap.py): the GUI apps, xterm's shell included, run in the desktop's app
sandbox (envd/desktop_apps.py) and see the workspace at /workspace, as the terminal does.

Env ids: `hybrid` (an open desktop + shell, reward 0) and `hybrid/<terminal task>` (a task of envd/terminal_tasks.py,
solved through either side; its verifier judges the shared workspace at `finished()`).

Action routing
  An action whose `target` is "terminal" goes to the terminal, with the terminal's action set:
    type(content='ls\\n', target='terminal'), hotkey(key='ctrl c', target='terminal'), wait(target='terminal').
  Every other action goes to the desktop (click/left_double/right_single/drag/type/hotkey/scroll/wait; a `target`
  there is a window title, as in the desktop backend). The desktop has no window manager: click a window (e.g.
  the xterm) before typing into it.
  finished() ends the episode on both sides: with a task the terminal's verifier decides the reward (1 or 0),
  without one the reward is 0. call_user() ends it with reward 0. `max_steps` (default 50) truncates it.
  A bad action is an ActionError and changes neither side.

Observation: the desktop's screenshot; text = the desktop's window list (at most WINDOW_CHARS characters) followed
by the terminal transcript (at most the terminal's `screen_chars`).

Workspace: the env makes it itself (never an option: a client naming host directories would defeat the sandbox),
inside a private directory of mode 0o711 so the sandbox uid can reach it without listing its neighbours. The
workspace belongs to the sandbox's uid (the terminal chowns it at each shell start) with mode 0o755. The GUI's
sandbox runs as the terminal's uid (a root daemon's, or the daemon's own), so what either side writes the other
may change; sharing the uid shares RLIMIT_NPROC's count too, so each side's limit is the sum of both sides' nproc
(the session's claim). Reset stops the GUI apps, clears the workspace, seeds the task's files, then starts a fresh
shell and fresh apps.

Options: the desktop's (width, height, apps, settle_s, command_timeout_s, instruction), the terminal's (verify,
screen_chars and the sandbox limits of envd/sandbox_limits.py), and max_steps. Snapshots: UNIMPLEMENTED (a live X
server cannot be serialised). A crashed X server or a sandbox that died between steps ends the session as
infra_error.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
import weakref
from dataclasses import replace

from envd import scratch, terminal_tasks
from envd.base import Action, ActionError, Env, Outcome, Resources, StepResult, refuse_unknown
from envd.desktop import DesktopEnv
from envd.desktop import parse_options as parse_desktop
from envd.sandbox_limits import Limits
from envd.terminal import TerminalEnv
from envd.terminal import parse_options as parse_terminal
from envd.workspace_archive import rmtree

DESKTOP_OPTIONS = {"width", "height", "apps", "settle_s", "command_timeout_s"}
TERMINAL_OPTIONS = {"verify", "screen_chars", *Limits.__dataclass_fields__}
WINDOW_CHARS = 2000          # bound of the window list in the text (GUI programs can open many windows)
TERMINAL_TARGET = "terminal"


def _split_options(options: dict[str, str]) -> tuple[dict[str, str], dict[str, str], int, str]:
    """(desktop options, terminal options, max_steps, instruction), each side's checked by its own parser
    (envd.desktop.parse_options, envd.terminal.parse_options): the factory, Reset and check_options use this."""
    if "workspace" in options:
        raise ValueError("hybrid makes its own shared workspace; option `workspace` is not accepted")
    refuse_unknown("hybrid", options, DESKTOP_OPTIONS | TERMINAL_OPTIONS | {"max_steps", "instruction", "task"})
    try:
        max_steps = int(options.get("max_steps", 50))
    except ValueError:
        raise ValueError(f"max_steps={options.get('max_steps')!r} is not an integer") from None
    if not 1 <= max_steps <= 10_000:
        raise ValueError("max_steps must be in [1, 10000]")
    desk = {k: v for k, v in options.items() if k in DESKTOP_OPTIONS}
    term = {k: v for k, v in options.items() if k in TERMINAL_OPTIONS}
    # The hybrid env counts steps itself; the children must never end an episode on their own count.
    desk["max_steps"], term["max_steps"] = "0", "10000"
    parse_desktop(desk)
    parse_terminal(term)
    return desk, term, max_steps, str(options.get("instruction", ""))


def _task(task: str, options: dict[str, str]) -> str:
    chosen = options.get("task", "") or task
    if task and chosen != task:
        raise ValueError(f"env id names task {task!r} but option task={chosen!r}")
    if chosen and chosen not in terminal_tasks.TASKS:
        raise KeyError(f"unknown env id 'hybrid/{chosen}': tasks are {list(terminal_tasks.TASKS)}")
    return chosen


def check_options(task: str, options: dict[str, str]) -> None:
    """registry.check_options for `hybrid[/task]`: what the factory would refuse of these options, starting nothing."""
    _task(task, options)
    _split_options(options)


class HybridEnv(Env):
    """An Xvfb desktop and a bubblewrap terminal sharing one workspace."""

    def __init__(self, task: str = "", options: dict[str, str] | None = None):
        options = dict(options or {})
        self.task = _task(task, options)
        self.env_id = f"hybrid/{task}" if task else "hybrid"
        desk_opts, term_opts, self.max_steps, self.instruction = _split_options(options)
        self.desktop: DesktopEnv | None = None
        self.terminal: TerminalEnv | None = None
        # 0o711: the sandbox uid may pass through to the workspace but not list this directory.
        self._dir = pathlib.Path(tempfile.mkdtemp(prefix="tars-hybrid-", dir=scratch.root()))
        weakref.finalize(self, rmtree, self._dir)
        os.chmod(self._dir, 0o711)
        self.workspace = self._dir / "workspace"
        self.workspace.mkdir(mode=0o755)
        self.steps, self.outcome, self._over, self._started = 0, Outcome.RUNNING, False, False
        self._final: StepResult | None = None   # the episode's last result, once it is over
        try:
            self.terminal = TerminalEnv(self.task, term_opts, workspace=self.workspace, reset_clears_workspace=True)
            self.desktop = DesktopEnv("", {**desk_opts, "workspace": str(self.workspace)})
            self._share_uid()
        except BaseException:
            self.close()
            raise
        self.action_space = (f"{self.desktop.action_space}; with target='terminal': {TerminalEnv.action_space} "
                             "go to the sandboxed shell on the same workspace")

    @property
    def screenshots(self) -> bool:   # the observation's screenshot is the desktop's
        return self.desktop is None or self.desktop.screenshots

    @screenshots.setter
    def screenshots(self, on: bool) -> None:
        if self.desktop is not None:
            self.desktop.screenshots = on

    def _share_uid(self) -> None:
        """The GUI's sandbox runs as the terminal's uid, in one process count of both sides' nproc."""
        apps, shell = self.desktop.apps_sandbox, self.terminal.sandbox
        apps.share_uid(shell.uid, extra_nproc=self.terminal.limits.nproc)
        apps.quota = self.terminal.limits    # one workspace, one quota: the terminal's disk_mb / disk_files
        shell.extra_nproc = apps.limits.nproc

    def resources(self, options: dict[str, str] | None = None) -> Resources:
        """The terminal sandbox's limits (after a Reset with `options`) plus the desktop's processes and memory; disk
        only the terminal's: one workspace, under one quota (the terminal's disk_mb, `_share_uid`)."""
        term_opts = _split_options(dict(options))[1] if options else None
        desk = self.desktop.resources()
        return self.terminal.resources(term_opts) + Resources(desk.pids, desk.memory_mb)

    # ---- health ----------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        """Either side gone is an infrastructure failure (never a reward of 0)."""
        self.desktop._check_x()
        t = self.terminal
        if t.state in ("prompt", "cont", "running") and not t.sandbox.alive:
            raise RuntimeError("the terminal's sandbox exited between steps")

    # ---- episodes --------------------------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        options = dict(options or {})
        if options:
            if options.get("task", self.task) != self.task:
                raise ValueError(f"{self.env_id} runs task {self.task!r}, not {options['task']!r}")
            _, term_opts, self.max_steps, instruction = _split_options(options)
            self.instruction = instruction or self.instruction
        else:
            term_opts = {}
        self.desktop._check_x()
        self.desktop._stop_apps()   # nothing from the old episode may write into the workspace being cleared
        self.terminal.reset(seed, term_opts or None)      # clears the workspace, seeds the task, starts a shell
        self._share_uid()                                 # the terminal's nproc may have changed with the options
        d = self.desktop.reset(seed, {"instruction": self.instruction})
        self.steps, self.outcome, self._over, self._started = 0, Outcome.RUNNING, False, True
        return self._compose(d, reward=0.0)

    def step(self, action: Action) -> StepResult:
        if not self._started:
            raise ActionError("reset the environment first")
        if self._over:
            raise ActionError("the episode is over; reset first")
        kind = action.type
        self._check_alive()
        to_terminal = action.target.strip().lower() == TERMINAL_TARGET
        if kind in ("finished", "call_user"):
            return self._end_episode(verify=kind == "finished")
        reward = 0.0
        if to_terminal:
            term_action = replace(action, target="")
            t = self.terminal.step(term_action)       # validates before acting: ActionError leaves it unchanged
            d = self.desktop.observe()
        else:
            d = self.desktop.step(action)             # validates before any input reaches the X server
            t = self.terminal._after_step()           # verify=step, disk quota: the GUI writes the same workspace
        self.steps += 1
        if t.outcome != Outcome.RUNNING:              # verify=step passed, or the disk quota was exceeded
            self._close_desktop_episode()
            self.outcome, reward = t.outcome, t.reward
        elif self.steps >= self.max_steps:
            self.terminal._end(Outcome.TRUNCATED, success=False)
            self._close_desktop_episode()
            self.outcome = Outcome.TRUNCATED
        return self._ended(self._compose(d, reward=reward))

    def _ended(self, r: StepResult) -> StepResult:
        if self._over:   # Observe shows the last screen from now on: the apps are gone
            self._final = replace(r, reward=0.0)
        return r

    def _end_episode(self, verify: bool) -> StepResult:
        d = self._close_desktop_episode()                   # the GUI stops before the verifier reads the workspace
        if verify:
            t = self.terminal.step(Action("finished"))      # stops the shell, then the task's verifier judges
        else:
            t = self.terminal._end(Outcome.TERMINATED, success=False)
        self.steps += 1
        self.outcome = Outcome.TERMINATED
        return self._ended(self._compose(d, reward=t.reward if self.terminal.spec else 0.0))

    def _close_desktop_episode(self) -> StepResult:
        """The desktop's last screen, then its apps stopped: once the episode is over nothing checks the quota (the
        terminal's sandbox is stopped), so a job the xterm's shell left running filled the disk until a Reset or
        Close; and with verify=finished it could change the workspace while the verifier read it."""
        self._over = True
        d = self.desktop.step(Action("finished")) if not self.desktop._done else self.desktop.observe()
        self.desktop._stop_apps()
        return d

    # ---- observation -----------------------------------------------------------------------------------------
    def _compose(self, d: StepResult, reward: float) -> StepResult:
        t = self.terminal._result()
        windows = d.text if len(d.text) <= WINDOW_CHARS else d.text[:WINDOW_CHARS] + "\n[... more windows ...]"
        text = f"{windows}\nterminal (target='terminal'), workspace {self.workspace} = /workspace:\n{t.text}"
        info = {"display": d.info.get("display"), "windows": d.info.get("windows"), "workspace": str(self.workspace),
                "terminal": {k: v for k, v in t.info.items() if k in ("cwd", "exit_status", "state")}}
        if self.terminal.spec:
            info["success"] = bool(t.info.get("success"))
            if "verifier" in t.info:
                info["verifier"] = t.info["verifier"]
        else:
            info["success"] = False
        return StepResult(text=text, instruction=t.instruction or self.instruction, reward=reward,
                          outcome=self.outcome, images=d.images, info=info, width=d.width, height=d.height,
                          step=self.steps)

    def observe(self) -> StepResult:
        if not self._started:
            raise ActionError("reset the environment first")
        if self._over:
            self.desktop._check_x()
            return self._final
        self._check_alive()
        return self._compose(self.desktop.observe(), reward=0.0)

    def snapshot(self) -> bytes:
        raise NotImplementedError("hybrid sessions cannot be snapshotted: the desktop half is a live X server "
                                  "with running programs, which cannot be serialised")

    def restore(self, state: bytes) -> StepResult:
        raise NotImplementedError("hybrid sessions cannot be restored: there are no hybrid snapshots")

    @property
    def pids(self) -> set[int]:
        out = set(self.desktop.pids) if self.desktop else set()
        if self.terminal and self.terminal.sandbox.proc is not None:
            out.add(self.terminal.sandbox.proc.pid)
        return out

    def close(self) -> None:
        for child in (getattr(self, "terminal", None), getattr(self, "desktop", None)):
            if child is not None:
                try:
                    child.close()
                except Exception:
                    pass
        if getattr(self, "_dir", None):
            rmtree(self._dir)   # the sandbox may have left unreadable directories in the workspace


def make(name: str = "", options: dict[str, str] | None = None) -> HybridEnv:
    return HybridEnv(name, options)
