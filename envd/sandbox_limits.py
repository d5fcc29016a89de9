"""Limits of a terminal sandbox, and the host-side helpers that account for them (envd/sandbox.py runs the shell).

When the daemon runs as root each sandbox gets a host uid of its own (`allocate_uid`): the kernel never enforces
RLIMIT_NPROC for uid 0, not even inside a user namespace, and a uid per sandbox makes the process count per
sandbox. As another user the sandbox shares that user's count, so the limit is raised by the user's current count.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import pathlib
import shutil
import threading
from dataclasses import dataclass

from envd.base import Resources
from envd.workspace_archive import MAX_DEPTH

INNER_ID = 1000                      # the uid/gid the shell has inside the sandbox
SANDBOX_UID_BASE = 2_000_000_000     # host uids for sandboxes of a root daemon: far above any real user's
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_uid_cursor: list[int] = []          # the offset the next allocation starts from (set at the first one)


def allocate_uid() -> int | None:
    """A host uid of its own for a new sandbox when the daemon is root (None otherwise). Spread by pid so that two
    daemons on one host rarely meet; a collision would only merge two sandboxes' process counts. Allocations go
    round the range rather than taking the lowest free uid: a released uid is not handed out again until a million
    others have been, so whatever of its last sandbox the kernel still counts against it (an init whose bwrap was
    SIGKILLed stays a zombie until the host's init reaps it, and RLIMIT_NPROC counts zombies) has long gone."""
    if os.getuid() != 0:
        return None
    with _uid_lock:
        if not _uid_cursor:
            _uid_cursor.append((os.getpid() * 7919) % 1_000_000)
        start = _uid_cursor[0]
        for i in range(1_000_000):
            uid = SANDBOX_UID_BASE + (start + i) % 1_000_000
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                _uid_cursor[0] = (start + i + 1) % 1_000_000
                return uid
    raise SandboxError("no free sandbox uid")


def uids_in_use() -> frozenset[int]:
    """The host uids given to sandboxes now (none unless the daemon is root)."""
    with _uid_lock:
        return frozenset(_uids_in_use)


def release_uid(uid: int | None) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def chown_tree(root: pathlib.Path, uid: int) -> None:
    """Give the sandbox's uid the workspace (a root daemon writes seeded and restored files as root)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.chown(root_fd, uid, uid)
        for dirpath, dirnames, filenames, dfd in os.fwalk(dir_fd=root_fd, follow_symlinks=False):
            for name in dirnames + filenames:
                try:
                    os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
            if dirpath.count("/") >= MAX_DEPTH:  # fwalk recurses per level: below what a restore makes, the sandbox's
                dirnames.clear()
    finally:
        os.close(root_fd)


class SandboxError(RuntimeError):
    """The sandbox could not start or broke in a way a new shell cannot fix."""


@dataclass(frozen=True)
class Limits:
    """Per-session limits; every field is also a CreateSession option (a string) with the bounds in LIMIT_BOUNDS."""

    timeout_s: float = 30.0      # wall time of one command line; past it its processes are killed
    wait_s: float = 10.0         # how long one step waits for a command to finish before returning "running"
    cpu_s: int = 30              # RLIMIT_CPU of every process in the sandbox
    memory_mb: int = 512         # RLIMIT_AS (address space) of every process
    nproc: int = 64              # RLIMIT_NPROC: processes (threads included) in the sandbox
    fsize_mb: int = 64           # RLIMIT_FSIZE: largest file a process may write
    nofile: int = 256            # RLIMIT_NOFILE
    tmp_mb: int = 64             # size of the /tmp tmpfs (it is memory)
    disk_mb: int = 256           # workspace quota, checked while a command runs and after it
    disk_files: int = 100_000    # workspace quota on entries (files, directories, links: inodes), checked likewise
    output_bytes: int = 16384    # output kept per command line (head and tail); the rest is dropped, and said so

    @classmethod
    def from_options(cls, options: dict[str, str], base: "Limits | None" = None) -> "Limits":
        """Limits from string options (ValueError on a malformed or out-of-bounds value)."""
        base = base or cls()
        changes = {}
        for f in dataclasses.fields(cls):
            if f.name not in options:
                continue
            kind = float if f.type in (float, "float") else int
            try:
                v = kind(str(options[f.name]).strip())
            except ValueError:
                raise ValueError(f"option {f.name}={options[f.name]!r} is not a number") from None
            lo, hi = LIMIT_BOUNDS[f.name]
            if not lo <= v <= hi:
                raise ValueError(f"option {f.name}={v} is outside [{lo}, {hi}]")
            changes[f.name] = v
        return dataclasses.replace(base, **changes)

    def host_claim(self) -> Resources:
        """What a sandbox with these limits may use of the host, as the daemon's budget counts it: `nproc`
        processes; `memory_mb` (RLIMIT_AS is per process, so this is the allowance, not a cgroup bound) plus the
        tmpfs sizes (/tmp and /dev/shm are memory); disk: the workspace quota `disk_mb` plus `fsize_mb`, the file
        a writer may finish between two walks of the polled quota (the workspace is the sandbox's only writable
        place on disk)."""
        return Resources(self.nproc, self.memory_mb + self.tmp_mb + min(self.tmp_mb, 16), self.disk_mb + self.fsize_mb)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Ceilings keep a client from asking for an unbounded sandbox (options come over the wire).
LIMIT_BOUNDS = {
    "timeout_s": (0.1, 600.0), "wait_s": (0.0, 30.0), "cpu_s": (1, 3600), "memory_mb": (32, 16384),
    "nproc": (8, 4096), "fsize_mb": (1, 4096), "nofile": (16, 4096), "tmp_mb": (1, 1024), "disk_mb": (1, 16384),
    "disk_files": (16, 1_000_000), "output_bytes": (256, 1 << 20),
}


def missing_tools() -> list[str]:
    """The host programs the sandbox needs that are not installed."""
    return [t for t in ("bwrap", "prlimit", "setpriv", "setsid", "bash") if shutil.which(t) is None]


def workspace_usage(root: pathlib.Path, max_entries: int) -> tuple[int, int]:
    """(bytes, entries) under `root`, not following symlinks. The walk stops once it has seen more than
    `max_entries` entries and then answers max_entries + 1: the bytes are a lower bound, and the caller must treat
    the workspace as over its entry quota (a partial count is never a total). PermissionError on a directory the
    daemon cannot list (the sandbox, running as an unprivileged daemon's own uid, may chmod 000 it): what it holds
    cannot be counted, and skipping it would let a sandbox hide any amount of data from the quota.

    The walk runs while the sandbox writes: a directory listed may be a symlink by the time it is read (to `/` on
    the host: listing it by path walked the host's tree). So each is opened with O_NOFOLLOW and read only if it is
    still the directory that was listed (device and inode); one replaced is skipped, as one removed is."""
    total = entries = 0
    stack: list[tuple[str, tuple[int, int] | None]] = [(str(root), None)]
    while stack:
        path, listed = stack.pop()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if listed else 0))
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue    # removed or replaced since it was listed
            raise
        try:
            st = os.fstat(fd)
            if listed is not None and (st.st_dev, st.st_ino) != listed:
                continue    # a directory put in its place, through a link on the way (to a host directory)
            with os.scandir(fd) as it:
                for e in it:
                    entries += 1
                    if entries > max_entries:
                        return total, entries
                    try:
                        est = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += est.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append((os.path.join(path, e.name), (est.st_dev, est.st_ino)))
        finally:
            os.close(fd)
    return total, entries


def quota_breach(root: pathlib.Path, limits: Limits) -> str:
    """Why the workspace is over its quota (`disk_mb` bytes, `disk_files` entries), e.g. "workspace holds 300 MiB,
    over its 256 MiB quota"; "" when it is within it."""
    try:
        used, entries = workspace_usage(root, limits.disk_files)
    except PermissionError as e:
        where = os.path.relpath(e.filename, root) if isinstance(e.filename, str) else "?"
        return f"workspace holds a directory envd cannot read ({where!r}), so its size is unknown: over its quota"
    if entries > limits.disk_files:
        return f"workspace holds more than {limits.disk_files} files and directories, over its quota"
    if used > limits.disk_mb << 20:
        return f"workspace holds {used >> 20} MiB, over its {limits.disk_mb} MiB quota"
    return ""


def uid_task_count(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) of `uid` on this host."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status", "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            n += int(fields.get("Threads", "1").strip() or 1)
    return n
