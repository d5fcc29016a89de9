"""No stopped sandbox leaves a zombie behind. In a container whose pid 1 is envd itself (a pod's `command:`), orphans
are re-parented to envd, which never waits for them: a sandbox stopped by killing its bwrap first left its init
there as a zombie holding a pid, one per terminal, desktop or hybrid episode (MiniWoB's old process-group kill left
four per session). The child process below stands in for such a daemon: it is a child subreaper (orphans of its
descendants come to it, as to a pid 1), runs episodes of every sandboxed backend, and counts its zombie children."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from envd.sandbox_limits import missing_tools

if missing_tools() or not all(shutil.which(t) for t in ("Xvfb", "xterm")):
    pytest.skip("bubblewrap, util-linux, Xvfb and xterm are needed (scripts/setup.sh --dev)", allow_module_level=True)

DAEMON = r"""
import ctypes, json, os, sys, time
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0          # PR_SET_CHILD_SUBREAPER: orphans come to us
from envd import registry
from envd.base import Action
from envd.sandbox_exit import exited

def children():
    me, out = str(os.getpid()), []
    for d in os.listdir("/proc"):
        try:
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split() if d.isdigit() else None
        except OSError:
            continue
        if f and f[1] == me:
            out.append((int(d), f[0]))
    return out

def zombies():    # our zombie children, once every child has exited (an orphan dies a moment after it comes to us)
    deadline = time.monotonic() + 10
    while (live := [pid for pid, s in children() if s != "Z"]) and time.monotonic() < deadline:
        try:
            fd = os.pidfd_open(live[0])
        except ProcessLookupError:
            continue
        try:
            exited(fd, max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return [s for _, s in children()].count("Z")

desk = {"apps": "xterm", "width": "640", "height": "480"}
runs = [("desktop", desk), ("hybrid/hello", desk), ("terminal", {"timeout_s": "2", "wait_s": "5"})]
if sys.argv[1] == "1":
    runs.append(("miniwob/click-test", {}))
counts = {}
for env_id, opts in runs:
    env = registry.make(env_id, opts)
    for seed in range(3):
        env.reset(seed)
        if env_id == "terminal" and seed == 1:   # a shell that ignores SIGINT is replaced: its sandbox is killed
            env.step(Action("type", content="trap '' INT; while :; do :; done\n"))
            deadline = time.monotonic() + 60
            while "new shell started" not in env.transcript and time.monotonic() < deadline:
                env.step(Action("wait"))
            assert "new shell started" in env.transcript
    env.close()
    counts[env_id] = zombies() - sum(counts.values())
print(json.dumps(counts))
"""


def test_stopped_sandboxes_leave_no_zombie_under_a_daemon_that_collects_orphans():
    from envd import miniwob_chromium

    try:
        import miniwob  # noqa: F401
        with_miniwob = not miniwob_chromium.missing()
    except ImportError:
        with_miniwob = False
    repo = pathlib.Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", DAEMON, str(int(with_miniwob))], cwd=repo, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert p.returncode == 0, p.stderr[-3000:]
    counts = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(counts) == 3 + with_miniwob and not any(counts.values()), counts
