"""envd's host-wide budget: the processes, memory and disk all sessions together may be allowed, and who holds how
much.

Each session is charged what its backend says it may use (envd.base.Env.resources: a terminal sandbox's nproc,
memory_mb plus its tmpfs, and its workspace quota; an estimate for backends without a sandbox) before it is let in,
again before a Reset that raises its limits and after a Restore that brings its own, and gives it back once its env
is closed. The sum never exceeds envd.max_total_pids / max_total_memory_mb / max_total_disk_mb (0 = derived from
the host: `host_totals`; the disk from the file system that holds the sessions' files, envd/scratch.py).

The charge is an allowance, not a measurement: what keeps a sandbox under it are its own limits (RLIMIT_NPROC,
RLIMIT_AS per process, sized tmpfs, the workspace quota). The point is that the allowances add up to what the host
has, so that many sessions each within its limits cannot together take the host down (nor fill the disk that the
learner's checkpoints and WAL may share).
"""
from __future__ import annotations

import asyncio
import os
import resource
import threading
from typing import Any, Callable

from envd import scratch
from envd.base import Resources

# Per resource: its name in a refusal, the config field that bounds it, the session options that lower a claim.
_KINDS = {"pids": ("processes", "envd.max_total_pids", "nproc"),
          "memory_mb": ("memory", "envd.max_total_memory_mb", "memory_mb, tmp_mb"),
          "disk_mb": ("disk", "envd.max_total_disk_mb", "disk_mb, fsize_mb")}


def host_totals(max_total_pids: int = 0, max_total_memory_mb: int = 0, max_total_disk_mb: int = 0) -> Resources:
    """The budget: the configured figures, or where 0, half the host's process limit, 3/4 of its memory and 3/4 of
    the space free now on the file system of the sessions' files (`free_disk_mb`)."""
    pids = max_total_pids
    if pids <= 0:
        limits = [_read_int("/proc/sys/kernel/pid_max"), _read_int("/proc/sys/kernel/threads-max")]
        if os.getuid() != 0:  # an unprivileged daemon's sandboxes count against its user's RLIMIT_NPROC
            soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
            limits.append(soft if soft != resource.RLIM_INFINITY else 0)
        known = [n for n in limits if n > 0]
        pids = max(1, min(known) // 2) if known else 16384
    memory = max_total_memory_mb
    if memory <= 0:
        try:
            phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            phys = 0
        memory = max(1, phys * 3 // 4 >> 20) if phys > 0 else 8192
    disk = max_total_disk_mb if max_total_disk_mb > 0 else max(1, free_disk_mb() * 3 // 4)
    return Resources(pids, memory, disk)


def free_disk_mb(path: str | os.PathLike | None = None) -> int:
    """MiB an unprivileged writer may still use on the file system of `path` (default: the directory that holds
    envd's scratch roots, where every session's workspace, profile and private files live)."""
    st = os.statvfs(path or scratch.base())
    return st.f_bavail * st.f_frsize >> 20


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class BudgetExhausted(Exception):
    """The charge does not fit; the message says what is used, what is asked and what the budget is."""


class HostBudget:
    """Charges and releases against fixed totals. Thread-safe: a session stuck in a backend call is closed (and its
    charge released) from a worker thread."""

    def __init__(self, total: Resources):
        self.total = total
        self.used = Resources()
        self._lock = threading.Lock()

    def fits(self, extra: Resources) -> bool:
        with self._lock:
            return self._fits(extra)

    def _fits(self, extra: Resources) -> bool:
        return not self._short(extra)

    def _short(self, extra: Resources) -> list[str]:
        """The resources (Resources field names) of which `extra` does not fit."""
        after = self.used + extra
        return [k for k in _KINDS if getattr(after, k) > getattr(self.total, k)]

    def charge(self, extra: Resources, what: str) -> None:
        """Take `extra` or raise BudgetExhausted (and take nothing)."""
        with self._lock:
            short = self._short(extra)
            if short:
                names = " and ".join(f"{_KINDS[k][0]} ({_KINDS[k][1]})" for k in short)
                raise BudgetExhausted(
                    f"host budget exhausted: not enough {names}: {what} needs {extra}, {self.used} of {self.total} are "
                    f"allowed to other sessions; close sessions or ask for lower limits (options "
                    f"{', '.join(_KINDS[k][2] for k in short)})")
            self.used = self.used + extra

    async def take(self, need: Resources, what: str, closing: Callable[[], list[asyncio.Task]], wait_s: float,
                   holder: Any = None) -> None:
        """`charge(need)`; while it does not fit and `closing()` lists tasks that will give budget back (sessions
        being closed), wait for them, `wait_s` at most, then BudgetExhausted. With `holder` (a session: its
        `charge` is what it holds), make the holder hold `need`: take only what it lacks, give back the rest."""
        held = holder.charge if holder is not None else Resources()
        more = (need - held).most(Resources())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while more != Resources():
            try:
                self.charge(more, what)
                break
            except BudgetExhausted:
                pending, left = closing(), deadline - loop.time()
                if not pending or left <= 0:
                    raise
                await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if holder is not None:
            holder.charge = held + more
            back = (holder.charge - need).most(Resources())
            holder.charge = holder.charge - back
            self.release(back)

    def give_back(self, holder: Any) -> None:
        """Release all a holder (a session) holds; idempotent."""
        charge, holder.charge = holder.charge, Resources()
        self.release(charge)

    def release(self, amount: Resources) -> None:
        with self._lock:
            self.used = (self.used - amount).most(Resources())

    def describe(self) -> dict:
        with self._lock:
            return {"pids": self.used.pids, "max_total_pids": self.total.pids, "memory_mb": self.used.memory_mb,
                    "max_total_memory_mb": self.total.memory_mb, "disk_mb": self.used.disk_mb,
                    "max_total_disk_mb": self.total.disk_mb}
