"""Process bookkeeping for backends that run real programs (browsers, X servers, GUI apps): parent-death signals,
and finding and killing everything a session started, including what escaped its process group.

Linux only (reads /proc). Zombies count as gone: they hold no resources but a pid, and their parent reaps them.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str


def _stat(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses, so split at the last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        return ProcInfo(pid, int(rest[1]), int(rest[2]), int(rest[3]), rest[0])
    except (IndexError, ValueError):
        return None


def snapshot() -> dict[int, ProcInfo]:
    """Every live (non-zombie) process on the machine."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = _stat(int(name))
            if p is not None and p.state not in ("Z", "X"):
                out[p.pid] = p
    return out


def alive(pid: int) -> bool:
    p = _stat(pid)
    return p is not None and p.state not in ("Z", "X")


def descendants(roots: set[int], table: dict[int, ProcInfo] | None = None) -> set[int]:
    """The live descendants of `roots` (not the roots themselves)."""
    table = snapshot() if table is None else table
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def group_members(pgid: int, table: dict[int, ProcInfo] | None = None) -> set[int]:
    table = snapshot() if table is None else table
    return {p.pid for p in table.values() if p.pgid == pgid}


def mentioning(needle: str) -> set[int]:
    """Live processes whose command line contains `needle` (e.g. a session's private directory: helpers that
    daemonise, like chromium's crash handler, leave the process group but still name the directory)."""
    want, out = needle.encode(), set()
    for pid in snapshot():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if want in f.read():
                    out.add(pid)
        except OSError:
            pass
    return out


def session_processes(pgid: int, roots: set[int] = frozenset(), needle: str = "") -> set[int]:
    """Live processes that belong to a session: its process group, the descendants of `roots` and of the group
    (children that made their own session, like a terminal's shell), and those whose command line names `needle`."""
    table = snapshot()
    pids = group_members(pgid, table) if pgid > 1 else set()
    live_roots = {r for r in roots if r in table}
    pids |= live_roots | descendants(live_roots | pids, table)
    if needle:
        pids |= mentioning(needle)
    pids.discard(os.getpid())
    return pids


def kill_session(pgid: int, roots: set[int] = frozenset(), needle: str = "", timeout_s: float = 5.0) -> set[int]:
    """SIGKILL everything `session_processes` finds and wait until it is gone. Returns the pids still alive at the
    deadline (empty on success)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = session_processes(pgid, roots, needle)
        if pgid > 1:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids:
            return set()
        if time.monotonic() > deadline:
            return {p for p in pids if alive(p)}
        time.sleep(0.02)


_SETPRIV = shutil.which("setpriv")


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGKILL when the thread that spawned it dies (setpriv --pdeathsig), so a killed
    daemon leaves no X server or chromedriver behind. The signal follows the spawning *thread*: spawn from a
    long-lived thread (envd's worker pool threads live as long as the daemon)."""
    if _SETPRIV is None:
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
