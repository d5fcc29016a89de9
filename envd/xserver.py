"""The X server behind a `desktop` session: one Xvfb on a free display number, reachable only with the session's
private MIT-MAGIC-COOKIE, in a bubblewrap sandbox of its own (envd/bwrap.py, as the apps'), so that it and every X
client started in it die together and a bug in it is not a way out to the host.

Xvfb parses every X request the sandboxed apps send, so it is sandboxed too: no network (its abstract socket lives in
a network namespace of its own, and it listens on no TCP port), no host file but the read-only system directories,
its cookie (read-only) and its socket directory (a private `x11/` of the session, bound at /tmp/.X11-unix), a
size-limited /tmp for the keymaps it compiles, and on a root daemon an unprivileged uid of its own, not the apps'.
Its address space is bounded (XVFB_AS_MB). Outside, the session's socket is reached two ways: the apps' sandbox binds
the socket file itself (envd/desktop_apps.py), and envd's own X clients (the screenshot, xdotool) connect to
`/tmp/.X11-unix/X<n>`, a symbolic link to it, since libxcb takes a display number, not a socket path.

Display numbers: threads of one daemon pick them one at a time; between processes the lock file `/tmp/.X<n>-lock`
decides: envd holds it for the sandboxed Xvfb (whose own lock lies in its private /tmp) with flock, writing its pid in
the X servers' format, and removes it with the link when the session closes; a killed daemon's lock, whose flock
died with it, is taken over when its number comes round again.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import secrets
import select
import signal
import struct
import subprocess
import threading
import time

from envd.bwrap import sandbox_argv, write_etc
from envd.cgroups import MemoryCgroup, memory_cgroup
from envd.proctree import alive, descendants, kill_session
from envd.sandbox_exit import exited, kill_and_wait, open_pidfd, read_child_pid, running
from envd.sandbox_limits import Limits, allocate_uid, chown_tree, missing_tools, release_uid

FIRST_DISPLAY = 100        # leave the low numbers to real desktops
_display_lock = threading.Lock()   # threads of one daemon pick numbers one at a time (other processes: the lock files)
_next_display = FIRST_DISPLAY + secrets.randbelow(400)


def write_xauthority(path: str, cookie: bytes) -> None:
    """An Xauthority file with one MIT-MAGIC-COOKIE-1 entry for any host and display (FamilyWild): the file is
    private to one session, so it needs no address."""
    def counted(b: bytes) -> bytes:
        return struct.pack(">H", len(b)) + b
    data = struct.pack(">H", 0xFFFF) + counted(b"") + counted(b"") + counted(b"MIT-MAGIC-COOKIE-1") + counted(cookie)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# Xvfb's address space: its own (~220 MiB of mappings), the frame buffer, and this much for what clients ask of it.
# Pixmaps are the server's memory, not the sandboxed app's that asks for them: without a bound, 16 of 4096x4096
# grew Xvfb by 1 GiB for an app whose own limit was 512 MiB (past it, a client gets BadAlloc).
XVFB_AS_MB = 512


def address_space(width: int, height: int) -> int:
    """The address-space bound (bytes, whole MiB) of an Xvfb with a width x height screen: XVFB_AS_MB plus its 32-bit
    frame buffer, rounded up to a MiB. envd's budget charges the desktop this much for it (envd/desktop_apps.py
    xvfb_claim)."""
    return -(-((XVFB_AS_MB << 20) + width * height * 4) >> 20) << 20


XVFB_PIDS = 8              # RLIMIT_NPROC of Xvfb's uid: bwrap's reaper, Xvfb and the xkbcomp (via sh) it runs


def xvfb_limits(width: int, height: int) -> Limits:
    """The limits Xvfb's sandbox runs under. RLIMIT_CPU counts a whole session's rendering: generous. Its /tmp holds
    only the keymaps xkbcomp compiles for it (a few KiB each)."""
    return Limits(cpu_s=24 * 3600, memory_mb=address_space(width, height) >> 20, nproc=XVFB_PIDS, fsize_mb=4,
                  nofile=1024, tmp_mb=4, disk_mb=0)


INNER_AUTH = "/run/tars/Xauthority"


def _tail(path: str, n: int = 400) -> str:
    """The end of a log, on one line (the session's directory, and the log with it, is removed when it fails)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return " | ".join(f.read().decode(errors="replace").split("\n")).strip(" |") or "(empty log)"
    except OSError as e:
        return f"(no log: {e.strerror})"


class XServer:
    """One sandboxed Xvfb in its own process group; `env` is what an X client outside needs to reach it."""

    def __init__(self, workdir: str, width: int, height: int, timeout_s: float = 10.0, tries: int = 20):
        if missing := missing_tools():
            raise RuntimeError(f"the desktop's X server sandbox needs {', '.join(missing)} on the host "
                               "(apt: bubblewrap, util-linux)")
        self.display, self.proc, self._lock, self._link, self._lock_fd = "", None, "", "", -1
        self.init_pid, self._init_fd = 0, -1
        self.cgroup: MemoryCgroup | None = None       # Xvfb's memory, at the host budget's claim
        self._server_pid, self._server_fd = 0, -1     # the Xvfb process itself, under the sandbox's init
        self.uid = allocate_uid()                      # None: the daemon's own (not root)
        try:
            self._start(workdir, width, height, timeout_s, tries)
        except BaseException:
            self.close()
            raise

    def _start(self, workdir: str, width: int, height: int, timeout_s: float, tries: int) -> None:
        global _next_display
        self.auth = os.path.join(workdir, "Xauthority")
        write_xauthority(self.auth, secrets.token_bytes(16))
        self.sockets = os.path.join(workdir, "x11")    # /tmp/.X11-unix in the sandbox: Xvfb's socket appears here
        home = os.path.join(workdir, "xvfb-home")      # its (empty) /workspace
        for d in (self.sockets, home):
            os.makedirs(d, mode=0o755, exist_ok=True)
        if self.uid is not None:
            os.chmod(workdir, 0o711)                   # the uid reaches its files; the apps' uid the socket
            chown_tree(pathlib.Path(self.sockets), self.uid)  # its one writable host directory (home stays root's)
            os.chown(self.auth, self.uid, self.uid)    # mode 0600: Xvfb reads it; root (envd) still can
        etc = write_etc(pathlib.Path(workdir) / "xvfb-etc")
        try:                                           # the host's socket directory (links to sessions' sockets)
            os.mkdir("/tmp/.X11-unix")
            os.chmod("/tmp/.X11-unix", 0o1777)         # as X servers make it: anyone's, sticky (mkdir's umask)
        except FileExistsError:
            pass
        last_err = ""
        for _ in range(tries):
            with _display_lock:
                n, _next_display = _next_display, FIRST_DISPLAY + (_next_display + 1 - FIRST_DISPLAY) % 900
            if not self._reserve(n):
                continue
            got = self._launch(n, workdir, width, height, etc, home, timeout_s)
            if got == str(n):
                self._server_pid = self._find_server()
                self._server_fd = open_pidfd(self._server_pid)
                self.display = f":{n}"
                os.symlink(self.socket, self._link)
                self.env = {"DISPLAY": self.display, "XAUTHORITY": self.auth,
                            "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
                return
            last_err = f"Xvfb :{n} did not start ({got or 'exited'}): {_tail(os.path.join(workdir, 'xvfb.log'))}"
            self._stop()
            self._unreserve()
        raise RuntimeError(f"no free X display after {tries} tries: {last_err}")

    def _reserve(self, n: int) -> bool:
        """Take display n for this session: its lock file, held with flock for the session's life (so a lock left by a
        killed daemon, whose flock died with it, is taken over, race-free between daemons) and holding this daemon's
        pid (so X servers that only read pids keep off it), and no socket or link left at /tmp/.X11-unix/X<n> (one a
        killed session left is removed; one we may not remove skips n). A lock that another program holds or that
        names a live process other than this daemon (an X server's own) skips n."""
        lock, link = f"/tmp/.X{n}-lock", f"/tmp/.X11-unix/X{n}"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            return False                               # not ours to open (an X server's lock is mode 0444)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, now = os.fstat(fd), os.lstat(lock)
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                raise OSError("the lock file was replaced")  # its holder unlinked it as we opened it
            pid = int(os.pread(fd, 64, 0).strip() or 0)
            if pid and pid != os.getpid() and alive(pid):
                raise OSError(f"display {n} is locked by pid {pid}")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid():10d}\n".encode(), 0)
        except (OSError, ValueError):
            os.close(fd)
            return False
        self._lock, self._lock_fd = lock, fd
        try:
            if os.path.lexists(link):
                os.unlink(link)
        except OSError:
            self._unreserve()
            return False
        self._link = link
        return True

    def _unreserve(self) -> None:
        for path in (self._link, self._lock):          # the lock's path first gone, then its flock released
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self._link = self._lock = ""
        self._lock_fd = -1

    def _launch(self, n: int, workdir: str, width: int, height: int, etc: pathlib.Path, home: str,
                timeout_s: float) -> str:
        """Start Xvfb :n in its sandbox -> what it wrote to -displayfd ("" when it exited, "timed out")."""
        r, w = os.pipe()
        info_r, info_w = os.pipe()
        try:
            limits = xvfb_limits(width, height)
            self.cgroup = memory_cgroup(limits.host_claim().memory_mb)
            argv = sandbox_argv(home, etc, limits, self.uid, info_w, ro_binds=[(self.auth, INNER_AUTH)],
                                rw_binds=[(self.sockets, "/tmp/.X11-unix")], cgroup=self.cgroup)
            argv += ["Xvfb", f":{n}", "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp", "-auth", INNER_AUTH,
                     "-noreset", "-displayfd", str(w)]
            with open(os.path.join(workdir, "xvfb.log"), "ab") as log:
                self.proc = subprocess.Popen(argv, pass_fds=[w, info_w], process_group=0, close_fds=True,
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            os.close(w)
            os.close(info_w)
            w = info_w = -1
            pid = read_child_pid(info_r, timeout_s)    # closes info_r
            info_r = -1
            self.init_pid, self._init_fd = pid or 0, open_pidfd(pid)
            return self._read_ready(r, timeout_s) if pid else ""
        finally:
            for fd in (r, w, info_r, info_w):
                if fd >= 0:
                    os.close(fd)

    @staticmethod
    def _read_ready(fd: int, timeout_s: float) -> str:
        """Xvfb writes its display number to -displayfd once it accepts connections; EOF means it exited."""
        deadline, buf = time.monotonic() + timeout_s, b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timed out"
            chunk = os.read(fd, 64)
            if not chunk:
                return ""
            buf += chunk
        return buf.decode().strip()

    @property
    def pid(self) -> int:
        """bwrap's pid (the process envd started; its process group is the session's)."""
        return self.proc.pid

    def _find_server(self) -> int:
        """The Xvfb process's host pid (0 when none): under the sandbox's init."""
        for pid in sorted(descendants({self.init_pid})) if self.init_pid else ():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "Xvfb":
                        return pid
            except OSError:
                continue
        return 0

    @property
    def server_pid(self) -> int:
        """The Xvfb process's host pid (found once, at the start)."""
        return self._server_pid

    @property
    def socket(self) -> str:
        """The server's unix socket in the file system (the apps' sandbox binds it: envd/desktop_apps.py)."""
        return os.path.join(self.sockets, f"X{self.display[1:]}")

    def alive(self) -> bool:
        """Xvfb itself runs (its pidfd: the moment it dies, before its sandbox's init and bwrap follow), and bwrap."""
        return (self.proc is not None and self.proc.poll() is None and alive(self.proc.pid)
                and running(self._server_fd))

    def wait_exit(self, timeout_s: float) -> None:
        """Wait up to timeout_s for Xvfb to exit (a client saw its connection fail: it may be dying)."""
        exited(self._server_fd, timeout_s)

    def kill(self) -> None:
        """SIGKILL the sandbox's init now (its whole namespace dies with it, and bwrap exits after reaping it); does
        not wait. For a caller on a deadline (the screenshot's timer)."""
        try:
            signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
        except (OSError, TypeError, ValueError):
            if self.proc is not None and self.proc.returncode is None:
                self.proc.kill()

    def _stop(self, roots: frozenset[int] | set[int] = frozenset()) -> None:
        """Stop the sandbox (`_end`), then remove its memory cgroup."""
        cgroup, self.cgroup = self.cgroup, None
        try:
            self._end(roots)
        finally:
            if cgroup is not None:
                cgroup.close()

    def _end(self, roots: frozenset[int] | set[int] = frozenset()) -> None:
        """Kill the sandbox: its init first, waited for until the namespace is empty; bwrap, its parent, reaps it and
        exits (killing bwrap first would leave the init a zombie of the host's init, counted against the uid's
        RLIMIT_NPROC). Then, while bwrap's unreaped exit still holds its pid, its process group (the session's: the
        apps' bwrap is in it) and `roots` are swept, and bwrap is reaped."""
        proc, fd = self.proc, self._init_fd
        self._init_fd, self.init_pid = -1, 0
        if self._server_fd >= 0:
            os.close(self._server_fd)
        self._server_fd = -1
        kill_and_wait(fd)
        if proc is None or proc.returncode is not None:  # reaped (by alive()/poll()): its pid may be another's now
            left = set(roots) - ({proc.pid} if proc is not None else set())
            if left:
                kill_session(0, left)
            return
        pidfd = open_pidfd(proc.pid)                   # our unreaped child: the pid is still its own
        try:
            if not exited(pidfd, 5.0):                 # bwrap exits once it has reaped the init
                proc.kill()
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        kill_session(proc.pid, {proc.pid, *roots})
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def close(self, roots: frozenset[int] | set[int] = frozenset()) -> None:
        """Stop Xvfb for good (and sweep `roots` and the session's process group with it), remove the display's lock
        and link, and give the uid back."""
        try:
            self._stop(roots)
        finally:
            self._unreserve()
            release_uid(self.uid)
            self.uid = None
