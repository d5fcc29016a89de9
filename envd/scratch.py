"""Where terminal sessions keep their files on the host: one scratch root per process, /tmp/tars-envd-<pid>-<hex>/.

A session removes its own directory when it closes, but a daemon killed with SIGKILL closes nothing: its sandboxes
die with it (parent-death signals), their workspaces stayed in /tmp for good. So each process holds an exclusive
flock on its root's `lock` file for as long as it lives (the kernel drops it when the process dies, however it
dies), and a process making its root first removes every root whose lock nobody holds (`sweep`): those of processes
that are gone. A live process's root is never touched; nor is anything this user does not own, or a link.

A root is made under a hidden name and renamed into place only once its lock is held, so a sweep never sees a
root without a held lock while its process lives.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import pathlib
import secrets
import stat
import tempfile
import threading

from envd.workspace_archive import rmtree

PREFIX = "tars-envd-"
_mutex = threading.Lock()
_root: pathlib.Path | None = None
_owner = 0                      # the pid that made _root (a forked child makes its own)


def root() -> pathlib.Path:
    """This process's scratch root (made, after a sweep of dead processes' roots, on first use)."""
    global _root, _owner
    with _mutex:
        if _root is not None and _owner == os.getpid():
            return _root
        parent = base()
        sweep(parent)
        new = pathlib.Path(tempfile.mkdtemp(prefix=f".{PREFIX}new-", dir=parent))
        fd = os.open(new / "lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)   # held until this process exits: the fd is never closed
        final = parent / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(new, final)
        os.chmod(final, 0o711)           # a root daemon's sandbox uids must reach their directories in here
        _root, _owner = final, os.getpid()
        atexit.register(_remove, final, os.getpid())
        return final


def base() -> pathlib.Path:
    """The directory that holds the scratch roots (the temp dir): its file system holds every session's files."""
    return pathlib.Path(tempfile.gettempdir())


def sweep(base: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Remove the scratch roots under `base` (the temp dir) whose lock nobody holds; returns them."""
    removed = []
    for d in pathlib.Path(base or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(d / "lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue                     # its process lives
        try:
            rmtree(d)
            removed.append(d)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _remove(path: pathlib.Path, pid: int) -> None:
    """At a clean exit: the root goes with the process (sessions left open lose their files with it)."""
    if os.getpid() == pid:
        try:
            rmtree(path)
        except OSError:
            pass
