"""The one bubblewrap command line every sandbox of envd starts with: the terminal's shell (envd/sandbox.py) and
each GUI application of a desktop (envd/desktop_apps.py) run behind the same mounts, namespaces and limits.

Inside: /usr, /bin, /lib*, /etc/alternatives, /etc/ld.so.cache and /etc/localtime read-only from the host; a
generated /etc/passwd, /etc/group and /etc/hosts (read-only); the session workspace read-write at /workspace; fresh
size-limited tmpfs at /tmp and /dev/shm; a new /proc and a minimal /dev; the root and /dev read-only; plus the
caller's extra binds (read-only: the terminal's bash rc file; a desktop's fonts, app-defaults, X socket and
Xauthority; read-write: the X server's socket directory, envd/xserver.py), mounted after the tmpfs so that they may
lie under /tmp. Nothing else of the host exists in there.
`--unshare-all --unshare-user` gives new user, pid, network (a loopback of its own), ipc, uts and cgroup namespaces;
all capabilities are dropped and no nested user namespace can be made; `--new-session` keeps the sandbox off any
terminal of the daemon; `--die-with-parent` and `setpriv --pdeathsig KILL` tie its life to the daemon's.

Limits (envd/sandbox_limits.py) are set by `prlimit` before bwrap starts (no preexec_fn: forking Python in a
threaded daemon can deadlock). A root daemon runs every sandbox as an unprivileged host uid (`allocate_uid`); the
uid must be able to reach every bound path (directories of mode 0o711 on the way). bwrap reports the pid of the
sandbox's init on `info_fd`: killing that init and waiting on its pidfd empties the sandbox (envd/sandbox_exit.py).
"""
from __future__ import annotations

import os
import pathlib
from typing import Iterable

from envd.cgroups import MemoryCgroup
from envd.sandbox_limits import INNER_ID, Limits, uid_task_count

SANDBOX_WORKSPACE = "/workspace"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


def write_etc(etc: pathlib.Path, extra: dict[str, str] | None = None) -> pathlib.Path:
    """The sandbox's passwd, group and hosts (and `extra` files: name -> text) in `etc`, made if needed."""
    etc.mkdir(mode=0o755, parents=True, exist_ok=True)
    files = {"passwd": f"user:x:{INNER_ID}:{INNER_ID}:user:{SANDBOX_WORKSPACE}:/bin/bash\n"
                       "nobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n",
             "group": f"user:x:{INNER_ID}:\nnogroup:x:65534:\n",
             "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n", **(extra or {})}
    for name, text in files.items():
        (etc / name).write_text(text)
        os.chmod(etc / name, 0o644)
    return etc


def unreachable(path: pathlib.Path) -> str:
    """The first directory above `path` that another uid cannot pass through ("" when none): a root daemon's
    sandbox uid could not bind `path`."""
    for p in path.parents:
        if not os.stat(p).st_mode & 0o001:
            return str(p)
    return ""


def sandbox_argv(workspace: str | os.PathLike, etc: pathlib.Path, limits: Limits, uid: int | None, info_fd: int,
                 *, ro_binds: Iterable[tuple[str, str]] = (), rw_binds: Iterable[tuple[str, str]] = (),
                 cwd: str = SANDBOX_WORKSPACE, extra_nproc: int = 0,
                 cgroup: MemoryCgroup | None = None) -> list[str]:
    """setpriv + prlimit + bwrap up to and including bwrap's "--": append the command to run in the sandbox.

    `etc`: a directory written by `write_etc`; `uid`: the host uid to run as (None: the daemon's own);
    `ro_binds`, `rw_binds`: (host path, sandbox path) pairs, read-only and read-write; `extra_nproc`: processes
    another sandbox of the same uid may use (a hybrid's terminal and desktop share one uid, so one process count: its
    limit is the sum of both); `cgroup`: the sandbox's memory cgroup (envd/cgroups.py), joined before setpriv."""
    if uid is not None:
        # Root daemon: the sandbox runs as its own unprivileged uid. RLIMIT_NPROC is never enforced for uid 0
        # (not even inside a user namespace), and a uid of its own makes the count per sandbox.
        drop = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        nproc = limits.nproc + extra_nproc
    else:
        # Unprivileged daemon: the sandbox shares the daemon user's process count, so leave room for it.
        drop, nproc = [], limits.nproc + extra_nproc + uid_task_count(os.getuid())
    argv = [*(cgroup.argv() if cgroup is not None else []), "setpriv", *drop, "--pdeathsig", "KILL", "--",
            "prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_mb << 20}", f"--nproc={nproc}",
            f"--fsize={limits.fsize_mb << 20}", f"--nofile={limits.nofile}", "--core=0", "--",
            # --cap-drop ALL: capabilities in the sandbox's user namespace would allow mounts (an unbounded
            # tmpfs) and more; --disable-userns: no nested namespace in which to regain them.
            "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
            "--uid", str(INNER_ID), "--gid", str(INNER_ID), "--die-with-parent", "--new-session",
            "--info-fd", str(info_fd),  # its child's pid: the caller waits for the namespace to empty
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = pathlib.Path("/") / name
        if p.is_symlink():               # merged-/usr systems: /bin -> usr/bin
            argv += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            argv += ["--ro-bind", str(p), str(p)]
    for extra in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(extra):        # alternatives: /usr/bin/awk -> /etc/alternatives/awk -> mawk
            argv += ["--ro-bind", extra, extra]
    for name in ("passwd", "group", "hosts"):
        argv += ["--ro-bind", str(etc / name), f"/etc/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(min(limits.tmp_mb, 16) << 20), "--tmpfs", "/dev/shm",
             "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
             "--bind", str(workspace), SANDBOX_WORKSPACE]
    for src, dst in ro_binds:
        argv += ["--ro-bind", str(src), dst]
    for src, dst in rw_binds:
        argv += ["--bind", str(src), dst]
    # bwrap's root and /dev are tmpfs (memory, unbounded): read-only once the mounts are in place.
    return argv + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd, "--"]
