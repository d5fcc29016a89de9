"""A memory cgroup per sandbox (envd/cgroups.py): where it goes, what it bounds, that nothing is left behind.

The parsing of /proc/self/mountinfo and /proc/self/cgroup is tested on texts of v1, v2 and namespaced hosts; the
bound itself on this host's kernel, where the daemon may make cgroups (skipped elsewhere): kernel memory that
RLIMIT_AS never counted (socket buffers) and the sum of several processes each under their RLIMIT_AS both end in an
OOM kill inside the sandbox, said in the transcript, and the session goes on.
"""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from envd import cgroups
from envd.base import Action
from envd.sandbox import missing_tools
from envd.terminal import TerminalEnv

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "9:name=systemd:/\n4:memory:/pods/abc\n0::/\n"


def test_locate_v1_and_a_namespaced_mount(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda p, mode: True)
    where, why = cgroups.locate(V1_MOUNTS.format(root="/"), V1_CGROUP, 42)
    assert (where, why) == (cgroups.Hierarchy(1, pathlib.Path("/sys/fs/cgroup/memory/pods/abc/tars-envd-42")), "")
    # A cgroup namespace (a container) mounts its own cgroup as the root: its path starts with that root.
    where, _ = cgroups.locate(V1_MOUNTS.format(root="/pods"), V1_CGROUP, 42)
    assert where.parent == pathlib.Path("/sys/fs/cgroup/memory/abc/tars-envd-42")
    where, _ = cgroups.locate(V1_MOUNTS.format(root="/pods/abc"), V1_CGROUP, 42)
    assert where.parent == pathlib.Path("/sys/fs/cgroup/memory/tars-envd-42")
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    where, why = cgroups.locate(V1_MOUNTS.format(root="/"), V1_CGROUP, 42)
    assert where is None and "not writable" in why


def test_locate_v2_needs_the_memory_controller_delegated(tmp_path):
    # A v2 host: the daemon's own cgroup holds it, so children get memory only from a parent that enables it.
    svc = tmp_path / "system.slice" / "envd.service"
    leaf = svc / "envd"
    leaf.mkdir(parents=True)
    (leaf / "cgroup.subtree_control").write_text("\n")
    (svc / "cgroup.subtree_control").write_text("cpu pids\n")
    mounts = f"25 1 0:22 / {tmp_path} rw - cgroup2 cgroup2 rw\n"
    own = "0::/system.slice/envd.service/envd\n"
    where, why = cgroups.locate(mounts, own, 7)
    assert where is None and "Delegate=memory" in why
    (svc / "cgroup.subtree_control").write_text("cpu memory pids\n")
    where, why = cgroups.locate(mounts, own, 7)
    assert where == cgroups.Hierarchy(2, svc / "tars-envd-7") and where.limit_file == "memory.max"
    assert cgroups.locate("31 23 0:28 / /sys rw - sysfs sysfs rw\n", own, 7)[0] is None


def test_modes(monkeypatch):
    try:
        monkeypatch.setattr(cgroups, "locate", lambda *a: (None, "no cgroup memory hierarchy is mounted"))
        with pytest.raises(cgroups.CgroupError, match="required.*no cgroup memory hierarchy"):
            cgroups.configure("required")
        assert cgroups.configure("auto").startswith("unavailable: no cgroup memory")
        assert cgroups.memory_cgroup(100) is None       # sandboxes start with their per-process limits only
        cgroups._state.mode = "required"                # probed fine once, then unavailable: no sandbox without
        with pytest.raises(cgroups.CgroupError, match="required"):
            cgroups.memory_cgroup(100)
        with pytest.raises(ValueError, match="one of auto, required, off"):
            cgroups.configure("on")
        monkeypatch.undo()
        assert cgroups.configure("off") == "off" and cgroups.memory_cgroup(100) is None
    finally:
        monkeypatch.undo()
        cgroups.configure("auto")


def test_envd_exits_2_when_required_cgroups_cannot_be_made(monkeypatch, capsys):
    from core.config import EnvdConfig
    from envd import server

    try:
        monkeypatch.setattr(cgroups, "locate", lambda *a: (None, "cgroup v2: neither /x nor its parent has memory"))
        assert server.main(EnvdConfig(memory_cgroups="required")) == 2
        assert "envd.memory_cgroups=required, but no memory cgroup can be made: cgroup v2" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        cgroups.configure("auto")


def test_envd_status_says_where_the_cgroups_go():
    import asyncio

    from core.config import EnvdConfig
    from envd.server import EnvServer, metrics
    from tars.ctl import summary

    async def status():
        srv = EnvServer(EnvdConfig(host="127.0.0.1", port=0, memory_cgroups="off"))
        await srv.start()
        try:
            return metrics(srv.servicer)
        finally:
            await srv.stop(0)
            cgroups.configure("auto")

    m = asyncio.run(status())
    assert m["memory_cgroups"] == "off" and summary("envd", m).endswith("memory_cgroups=off")
    assert summary("envd", {"memory_cgroups": "v1 /sys/fs/cgroup/memory/tars-envd-7"}).endswith("memory_cgroups=v1")
    assert summary("envd", {"memory_cgroups": "unavailable: no cgroup"}).endswith("memory_cgroups=unavailable")


needs_cgroups = pytest.mark.skipif(
    bool(missing_tools()) or cgroups.describe().startswith(("off", "unavailable")),
    reason=f"no memory cgroups for sandboxes here ({cgroups.describe()}) or sandbox tools missing")


def sh(env: TerminalEnv, cmd: str) -> str:
    """Run one command line to its prompt; the transcript it added."""
    before = len(env.transcript)
    env.step(Action("type", content=cmd + "\n"))
    for _ in range(120):
        if env.state != "running":
            break
        env.step(Action("wait"))
    assert env.state == "prompt", env.transcript[-500:]
    return env.transcript[before:]


@needs_cgroups
def test_a_sandbox_runs_in_a_cgroup_of_its_own_that_goes_with_it():
    env = TerminalEnv(options={"memory_mb": "256", "tmp_mb": "16", "wait_s": "5", "screen_chars": "100000"})
    try:
        env.reset(1, {})
        cg = env.sandbox.cgroup
        assert cg is not None and cg.limit_mb == 256 + 16 + 16         # memory_mb + /tmp + /dev/shm: the claim
        assert (cg.path / cgroups.Hierarchy(cg.version, cg.path).limit_file).read_text().strip() == str(288 << 20)
        procs = {int(p) for p in (cg.path / "cgroup.procs").read_text().split()}
        assert env.sandbox._init_pid in procs and len(procs) >= 3   # setpriv's bwrap, its init, the shell
    finally:
        env.close()
    assert not cg.path.exists()


@needs_cgroups
def test_kernel_memory_and_the_sum_of_processes_are_bounded():
    env = TerminalEnv(options={"memory_mb": "256", "tmp_mb": "16", "timeout_s": "60", "wait_s": "10",
                               "screen_chars": "100000", "nofile": "4096"})
    try:
        env.reset(1, {})
        # Socket buffers are kernel memory: RLIMIT_AS never counted them (~450 MiB held under a 64 MiB memory_mb).
        fill = ("import socket\nn = 0\nkeep = []\nfor i in range(2000):\n a, b = socket.socketpair()\n"
                " a.setblocking(False)\n try:\n  while True: n += a.send(bytes(65536))\n except BlockingIOError:\n"
                "  pass\n keep.append((a, b))\nprint('held', n >> 20, 'MiB')\n")
        (env.workspace / "fill.py").write_text(fill)
        out = sh(env, "python3 fill.py")
        assert "held" not in out and "out of memory: the sandbox's 288 MiB" in out, out[-800:]
        # Three processes of 200 MiB, each well under its 256 MiB address space, together past the bound.
        # Each holds its 200 MiB for 3 s (a select on nothing), so that the three hold theirs at once.
        out = sh(env, "for i in 1 2 3; do python3 -c 'import select; b = bytearray(200 << 20); "
                      "select.select([], [], [], 3)' & done; wait; echo done")
        assert "done" in out and "out of memory" in out, out[-800:]
        assert env.sandbox.cgroup.oom_kills() >= 2
        assert "ok" in sh(env, "echo ok")                            # the session goes on
    finally:
        env.close()


@needs_cgroups
def test_what_a_killed_daemon_left_is_swept(tmp_path):
    where = cgroups._hierarchy()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = where.parent.parent / f"{cgroups.PREFIX}{dead.pid}"
    (stale / "s1").mkdir(parents=True)
    cgroups.configure("auto")                                       # a new daemon's probe
    assert not stale.exists()


@needs_cgroups
def test_the_miniwob_browser_is_bounded():
    from envd import miniwob_chromium

    if miniwob_chromium.missing():
        pytest.skip(f"needs {miniwob_chromium.missing()}")
    from envd.miniwob_backend import MiniWoBEnv

    env = MiniWoBEnv("click-button", {})
    try:
        env.reset(3, {})
        cg = env.browser.cgroup
        assert cg is not None and cg.limit_mb == miniwob_chromium.MEMORY_BOUND_MB
        procs = {int(p) for p in (cg.path / "cgroup.procs").read_text().split()}
        assert env.browser.init_pid in procs and len(procs) > 4      # chromedriver, socat, Chromium's processes
        assert 50 < cg.peak_mb() < cg.limit_mb
    finally:
        env.close()
    assert not cg.path.exists()
