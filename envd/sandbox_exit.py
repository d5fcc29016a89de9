"""Facts about a sandbox's processes: that it is gone (no process of it runs once ShellSandbox.stop() returns), that
its shell is idle (a prompt sentinel is the shell's own), and which of its processes are strays once the shell
waits at its prompt (`strays`, `kill_strays`: everything but the namespace's init and the shell).

Killing bwrap (the process the daemon started) does not wait for the sandbox: bwrap's child is the init of the
sandbox's pid namespace, and it and every process under it die a moment later (--die-with-parent, then the kernel's
SIGKILL to the whole namespace when its init dies). In that moment a command still running could write into the
workspace the daemon is about to clear, seed, judge or snapshot (a symlink planted after the clear, and a root
daemon's seeding writes where it points). So bwrap reports its child's pid on --info-fd, the daemon holds a pidfd
of it, and stop() kills it and waits for it: a namespace's init finishes exiting only after every other process in
the namespace is gone (the kernel's zap_pid_ns_processes), so its pidfd turning readable means the sandbox is empty.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

from envd.cgroups import MemoryCgroup


def read_child_pid(fd: int, timeout: float) -> int | None:
    """bwrap's {"child-pid": N} from the read end of its --info-fd pipe (closed here), or None (bwrap died first)."""
    buf, deadline = b"", time.monotonic() + timeout
    try:
        while b"}" not in buf and time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(fd)
    try:
        pid = json.loads(buf[:buf.index(b"}") + 1])["child-pid"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(pid) if isinstance(pid, int) and pid > 0 else None


def open_pidfd(pid: int | None) -> int:
    """A pidfd of the sandbox's init, or -1 (no pid, or it is already gone)."""
    if not pid:
        return -1
    try:
        return os.pidfd_open(pid)
    except OSError:
        return -1


def kill_and_wait(pidfd: int, timeout: float = 5.0) -> bool:
    """SIGKILL the sandbox's init through its pidfd and wait until it (and so its whole namespace) has exited;
    closes the pidfd. True when it is gone within `timeout`."""
    if pidfd < 0:
        return True
    try:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except OSError:
            pass  # not ours to signal (it already changed hands): still wait for it
        return exited(pidfd, timeout)
    finally:
        os.close(pidfd)


def shell_idle(shell_pgid: int, foreground_pgrp) -> bool:
    """Whether a prompt sentinel can be the shell's own: the shell holds the terminal (foreground_pgrp() is its
    process group) and has no child (its PROMPT_COMMAND kills and reaps every other process before the prompt). A
    running job printing look-alikes, in front or in the back while the shell waits for it, would otherwise reset
    the command's deadline and flood count. shell_pgid 0: the shell is starting (its first prompt)."""
    if not shell_pgid:
        return True
    if foreground_pgrp() not in (shell_pgid, 0):
        return False
    return not _children(shell_pgid)  # gone, or no /proc: the terminal check stands alone


def _children(pid: int) -> list[int]:
    """`pid`'s children, from every one of its threads (a child is listed under the thread that made it)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def _stat_field(pid: int, k: int) -> int:
    """Field k after the command name of /proc/<pid>/stat (1: the parent's pid, 2: the process group), 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rfind(b")") + 2:].split()[k])
    except (OSError, IndexError, ValueError):
        return 0


def _ppid(pid: int) -> int:
    return _stat_field(pid, 1)


def _pgid(pid: int) -> int:
    return _stat_field(pid, 2)


def signal_group(init_pid: int, pgid: int, sig: int) -> bool:
    """killpg(pgid, sig) if a live process of the sandbox (the init or one under it) is in that group; False when
    none is. The terminal's foreground process group (tcgetpgrp) is a number: a job can make a group of its own the
    foreground and let it die, and the number, free, then names whatever host process group gets it next."""
    todo, seen = [init_pid] if init_pid > 0 and pgid > 0 else [], 0
    while todo and seen < 65536:
        pid = todo.pop()
        seen += 1
        if _pgid(pid) == pgid:
            killpg(pgid, sig)
            return True
        todo += _children(pid)
    return False


def strays(init_pid: int, shell_pid: int) -> tuple[dict[int, int], dict[int, int]]:
    """The processes of a sandbox besides its init, its shell and any process between the two, as {pid: parent}:
    (orphans, jobs), jobs being the shell's descendants. Every process of a pid namespace descends from its init
    (an orphan is reparented to it), so walking the init's children finds them all."""
    keep, p = {init_pid, shell_pid}, shell_pid
    while p and p != init_pid and len(keep) < 64:   # the shell's ancestors up to the init
        p = _ppid(p)
        keep.add(p)
    orphans: dict[int, int] = {}
    jobs: dict[int, int] = {}
    todo = [(c, init_pid, False) for c in _children(init_pid)]
    while todo:
        pid, parent, under_shell = todo.pop()
        if pid not in keep:
            (jobs if under_shell else orphans)[pid] = parent
        todo += [(c, pid, under_shell or pid == shell_pid) for c in _children(pid)]
    return orphans, jobs


def kill_strays(init_pid: int, shell_pid: int, jobs_too: bool = True, rounds: int = 64) -> set[int]:
    """SIGKILL the sandbox's strays (`strays`: the orphans, and with `jobs_too` the shell's jobs as well), again
    until a pass finds none it has not killed yet (one forking while it was listed). Returns the pids killed.

    Each is signalled through a pidfd taken while it is still the child of the parent it was found under, so that
    a pid freed and reused by another process in between is never signalled."""
    killed: set[int] = set()
    for _ in range(rounds):
        orphans, jobs = strays(init_pid, shell_pid)
        found = orphans | jobs if jobs_too else orphans
        new = {pid: parent for pid, parent in found.items() if pid not in killed}
        if not new:
            break
        for pid, parent in new.items():
            killed.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # already gone
            try:
                if _ppid(pid) == parent:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
    return killed


def exited(pidfd: int, timeout: float = 0.0) -> bool:
    """Whether the process behind `pidfd` has exited (a zombie counts), waiting up to `timeout` s for it; True
    when there is no pidfd (-1)."""
    if pidfd < 0:
        return True
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(int(timeout * 1000)))


def end_sandbox(init_fd: int, proc: subprocess.Popen | None, timeout: float = 5.0,
                cgroup: MemoryCgroup | None = None) -> bool:
    """Kill the sandbox's init through its pidfd (closed) and wait until its namespace is empty, then reap its bwrap,
    which exits once it has reaped the init (SIGKILLed if it has not within `timeout`, and at once when no init is
    known). True when the namespace emptied in time. In this order nothing is orphaned: killing bwrap first leaves
    its init to whatever reaps for the daemon, and in a container whose pid 1 is the daemon itself (envd as a pod's
    command) nothing ever does, so each stopped sandbox left a zombie holding a pid. Then `cgroup`, the sandbox's
    memory cgroup, is removed (whatever still ran in it killed)."""
    if init_fd < 0:
        kill_bwrap(proc)              # no init known (it never started, or this sandbox was stopped before)
    gone = kill_and_wait(init_fd, timeout)
    if proc is not None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_bwrap(proc)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
    if cgroup is not None:
        gone = cgroup.close(timeout) and gone
    return gone


def running(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has not exited yet (so its pid still names it)."""
    return not exited(pidfd)


def reap(proc: subprocess.Popen | None) -> int:
    """The exit status of the sandbox's bwrap (-1 when none ran), SIGKILLed if it does not exit within 5 s."""
    if proc is None:
        return -1
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        killpg(proc.pid, signal.SIGKILL)
        return -signal.SIGKILL


def kill_bwrap(proc: subprocess.Popen | None) -> None:
    """SIGKILL the process group of the sandbox's bwrap, unless that bwrap has been reaped already (by the reader's
    `reap`, or a `poll`): its pid is free then, and may name another process group by now, another session's sandbox
    or any program of the host (pid_max is often 32768)."""
    if proc is not None and proc.poll() is None:
        killpg(proc.pid, signal.SIGKILL)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
