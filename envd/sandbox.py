"""A bash shell in a bubblewrap sandbox, driven through a pseudo-terminal (the `terminal` backend's engine).

The sandbox itself (mounts, namespaces, dropped capabilities, the prlimit limits of envd/sandbox_limits.py, a root
daemon's uid of its own) is the command line of envd/bwrap.py, which the desktop's GUI apps share; the shell adds
its bash rc file (read-only at /etc/tars.bashrc) and runs in the workspace at /workspace.

Command boundaries: the shell is interactive (job control: each command line is its own process group, and ctrl-c
reaches it through the terminal); PS1/PS2 print sentinels carrying the prompt's number (a look-alike a job printed,
or one left in the pty after a kill, cannot know it), the exit status and the cwd. PS1, PS2 and
PROMPT_COMMAND are read-only, and PROMPT_COMMAND kills every other process in the sandbox (`kill -9 -1` from the
shell spares only itself and the namespace's init), so background jobs and fork bombs end with the command line
that started them. The daemon does the same from the host at each prompt, since bash can still run user code after
that kill (a DEBUG trap, PS4 under `set -x`), and every half second while the shell waits at its prompt (a trap
run when the shell takes a signal there): everything but the init and the shell is killed (a job of the shell's
own, such as a line typed ahead, is timed like a command line). A reader thread owns the pty's output: it parses it into events,
caps what each command line may print, and polices the limits that need a clock: past the wall timeout (or the
disk quota, or an output flood) the foreground job gets SIGINT, then SIGKILL after a grace period; a shell that
still does not come back (a busy loop of builtins with SIGINT ignored) has its whole sandbox killed, and the
caller starts a new one. The disk quota is checked while the sandbox lives, between command lines too.
"""
from __future__ import annotations

import codecs
import fcntl
import logging
import os
import pathlib
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass

from envd.cgroups import MemoryCgroup, memory_cgroup
from envd.bwrap import SANDBOX_PATH, SANDBOX_WORKSPACE, sandbox_argv, write_etc
from envd.sandbox_exit import (end_sandbox, kill_bwrap, kill_strays, open_pidfd, read_child_pid, reap, running,
                               shell_idle, signal_group, strays)
from envd.sandbox_limits import (Limits, SandboxError, allocate_uid, chown_tree, missing_tools, quota_breach,
                                 release_uid, workspace_usage)
from envd.terminal_text import OutputSegment

log = logging.getLogger(__name__)

__all__ = ["SANDBOX_WORKSPACE", "Event", "Limits", "SandboxError", "ShellSandbox", "missing_tools", "quota_breach",
           "workspace_usage"]

ROWS, COLS = 40, 160
_PROMPT, _CONT, _END = b"\x1e", b"\x1d", b"\x1f"   # PS1 = \x1e<n> <status> <cwd>\x1f, PS2 = \x1d\x1f
_MAX_SENTINEL = 4096                             # a \x1e without its \x1f this far on is plain output
_GRACE_S = 1.0                                   # SIGINT first; SIGKILL the job after this; the sandbox after 3x
_RC = r"""
PS1=$'\x1e${__tars_prompt} $? ${PWD}\x1f'
PS2=$'\x1d\x1f'
PROMPT_COMMAND='builtin kill -9 -1 2>/dev/null; builtin wait 2>/dev/null; __tars_prompt=$((__tars_prompt + 1))'
readonly PS1 PS2 PROMPT_COMMAND
unset HISTFILE
set +o histexpand
"""


@dataclass
class Event:
    kind: str            # "out" (text), "prompt" (the shell waits for a command), "cont" (PS2), "exit" (shell gone)
    text: str = ""
    status: int = 0      # prompt: $? of the last command line; exit: the sandbox's exit status
    cwd: str = ""
    note: str = ""       # prompt/exit: why the sandbox killed the command line ("" when it did not)


class ShellSandbox:
    """One sandboxed interactive bash on a pty, with a reader thread that parses its output and polices limits.
    The caller (one thread) writes input and consumes events with `wait`; the reader thread owns the pty's output."""

    def __init__(self, workspace: str | os.PathLike, private_dir: str | os.PathLike, limits: Limits):
        self.workspace = pathlib.Path(workspace)
        self.private_dir = pathlib.Path(private_dir)
        self.limits = limits
        self.uid = allocate_uid()           # the host uid the shell runs as (None: the daemon's own)
        self.extra_nproc = 0                # processes a GUI sharing the uid may use (envd/hybrid.py)
        self.proc: subprocess.Popen | None = None
        self.cgroup: MemoryCgroup | None = None   # bounds the whole sandbox at the host budget's memory claim
        self.master = -1
        self.shell_pgid = 0
        self._cond = threading.Condition()
        self._events: list[Event] = []      # produced by the reader, consumed by `wait`; bounded by _MAX_EVENTS
        self._seq = 0                       # bumped on every new output or event (for `wait`'s quiet detection)
        # Policing state, shared with the reader thread under _cond:
        self._deadline = 0.0                # monotonic deadline of the submitted command line; 0 when none runs
        self._expired_at = 0.0              # when the deadline (or the quota, or the flood limit) fired
        self._note = ""                     # why the command line is being killed
        self._ooms = 0                      # the cgroup's OOM kills when the command line was submitted
        self.at_prompt = False              # the shell waits for a new command line (PS1 or PS2 shown)
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._info_fd = self._init_fd = -1  # bwrap's --info-fd (while starting); a pidfd of the sandbox's init
        self._init_pid = 0                  # that init's pid (0 when none runs), for the stray sweeps
        self._jobs_since = 0.0              # when jobs of the shell were first seen while it idles at its prompt
        self._since_submit = 0              # output bytes since the last command line (the flood limit)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def _argv(self, cwd: str) -> list[str]:
        etc = write_etc(self.private_dir / "etc", {"bashrc": _RC})
        return [*sandbox_argv(self.workspace, etc, self.limits, self.uid, self._info_fd, cwd=cwd,
                              ro_binds=[(etc / "bashrc", "/etc/tars.bashrc")], extra_nproc=self.extra_nproc,
                              cgroup=self.cgroup),
                "setsid", "-c", "bash", "--noprofile", "--rcfile", "/etc/tars.bashrc", "--noediting", "-i"]

    def start(self, cwd: str = SANDBOX_WORKSPACE, timeout: float = 10.0) -> str:
        """Start the shell in `cwd` (a path inside the sandbox) and wait for its first prompt; returns its output."""
        if missing := missing_tools():
            raise SandboxError(f"the terminal sandbox needs {', '.join(missing)} on the host "
                               "(apt: bubblewrap, util-linux)")
        self.stop()
        if self.uid is not None:
            os.chmod(self.private_dir, 0o711)      # the sandbox uid must reach etc/ and the workspace in here
            chown_tree(self.workspace, self.uid)
        self.cgroup = memory_cgroup(self.limits.host_claim().memory_mb)
        master, slave = os.openpty()
        info_r, self._info_fd = os.pipe()
        try:
            attrs = termios.tcgetattr(slave)
            attrs[3] &= ~(termios.ECHO | termios.ECHONL)     # the transcript shows typed commands itself
            attrs[1] &= ~termios.ONLCR                        # \n stays \n
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
            env = {"PATH": SANDBOX_PATH, "HOME": SANDBOX_WORKSPACE, "TERM": "dumb",
                   "LANG": "C.UTF-8", "USER": "user", "SHELL": "/bin/bash",
                   "TMPDIR": "/tmp", "PAGER": "cat", "GIT_PAGER": "cat", "COLUMNS": str(COLS), "LINES": str(ROWS)}
            self.proc = subprocess.Popen(self._argv(cwd), stdin=slave, stdout=slave, stderr=slave, env=env,
                                         close_fds=True, start_new_session=True, pass_fds=(self._info_fd,))
        except BaseException:
            os.close(master)
            os.close(info_r)
            raise
        finally:
            os.close(slave)  # the shell holds the only slave fds: its exit reads as EIO on the master
            os.close(self._info_fd)
        init_pid = read_child_pid(info_r, timeout)
        self._init_fd, self._init_pid = open_pidfd(init_pid), init_pid or 0
        os.set_blocking(master, False)
        self.master, self._events, self.at_prompt, self.shell_pgid = master, [], False, 0
        self._since_submit = self._prompts = 0  # the shell's prompts seen: the next one says _prompts + 1
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, args=(master, self._stop), name="terminal-reader",
                                        daemon=True)
        self._reader.start()
        events = self.wait(time.monotonic() + timeout)
        out = "".join(e.text for e in events if e.kind == "out")
        if not events or events[-1].kind != "prompt":
            self.stop()
            raise SandboxError(f"the sandboxed shell did not start: {out.strip()[-2000:] or 'no output'}")
        self.shell_pgid = self._foreground_pgrp()
        return out

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def release(self) -> None:
        """Stop the sandbox for good and give its uid back."""
        self.stop()
        release_uid(self.uid)
        self.uid = None

    def stop(self) -> None:
        """Kill the sandbox (the namespace's init dies, taking every process in it) and release the pty."""
        self._stop.set()
        with self._cond:                      # no stray sweep of the reader's may start from here on
            init_fd, self._init_fd, self._init_pid = self._init_fd, -1, 0
        # The init first, then bwrap reaped (the reader thread may reap it too: Popen.wait is thread-safe).
        cgroup, self.cgroup = self.cgroup, None
        if not end_sandbox(init_fd, self.proc, cgroup=cgroup):  # every process of it gone (envd/sandbox_exit.py)
            log.error("sandbox processes still running 5 s after they were killed")
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self._reader = None
        if self.master >= 0:
            os.close(self.master)
        self.master, self.shell_pgid, self.at_prompt = -1, 0, False

    # ---- input ---------------------------------------------------------------------------------------------
    def write(self, data: bytes, timeout: float = 2.0) -> int:
        """Write to the terminal; returns the bytes written (fewer when the reader does not drain its input)."""
        done, deadline = 0, time.monotonic() + timeout
        while done < len(data) and time.monotonic() < deadline:
            _, w, _ = select.select([], [self.master], [], max(0.0, deadline - time.monotonic()))
            if not w:
                break
            try:
                done += os.write(self.master, data[done:done + 1024])
            except BlockingIOError:
                time.sleep(0.01)
            except OSError:
                break
        return done

    def submit(self, line: str) -> bool:
        """Send one command line to the shell waiting at its prompt; arms the wall timeout."""
        data = line.encode() + b"\n"
        with self._cond:
            self.at_prompt, self._since_submit, self._expired_at, self._note = False, 0, 0.0, ""
            self._ooms = self.cgroup.oom_kills() if self.cgroup is not None else 0
            self._deadline = time.monotonic() + self.limits.timeout_s
        return self.write(data) == len(data)

    # ---- output --------------------------------------------------------------------------------------------
    def wait(self, until: float, settle: float = 0.0) -> list[Event]:
        """Consume events until the shell shows a prompt (PS1/PS2) or exits, or `until` (monotonic) passes.
        With `settle` > 0, also return once output has been quiet that long after some arrived."""
        with self._cond:
            seen, quiet_since = self._seq, time.monotonic()
            while True:
                if self._events and self._events[-1].kind in ("prompt", "cont", "exit"):
                    break
                now = time.monotonic()
                if self._seq != seen:
                    seen, quiet_since = self._seq, now
                if now >= until or (settle and self._events and now - quiet_since >= settle):
                    break
                self._cond.wait(min(until - now, 0.05))
            out, self._events = self._events, []
            return out

    def _push(self, ev: Event) -> None:
        """Append an event (caller holds the condition); consecutive output coalesces."""
        self._seq += 1
        self._cond.notify_all()
        if ev.kind == "out":
            if not ev.text:
                return
            if self._events and self._events[-1].kind == "out":
                self._events[-1].text += ev.text
                return
        self._events.append(ev)
        if len(self._events) > _MAX_EVENTS:   # a client that never reads: keep the newest
            del self._events[:len(self._events) - _MAX_EVENTS]

    def _kill_init(self) -> None:
        """SIGKILL the namespace's init (caller holds the condition): every process of the sandbox dies, bwrap reaps
        the init and exits, and the reader sees the terminal close. bwrap itself only when no init is known (killed
        first, it would leave the init to whatever reaps for the daemon: envd/sandbox_exit.py end_sandbox)."""
        if self._init_fd >= 0:
            try:
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
            except OSError:
                pass
        else:
            kill_bwrap(self.proc)

    def _foreground_pgrp(self) -> int:
        try:
            return os.tcgetpgrp(self.master)
        except OSError:
            return 0

    # ---- signals -------------------------------------------------------------------------------------------
    def interrupt(self) -> None:  # SIGINT to the foreground process group: ctrl-c, even if the program turned ISIG off
        pg = self._foreground_pgrp()
        if pg > 0:
            signal_group(self._init_pid, pg, signal.SIGINT)   # only while it is the sandbox's: it may have died

    def kill_foreground(self) -> None:  # SIGKILL the foreground job unless the foreground is the shell itself
        pg = self._foreground_pgrp()
        if pg > 0 and pg != self.shell_pgid:
            signal_group(self._init_pid, pg, signal.SIGKILL)

    # ---- the reader thread ---------------------------------------------------------------------------------

    def _read_loop(self, master: int, stop: threading.Event) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        buf = b""
        seg = OutputSegment(self.limits.output_bytes)
        flood = max(8 << 20, 64 * self.limits.output_bytes)
        next_disk = next_idle = 0.0
        fg_seen = (0, 0.0)
        while not stop.is_set():
            try:
                r, _, _ = select.select([master], [], [], 0.1)
                chunk = os.read(master, 65536) if r else None
            except BlockingIOError:
                chunk = None
            except OSError:           # EIO: every slave fd is closed, the shell is gone
                chunk = b""
            with self._cond:
                if chunk == b"":
                    self._push(Event("out", decoder.decode(buf + seg.close(self.limits.output_bytes), final=True)))
                    self._push(Event("exit", status=reap(self.proc), note=self._note or self._oom_note()))
                    self.at_prompt = False
                    return
                if chunk:
                    self._since_submit += len(chunk)  # prompts (a program can print look-alikes) do not reset it
                    buf = self._parse(buf + chunk, seg, decoder)
                    if self._since_submit > flood and not self._expired_at:
                        self._expire(f"output flood: more than {flood} bytes")
                now = time.monotonic()
                fg_seen = self._police(now, fg_seen)
                if now >= next_idle:
                    next_idle = now + _IDLE_CHECK_S
                    self._police_idle(now)
                busy = bool(self._deadline or fg_seen[0])
            if now >= next_disk:          # a tree walk: outside the lock, so `wait` is never held up by it
                t0 = time.monotonic()
                breach = quota_breach(self.workspace, self.limits)
                # Every second, or less often when the walk itself is slow (it is bounded by disk_files entries),
                # and much less often between command lines, when only a stray can write (and is swept anyway).
                next_disk = now + max(1.0, (4 if busy else 16) * (time.monotonic() - t0))
                with self._cond:
                    if breach and not self._expired_at and self._deadline:
                        self._expire(breach)
                    elif breach and self._idle():
                        self._sweep(jobs_too=True)   # nothing may keep filling the workspace between commands

    def _parse(self, buf: bytes, seg: OutputSegment, decoder) -> bytes:
        """Turn raw output into events (caller holds the condition); returns the unparsed rest."""
        while buf:
            starts = [j for j in (buf.find(_PROMPT), buf.find(_CONT)) if j >= 0]
            i = min(starts) if starts else len(buf)
            if i:
                self._push(Event("out", decoder.decode(seg.add(buf[:i]))))
                buf = buf[i:]
                continue
            end = buf.find(_END)
            cut = [j for j in (buf.find(_PROMPT, 1), buf.find(_CONT, 1)) if 0 < j < (end if end >= 0 else len(buf))]
            if cut:  # a sentinel cut short (its writer killed mid-line): what follows it may be the shell's own
                self._push(Event("out", decoder.decode(seg.add(buf[:min(cut)]))))
                buf = buf[min(cut):]
                continue
            if end < 0:
                if len(buf) <= _MAX_SENTINEL:
                    return buf  # the rest of the sentinel is still on its way
                self._push(Event("out", decoder.decode(seg.add(buf[:1]))))
                buf = buf[1:]
                continue
            kind, body, buf = buf[:1], buf[1:end], buf[end + 1:]
            n, _, rest = body.partition(b" ")
            status, sep, cwd = rest.partition(b" ")
            if kind == _CONT and not body:
                self._push(Event("cont"))
                self.at_prompt = True
            elif kind == _PROMPT and n == b"%d" % (self._prompts + 1) and sep and status.isdigit() and \
                    cwd.startswith(b"/") and shell_idle(self.shell_pgid, self._foreground_pgrp):  # not a look-alike
                self._sweep(jobs_too=True)  # what escaped PROMPT_COMMAND's kill (a trap's job) ends here
                self._push(Event("out", decoder.decode(seg.close(self.limits.output_bytes))))
                self._push(Event("prompt", status=int(status), cwd=cwd.decode(errors="replace"),
                                 note=self._note or self._oom_note()))
                self.at_prompt, self._prompts = True, self._prompts + 1
                self._deadline = self._expired_at = 0.0
                self._note, self._since_submit = "", 0
                seg.__init__(self.limits.output_bytes)
            else:  # a look-alike without the shape of ours: plain output
                self._push(Event("out", decoder.decode(seg.add(kind + body + _END))))
        return buf

    def _oom_note(self) -> str:
        """Why the command line's processes died, when the kernel killed some for the sandbox's memory bound."""
        cg = self.cgroup
        if cg is None or cg.oom_kills() <= self._ooms:
            return ""
        return f"out of memory: the sandbox's {cg.limit_mb} MiB (memory_mb + tmpfs) were used up"

    def _expire(self, why: str) -> None:
        """Start killing the running command line: SIGINT now; the policing loop escalates (caller holds _cond)."""
        self._note = self._note or why
        self._expired_at = time.monotonic()
        self.interrupt()

    def _idle(self) -> bool:  # the shell waits at its primary prompt, no command line submitted (holds _cond)
        return self.at_prompt and not self._deadline and not self._expired_at

    def _sweep(self, jobs_too: bool) -> dict[int, int]:
        """SIGKILL every process of the sandbox but its init and shell (with `jobs_too`; else only those not
        under the shell) while the init runs; returns the shell's jobs found (caller holds the condition)."""
        if not (self.shell_pgid and self._init_pid and running(self._init_fd)):
            return {}
        orphans, jobs = strays(self._init_pid, self.shell_pgid)
        if orphans or (jobs and jobs_too):
            kill_strays(self._init_pid, self.shell_pgid, jobs_too)
        return jobs

    def _police_idle(self, now: float) -> None:
        """Between command lines only the shell may run (caller holds the condition): a process outside it (a
        trap's orphan) is killed at once; a job of its own (a trap's `cmd &`, a line typed ahead) past the wall
        timeout. The shell is not interrupted, so no prompt comes that nobody asked for."""
        jobs = self._sweep(jobs_too=False) if self._idle() else {}
        if not jobs:
            self._jobs_since = 0.0
        elif not self._jobs_since:
            self._jobs_since = now
        elif now - self._jobs_since > self.limits.timeout_s:
            self._sweep(jobs_too=True)
            self._jobs_since = 0.0

    def _police(self, now: float, fg_seen: tuple[int, float]) -> tuple[int, float]:
        """Enforce the wall timeout (caller holds the condition). Returns the foreground job being timed."""
        if self._deadline and not self._expired_at and now >= self._deadline:
            self._expire(f"timed out after {self.limits.timeout_s:g}s")
        pg = self._foreground_pgrp()
        if self._expired_at and now - self._expired_at > _GRACE_S:
            if pg > 0 and pg != self.shell_pgid:
                signal_group(self._init_pid, pg, signal.SIGKILL)  # ignored SIGINT, or a later job of the line
            if now - self._expired_at > 3 * _GRACE_S:
                self._kill_init()            # the shell itself will not come back: new sandbox
        # A foreground job the timeout does not cover (typed ahead, or after a prompt look-alike) is timed here.
        if pg <= 0 or pg == self.shell_pgid or not self.shell_pgid:
            return 0, 0.0
        if fg_seen[0] != pg:
            return pg, now
        if now - fg_seen[1] > self.limits.timeout_s and not self._deadline:
            self._note = self._note or f"timed out after {self.limits.timeout_s:g}s"
            signal_group(self._init_pid, pg, signal.SIGKILL)
        return fg_seen


_MAX_EVENTS = 1024
_IDLE_CHECK_S = 0.5                              # how often a shell at its prompt is checked for strays

