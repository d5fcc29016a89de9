"""The desktop backend: a real Xvfb with xterm and xedit per session. Typing a shell command into xterm makes the
file in the workspace, screenshots have the screen's size and change with input, bad input is rejected without
effect, display numbers never collide, a killed X server is infra_error, and nothing outlives a session or the
daemon. Also the PNG encoder the screenshots go through."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
import zlib

import grpc
import pytest

from envd import png, proctree, scratch, xserver
from envd.base import Action, ActionError
from envd_compliance import EnvCompliance, dir_left_by_a_killed_daemon, envd_client, expect_code, run
from core.proc import wait_for
from core.v1 import common_pb2, env_pb2

_NEEDED = ["Xvfb", "xdotool", "xwininfo", "xterm", "xedit"]
if any(shutil.which(b) is None for b in _NEEDED):
    pytest.skip(f"the desktop backend needs {_NEEDED} (scripts/setup.sh --dev)", allow_module_level=True)
pytest.importorskip("mss", reason="mss is not installed")

from envd import desktop  # noqa: E402


def _poll(cond, timeout_s: float = 10.0, what: str = "condition"):
    return wait_for(cond, timeout_s, what, every=0.05)


def _gone(env, timeout_s: float = 10.0) -> set[int]:
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
    for bad in ("", "ctrl nosuchkey", "hyper x", "ctrl ++"):
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
                {"type": "type", "content": ""}, {"type": "teleport"}):
        with pytest.raises(ActionError):
            desk.step(Action(**bad))
    assert desk.observe().step == steps and desk.observe().text == text
    r = desk.step(Action("finished"))
    assert r.outcome == "terminated" and r.reward == 0.0
    with pytest.raises(ActionError):
        desk.step(Action("wait"))
    with pytest.raises(NotImplementedError, match="snapshot"):
        desk.snapshot()


def test_shared_workspace_and_distinct_displays(tmp_path, monkeypatch, desk):
    # Pretend no lock files exist and aim at the display in use: Xvfb itself refuses it and the next one is tried.
    taken = int(desk.display[1:])
    monkeypatch.setattr(xserver, "_next_display", taken)
    real_exists = os.path.exists
    monkeypatch.setattr(xserver.os.path, "exists", lambda p: False if str(p).startswith("/tmp/.X") else real_exists(p))
    other = desktop.make("", {"apps": "xterm", "workspace": str(tmp_path), "width": "640", "height": "480"})
    try:
        assert other.display != desk.display
        other.reset(0)
        other.step(Action("click", target="xterm"))
        other.step(Action("type", content="pwd > where\n"))
        _poll(lambda: (tmp_path / "where").exists() and (tmp_path / "where").read_text().strip(), what="pwd output")
        assert (tmp_path / "where").read_text().strip() == str(tmp_path)
    finally:
        other.close()
    assert not _gone(other) and tmp_path.exists()  # a workspace we were given is not ours to delete


# ---- over a real envd -----------------------------------------------------------------------------------------

class TestDesktopCompliance(EnvCompliance):
    env_id = "desktop"
    envd_overrides = {"unsandboxed_envs": True}
    options = {"max_steps": "3", "apps": "xterm", "width": "640", "height": "480", "settle_s": "0"}
    valid_action = {"type": "click", "point": [50, 50]}
    invalid_action = {"type": "click", "point": [5000, 5]}
    max_episode_steps = 4

    def test_concurrent_sessions(self):
        super().test_concurrent_sessions(n=4)  # each session is an X server and an xterm


def test_killed_x_server_is_infra_error_and_nothing_outlives_the_daemon():
    async def body():
        async with envd_client(gc_interval_s=0.05, unsandboxed_envs=True) as c:
            opts = {"apps": "xterm,xcalc", "width": "640", "height": "480"}
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="desktop", options=opts))).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid, options=opts))
            assert r.outcome == common_pb2.RUNNING and '"Calculator"' in r.observation.text
            env = c.server.servicer.sessions[sid].env
            os.kill(env.x.pid, signal.SIGKILL)
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


def test_envd_serves_the_unsandboxed_desktop_only_when_told_and_never_a_callers_workspace(tmp_path):
    """The desktop's xterm is a shell as envd's user: over RPC it is refused unless envd.unsandboxed_envs is set,
    and even then a workspace the caller names (a directory envd would create and run programs in) is refused."""
    opts = {"apps": "xterm", "width": "640", "height": "480", "settle_s": "0"}

    async def main():
        for env_id in ("desktop", "hybrid"):
            async with envd_client() as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.CreateSession(env_pb2.CreateSessionRequest(env_id=env_id, options=opts))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "envd.unsandboxed_envs" in e.value.details()
        async with envd_client(unsandboxed_envs=True) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.CreateSession(env_pb2.CreateSessionRequest(
                    env_id="desktop", options={**opts, "workspace": str(tmp_path / "chosen" / "dir")}))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "workspace" in e.value.details()
        assert not (tmp_path / "chosen").exists()

    run(main())


def test_a_killed_daemons_session_dir_is_removed_by_the_next_sweep():
    """A SIGKILLed envd closes nothing: the session's directory (Xauthority, logs, the workspace) stayed in /tmp for
    good. It now lives in the daemon's scratch root (envd/scratch.py), which the next daemon's start-up sweep
    removes."""
    d = dir_left_by_a_killed_daemon(
        "from envd import desktop\ne = desktop.DesktopEnv('', {'apps': 'xterm'})\ne.reset(1)\npath = e._dir")
    assert d.is_dir() and d.parent.name.startswith(scratch.PREFIX)
    assert d.parent in scratch.sweep() and not d.exists()
