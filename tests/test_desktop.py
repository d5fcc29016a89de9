"""The desktop backend: a real Xvfb with xterm and xedit per session. Typing a shell command into xterm makes the
file in the workspace, and that shell is sandboxed (no host file outside the workspace, no network, the sandbox's
user, nothing of it outlives the session, not even a daemonised job), screenshots have the screen's size and change
with input, bad input is rejected without effect, display numbers never collide, a killed X server is infra_error,
and nothing outlives a session or the daemon. Also the PNG encoder the screenshots go through."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import secrets
import shutil
import signal
import socket
import tempfile
import time
import zlib

import grpc
import pytest

from envd import png, proctree, scratch, xserver
from envd.sandbox_limits import missing_tools
from envd.workspace_archive import rmtree
from envd.base import Action, ActionError, Outcome
from envd_compliance import (EnvCompliance, assert_untouched, dir_left_by_a_killed_daemon, envd_client, expect_code,
                             occupy_pid, release, run)
from core.config import EnvdConfig, from_dict
from core.proc import wait_for
from core.v1 import common_pb2, env_pb2

_NEEDED = ["Xvfb", "xdotool", "xwininfo", "xterm", "xedit"]
if any(shutil.which(b) is None for b in _NEEDED) or missing_tools():
    pytest.skip(f"the desktop backend needs {_NEEDED} and the sandbox tools {missing_tools()} (scripts/setup.sh --dev)",
                allow_module_level=True)
pytest.importorskip("mss", reason="mss is not installed")

from envd import desktop  # noqa: E402


def _poll(cond, timeout_s: float = 30.0, what: str = "condition"):  # X apps on a loaded 2-core host
    return wait_for(cond, timeout_s, what, every=0.05)


def _gone(env, timeout_s: float = 30.0) -> set[int]:
    x = env.x.pid
    deadline = time.monotonic() + timeout_s
    while True:
        left = proctree.session_processes(x, {x, *env.pids})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---- pure pieces ------------------------------------------------------------------------------------------------

def test_png_roundtrip_and_errors():
    w, h = 7, 3
    pixels = bytes((x * 30 + y * 7 + c) % 256 for y in range(h) for x in range(w) for c in range(3))
    data = png.encode_rgb(pixels, w, h)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and png.decode_rgb(data) == (w, h, pixels)
    # The IDAT stream is plain zlib over filter-0 scanlines, as PNG readers expect.
    assert zlib.decompress(data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8])[:1] == b"\x00"
    with pytest.raises(ValueError):
        png.encode_rgb(pixels[:-1], w, h)


def test_hotkeys_map_to_xdotool():
    assert desktop.xdotool_key("ctrl c") == "ctrl+c" and desktop.xdotool_key("Ctrl+Shift+t") == "ctrl+shift+t"
    assert desktop.xdotool_key("enter") == "Return" and desktop.xdotool_key("alt f4") == "alt+F4"
    assert desktop.xdotool_key("ctrl -") == "ctrl+minus" and desktop.xdotool_key("Page_Up") == "Page_Up"
    for bad in ("", "ctrl nosuchkey", "hyper x", "ctrl ++", "\x00", "ctrl \x01",   # NUL: ValueError in subprocess
                "Terminate_Server", "ctrl terminate_server"):   # Xvfb exited at it: INFRA_ERROR
        with pytest.raises(ActionError):
            desktop.xdotool_key(bad)


def test_bad_options_are_value_errors():
    for opts in ({"apps": "firefox"}, {"width": "10"}, {"max_steps": "-1"}, {"settle_s": "x"}):
        with pytest.raises(ValueError):
            desktop.make("", opts)
    with pytest.raises(KeyError):
        desktop.make("something", {})


# ---- one real desktop for the input tests -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def desk():
    env = desktop.make("", {"width": "800", "height": "600", "settle_s": "0.05"})
    yield env
    env.close()
    assert not _gone(env) and not os.path.exists(env._dir)


def test_typing_into_xterm_makes_a_file(desk):
    r = desk.reset(0)
    assert r.width == 800 and r.height == 600 and r.images[0].width == 800
    assert '"xterm" (XTerm)' in r.text and '"xedit" (Xedit)' in r.text and desk.workspace in r.text
    assert png.decode_rgb(r.images[0].data)[:2] == (800, 600)
    before = r.images[0].sha256
    desk.step(Action("click", target="xterm"))  # no window manager: focus follows the pointer
    r = desk.step(Action("type", content="echo hi > file\n"))
    path = os.path.join(desk.workspace, "file")
    _poll(lambda: os.path.exists(path) and open(path).read() == "hi\n", what="xterm to write the file")
    _poll(lambda: desk.screenshot().sha256 != before, what="the screenshot to change")
    # A new episode starts with fresh apps in an empty workspace.
    r = desk.reset(1)
    assert not os.listdir(desk.workspace) and r.step == 0


def test_every_input_kind_and_rejected_input(desk):
    r = desk.reset(2)
    wins = {w["title"]: w for w in desk.windows()}
    cx, cy = wins["xedit"]["x"] + 100, wins["xedit"]["y"] + 200
    for a in ({"type": "click", "point": [cx, cy]}, {"type": "type", "content": "one two"},
              {"type": "left_double", "point": [cx, cy]}, {"type": "right_single", "point": [cx, cy]},
              {"type": "hotkey", "key": "ctrl e"}, {"type": "scroll", "point": [cx, cy], "direction": "down"},
              {"type": "drag", "point": [cx, cy], "end_point": [cx + 40, cy]}, {"type": "wait"}):
        r = desk.step(Action(**a))
        assert r.outcome == "running" and r.images[0].width == 800
    steps, text = r.step, desk.observe().text
    for bad in ({"type": "click", "point": [800, 10]}, {"type": "click"}, {"type": "hotkey", "key": "ctrl nope"},
                {"type": "scroll", "direction": "sideways"}, {"type": "click", "target": "no such window"},
                {"type": "type", "content": ""}, {"type": "teleport"},
                # a NUL cannot go into xdotool's argv: subprocess's ValueError ended the session as INFRA_ERROR
                {"type": "type", "content": "a\x00b"}, {"type": "hotkey", "key": "\x00"}):
        with pytest.raises(ActionError):
            desk.step(Action(**bad))
    assert desk.observe().step == steps and desk.observe().text == text
    r = desk.step(Action("finished"))
    assert r.outcome == "terminated" and r.reward == 0.0
    with pytest.raises(ActionError):
        desk.step(Action("wait"))
    with pytest.raises(NotImplementedError, match="snapshot"):
        desk.snapshot()


@pytest.fixture
def shared_dir():
    """A directory a root daemon's sandbox uid can reach (pytest's tmp_path lies under a 0700 directory)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="shared-", dir=scratch.root()))
    yield d
    rmtree(d)


def test_shared_workspace_and_distinct_displays(tmp_path, shared_dir, monkeypatch, desk):
    if os.getuid() == 0 and any(not os.stat(p).st_mode & 0o001 for p in tmp_path.parents):
        # The sandbox's own uid could not bind a workspace it cannot reach: said at once.
        with pytest.raises(ValueError, match="reachable"):
            desktop.make("", {"apps": "xterm", "workspace": str(tmp_path)})
    # Pretend no lock files exist and aim at the display in use: Xvfb itself refuses it and the next one is tried.
    taken = int(desk.display[1:])
    monkeypatch.setattr(xserver, "_next_display", taken)
    real_exists = os.path.exists
    monkeypatch.setattr(xserver.os.path, "exists", lambda p: False if str(p).startswith("/tmp/.X") else real_exists(p))
    other = desktop.make("", {"apps": "xterm", "workspace": str(shared_dir), "width": "640", "height": "480"})
    try:
        assert other.display != desk.display
        other.reset(0)
        other.step(Action("click", target="xterm"))
        other.step(Action("type", content="pwd > where\n"))
        _poll(lambda: (shared_dir / "where").exists() and (shared_dir / "where").read_text().strip(), what="pwd")
        assert (shared_dir / "where").read_text().strip() == "/workspace"   # the workspace, as the terminal sees it
    finally:
        other.close()
    assert not _gone(other) and shared_dir.exists()  # a workspace we were given is not ours to delete


def _typed_lines(env, script: str, out: str, timeout_s: float = 30.0) -> list[str]:
    """Type `script` (one line) into the env's xterm with its output to `out` in the workspace; its lines."""
    env.step(Action("click", target="xterm"))
    env.step(Action("type", content=f"({script}; echo END) > {out} 2>&1\n"))
    path = pathlib.Path(env.workspace) / out
    _poll(lambda: path.exists() and path.read_text().endswith("END\n"), timeout_s, f"the xterm to write {out}")
    return path.read_text().splitlines()


def test_long_typed_text_is_typed_in_chunks_and_too_long_is_refused():
    """One xdotool call typed a whole line (8 ms a key): a 4000-character type() ran past the 10 s command timeout
    and ended the session as INFRA_ERROR, a model's long text counted as a broken backend. Lines are now typed in
    chunks that fit command_timeout_s (2 s here: ~1000 characters took 8 s in one call), and more than MAX_TYPE
    characters is an ActionError that changes nothing."""
    env = desktop.make("", {"width": "800", "height": "600", "settle_s": "0.05", "apps": "xterm",
                            "command_timeout_s": "2"})
    try:
        env.reset(0)
        long = "x" * 950
        assert _typed_lines(env, f"echo {long}", "long.txt", timeout_s=60) == [long, "END"]
        steps, text = env.observe().step, env.observe().text
        with pytest.raises(ActionError, match=f"at most {desktop.MAX_TYPE} per type"):
            env.step(Action("type", content="y" * (desktop.MAX_TYPE + 1)))
        assert (env.observe().step, env.observe().text) == (steps, text)
    finally:
        env.close()
    assert not _gone(env)


@pytest.fixture
def host_dir():
    """A host directory outside any workspace that every uid could read (so only the sandbox keeps it out)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="tars-host-marker-"))
    os.chmod(d, 0o755)
    (d / "host_secret").write_text("HOST-SECRET\n")
    os.chmod(d / "host_secret", 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_xterm_commands_run_in_the_sandbox(desk, host_dir):
    """What a policy types into the xterm runs in the sandbox: a world-readable host file outside the workspace is
    not there, a port on the host's loopback cannot be reached, no name resolves, and the shell is the sandbox's
    user in /workspace; what it writes lands in the workspace on the host, owned by the sandbox's uid."""
    marker = host_dir / "host_secret"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    try:
        desk.reset(5)
        lines = _typed_lines(desk, f"id -u; id -un; pwd; cat {marker} || echo NO-FILE; "
                                   f"test -e {host_dir} || echo NO-DIR; getent hosts example.com || echo NO-DNS;"
                                   f" (exec 3<>/dev/tcp/127.0.0.1/{port}) && echo CONNECTED "
                                   f"|| echo NO-NET; ls /", "probe.txt")
    finally:
        srv.close()
    assert lines[:3] == ["1000", "user", "/workspace"], lines
    assert "HOST-SECRET" not in lines and "NO-FILE" in lines and "NO-DIR" in lines, lines
    assert "NO-NET" in lines and "CONNECTED" not in lines and "NO-DNS" in lines, lines
    assert not {"root", "home", "var", "opt"} & set(lines), lines    # no host directory but the system's
    st = os.stat(pathlib.Path(desk.workspace) / "probe.txt")
    assert st.st_uid == (desk.apps_sandbox.uid if os.getuid() == 0 else os.getuid())


@pytest.fixture
def tag():
    """A unique argument for a `sleep` typed into a session; whatever still runs with it is killed at teardown (a
    job that escaped the session, as it did before the apps were sandboxed, is never left behind)."""
    t = f"{31000 + os.getpid() % 1000}.{secrets.randbelow(10 ** 6):06d}"
    yield t
    for pid in proctree.mentioning(t):
        os.kill(pid, signal.SIGKILL)


def test_closing_kills_every_process_of_the_apps_even_a_daemonised_one(shared_dir, tag):
    """A job the xterm's shell daemonises (setsid, double fork) leaves the apps' process group and is no descendant
    of theirs: as the daemon's user it outlived the session. In the sandbox it is in the apps' pid namespace, which
    closing empties; so are the apps themselves (their pids, from /proc, are gone)."""
    env = desktop.make("", {"apps": "xterm,xedit", "workspace": str(shared_dir), "width": "640", "height": "480"})
    try:
        env.reset(0)
        _typed_lines(env, f"(setsid sleep {tag} > /dev/null 2>&1 &)", "daemonised.txt")
        jobs = _poll(lambda: proctree.mentioning(tag), what="the daemonised sleep")
        roots = env.pids - {env.x.pid}
        apps = roots | proctree.descendants(roots)
        assert len(apps) >= 3      # xterm, its shell, xedit (and the sandbox's bwrap, init and sh)
    finally:
        env.close()
    assert not _gone(env)
    assert not {p for p in apps | jobs if proctree.alive(p)}, "processes of the closed session still run"


# ---- over a real envd -----------------------------------------------------------------------------------------

class TestDesktopCompliance(EnvCompliance):
    env_id = "desktop"
    options = {"max_steps": "3", "apps": "xterm", "width": "640", "height": "480", "settle_s": "0"}
    valid_action = {"type": "click", "point": [50, 50]}
    invalid_action = {"type": "click", "point": [5000, 5]}
    max_episode_steps = 4

    def test_concurrent_sessions(self):
        super().test_concurrent_sessions(n=4)  # each session is an X server and an xterm


def test_killed_x_server_is_infra_error_and_nothing_outlives_the_daemon():
    async def body():
        async with envd_client(gc_interval_s=0.05) as c:
            opts = {"apps": "xterm,xcalc", "width": "640", "height": "480"}
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid, options=opts))
            assert r.outcome == common_pb2.RUNNING and '"Calculator"' in r.observation.text
            env = c.server.servicer.sessions[sid].env
            os.kill(env.x.server_pid, signal.SIGKILL)        # Xvfb itself, in its sandbox
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", point=[5, 5])))
            assert r.outcome == common_pb2.INFRA_ERROR and "X server" in r.info_json
            await expect_code(grpc.StatusCode.NOT_FOUND, c.Observe(env_pb2.SessionRef(session_id=sid)))
            assert not await asyncio.to_thread(_gone, env)
            sid2 = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid2, options=opts))
            assert r.outcome == common_pb2.RUNNING and r.observation.images[0].width == 640
            return c.server.servicer.sessions[sid2].env  # still open when the daemon stops

    live = run(body(), timeout=60)
    assert not _gone(live) and not os.path.exists(live._dir)


def test_an_app_holding_the_x_server_cannot_hang_the_screenshot():
    """A program typed into the xterm may grab the X server (XGrabServer through ctypes). The X tools envd runs
    have deadlines, but mss's screenshot waited for its reply with none: still blocked after 20 s, and for good
    (its worker thread, and the session, whose close waits for the call). Past command_timeout_s the X server is
    now killed and the screenshot fails: INFRA_ERROR, as for any broken desktop."""
    import threading

    env = desktop.make("", {"width": "400", "height": "300", "settle_s": "0.05", "apps": "xterm",
                            "command_timeout_s": "3"})
    t = None
    try:
        env.reset(0)
        env.step(Action("click", target="xterm"))
        # It grabs once told to (the file 'go', made once the typing step has returned, so the step's own
        # screenshot is not the one held up), then holds the server until it is killed.
        grab = ("import ctypes, os, time; x = ctypes.CDLL('libX11.so.6'); x.XOpenDisplay.restype = ctypes.c_void_p; "
                "d = ctypes.c_void_p(x.XOpenDisplay(None)); end = time.time() + 60; "
                "[time.sleep(0.05) for _ in iter(lambda: os.path.exists('go') or time.time() > end, True)]; "
                "x.XGrabServer(d); x.XSync(d, 0); open('grabbed', 'w').close(); time.sleep(600)")
        env.step(Action("type", content=f'python3 -c "{grab}" &\n'))
        open(os.path.join(env.workspace, "go"), "w").close()
        _poll(lambda: os.path.exists(os.path.join(env.workspace, "grabbed")), what="the app to grab the server")
        got = {}

        def shot():
            try:
                got["shot"] = env.screenshot()
            except Exception as e:   # noqa: BLE001 - what the worker would raise
                got["error"] = e

        t = threading.Thread(target=shot, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the screenshot still waits for the X server 20 s on"
        assert isinstance(got.get("error"), RuntimeError) and "took longer than 3s" in str(got["error"]), got
    finally:
        if t is not None and t.is_alive():
            env.apps_sandbox.stop()   # the grab goes with its app: the screenshot returns
            t.join(10)
        env.close()
    assert not _gone(env)


def test_an_app_cannot_grow_the_x_server_past_its_bound():
    """Pixmaps are the X server's memory, not the app's that asks for them: 24 filled 4096x4096 pixmaps grew Xvfb to
    1.6 GiB for an app whose own limit was 512 MiB, and more would go on to the host's last byte. Xvfb now runs under
    an address-space bound (xserver.XVFB_AS_MB plus its frame buffer): the app gets BadAlloc, the desktop lives on."""
    env = desktop.make("", {"width": "400", "height": "300", "settle_s": "0.05", "apps": "xterm"})
    try:
        env.reset(0)
        env.step(Action("click", target="xterm"))
        pathlib.Path(env.workspace, "grow.py").write_text(
            "import ctypes as c\n"
            "x = c.CDLL('libX11.so.6')\n"
            "x.XOpenDisplay.restype, x.XDefaultRootWindow.restype = c.c_void_p, c.c_ulong\n"
            "x.XCreatePixmap.restype, x.XCreateGC.restype = c.c_ulong, c.c_void_p\n"
            "d = c.c_void_p(x.XOpenDisplay(None))\n"
            "r = c.c_ulong(x.XDefaultRootWindow(d))\n"
            "g = c.c_void_p(x.XCreateGC(d, r, 0, None))\n"
            "ps = []\n"
            "for i in range(24):\n"
            "    ps.append(c.c_ulong(x.XCreatePixmap(d, r, 4096, 4096, 24)))\n"
            "    x.XFillRectangle(d, ps[-1], g, 0, 0, 4096, 4096)\n"
            "    x.XSync(d, 0)\n"
            "    print(i, flush=True)\n")
        env.step(Action("type", content="(python3 grow.py > grow.log 2>&1; touch finished) &\n"))
        _poll(lambda: os.path.exists(os.path.join(env.workspace, "finished")), 120, "the app to stop growing Xvfb")
        with open(f"/proc/{env.x.server_pid}/status") as f:
            peak_kb = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
        assert peak_kb < 600 << 10, f"Xvfb grew to {peak_kb >> 10} MiB"          # 512 MiB + its frame buffer
        assert env.x.alive() and env.screenshot().width == 400
    finally:
        env.close()
    assert not _gone(env)


def test_closing_after_the_x_server_was_reaped_never_signals_its_freed_pid(monkeypatch):
    """An X server that died is reaped by the next _check_x (its poll), and close() then SIGKILLed the group and the
    pid of that Xvfb by number. With the apps already stopped (a hybrid's episode end, a reset) nothing holds the
    number: a host 'sleep 60' given it (ns_last_pid, as root) was killed by the close. Now a reaped Xvfb is not."""
    env = desktop.make("", {"width": "400", "height": "300", "apps": "xterm"})
    victim, signalled = None, []
    try:
        env.reset(0)
        env._stop_apps()
        stale = env.x.pid
        os.kill(stale, signal.SIGKILL)
        _poll(lambda: not proctree.alive(stale), what="the X server to die")
        with pytest.raises(RuntimeError, match="exited"):
            env._check_x()                                  # reaps it
        victim = occupy_pid(stale)  # None (not root): the signals themselves are checked
        real_kill, real_killpg = os.kill, os.killpg
        monkeypatch.setattr(os, "kill", lambda p, sig: (signalled.append(p), real_kill(p, sig))[1])
        monkeypatch.setattr(os, "killpg", lambda p, sig: (signalled.append(p), real_killpg(p, sig))[1])
        env.close()
        monkeypatch.undo()
        assert_untouched(victim)                            # still running: the close did not kill it
        assert stale not in signalled
    finally:
        release(victim)
        env.close()


def test_the_disk_quota_holds_for_what_the_apps_write_between_steps():
    """Nothing checked the desktop's workspace quota: a job of the xterm wrote on into the host's disk for as long as
    it liked (here 1 MiB every 20 ms: 171 MiB in 4 s between two steps, against a quota of 8 MiB). A guard now walks
    the workspace every second while the apps run and stops them all once it is over; the next step ends the
    episode (truncated) and says why."""
    from envd.sandbox_limits import Limits, workspace_usage

    env = desktop.make("", {"width": "400", "height": "300", "settle_s": "0.05", "apps": "xterm"})
    try:
        env.apps_sandbox.quota = Limits(disk_mb=8)
        env.reset(0)
        env.step(Action("click", target="xterm"))
        env.step(Action("type", content="(for i in $(seq 400); do head -c 1M /dev/zero > f$i; sleep 0.02; done) &\n"))
        # no step: only the guard can stop the apps
        _poll(lambda: not env.apps_sandbox.alive, 20.0, "the guard to stop the apps over the quota")
        used = workspace_usage(pathlib.Path(env.workspace), 100_000)[0]
        assert used < 40 << 20, f"the apps wrote {used >> 20} MiB over an 8 MiB quota"
        r = env.step(Action("wait"))
        assert r.outcome == Outcome.TRUNCATED and "over its 8 MiB quota" in r.text, r.text
    finally:
        env.close()
    assert not _gone(env)


def test_envd_serves_the_desktop_without_a_setting_but_never_a_callers_workspace(tmp_path, caplog):
    """The GUI apps run in the sandbox, so envd serves desktop and hybrid as it is (they needed
    envd.unsandboxed_envs=true once); that setting still loads but is ignored, with a warning. A workspace the caller
    names (a directory envd would create and run programs in) is still refused over RPC."""
    opts = {"apps": "xterm", "width": "640", "height": "480", "settle_s": "0"}

    async def main():
        async with envd_client() as c:
            for env_id in ("desktop", "hybrid"):
                sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id=env_id, options=opts))).session_id
                await c.Close(env_pb2.SessionRef(session_id=sid))
            for env_id in ("desktop", "hybrid"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.CreateSession(env_pb2.CreateSessionRequest(
                        env_id=env_id, options={**opts, "workspace": str(tmp_path / "chosen" / "dir")}))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "workspace" in e.value.details()
        assert not (tmp_path / "chosen").exists()
        with caplog.at_level(logging.WARNING, logger="envd.servicer"):
            async with envd_client(from_dict(EnvdConfig, {"unsandboxed_envs": True})) as c:
                sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts))).session_id
                await c.Close(env_pb2.SessionRef(session_id=sid))
        assert "envd.unsandboxed_envs is deprecated and ignored" in caplog.text

    run(main())


def test_a_killed_daemons_session_dir_is_removed_by_the_next_sweep():
    """A SIGKILLed envd closes nothing: the session's directory (Xauthority, logs, the workspace) stayed in /tmp for
    good. It now lives in the daemon's scratch root (envd/scratch.py), which the next daemon's start-up sweep
    removes."""
    d = dir_left_by_a_killed_daemon(
        "from envd import desktop\ne = desktop.DesktopEnv('', {'apps': 'xterm'})\ne.reset(1)\npath = e._dir")
    assert d.is_dir() and d.parent.name.startswith(scratch.PREFIX)
    assert d.parent in scratch.sweep() and not d.exists()


@pytest.mark.parametrize("w,h", [(400, 300), (4096, 4096)])
def test_the_budget_charges_xvfb_the_address_space_it_runs_under(w, h):
    """The desktop's claim counted Xvfb as 64 MiB, an estimate, while Xvfb runs under `prlimit --as` of 512 MiB plus
    its frame buffer: envd admitted about twice the desktops its memory budget holds. The claim is now that bound
    (in whole MiB), read from the Xvfb process itself, inside its sandbox."""
    from envd.base import Resources
    from envd.desktop_apps import DESKTOP_LIMITS

    env = desktop.make("", {"width": str(w), "height": str(h), "apps": "xterm"})
    try:
        with open(f"/proc/{env.x.server_pid}/limits") as f:
            bound = int(next(line for line in f if line.startswith("Max address space")).split()[3])
        assert bound == xserver.address_space(w, h) == -(-((512 << 20) + w * h * 4) >> 20) << 20
        xvfb = env.resources() - DESKTOP_LIMITS.host_claim()
        assert xvfb.pids == 8 and bound == (xvfb.memory_mb - 4 - 4) << 20   # and its /tmp and /dev/shm tmpfs
    finally:
        env.close()
    assert xvfb == Resources(8, 521 if w == 400 else 584)


def test_the_x_server_runs_in_a_sandbox_of_its_own():
    """Xvfb parses every X request the sandboxed apps send, so it runs sandboxed too: a network namespace that is
    neither the daemon's nor the apps', none of the host's files but the system's directories and its socket
    directory, on a root daemon a uid that is neither the daemon's nor the apps'. envd's own clients reach it through
    the display's link, which closing removes with the lock file envd holds for it."""
    env = desktop.make("", {"width": "320", "height": "240", "apps": "xterm"})
    try:
        env.reset(0)
        pid, n = env.x.server_pid, env.x.display[1:]
        assert pid and pid != env.x.pid
        net = lambda p: os.readlink(f"/proc/{p}/ns/net")  # noqa: E731
        assert net(pid) != net(os.getpid()) and net(pid) != net(env.apps_sandbox.init_pid)
        root = pathlib.Path(f"/proc/{pid}/root")
        assert (root / "tmp/.X11-unix" / f"X{n}").is_socket() and (root / "usr/bin/Xvfb").exists()
        for host_path in ("home", "root", "etc/shadow", "var", env._dir.lstrip("/")):   # the last: the session's
            assert not (root / host_path).exists(), host_path
        with open(f"/proc/{pid}/status") as f:
            uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        if os.getuid() == 0:
            assert uid not in (0, env.apps_sandbox.uid)
        with open(f"/tmp/.X{n}-lock") as f:
            assert int(f.read()) == os.getpid()
        assert os.readlink(f"/tmp/.X11-unix/X{n}") == env.x.socket and env.screenshot().width == 320
    finally:
        env.close()
    assert not os.path.lexists(f"/tmp/.X{n}-lock") and not os.path.lexists(f"/tmp/.X11-unix/X{n}")


def test_a_killed_daemons_display_lock_is_taken_over_and_a_held_or_foreign_one_is_not(monkeypatch):
    """A daemon killed with a desktop open leaves the display's lock file and link (no close ran): before, every such
    number was skipped for good. envd holds its locks with flock, so one whose holder died is taken over; one another
    process holds, or one naming a live process other than this daemon (an X server's), is skipped."""
    import fcntl
    import subprocess

    def free(k: int) -> int:                          # k numbers in a row without a lock file
        return next(n for n in range(xserver.FIRST_DISPLAY, 990)
                    if not any(os.path.lexists(f"/tmp/.X{n + i}-lock") for i in range(k)))

    dead = subprocess.Popen(["true"])
    dead.wait()
    n = free(3)
    paths = [f"/tmp/.X{n + i}-lock" for i in range(3)] + [f"/tmp/.X11-unix/X{n}"]
    held = None
    try:
        with open(paths[0], "w") as f:               # the killed daemon's: a dead pid, no flock, a dangling link
            f.write(f"{dead.pid:10d}\n")
        os.makedirs("/tmp/.X11-unix", exist_ok=True)
        os.symlink("/nonexistent/x11/X0", paths[3])
        monkeypatch.setattr(xserver, "_next_display", n)
        env = desktop.make("", {"width": "320", "height": "240", "apps": "xterm"})
        try:
            assert env.x.display == f":{n}" and os.readlink(paths[3]) == env.x.socket
            with open(paths[0]) as f:
                assert int(f.read()) == os.getpid()
        finally:
            env.close()
        assert not os.path.lexists(paths[0]) and not os.path.lexists(paths[3])

        held = os.open(paths[0], os.O_RDWR | os.O_CREAT, 0o644)   # held by a live process (another description)
        fcntl.flock(held, fcntl.LOCK_EX)
        with open(paths[1], "w") as f:               # an X server's: a live pid that is not this daemon's
            f.write(f"{os.getppid():10d}\n")
        monkeypatch.setattr(xserver, "_next_display", n)
        env = desktop.make("", {"width": "320", "height": "240", "apps": "xterm"})
        try:
            assert env.x.display == f":{n + 2}"
        finally:
            env.close()
        with open(paths[1]) as f:
            assert int(f.read()) == os.getppid()      # left as it was
    finally:
        if held is not None:
            os.close(held)
        for p in paths:
            if os.path.lexists(p):
                os.unlink(p)


@pytest.mark.skipif(os.getuid() != 0, reason="sandbox uids of their own are a root daemon's")
def test_a_released_sandbox_uid_is_not_handed_out_again_at_once():
    """RLIMIT_NPROC counts zombies: a sandbox's init whose bwrap was SIGKILLed stays one until the host's init reaps
    it, so a uid handed out again at once could start its next sandbox (Xvfb's, 8 processes) over its limit ("bwrap:
    Creating new namespace failed: Resource temporarily unavailable"). Allocation goes round the range."""
    from envd.sandbox_limits import allocate_uid, release_uid

    seen = []
    for _ in range(3):
        seen.append(allocate_uid())
        release_uid(seen[-1])
    assert len(set(seen)) == 3


def test_envd_refuses_a_desktop_its_memory_budget_cannot_hold():
    """A desktop is charged its app sandbox (56 processes, 512 + 32 + 16 MiB) plus Xvfb's sandbox (8 processes, 512 MiB
    + 1024x768x4 bytes = 515 MiB, and 4 + 4 MiB of tmpfs): 1083 MiB. A 1500 MiB budget holds one, not two (with Xvfb
    at 64 MiB it took
    two, 1248 MiB, whose X servers alone may grow to 1030 MiB); the second CreateSession is RESOURCE_EXHAUSTED."""
    async def main():
        async with envd_client(max_total_pids=10_000, max_total_memory_mb=1500) as c:
            opts = {"apps": "xterm", "settle_s": "0"}
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts))).session_id
            e = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts)))
            assert "host budget" in e.details() and "64 processes, 1083 MiB" in e.details(), e.details()
            await c.Close(env_pb2.SessionRef(session_id=sid))

    run(main())
