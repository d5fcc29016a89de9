"""The GUI applications of a `desktop` session (envd/desktop.py), all in ONE bubblewrap sandbox per episode.

The sandbox is envd/bwrap.py's, the terminal's: no network, no host files but the read-only system directories,
the session workspace read-write at /workspace, its own /tmp, limits from DESKTOP_LIMITS, and on a root daemon an
unprivileged host uid of its own (a `hybrid` session's desktop shares its terminal's uid, and so its process count
and file ownership). On top of that the apps get, read-only: /etc/X11 (app-defaults: xedit will not start
without them) and /etc/fonts (fontconfig, for xclock); the X server's unix socket, bound at /tmp/.X11-unix/X0 (the
sandbox has its own network namespace, so Xvfb's abstract socket is out of reach, and Xvfb listens on no TCP
port); and a copy of the session's Xauthority that the sandbox uid may read. Inside, DISPLAY is :0.

One sandbox for all apps, not one each: the apps share one /tmp and one process table as on a real desktop, the
session's claim is exactly one sandbox's limits, and stopping the apps is one kill of the namespace's init, waited
for on its pidfd (envd/sandbox_exit.py): once `stop` returns no process of any app runs. A small `sh` inside starts
the apps and waits for them.
"""
from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import threading
import time

from envd.base import Resources
from envd.cgroups import MemoryCgroup, memory_cgroup
from envd.bwrap import SANDBOX_PATH, SANDBOX_WORKSPACE, sandbox_argv, unreachable, write_etc
from envd.proctree import descendants
from envd.sandbox_exit import end_sandbox, open_pidfd, read_child_pid, running
from envd.sandbox_limits import Limits, allocate_uid, chown_tree, missing_tools, quota_breach, release_uid
from envd.xserver import XServer, xvfb_limits

# RLIMIT_CPU is per process and xterm lives all episode: generous. The rest as the terminal's defaults.
DESKTOP_LIMITS = Limits(cpu_s=600, memory_mb=512, nproc=56, fsize_mb=64, nofile=1024, tmp_mb=32)
SANDBOX_DISPLAY = ":0"
SANDBOX_XAUTHORITY = "/run/tars/Xauthority"
_SHARED = ("/etc/X11", "/etc/fonts")              # read-only, where the host has them


def xvfb_claim(width: int, height: int) -> Resources:
    """The X server of a width x height desktop as the host budget counts it: its sandbox's limits (envd/xserver.py:
    8 processes, an address space of 512 MiB plus the frame buffer in whole MiB, and its two 4 MiB tmpfs); no disk
    (its one writable host directory holds its socket)."""
    c = xvfb_limits(width, height).host_claim()
    return Resources(pids=c.pids, memory_mb=c.memory_mb)


class AppSandbox:
    """The one sandbox the desktop's apps run in; `start` replaces it, `stop` empties it, `release` ends it."""

    def __init__(self, private_dir: str | os.PathLike, workspace: str | os.PathLike, server: XServer,
                 limits: Limits = DESKTOP_LIMITS, owns_workspace: bool = True):
        self.dir = pathlib.Path(private_dir)
        self.workspace = pathlib.Path(workspace)
        self.x = server
        self.limits = limits
        self.uid = allocate_uid()            # the host uid the apps run as (None: the daemon's own)
        self._owns_uid = True
        self.extra_nproc = 0                 # processes a terminal sharing the uid may use (envd/hybrid.py)
        self.chown_workspace = True          # hand the workspace to the uid at each start (not when shared)
        self.proc: subprocess.Popen | None = None
        self.cgroup: MemoryCgroup | None = None   # the apps' memory together, at the host budget's claim
        self.init_pid, self._init_fd = 0, -1
        self.quota = limits                  # disk_mb / disk_files of the workspace (a hybrid's: its terminal's)
        self.breach = ""                     # why the disk guard killed the apps ("" when it did not)
        self._guard_stop = threading.Event()
        if self.uid is not None:
            os.chmod(self.dir, 0o711)        # the sandbox uid must reach etc/, the Xauthority and the workspace
            blocked = "" if owns_workspace else unreachable(self.workspace)
            if blocked:
                self.release()
                raise ValueError(f"the workspace {self.workspace} must be reachable by the sandbox's own uid, but "
                                 f"{blocked} is not searchable by others (chmod o+x, or put it elsewhere)")

    def share_uid(self, uid: int | None, extra_nproc: int) -> None:
        """Run as another sandbox's uid (a hybrid's terminal: files either side writes are the other's too), in one
        process count of this sandbox's nproc plus `extra_nproc`; that sandbox's owner gives the uid back."""
        if self._owns_uid:
            release_uid(self.uid)
        self.uid, self._owns_uid, self.extra_nproc, self.chown_workspace = uid, False, extra_nproc, False

    def env(self) -> dict[str, str]:
        """The apps' environment inside the sandbox."""
        return {"DISPLAY": SANDBOX_DISPLAY, "XAUTHORITY": SANDBOX_XAUTHORITY, "HOME": SANDBOX_WORKSPACE,
                "PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "USER": "user", "SHELL": "/bin/bash", "PS1": "$ ",
                "TMPDIR": "/tmp"}

    def _binds(self) -> list[tuple[str, str]]:
        auth = self.dir / "Xauthority.apps"  # the server's file stays the daemon's own (mode 0600)
        auth.unlink(missing_ok=True)         # mode 0400 from the last start
        shutil.copyfile(self.x.auth, auth)
        if self.uid is not None:
            os.chown(auth, self.uid, self.uid)
        os.chmod(auth, 0o400)
        binds = [(p, p) for p in _SHARED if os.path.isdir(p)]
        return binds + [(self.x.socket, f"/tmp/.X11-unix/X{SANDBOX_DISPLAY[1:]}"), (str(auth), SANDBOX_XAUTHORITY)]

    def start(self, argvs: list[list[str]], log_path: str, process_group: int, timeout_s: float = 10.0) -> None:
        """Start the apps (`argvs`, commands as seen inside) in a fresh sandbox in the workspace."""
        if missing := missing_tools():
            raise RuntimeError(f"the desktop's app sandbox needs {', '.join(missing)} on the host "
                               "(apt: bubblewrap, util-linux)")
        self.stop()
        if self.uid is not None and self.chown_workspace:
            chown_tree(self.workspace, self.uid)      # files the daemon (root) wrote become the apps' to change
        etc, binds = write_etc(self.dir / "etc"), self._binds()
        script = "".join(f"{shlex.join(a)} & " for a in argvs) + "wait"
        self.cgroup = memory_cgroup(self.limits.host_claim().memory_mb)
        info_r, info_w = os.pipe()
        try:
            argv = sandbox_argv(self.workspace, etc, self.limits, self.uid, info_w, ro_binds=binds,
                                extra_nproc=self.extra_nproc, cgroup=self.cgroup)
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen([*argv, "/bin/sh", "-c", script], env=self.env(), close_fds=True,
                                             pass_fds=(info_w,), process_group=process_group,
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        pid = read_child_pid(info_r, timeout_s)
        self.init_pid, self._init_fd = pid or 0, open_pidfd(pid)
        if not pid:
            self.stop()
            raise RuntimeError(f"the desktop's app sandbox did not start (see {log_path})")
        self.breach, self._guard_stop = "", threading.Event()
        if self._init_fd >= 0:
            threading.Thread(target=self._guard_disk, args=(self._guard_stop, os.dup(self._init_fd), self.quota),
                             name="desktop-disk-guard", daemon=True).start()

    def _guard_disk(self, stop: threading.Event, pidfd: int, quota: Limits) -> None:
        """While the apps run, walk the workspace every second (less often when the walk is slow) and kill the whole
        sandbox once it is over its quota: nothing else polices what a job of the xterm writes, between steps too.
        Owns `pidfd` (a dup of the init's: it never names another process)."""
        try:
            wait = 1.0
            while not stop.wait(wait):
                t0 = time.monotonic()
                why = quota_breach(self.workspace, quota)
                wait = max(1.0, 4 * (time.monotonic() - t0))
                if why and not stop.is_set():
                    self.breach = why
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    except OSError:
                        pass
                    return
        finally:
            os.close(pidfd)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pids(self) -> set[int]:
        """bwrap's pid and the sandbox's init's, those of them still running (a pid is never named once freed)."""
        return ({self.proc.pid} if self.alive else set()) | ({self.init_pid} if running(self._init_fd) else set())

    def processes(self) -> set[int]:
        """Every live process of the sandbox (host pids): its init and everything under it."""
        return {self.init_pid, *descendants({self.init_pid})} if running(self._init_fd) else set()

    def stop(self) -> None:
        """Kill every app: the namespace's init, waited for until the namespace is empty, then bwrap reaped
        (envd/sandbox_exit.py end_sandbox)."""
        self._guard_stop.set()               # the disk guard ends with the apps
        proc, self.proc = self.proc, None
        init_fd, self._init_fd, self.init_pid = self._init_fd, -1, 0
        cgroup, self.cgroup = self.cgroup, None
        if not end_sandbox(init_fd, proc, cgroup=cgroup):
            raise RuntimeError("the desktop's app sandbox still runs 5 s after it was killed")

    def release(self) -> None:
        """Stop the apps for good and give the uid back (when it is this sandbox's own)."""
        try:
            self.stop()
        finally:
            if self._owns_uid:
                release_uid(self.uid)
            self.uid = None
