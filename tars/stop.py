"""`tars learner-stop PID`: stop a learner gracefully, whether PID is a single `tars learner` or the launcher of an
`accelerate launch` job, and wait until it has exited.

Why not just SIGTERM the launcher: torch elastic (what `accelerate launch` runs) answers a SIGTERM by forwarding it to
the ranks, SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default), and then exits 1 whatever the ranks
did, so a service manager sees every stop as a failure and a final checkpoint longer than 30 s is cut. Signalled
directly, rank 0 finishes its update, checkpoints and exports with the other ranks, every rank returns 0 and the
launcher exits 0 as after a finished run. So this sends SIGTERM to PID's children that are ranks (their environment
carries LOCAL_RANK; other children, such as a learner's WAL writer, are left alone), or to PID itself when it has
none (a single-process learner stops the same way on its own SIGTERM), then waits for PID to exit.

For systemd (`ExecStop=tars learner-stop $MAINPID --timeout 280`) and a Kubernetes preStop hook
(`tars learner-stop 1 --timeout 280` when the launcher is the container's first process): docs/deploy.md.
"""
from __future__ import annotations

import os
import signal
import time


class StopError(Exception):
    """The process could not be signalled or did not exit in time (one line for the CLI)."""


def _stat(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); [] when there is no such process. The name
    may hold spaces and parentheses, so the split is after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return []


def _is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:  # gone, or another user's: not ours to signal
        return False
    return any(e.startswith(b"LOCAL_RANK=") for e in env)


def ranks_of(pid: int) -> list[int]:
    """PID's child processes that are ranks of a distributed launch (LOCAL_RANK in their environment)."""
    parent = [str(pid).encode()]
    kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _stat(int(p))[1:2] == parent]  # field 2: ppid
    return sorted(k for k in kids if _is_rank(k))


def _alive(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], [b"Z"])  # a zombie has exited; its parent has not reaped it yet


def stop(pid: int, timeout_s: float, every: float = 0.2) -> list[int]:
    """SIGTERM to PID's ranks (or PID itself), then wait up to timeout_s for PID to exit. Returns the signalled pids;
    StopError when PID is not there, cannot be signalled, or is still running at the deadline."""
    if not _alive(pid):
        raise StopError(f"no process {pid}")
    # A process that is itself a rank (or a learner started with LOCAL_RANK set) is no launcher: its children (the
    # WAL writer) inherit the variable and are not ranks.
    targets = (ranks_of(pid) if not _is_rank(pid) else []) or [pid]
    for t in targets:
        try:
            os.kill(t, signal.SIGTERM)
        except ProcessLookupError:
            pass  # ended meanwhile
        except PermissionError as e:
            raise StopError(f"cannot signal {t}: {e.strerror} (run as the learner's user)") from None
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise StopError(f"process {pid} still running {timeout_s:g} s after SIGTERM to {targets}")
        time.sleep(every)
    return targets


def main(pid: int, timeout_s: float) -> int:
    import sys

    try:
        targets = stop(pid, timeout_s)
    except StopError as e:
        print(f"tars learner-stop: {e}", file=sys.stderr, flush=True)
        return 1
    what = "its ranks " + ", ".join(map(str, targets)) if targets != [pid] else "it"
    print(f"tars learner-stop: {pid} exited (SIGTERM to {what})", flush=True)
    return 0
