"""The X server behind a `desktop` session: one Xvfb on a free display number, reachable only with the session's
private MIT-MAGIC-COOKIE, in its own process group so that it and every X client started in it die together. Xvfb is
the daemon's own (no policy input reaches it but X requests); the apps that talk to it run in a sandbox.

Display numbers: threads of one daemon pick them one at a time; between processes Xvfb's own lock file decides (a
taken number makes it exit and the next is tried).
"""
from __future__ import annotations

import os
import secrets
import select
import shutil
import struct
import subprocess
import threading
import time

from envd.proctree import alive, kill_session, with_parent_death_signal

FIRST_DISPLAY = 100        # leave the low numbers to real desktops
_display_lock = threading.Lock()   # threads of one daemon pick numbers one at a time (other processes: Xvfb's lock)
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
    """The address-space bound (bytes) of an Xvfb with a width x height screen: XVFB_AS_MB plus its 32-bit frame
    buffer. envd's budget charges the desktop this much for it (envd/desktop_apps.py xvfb_claim)."""
    return (XVFB_AS_MB << 20) + width * height * 4


def _limited(width: int, height: int) -> list[str]:
    """prlimit's prefix that bounds Xvfb's address space (none when prlimit is missing)."""
    if shutil.which("prlimit") is None:
        return []
    return ["prlimit", f"--as={address_space(width, height)}", "--"]


class XServer:
    """One Xvfb in its own process group; `env` is what an X client needs to reach it."""

    def __init__(self, workdir: str, width: int, height: int, timeout_s: float = 10.0, tries: int = 20):
        global _next_display
        self.auth = os.path.join(workdir, "Xauthority")
        write_xauthority(self.auth, secrets.token_bytes(16))
        last_err = ""
        for _ in range(tries):
            with _display_lock:
                n, _next_display = _next_display, FIRST_DISPLAY + (_next_display + 1 - FIRST_DISPLAY) % 900
            if os.path.exists(f"/tmp/.X{n}-lock"):
                continue  # taken (or stale: Xvfb would check the pid, but another number is cheaper)
            # A socket without a lock file is left over from a killed Xvfb: Xvfb takes the lock and replaces it.
            r, w = os.pipe()
            try:
                argv = [*_limited(width, height), "Xvfb", f":{n}", "-screen", "0", f"{width}x{height}x24", "-nolisten",
                        "tcp", "-auth", self.auth, "-noreset", "-displayfd", str(w)]
                with open(os.path.join(workdir, "xvfb.log"), "ab") as log:
                    self.proc = subprocess.Popen(with_parent_death_signal(argv), pass_fds=[w], process_group=0,
                                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                os.close(w)
                w = -1
                got = self._read_ready(r, timeout_s)
            finally:
                os.close(r)
                if w >= 0:
                    os.close(w)
            if got == str(n):
                self.display = f":{n}"
                self.env = {"DISPLAY": self.display, "XAUTHORITY": self.auth, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
                return
            last_err = f"Xvfb :{n} did not start ({got or 'exited'})"
            kill_session(self.proc.pid, {self.proc.pid})
            self.proc.wait(timeout=5)
        raise RuntimeError(f"no free X display after {tries} tries: {last_err}")

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
        return self.proc.pid

    @property
    def socket(self) -> str:
        """The server's unix socket in the file system (sandboxed clients get it bound in: envd/desktop_apps.py)."""
        return f"/tmp/.X11-unix/X{self.display[1:]}"

    def alive(self) -> bool:
        return self.proc.poll() is None and alive(self.proc.pid)

    def remove_stale_files(self) -> None:
        """A SIGKILLed Xvfb leaves its socket (and lock file) behind, and the display picker skips numbers that have
        one: without this every closed session would use up a display number for good."""
        if getattr(self, "display", "") and self.proc.poll() is not None:
            n = self.display[1:]
            for path in (f"/tmp/.X11-unix/X{n}", f"/tmp/.X{n}-lock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
