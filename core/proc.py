"""Process conventions shared by the roles: ready files, signals, parent-death; polling other processes' output."""
from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import socket
import time


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\nSTATUS=...") to systemd's $NOTIFY_SOCKET (Type=notify units).

    A unix datagram to the path in $NOTIFY_SOCKET ('@' = Linux abstract namespace). Returns True when sent;
    False (and does nothing) when the variable is unset, the socket is gone or the send fails.
    """
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr or not state:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    elif addr[0] != "/":
        return False  # vsock:… and other schemes are not supported here
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def write_ready(path: str | os.PathLike | None, info: dict) -> None:
    """Announce a started server: atomically write {role, address, pid, ...} as JSON to `path` (if given), and
    tell systemd (READY=1) when run as a Type=notify unit."""
    from core import telemetry

    info = {**telemetry.info(), **info}  # the Prometheus address and span file, when this process has them
    if path:
        p = pathlib.Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
        os.replace(tmp, p)
    status = " ".join(f"{k}={info[k]}" for k in ("role", "address", "stream", "version") if k in info)
    sd_notify(f"READY=1\nSTATUS=listening {status}")


def pid_alive(pid: int) -> bool:
    """Is process `pid` running on this host (a zombie has exited; another user's process counts as running)?"""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return pathlib.Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# Set by a parent that starts a role (tars.topology.Process) to its own pid: die_with_parent() then sees whether that
# parent is already gone. Read once and taken out of the environment, so the role's own children do not inherit it.
PARENT_ENV = "TARS_PARENT_PID"


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, so a killed `tars up` leaves no orphans. PDEATHSIG only covers a
    death after this call: a parent killed while the role was still starting (its imports, config and checks take
    seconds) left it running for good, listening, with init as parent. So when the parent named itself in
    $TARS_PARENT_PID and is no longer this process's parent, the SIGTERM is sent now."""
    expected = os.environ.pop(PARENT_ENV, "")
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if expected.isdigit() and os.getppid() != int(expected):  # orphaned before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def wait_for(pred, timeout: float, what: str, every: float = 0.2):
    """Poll pred() until it returns something truthy (returned) or raise TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by a kill or cut by a stop
    return out


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_as_init(main) -> int:
    """`main()`, and when this process is pid 1 (a container's command: `docker run IMAGE`, a pod's `command:`),
    a minimal init around it, as `docker run --init` gives: this process forks, the child runs `main` and exits with
    its status (atexit handlers run), and pid 1 forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to it,
    reaps every orphan the kernel hands it (a pid 1 that never waits leaves each a zombie holding a pid for the
    container's life), and exits with the child's status (128 + the signal that killed it). TARS_NO_INIT=1: no
    init. Call it before any thread starts: only the calling thread survives a fork."""
    if os.getpid() != 1 or os.environ.get("TARS_NO_INIT"):
        return main()
    # pid 1 takes its signals with sigtimedwait, not handlers: a handler's Python code runs only between bytecodes,
    # so a signal caught just before a blocking waitpid would be forwarded only once some child exits. Blocked from
    # before the fork: nothing that comes early is dropped (the kernel drops a signal that pid 1 neither handles nor
    # blocks).
    waited = {*FORWARDED_SIGNALS, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # A process group of its own, the terminal's foreground one when there is a terminal: Ctrl-C reaches the
        # command once (from the terminal), not twice (the terminal's, and pid 1's forward of its own copy).
        os.setpgid(0, 0)
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(0, os.getpgrp())
        except OSError:
            pass                             # no terminal
        signal.signal(signal.SIGTTOU, old)
        raise SystemExit(main())
    while True:
        info = signal.sigtimedwait(waited, 1.0)  # None each second: the reaping below runs anyway
        if info is not None and info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass                         # it has just exited: its SIGCHLD is on its way
            continue
        while True:                          # one SIGCHLD may stand for several exits
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:        # not reachable while the child lives
                return 1
            if pid == 0:
                break
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                return code if code >= 0 else 128 - code
