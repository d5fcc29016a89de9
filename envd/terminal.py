"""The `terminal` backend: a bash shell in a bubblewrap sandbox (envd/sandbox.py) with a per-session workspace.

Env ids: `terminal` (an open shell, or the task named by option `task`) and `terminal/<task>`.

Actions
  type(content='ls -la\\n')   every `\\n` submits the line typed so far; text after the last `\\n` waits in the
                              line buffer (shown on the prompt line) for a later `\\n`. While a command runs, typed
                              text goes to that program's input instead (e.g. answering `read`).
  hotkey(key='ctrl c')        interrupt the running command (SIGINT, then SIGKILL after a grace period), or clear
                              the line buffer. Also: 'ctrl d' (end of input), 'ctrl u' (clear the line), 'ctrl l'
                              (clear the screen), 'enter', 'backspace'.
  wait()                      let a running command go on for up to `wait_s` more seconds and show its output.
  finished()                  end the episode (the task's verifier decides the reward).
A step that submits a command returns once the prompt is back or after `wait_s` seconds ("running" then shows on
the last line); the command's wall timeout `timeout_s` runs regardless of steps.

Observation: the recent transcript (prompt with cwd, command, output, `[exit N]`), at most `screen_chars`
characters, ANSI sequences and carriage-return overwrites resolved. Background jobs do not outlive the command line
that started them (the shell kills every other process at each prompt). Commands that exit the shell get a new shell
(same workspace, same cwd), and the transcript says so.

Reward: tasks are verified at `finished()` only (option `verify=finished`, the default: reward 1 when the verifier
passes, else 0), or after every step with `verify=step` (the episode ends, reward 1, as soon as it passes). Without a
task the env is an open shell: reward 0, the episode ends on `finished()` or at `max_steps` (truncated).

Snapshots: a gzip'd tar of the workspace plus the task state and transcript as JSON (envd/workspace_archive.py),
taken only while the shell waits at its prompt; restore starts a fresh sandbox on the unpacked workspace (shell
variables and functions are not part of a snapshot; the cwd is).
"""
from __future__ import annotations

import os
import pathlib
import tempfile
import time

from envd import scratch, terminal_tasks, workspace_archive
from envd.base import Action, ActionError, Env, Outcome, Resources, StepResult, refuse_unknown
from envd.sandbox import SANDBOX_WORKSPACE, Limits, SandboxError, ShellSandbox, quota_breach
from envd.terminal_text import KEYS, MAX_CONTENT, MAX_LINE, check_content, clean_terminal_text, normalize_key
from envd.workspace_archive import clear_dir, rmtree

SNAPSHOT_VERSION = 1


OPTIONS = ("max_steps", "verify", "screen_chars", *Limits.__dataclass_fields__)   # and `task`: session_task


def parse_options(options: dict[str, str]) -> tuple[Limits, int, int, str]:
    """(limits, max_steps, screen_chars, verify) from the options other than `task`: the one parser of the factory,
    Reset, restore and registry.check_options (`task`, taken apart by session_task, is not read here). ValueError
    names a bad or unknown one; nothing is started."""
    refuse_unknown("terminal", options, {*OPTIONS, "task"})
    limits = Limits.from_options(options)
    try:
        max_steps, screen_chars = int(options.get("max_steps", 50)), int(options.get("screen_chars", 6000))
    except ValueError as e:
        raise ValueError(f"bad terminal option: {e}") from None
    if not 1 <= max_steps <= 10_000 or not 500 <= screen_chars <= 200_000:
        raise ValueError("max_steps must be in [1, 10000] and screen_chars in [500, 200000]")
    verify = options.get("verify", "finished")
    if verify not in ("finished", "step"):
        raise ValueError(f"verify={verify!r}: use 'finished' or 'step'")
    return limits, max_steps, screen_chars, verify


def session_task(task: str, options: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(the task the session runs, the other options): the env id's task or option `task`, which must agree."""
    rest = dict(options)
    chosen = rest.pop("task", "") or task
    if task and chosen != task:
        raise ValueError(f"env id names task {task!r} but option task={chosen!r}")
    if chosen and chosen not in terminal_tasks.TASKS:
        raise ValueError(f"unknown terminal task {chosen!r}; tasks are {list(terminal_tasks.TASKS)}")
    return chosen, rest


def check_options(task: str, options: dict[str, str]) -> None:
    """registry.check_options for `terminal[/task]`: what CreateSession would refuse of these options."""
    parse_options(session_task(task, options)[1])


class TerminalEnv(Env):
    """One terminal session: a workspace, a sandboxed shell on it, a transcript, and optionally a task."""

    action_space = ("type(content='COMMAND\\n'), hotkey(key='ctrl c'|'ctrl d'|'ctrl u'|'ctrl l'|'enter'|'backspace'), "
                    "wait(), finished()")

    def __init__(self, task: str = "", options: dict[str, str] | None = None, workspace: str | os.PathLike | None = None,
                 reset_clears_workspace: bool = True):
        """`workspace`: a host directory to use as /workspace (a `hybrid` backend shares one between a GUI and this
        shell); it is never an option, since a client naming host directories would defeat the sandbox. Without
        it the session gets a fresh temp dir (in this process's scratch root, envd/scratch.py), removed at close."""
        options = dict(options or {})
        self.options = dict(options)     # creation options; a Reset's options are laid over them
        self.task, options = session_task(task, options)
        self.env_id = f"terminal/{task}" if task else "terminal"
        self._configure(options)
        self.private_dir = pathlib.Path(tempfile.mkdtemp(prefix="tars-terminal-", dir=scratch.root()))
        self.owns_workspace = workspace is None
        self.workspace = self.private_dir / "workspace" if workspace is None else pathlib.Path(workspace).resolve()
        self.workspace.mkdir(mode=0o755, exist_ok=True)
        self.reset_clears_workspace = reset_clears_workspace
        self.sandbox = ShellSandbox(self.workspace, self.private_dir, self.limits)
        if self.sandbox.uid is not None and not self.owns_workspace:
            blocked = [str(p) for p in self.workspace.parents if not os.stat(p).st_mode & 0o001]
            if blocked:
                self.close()
                raise ValueError(f"the shared workspace {self.workspace} must be reachable by the sandbox's own uid, "
                                 f"but {blocked[0]} is not searchable by others (chmod o+x, or put it elsewhere)")
        self.spec: terminal_tasks.TaskSpec | None = None
        self.transcript = ""
        self.cwd = SANDBOX_WORKSPACE
        self.pending = ""                # typed at the prompt, not yet submitted
        self.queued: list[str] = []      # submitted lines waiting for the prompt to come back
        self.state = "idle"              # idle (no episode) | prompt | cont | running | over
        self.steps = 0
        self.outcome, self.success, self.last_status, self.detail = Outcome.RUNNING, False, 0, ""

    def _configure(self, options: dict[str, str]) -> None:
        self.limits, self.max_steps, self.screen_chars, self.verify_mode = parse_options(options)

    def resources(self, options: dict[str, str] | None = None) -> Resources:
        """The sandbox's process and memory limits (after a Reset with `options`: its limits merged over these)."""
        if not options:
            return self.limits.host_claim()
        merged = {k: v for k, v in (self.options | dict(options)).items() if k in Limits.__dataclass_fields__}
        return Limits.from_options(merged).host_claim()

    # ---- episode -------------------------------------------------------------------------------------------
    def reset(self, seed: int, options: dict[str, str] | None = None) -> StepResult:
        if options:
            options = self.options | dict(options)
            task = options.pop("task", self.task)
            if task and task not in terminal_tasks.TASKS:
                raise ValueError(f"unknown terminal task {task!r}; tasks are {list(terminal_tasks.TASKS)}")
            if self.env_id != "terminal" and task != self.task:
                raise ValueError(f"{self.env_id} runs task {self.task!r}, not {task!r}")
            self._configure(options)
            self.task = task
            self.sandbox.limits = self.limits
        self.sandbox.stop()
        if self.reset_clears_workspace:
            clear_dir(self.workspace)
        self.spec = terminal_tasks.build(self.task, seed) if self.task else None
        if self.spec:
            terminal_tasks.seed_files(self.workspace, self.spec)
        self._begin(SANDBOX_WORKSPACE, transcript="", pending="", steps=0)
        return self._result()

    def _begin(self, cwd: str, transcript: str, pending: str, steps: int) -> None:
        self.transcript, self.pending, self.queued, self.steps = transcript, pending, [], steps
        self.outcome, self.success, self.detail, self.last_status = Outcome.RUNNING, False, "", 0
        self._start_shell(cwd)

    def _start_shell(self, cwd: str) -> None:
        # The sandbox owns the workspace and may have chmod'ed it, or the directory it left the shell in, so that it
        # cannot enter it: bwrap's --chdir then failed and a policy's `chmod 000 . && exit` ended the session as
        # INFRA_ERROR (a Reset too). The workspace is made enterable again, and a cwd that is not falls back to it.
        os.chmod(self.workspace, 0o755)
        self.cwd = cwd if self._cwd_exists(cwd) else SANDBOX_WORKSPACE
        try:
            out = self.sandbox.start(self.cwd)
        except SandboxError:
            if self.cwd == SANDBOX_WORKSPACE:
                raise
            self.cwd = SANDBOX_WORKSPACE
            out = self.sandbox.start(self.cwd)
        self._append(out)
        self.state = "prompt"

    def _cwd_exists(self, cwd: str) -> bool:
        if cwd != SANDBOX_WORKSPACE and not cwd.startswith(SANDBOX_WORKSPACE + "/"):
            return False
        host = os.path.realpath(self.workspace / cwd[len(SANDBOX_WORKSPACE):].lstrip("/"))
        root = os.path.realpath(self.workspace)
        return (host == root or host.startswith(root + os.sep)) and os.path.isdir(host)

    def step(self, action: Action) -> StepResult:
        if self.state == "idle":
            raise ActionError("reset the terminal first")
        if self.state == "over":
            raise ActionError("the episode is over; reset first")
        kind = action.type
        if kind == "type":
            content = check_content(action.content)
            if self.state != "running" or self.queued:
                line = (self.pending + content).split("\n", 1)[0]
                if len(line.encode()) > MAX_LINE:
                    raise ActionError(f"the line being typed would be longer than {MAX_LINE} bytes")
                waiting = sum(len(q) + 1 for q in self.queued) + len(self.pending) + len(content)
                if waiting > MAX_CONTENT:
                    raise ActionError(f"{waiting} characters would wait for the shell; at most {MAX_CONTENT} may "
                                      "(wait for the running command, or ctrl c it)")
            self.steps += 1
            self._type(content)
        elif kind == "hotkey":
            key = normalize_key(action.key)
            if key not in KEYS:
                raise ActionError(f"unsupported key {action.key!r}; the terminal takes {sorted(KEYS)}")
            self.steps += 1
            self._hotkey(key)
        elif kind == "wait":
            self.steps += 1
            self._settle(time.monotonic() + self.limits.wait_s)
        elif kind == "finished":
            self.steps += 1
            return self._finish()
        else:
            raise ActionError(f"the terminal takes type, hotkey, wait and finished, not {kind!r}")
        return self._after_step()

    def _after_step(self) -> StepResult:
        if self.spec and self.verify_mode == "step" and self.state != "running":
            ok, self.detail = terminal_tasks.verify(self.spec.name, self.workspace, self.spec.answer)
            if ok:
                return self._end(Outcome.TERMINATED, success=True)
        breach = quota_breach(self.workspace, self.limits)
        if breach:
            self.detail = f"the {breach}"
            self._append(f"[{self.detail}: the episode ends]\n")
            return self._end(Outcome.TRUNCATED, success=False)
        if self.steps >= self.max_steps:
            return self._end(Outcome.TRUNCATED, success=False)
        return self._result()

    def _finish(self) -> StepResult:
        self.sandbox.stop()   # nothing may change the workspace while (or after) it is judged
        success = False
        if self.spec:
            success, self.detail = terminal_tasks.verify(self.spec.name, self.workspace, self.spec.answer)
        return self._end(Outcome.TERMINATED, success=success)

    def _end(self, outcome: Outcome, success: bool) -> StepResult:
        self.sandbox.stop()
        self.state, self.outcome, self.success = "over", outcome, success
        return self._result(reward=1.0 if success else 0.0)

    # ---- actions -------------------------------------------------------------------------------------------
    def _type(self, content: str) -> None:
        deadline = time.monotonic() + self.limits.wait_s
        if self.state == "running" and not self.queued:
            # Input for the running program (like typing into `read` or a REPL): straight to the terminal.
            self._append(content)
            self.sandbox.write(content.encode())
            self._settle(deadline, settle=0.5)
            return
        lines = (self.pending + content).split("\n")
        self.pending = lines.pop()
        self.queued += lines
        self._settle(deadline)

    def _hotkey(self, key: str) -> None:
        deadline = time.monotonic() + self.limits.wait_s
        if key == "enter":
            return self._type("\n")
        if key == "ctrl l":
            self.transcript = ""
            return self._settle(time.monotonic())
        if self.state != "running":
            if key == "backspace":
                self.pending = self.pending[:-1]
            elif key == "ctrl u":
                self.pending = ""
            elif key == "ctrl c":
                self._append(f"{self._prompt()}{self.pending}^C\n")
                self.pending = ""
                if self.state == "cont":
                    self.sandbox.interrupt()   # abandon the unfinished construct: back to PS1
                    self._settle(deadline)
            elif key == "ctrl d" and not self.pending:
                self.sandbox.write(b"\x04")    # EOF at an empty prompt: bash exits, a new shell follows
                self._settle(deadline)
            return None
        if key == "ctrl c":
            self._append("^C\n")
            self.queued.clear()
            self.sandbox.interrupt()
            self._settle(min(deadline, time.monotonic() + 1.0))
            if self.state == "running":        # it ignored SIGINT
                self.sandbox.kill_foreground()
                self._settle(min(deadline, time.monotonic() + 1.0))
        else:
            self.sandbox.write({"ctrl d": b"\x04", "ctrl u": b"\x15", "backspace": b"\x7f"}[key])
            self._settle(deadline, settle=0.5)
        return None

    # ---- the shell's events ------------------------------------------------------------------------------
    def _settle(self, deadline: float, settle: float = 0.0) -> None:
        """Feed queued lines at each prompt and record output until the queue is empty and the shell waits, or
        `deadline` passes (a running command goes on: a later wait() picks it up). `settle`: for input to a running
        program, also return once its output has been quiet that long."""
        restarts, fed = 0, False
        while True:
            if self.state in ("prompt", "cont") and self.queued and (not fed or time.monotonic() < deadline):
                line = self.queued.pop(0)
                self._append(f"{self._prompt()}{line}\n")
                self.state, fed = "running", True
                if not self.sandbox.submit(line):
                    self._append("[the shell did not take the input]\n")
            running = self.state == "running"
            events = self.sandbox.wait(deadline if running else time.monotonic(), settle=settle if running else 0.0)
            for ev in events:
                if ev.kind == "out":
                    self._append(ev.text)
                elif ev.kind == "prompt":
                    self.cwd, self.last_status, self.state = ev.cwd, ev.status, "prompt"
                    self._newline()
                    self._append(f"[exit {ev.status}]" + (f" ({ev.note})" if ev.note else "") + "\n")
                elif ev.kind == "cont":
                    self.state = "cont"
                elif ev.kind == "exit":
                    restarts += 1
                    if restarts > 3:
                        raise SandboxError("the sandboxed shell keeps exiting")
                    self._newline()
                    why = f"; {ev.note}" if ev.note else ""
                    dropped = f"; {len(self.queued)} queued line(s) dropped" if self.queued else ""
                    self.queued.clear()
                    self._append(f"[the shell exited (status {ev.status}{why}{dropped}); a new shell started]\n")
                    self._start_shell(self.cwd)
            if self.state == "running":
                if time.monotonic() >= deadline or (settle and events):
                    return
            elif not self.queued or time.monotonic() >= deadline:
                return

    def _append(self, text: str) -> None:
        if text:
            self.transcript += text
            if len(self.transcript) > 4 * self.screen_chars:
                self.transcript = self.transcript[-2 * self.screen_chars:]

    def _newline(self) -> None:
        if self.transcript and not self.transcript.endswith("\n"):
            self.transcript += "\n"

    def _prompt(self) -> str:
        return "> " if self.state == "cont" else f"{self.cwd}$ "

    # ---- observation ---------------------------------------------------------------------------------------
    def render(self) -> str:
        text = clean_terminal_text(self.transcript[-3 * self.screen_chars:])
        if self.state in ("prompt", "cont"):
            tail = f"{self._prompt()}{self.pending}"
        elif self.state == "running":
            queued = f"; {len(self.queued)} line(s) queued" if self.queued else ""
            tail = (f"[running{queued}: wait() for more output, hotkey(key='ctrl c') to interrupt; "
                    f"killed after {self.limits.timeout_s:g}s]")
        else:
            tail = "[episode over]"
        if text and not text.endswith("\n"):
            text += "\n"
        tail = tail[-self.screen_chars:]
        budget = self.screen_chars - len(tail)
        if len(text) > budget:
            marker = "[... earlier output scrolled away ...]\n"
            keep = budget - len(marker)
            cut = text[-keep:] if keep > 0 else ""
            if "\n" in cut[:-1]:
                cut = cut[cut.find("\n") + 1:]   # start on a whole line
            text = marker + cut if keep > 0 else ""
        return text + tail

    def _result(self, reward: float = 0.0) -> StepResult:
        info = {"cwd": self.cwd, "exit_status": self.last_status, "state": self.state, "task": self.task}
        if self.spec:
            info["success"] = self.success
            if self.detail:
                info["verifier"] = self.detail
        return StepResult(text=self.render(), instruction=self.spec.instruction if self.spec else "",
                          reward=reward, outcome=self.outcome, info=info, step=self.steps)

    def observe(self) -> StepResult:
        if self.state == "idle":
            raise ActionError("reset the terminal first")
        return self._result()

    # ---- snapshots -----------------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        if self.state == "idle":
            raise ActionError("reset the terminal first")
        if self.state in ("running", "cont") or self.queued:
            raise ActionError("a command is running: wait for its prompt (or interrupt it) before a snapshot")
        meta = {"version": SNAPSHOT_VERSION, "task": self.task, "limits": self.limits.as_dict(),
                "max_steps": self.max_steps, "screen_chars": self.screen_chars, "verify": self.verify_mode,
                "spec": vars(self.spec) | {"files": {}} if self.spec else None, "steps": self.steps,
                "transcript": self.transcript, "cwd": self.cwd, "pending": self.pending, "state": self.state,
                "outcome": self.outcome, "success": self.success, "last_status": self.last_status}
        return workspace_archive.pack(self.workspace, meta)

    def restore(self, state: bytes) -> StepResult:
        self.sandbox.stop()
        clear_dir(self.workspace)
        meta = workspace_archive.unpack(bytes(state), self.workspace)
        try:
            if meta.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"snapshot version {meta.get('version')!r}, expected {SNAPSHOT_VERSION}")
            opts = {k: str(v) for k, v in meta["limits"].items()}
            opts |= {"max_steps": str(meta["max_steps"]), "screen_chars": str(meta["screen_chars"]),
                     "verify": str(meta["verify"])}
            self._configure(opts)     # the same bounds as client options
            self.sandbox.limits = self.limits
            task = str(meta["task"])
            if task and task not in terminal_tasks.TASKS:
                raise ValueError(f"unknown task {task!r}")
            spec = meta["spec"]
            self.task = task
            self.spec = None if not spec else terminal_tasks.TaskSpec(
                name=task, instruction=str(spec["instruction"]), answer=dict(spec["answer"]))
            transcript, cwd, pending = str(meta["transcript"]), str(meta["cwd"]), str(meta["pending"])
            steps, state = int(meta["steps"]), str(meta["state"])
            if state not in ("prompt", "over") or len(transcript) > 8 * self.screen_chars or len(pending) > MAX_LINE \
                    or not 0 <= steps <= self.max_steps:
                raise ValueError("inconsistent session state")
            if self.spec and not (isinstance(self.spec.answer.get("number"), int)
                                  or isinstance(self.spec.answer.get("text"), str)):
                raise ValueError("the task's answer must hold an integer `number` or a string `text`")
            ended = Outcome(str(meta["outcome"])) if state == "over" else Outcome.RUNNING
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ActionError(f"not a terminal snapshot: {type(e).__name__}: {e}") from None
        if state == "over":
            self.transcript, self.pending, self.queued, self.steps, self.cwd = transcript, pending, [], steps, cwd
            self.state, self.outcome, self.success = "over", ended, bool(meta["success"])
            self.last_status = int(meta.get("last_status", 0))
            return self._result()
        self._begin(cwd, transcript=transcript, pending=pending, steps=steps)
        self.last_status = int(meta.get("last_status", 0))
        return self._result()

    def close(self) -> None:
        self.sandbox.release()
        rmtree(self.private_dir)   # holds the workspace only when this env made it


def make(name: str, options: dict[str, str]) -> TerminalEnv:
    return TerminalEnv(task=name, options=options)
