"""The hybrid backend: an X desktop and a sandboxed terminal on one workspace. Files cross both ways (xterm ->
shell, shell -> host and xterm), the xterm's shell is sandboxed like the terminal (same /workspace, same user, no
host file, no network), terminal tasks are judged at finished() whichever side solved them, actions route by
target, bad actions change neither side, a dead X server or sandbox is infra_error, and nothing outlives close."""
from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import time

import grpc
import pytest

from envd import proctree, scratch
from envd.base import Action, ActionError
from envd.sandbox import missing_tools
from envd_compliance import EnvCompliance, envd_client, expect_code, run
from test_desktop import host_dir, tag  # noqa: F401  (fixtures: the same host marker and sleep tag)
from core.proc import wait_for
from core.v1 import common_pb2, env_pb2

_NEEDED = ["Xvfb", "xdotool", "xwininfo", "xterm", "xedit"]
if any(shutil.which(b) is None for b in _NEEDED) or missing_tools():
    pytest.skip(f"the hybrid backend needs {_NEEDED} and the sandbox tools {missing_tools()} (scripts/setup.sh --dev)",
                allow_module_level=True)
pytest.importorskip("mss", reason="mss is not installed")

from envd import hybrid  # noqa: E402

SMALL = {"width": "640", "height": "480", "settle_s": "0.05", "apps": "xterm", "wait_s": "5"}


def _poll(cond, timeout_s: float = 30.0, what: str = "condition"):  # X apps on a loaded 2-core host
    return wait_for(cond, timeout_s, what, every=0.05)


def _leftovers(env) -> set[int]:
    x = env.desktop.x.pid
    return proctree.session_processes(x, {x, *env.pids}) | {p for p in env.pids if proctree.alive(p)}


def _closed_cleanly(env) -> bool:
    """No process of either side is left and both private directories are gone (polled: a daemon closes a failed
    session in a worker thread)."""
    def done():
        return not _leftovers(env) and not os.path.exists(env._dir) and not os.path.exists(env.desktop._dir)
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    return done()


def _read(path) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def test_bad_options_and_ids():
    with pytest.raises(ValueError, match="workspace"):
        hybrid.make("", {"workspace": "/etc"})       # a client may not name host directories
    with pytest.raises(ValueError, match="unknown hybrid option"):
        hybrid.make("", {"colour": "red"})
    with pytest.raises(ValueError):
        hybrid.make("", {"max_steps": "0"})
    with pytest.raises(KeyError):
        hybrid.make("no_such_task", {})


@pytest.fixture(scope="module")
def env():
    e = hybrid.make("hello", SMALL)
    yield e
    e.close()
    assert _closed_cleanly(e)


def test_session_dirs_live_in_the_daemons_scratch_root(env):
    """Both private directories are in this process's scratch root (envd/scratch.py), so a SIGKILLed daemon's are
    removed when the next daemon starts (before, they stayed in /tmp for good)."""
    assert {env._dir.parent, pathlib.Path(env.desktop._dir).parent} == {scratch.root()}


def test_workspace_round_trip_between_gui_and_shell(env):
    r = env.reset(0)
    ws = env.workspace
    assert r.images[0].width == 640 and '"xterm" (XTerm)' in r.text and r.text.endswith("/workspace$ ")
    assert "hello.txt" in r.instruction and os.stat(env._dir).st_mode & 0o777 == 0o711
    env.step(Action("click", target="xterm"))      # no window manager: keys go to the window under the pointer
    env.step(Action("type", content="echo gui > from_gui.txt\n"))
    _poll(lambda: _read(ws / "from_gui.txt") == "gui\n", what="the xterm to write from_gui.txt")
    r = env.step(Action("type", content="cat from_gui.txt\n", target="terminal"))
    assert "$ cat from_gui.txt\ngui\n[exit 0]" in r.text
    # The shell may also change what the GUI wrote, and writes files the GUI side sees.
    r = env.step(Action("type", content="echo more >> from_gui.txt && echo shell > from_shell.txt\n", target="terminal"))
    assert r.info["terminal"]["exit_status"] == 0 and _read(ws / "from_gui.txt") == "gui\nmore\n"
    assert _read(ws / "from_shell.txt") == "shell\n"
    env.step(Action("type", content="cat from_shell.txt > seen_by_gui.txt\n"))    # the xterm reads it
    _poll(lambda: _read(ws / "seen_by_gui.txt") == "shell\n", what="the xterm to copy from_shell.txt")
    r = env.step(Action("finished"))
    assert r.outcome == "terminated" and r.reward == 0.0 and r.info["success"] is False   # hello.txt was not made
    assert "hello.txt is missing" in r.info["verifier"]
    with pytest.raises(ActionError, match="over"):
        env.step(Action("wait"))
    r = env.reset(1)                                     # a new episode: the workspace is empty again
    assert sorted(os.listdir(ws)) == [] and r.step == 0 and r.outcome == "running"


def test_bad_actions_change_neither_side(env):
    r = env.reset(2)
    env.step(Action("type", content="echo x", target="terminal"))   # pending on the prompt line
    before = env.observe()
    for bad in ({"type": "click", "point": [900, 10]}, {"type": "teleport"}, {"type": "hotkey", "key": "ctrl nope"},
                {"type": "click", "target": "terminal"}, {"type": "hotkey", "key": "alt f4", "target": "terminal"},
                {"type": "type", "content": "", "target": "terminal"}, {"type": "scroll", "target": "Terminal"},
                {"type": "type", "content": "a\x07b", "target": "TERMINAL"}):
        with pytest.raises(ActionError):
            env.step(Action(**bad))
    after = env.observe()
    assert (after.text, after.step) == (before.text, before.step) and after.text.endswith("/workspace$ echo x")
    assert env.terminal.pending == "echo x" and r.step == 0


def test_task_solved_through_either_side(env):
    env.reset(3)
    env.step(Action("type", content="echo hi > hello.txt\n", target="terminal"))
    r = env.step(Action("finished"))
    assert r.reward == 1.0 and r.outcome == "terminated" and r.info["success"] is True
    env.reset(4)
    env.step(Action("click", target="xterm"))
    env.step(Action("type", content="echo hi > hello.txt\n"))
    _poll(lambda: _read(env.workspace / "hello.txt") == "hi\n", what="the xterm to write hello.txt")
    r = env.step(Action("finished"))
    assert r.reward == 1.0 and r.info["success"] is True


def test_xterm_is_sandboxed_like_the_terminal_and_nothing_outlives_close(host_dir, tag):
    """The desktop's xterm sees what the terminal sees: the same files at /workspace, the same sandbox user, no
    host file outside the workspace, no network; the two run as one host uid, so each may change what the other
    wrote; and closing the session ends every process of both, even a job the xterm's shell daemonised."""
    marker = host_dir / "host_secret"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    e = hybrid.make("", SMALL)
    try:
        e.reset(0)
        e.step(Action("type", content="echo from-shell > shell.txt\n", target="terminal"))
        e.step(Action("click", target="xterm"))
        e.step(Action("type", content=f"(id -u; id -un; pwd; cat shell.txt; cat {marker} || echo NO-FILE; "
                                      f"(exec 3<>/dev/tcp/127.0.0.1/{srv.getsockname()[1]}) && echo CONNECTED || "
                                      f"echo NO-NET; echo gui >> shell.txt; (setsid sleep {tag} >/dev/null 2>&1 &); "
                                      "echo END) > gui.txt 2>&1\n"))
        _poll(lambda: _read(e.workspace / "gui.txt").endswith("END\n"), 30, "the xterm to write gui.txt")
        lines = _read(e.workspace / "gui.txt").splitlines()
        assert lines[:4] == ["1000", "user", "/workspace", "from-shell"], lines
        assert "HOST-SECRET" not in lines and "NO-FILE" in lines and "NO-NET" in lines, lines
        r = e.step(Action("type", content="id -u; cat shell.txt; echo shell >> gui.txt\n", target="terminal"))
        assert "1000\nfrom-shell\ngui\n[exit 0]" in r.text, r.text
        if os.getuid() == 0:   # one uid for both sides, the terminal's own
            assert os.stat(e.workspace / "gui.txt").st_uid == e.terminal.sandbox.uid == e.desktop.apps_sandbox.uid
        jobs = _poll(lambda: proctree.mentioning(tag), what="the daemonised sleep")
        roots = e.desktop.pids - {e.desktop.x.pid}
        apps = roots | proctree.descendants(roots)
    finally:
        srv.close()
        e.close()
    assert _closed_cleanly(e)
    assert not {p for p in apps | jobs if proctree.alive(p)}, "processes of the closed session still run"


def test_nothing_of_the_gui_writes_the_workspace_once_the_episode_is_over():
    """The episode's end stops the GUI apps: a job the xterm's shell left running went on writing after the quota
    ended the episode (nothing checks the quota then) until a Reset or Close, 10 MB -> 34 MB in 5 s past a 2 MB
    quota; and after finished() it could change the workspace while the verifier read it."""
    e = hybrid.make("hello", {**SMALL, "disk_mb": "1"})
    writer = "(while :; do head -c {} /dev/zero > f$RANDOM; sleep 0.05; done) &\n"
    try:
        # Past the quota (6 files of 200 KB > 1 MiB: the apps' disk guard may stop them first, the step then ends the
        # episode); and finished while the job still writes, under the quota (files of 1 KB).
        for end, size, files in (("quota", 200_000, 6), ("finished", 1000, 8)):
            e.reset(0)
            e.step(Action("click", target="xterm"))
            e.step(Action("type", content=writer.format(size)))
            _poll(lambda: len(list(e.workspace.glob("f*"))) >= files, what=f"the xterm's job to write {files} files")
            r = e.step(Action("wait" if end == "quota" else "finished"))
            assert r.outcome == ("truncated" if end == "quota" else "terminated")
            assert ("over its 1 MiB quota" in r.text) == (end == "quota")
            # stopped and waited for when the episode ended: nothing of the GUI (the xterm's job) can write any more
            assert not e.desktop.apps_sandbox.processes(), f"the GUI's job still runs after {end} ended the episode"
            assert e.observe().text == r.text     # the episode's last screen, with the windows it had
    finally:
        e.close()
    assert _closed_cleanly(e)


def test_dead_sandbox_is_an_infra_failure():
    e = hybrid.make("", SMALL)
    try:
        e.reset(0)
        os.killpg(e.terminal.sandbox.proc.pid, signal.SIGKILL)
        _poll(lambda: not e.terminal.sandbox.alive, what="the sandbox to die")
        with pytest.raises(RuntimeError, match="sandbox") as ei:
            e.step(Action("wait"))
        assert not isinstance(ei.value, ActionError)
    finally:
        e.close()
    assert _closed_cleanly(e)


class TestHybridCompliance(EnvCompliance):
    env_id = "hybrid"
    options = {**SMALL, "max_steps": "3", "settle_s": "0"}
    valid_action = {"type": "type", "content": "echo hi\n", "target": "terminal"}
    invalid_action = {"type": "click", "point": [5000, 5]}
    max_episode_steps = 4

    def test_concurrent_sessions(self):
        super().test_concurrent_sessions(n=3)  # each session is an X server, an xterm and a sandbox


def test_killed_x_server_is_infra_error_and_nothing_outlives_the_daemon():
    async def body():
        async with envd_client(gc_interval_s=0.05) as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="hybrid/hello", options=SMALL))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid))
            assert r.outcome == common_pb2.RUNNING and "hello.txt" in r.observation.instruction
            env = c.server.servicer.sessions[sid].env
            os.kill(env.desktop.x.server_pid, signal.SIGKILL)
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(
                type="type", content="echo hi > hello.txt\n", target="terminal")))
            assert r.outcome == common_pb2.INFRA_ERROR and "X server" in r.info_json
            await expect_code(grpc.StatusCode.NOT_FOUND, c.Observe(env_pb2.SessionRef(session_id=sid)))
            assert await asyncio.to_thread(_closed_cleanly, env)   # the daemon closes it in a worker thread
            sid2 = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="hybrid", options=SMALL))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid2))
            return c.server.servicer.sessions[sid2].env   # still open when the daemon stops

    live = run(body(), timeout=60)
    assert _closed_cleanly(live)
