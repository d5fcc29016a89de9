"""envd's host-wide budget: the processes and memory all sessions together may be allowed, and who holds how much.

Each session is charged what its backend says it may use (envd.base.Env.resources: a terminal sandbox's nproc and
memory_mb plus its tmpfs; an estimate for backends without a sandbox) before it is let in, again before a Reset
that raises its limits and after a Restore that brings its own, and gives it back once its env is closed. The sum
never exceeds envd.max_total_pids / envd.max_total_memory_mb (0 = derived from the host: `host_totals`).

The charge is an allowance, not a measurement: what keeps a sandbox under it are its own limits (RLIMIT_NPROC,
RLIMIT_AS per process, sized tmpfs). The point is that the allowances add up to what the host has, so that many
sessions each within its limits cannot together take the host down.
"""
from __future__ import annotations

import asyncio
import os
import resource
import threading
from typing import Any, Callable

from envd.base import Resources


def host_totals(max_total_pids: int = 0, max_total_memory_mb: int = 0) -> Resources:
    """The budget: the configured figures, or where 0, half the host's process limit and 3/4 of its memory."""
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
    return Resources(pids, memory)


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
        after = self.used + extra
        return after.pids <= self.total.pids and after.memory_mb <= self.total.memory_mb

    def charge(self, extra: Resources, what: str) -> None:
        """Take `extra` or raise BudgetExhausted (and take nothing)."""
        with self._lock:
            if not self._fits(extra):
                raise BudgetExhausted(
                    f"host budget exhausted: {what} needs {extra}, {self.used} of {self.total} are allowed to other "
                    "sessions (envd.max_total_pids / envd.max_total_memory_mb); close sessions or ask for lower "
                    "limits (options nproc, memory_mb, tmp_mb)")
            self.used = self.used + extra

    async def take(self, need: Resources, what: str, closing: Callable[[], list[asyncio.Task]], wait_s: float,
                   holder: Any = None) -> None:
        """`charge(need)`; while it does not fit and `closing()` lists tasks that will give budget back (sessions
        being closed), wait for them, `wait_s` at most, then BudgetExhausted. With `holder` (a session: its
        `charge` is what it holds), make the holder hold `need`: take only what it lacks, give back the rest."""
        held = holder.charge if holder is not None else Resources()
        more = Resources(max(0, need.pids - held.pids), max(0, need.memory_mb - held.memory_mb))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while more.pids or more.memory_mb:
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
            back = holder.charge - need
            back = Resources(max(0, back.pids), max(0, back.memory_mb))
            holder.charge = holder.charge - back
            self.release(back)

    def give_back(self, holder: Any) -> None:
        """Release all a holder (a session) holds; idempotent."""
        charge, holder.charge = holder.charge, Resources()
        self.release(charge)

    def release(self, amount: Resources) -> None:
        with self._lock:
            self.used = Resources(max(0, self.used.pids - amount.pids), max(0, self.used.memory_mb - amount.memory_mb))

    def describe(self) -> dict:
        with self._lock:
            return {"pids": self.used.pids, "max_total_pids": self.total.pids, "memory_mb": self.used.memory_mb,
                    "max_total_memory_mb": self.total.memory_mb}
