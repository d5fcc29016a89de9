"""`tars` as a container's pid 1 (core/proc.py run_as_init): orphans are reaped, signals reach the command, its
exit status is the container's. Run in a pid namespace of its own (`unshare --pid --fork`), where the command is
pid 1 as in a container."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
UNSHARE = (["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
           + ([] if os.getuid() == 0 else ["--user", "--map-root-user"]))


def _pid1(code: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([*UNSHARE, sys.executable, "-c", code], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kw)


def _usable() -> bool:
    try:
        p = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


pytestmark = pytest.mark.skipif(not _usable(), reason="unshare cannot make a pid namespace here")

# The command leaves an orphan (a grandchild whose parent exits first), lets it exit, and reports whether it is still
# there as a zombie 3 s on: under the init, pid 1 reaps it at once; without it, the command is pid 1 and never does.
ORPHAN = r"""
import os, sys, time
from core.proc import run_as_init

def main():
    r, w = os.pipe()
    p2r, p2w = os.pipe()
    if os.fork() == 0:
        if os.fork() == 0:                   # the orphan: tells its pid, exits once its parent is gone
            os.write(p2w, str(os.getpid()).encode())
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os._exit(0)
    os.wait()                                # its parent, reaped: the orphan now belongs to pid 1
    orphan = int(os.read(p2r, 32))
    os.close(w)                              # the orphan's read returns: it exits
    os.close(r)
    deadline, state = time.monotonic() + 3, "?"
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{orphan}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:                      # ENOENT, or ESRCH when reaped between open and read
            state = "gone"                   # reaped
            break
        time.sleep(0.02)                     # polled: no file descriptor tells that a process was reaped
    print("pid", os.getpid(), "orphan", state, flush=True)
    return 3

sys.exit(run_as_init(main))
"""


def test_as_pid_1_orphans_are_reaped_and_the_status_is_the_commands():
    p = _pid1(ORPHAN)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert out.split() == ["pid", "2", "orphan", "gone"], (out, err)   # the command runs as pid 2 under the init


def test_without_the_init_the_orphan_stays_a_zombie():
    """What the init is for: TARS_NO_INIT=1 runs the command as pid 1 itself, and the orphan is never reaped."""
    p = _pid1(ORPHAN, {"TARS_NO_INIT": "1"})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert out.split() == ["pid", "1", "orphan", "Z"], (out, err)


def test_sigterm_to_pid_1_reaches_the_command():
    """`docker stop` signals pid 1: the command gets SIGTERM (here it answers with status 7); a command killed by a
    signal exits as 128 + the signal."""
    code = r"""
import os, signal, sys, time
from core.proc import run_as_init

def main():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # taken by sigtimedwait: no handler's race
    print("ready", flush=True)
    return 7 if signal.sigtimedwait({signal.SIGTERM}, 60) else 0

sys.exit(run_as_init(main))
"""
    p = _pid1(code)
    try:
        assert p.stdout.readline().strip() == "ready"
        init = _child_of(p.pid)               # unshare's child: the namespace's pid 1 (a host pid here)
        os.kill(init, signal.SIGTERM)
        assert p.wait(timeout=30) == 7
    finally:
        p.kill()
        p.communicate(timeout=30)
    p = _pid1("import os, signal\nfrom core.proc import run_as_init\n"
              "raise SystemExit(run_as_init(lambda: os.kill(os.getpid(), signal.SIGKILL)))")
    p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL


def _child_of(pid: int) -> int:
    """unshare's child, once the command under it has said it is ready."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = f.read().split()
    assert len(kids) == 1, kids
    return int(kids[0])


def test_the_tars_command_runs_under_it():
    p = subprocess.run([*UNSHARE, sys.executable, "-m", "tars.cli", "config", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0 and "usage: tars config" in p.stdout, p.stderr


def test_ctrl_c_at_a_terminal_reaches_the_command_once():
    """`docker run -it`: the command's process group is the terminal's foreground one, so Ctrl-C reaches it once
    (in pid 1's group it got the terminal's SIGINT and pid 1's forward of its own copy: two)."""
    import pty
    import select

    code = r"""
import os, select, signal, sys, time
from core.proc import run_as_init

def main():
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGINT, lambda *a: None)
    signal.set_wakeup_fd(w)                  # a byte for each SIGINT caught
    print("ready", flush=True)
    got, deadline = 0, time.monotonic() + 1.5
    while (left := deadline - time.monotonic()) > 0:
        if select.select([r], [], [], left)[0]:
            got += len(os.read(r, 64))
    print("sigints", got, flush=True)
    return 0

sys.exit(run_as_init(main))
"""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.environ["PYTHONPATH"] = str(REPO)
        os.execvp(UNSHARE[0], [*UNSHARE, sys.executable, "-c", code])
    out, deadline, sent = b"", time.monotonic() + 60, False
    try:
        while not re.search(rb"sigints \d+\s", out) and time.monotonic() < deadline:   # the whole line
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    out += os.read(fd, 1024)
                except OSError:
                    break
            if b"ready" in out and not sent:
                os.write(fd, b"\x03")
                sent = True
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
    assert re.search(rb"sigints 1\s", out), out
