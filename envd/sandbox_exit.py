"""Facts about a sandbox's processes: that it is gone (no process of it runs once ShellSandbox.stop() returns), and
that its shell is idle (a prompt sentinel is the shell's own).

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
import time


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
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        return bool(p.poll(int(timeout * 1000)))
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
    try:
        with open(f"/proc/{shell_pgid}/task/{shell_pgid}/children") as f:
            return not f.read().strip()
    except OSError:
        return True  # gone, or no /proc: the terminal check stands alone
