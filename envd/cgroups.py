"""A memory cgroup per sandbox: one bound on everything a sandbox's processes hold together.

RLIMIT_AS bounds each process's address space, not the sandbox: `nproc x memory_mb` was the worst case, and
kernel memory (socket buffers, the pages of a memfd written and never mapped) escaped it altogether; a MiniWoB
browser (V8 reserves a terabyte of address space) had no bound at all. With a memory cgroup the kernel charges all
of it, page cache and kernel memory included, to the sandbox, and OOM-kills inside the sandbox once it passes
its limit (the host budget's memory claim, envd/budget.py: what was an estimate becomes a bound).

`envd.memory_cgroups`: `auto` (the default) uses them where the daemon may make cgroups and says once in its log
when it may not; `required` refuses to start without them; `off` never uses them. Where: cgroup v1's memory
hierarchy, under the daemon's own cgroup (a root daemon, or one given the directory); cgroup v2, under the daemon's
cgroup or its parent, whichever has the memory controller enabled for its children and is writable (systemd:
`Delegate=memory` with `DelegateSubgroup=`, docs/deploy.md). Each daemon makes `tars-envd-<pid>` there and a
child per sandbox; a daemon killed before removing its own leaves it to the next daemon's sweep.

A sandbox's processes join its cgroup before any of them runs: the command line starts with a `sh` that writes its
own pid into `cgroup.procs` and then execs setpriv (no preexec_fn in a threaded daemon), so every process the
sandbox forks is born inside.
"""
from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import pathlib
import signal
import threading
import time
from dataclasses import dataclass

from core.proc import pid_alive
from envd.sandbox_limits import SandboxError

log = logging.getLogger("envd.cgroups")

MODES = ("auto", "required", "off")
PREFIX = "tars-envd-"


class CgroupError(SandboxError):
    """Memory cgroups were required and cannot be made, or a sandbox's could not be set up."""


@dataclass(frozen=True)
class Hierarchy:
    """Where this daemon's sandboxes' cgroups go: `parent` (a directory of a cgroup file system) and its version."""

    version: int                 # 1 or 2
    parent: pathlib.Path         # tars-envd-<pid>: made at the first sandbox

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(mount point, root within the hierarchy, fs type, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
            out.append((f[4].replace("\\040", " "), f[3], r[0], r[2]))
    return out


def _own_path(cgroup_file: str, version: int) -> str | None:
    """This process's path in the v1 memory hierarchy or in the v2 one, from /proc/self/cgroup."""
    for line in cgroup_file.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == 2 and hid == "0" and controllers == "":
            return path
        if version == 1 and "memory" in controllers.split(","):
            return path
    return None


def _join(mount: str, root: str, path: str) -> pathlib.Path:
    """The directory of cgroup `path` under a mount of the hierarchy's `root` (a cgroup namespace mounts its own
    cgroup as the root: its path then starts with that root, or is the root)."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root):]
    return pathlib.Path(mount) / rel.lstrip("/")


def locate(mountinfo: str, cgroup_file: str, pid: int) -> tuple[Hierarchy | None, str]:
    """Where this daemon (`pid`) may put its sandboxes' memory cgroups, or None and why not."""
    mounts = _mounts(mountinfo)
    for mount, root, kind, opts in mounts:
        if kind == "cgroup" and "memory" in opts.split(","):
            own = _own_path(cgroup_file, 1)
            if own is None:
                return None, "no memory line in /proc/self/cgroup"
            here = _join(mount, root, own)
            if not os.access(here, os.W_OK | os.X_OK):
                return None, f"{here} is not writable by this daemon (root, or a delegated cgroup, is needed)"
            return Hierarchy(1, here / f"{PREFIX}{pid}"), ""
    for mount, root, kind, _ in mounts:
        if kind != "cgroup2":
            continue
        own = _own_path(cgroup_file, 2)
        if own is None:
            return None, "no cgroup v2 line in /proc/self/cgroup"
        here = _join(mount, root, own)
        # A v2 cgroup that holds processes cannot enable controllers for children, so the daemon's own cgroup
        # serves only if something else already did (it then holds no process but threads); else its parent,
        # where a delegated leaf (systemd's DelegateSubgroup=) sits.
        for cand in (here, here.parent):
            try:
                enabled = (cand / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            if "memory" in enabled and os.access(cand, os.W_OK | os.X_OK):
                return Hierarchy(2, cand / f"{PREFIX}{pid}"), ""
        return None, (f"cgroup v2: neither {here} nor its parent has the memory controller enabled for children "
                      "and writable by this daemon (systemd: Delegate=memory, DelegateSubgroup=envd)")
    return None, "no cgroup memory hierarchy is mounted"


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mode = "auto"
        self.where: Hierarchy | None = None
        self.why = ""
        self.probed = False
        self.made = False             # tars-envd-<pid> exists
        self.names = itertools.count(1)
        self.released_at_exit: set[pathlib.Path] = set()   # parents removed at exit (registered once each)


_state = _State()


def configure(mode: str) -> str:
    """Set `envd.memory_cgroups` and probe the host once; returns what `describe` says. CgroupError when `mode` is
    `required` and no cgroup can be made, ValueError on an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"envd.memory_cgroups={mode!r}: one of {', '.join(MODES)}")
    with _state.lock:
        _state.mode, _state.probed = mode, False
    where = _hierarchy()
    if where is None and mode == "required":
        raise CgroupError(f"envd.memory_cgroups=required, but no memory cgroup can be made: {_state.why}")
    return describe()


def describe() -> str:
    """One line for the daemon's status: where the sandboxes' memory cgroups go, or why there are none."""
    where = _hierarchy()
    if where is not None:
        return f"v{where.version} {where.parent}"
    return "off" if _state.mode == "off" else f"unavailable: {_state.why}"


def _hierarchy() -> Hierarchy | None:
    with _state.lock:
        if _state.probed:
            return _state.where
        _state.probed, _state.where, _state.made = True, None, False
        if _state.mode == "off":
            _state.why = "envd.memory_cgroups=off"
            return None
        try:
            where, why = locate(pathlib.Path("/proc/self/mountinfo").read_text(),
                                pathlib.Path("/proc/self/cgroup").read_text(), os.getpid())
        except OSError as e:
            where, why = None, f"cannot read /proc/self: {e}"
        if where is None:
            _state.why = why
            log.warning("sandboxes get no memory cgroup (%s): memory is bounded per process only (RLIMIT_AS)", why)
            return None
        _sweep(where.parent.parent)
        _state.where = where
        return where


def _parent() -> Hierarchy | None:
    where = _hierarchy()
    if where is None:
        return None
    with _state.lock:
        if not _state.made:
            try:
                where.parent.mkdir(exist_ok=True)
                if where.version == 2:   # the sandboxes' cgroups under it get the memory controller too
                    (where.parent / "cgroup.subtree_control").write_text("+memory")
            except OSError as e:
                _state.where, _state.why = None, f"cannot make {where.parent}: {e}"
                log.warning("sandboxes get no memory cgroup (%s)", _state.why)
                return None
            _state.made = True
            if where.parent not in _state.released_at_exit:
                _state.released_at_exit.add(where.parent)
                atexit.register(_release, where.parent)
    return where


def _release(parent: pathlib.Path, timeout: float = 2.0) -> None:
    """A daemon's parent cgroup and its sandboxes' (whatever still runs in them killed): this daemon's at exit
    (sandboxes never closed are dying with it: pdeathsig), or one a killed daemon left (`_sweep`)."""
    deadline = time.monotonic() + timeout
    for child in _subdirs(parent):
        _remove(child, deadline)
    _remove(parent, deadline)


def _sweep(base: pathlib.Path) -> None:
    """Remove what daemons that are gone left under `base` (tars-envd-<pid> of a pid that no longer runs)."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for d in entries:
        pid = d.name[len(PREFIX):]
        if d.name.startswith(PREFIX) and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            _release(d, 1.0)


def _subdirs(d: pathlib.Path) -> list[pathlib.Path]:
    try:
        return [c for c in d.iterdir() if c.is_dir()]
    except OSError:
        return []


def _procs(d: pathlib.Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _remove(d: pathlib.Path, deadline: float) -> bool:
    """Kill whatever still runs in cgroup `d` and remove it; False if it still holds processes at `deadline`."""
    while True:
        for pid in _procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        time.sleep(0.02)


class MemoryCgroup:
    """The memory cgroup of one sandbox, bounded at `limit_mb`."""

    def __init__(self, path: pathlib.Path, version: int, limit_mb: int):
        self.path, self.version, self.limit_mb = path, version, limit_mb

    def argv(self) -> list[str]:
        """The start of the sandbox's command line: joins the cgroup, then execs the rest."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for passing its limit."""
        name, key = ("memory.oom_control", "oom_kill") if self.version == 1 else ("memory.events", "oom_kill")
        try:
            for line in (self.path / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def peak_mb(self) -> float:
        """The most memory charged to it at once (MiB); 0 where the kernel does not say."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text()) / (1 << 20)
        except (OSError, ValueError):
            return 0.0

    def close(self, timeout: float = 5.0) -> bool:
        """Remove the cgroup, killing what still runs in it; False (logged) if that took longer than `timeout`."""
        ok = _remove(self.path, time.monotonic() + timeout)
        if not ok:
            log.error("sandbox cgroup %s still holds processes %s s after they were killed", self.path, timeout)
        return ok


def memory_cgroup(limit_mb: int) -> MemoryCgroup | None:
    """A new memory cgroup bounded at `limit_mb` MiB for one sandbox, or None where this daemon makes none (the
    sandbox then has its per-process limits only). CgroupError if making it fails where cgroups work, or if none
    can be made under `required` (a parent that could not be made after the daemon's probe)."""
    where = _parent()
    if where is None:
        if _state.mode == "required":
            raise CgroupError(f"envd.memory_cgroups=required, but no memory cgroup can be made: {_state.why}")
        return None
    path = where.parent / f"s{next(_state.names)}"
    try:
        path.mkdir()
        limit = str(int(limit_mb) << 20)
        (path / where.limit_file).write_text(limit)
        if where.version == 1:
            swap = path / "memory.memsw.limit_in_bytes"   # only where swap is accounted; swap may not extend it
            if swap.exists():
                swap.write_text(limit)
        else:
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
    except OSError as e:
        _remove(path, time.monotonic() + 1.0)
        raise CgroupError(f"cannot set up the sandbox's memory cgroup {path}: {e}") from None
    return MemoryCgroup(path, where.version, limit_mb)
