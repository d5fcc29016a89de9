"""The `browser` backend against real Chromium: the envd compliance suite, every action kind on a test page, bad
actions, verifiers, the URL gate, isolated contexts, snapshots, a killed browser, and no Chromium left behind.

One Chromium serves the whole test process (envd.browser.HOST, kept across tests by its idle linger), so most tests
only open a context. The tests that kill or stop the browser run last.
"""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import grpc
import pytest

from envd.base import Action, ActionError, Outcome
from envd_compliance import EnvCompliance, envd_client, expect_code, run
from core.v1 import common_pb2, env_pb2

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                reason="Debian's chromium is not installed (scripts/setup.sh --dev installs it)")

from envd.browser import HOST, BrowserEnv  # noqa: E402
from envd.browser_host import BrowserGone, process_group  # noqa: E402

# Every widget sits at a fixed place so that tests can click points; events land in #log, keys in #keys.
PAGE = """<!doctype html><html><head><title>Test page</title><style>
  body { margin: 0; font: 14px sans-serif; } .a { position: absolute; }
</style></head><body>
<button class="a" style="left:10px;top:10px;width:100px;height:40px" onclick="count++; show()">Add</button>
<p id="count" class="a" style="left:130px;top:10px">count 0</p>
<form class="a" style="left:10px;top:60px" onsubmit="event.preventDefault();
  document.getElementById('sub').textContent = 'submitted ' + document.getElementById('name').value">
  <label>Name <input id="name"></label></form>
<p id="sub" class="a" style="left:10px;top:90px">not submitted</p>
<p id="keys" class="a" style="left:10px;top:120px">keys:</p>
<div id="pad" class="a" style="left:10px;top:160px;width:400px;height:100px;background:#ddd"></div>
<p id="log" class="a" style="left:10px;top:270px">log:</p>
<p id="scroll" class="a" style="left:10px;top:300px">scroll 0</p>
<button class="a" style="left:500px;top:10px">Twin</button><button class="a" style="left:600px;top:10px">Twin</button>
<button class="a" style="left:10px;top:1500px" onclick="document.getElementById('count').textContent='far'">Far</button>
<div style="height:4000px"></div>
<script>
  let count = 0;
  const MODS = ['Control', 'Shift', 'Alt', 'Meta'];
  const show = () => document.getElementById('count').textContent = 'count ' + count;
  const log = s => { const p = document.getElementById('log'); p.textContent += ' ' + s; };
  document.addEventListener('keydown', e => { if (e.target === document.body && !MODS.includes(e.key))
    document.getElementById('keys')
    .textContent += ' ' + (e.ctrlKey ? 'Control+' : '') + (e.shiftKey && e.key.length > 1 ? 'Shift+' : '') + e.key; });
  const pad = document.getElementById('pad');
  pad.addEventListener('mousedown', e => log(`down@${e.offsetX},${e.offsetY}`));
  pad.addEventListener('mouseup', e => log(`up@${e.offsetX},${e.offsetY}`));
  pad.addEventListener('dblclick', () => log('dblclick'));
  pad.addEventListener('contextmenu', e => { e.preventDefault(); log('contextmenu'); });
  addEventListener('scroll', () => document.getElementById('scroll').textContent = 'scroll ' + Math.round(scrollY));
</script></body></html>"""
ADD = [60, 30]  # the middle of the Add button


class _Site(http.server.BaseHTTPRequestHandler):
    """A loopback site: / shows its cookie and localStorage and sets both on "Set"."""

    BODY = b"""<!doctype html><title>Site</title><button onclick="document.cookie='sid=abc; path=/';
      localStorage.setItem('k', 'v'); show()">Set</button><p id="c"></p><script>
      function show() { document.getElementById('c').textContent =
        'cookie ' + (document.cookie || '(none)') + ' storage ' + (localStorage.getItem('k') || '(none)'); }
      show();</script>"""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Site)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture
def env():
    e = BrowserEnv({"html": PAGE, "width": "800", "height": "600", "settle_ms": "20"})
    e.reset(0, {})
    yield e
    e.close()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def poll(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        time.sleep(0.05)


# ---- the compliance suite over envd -------------------------------------------------------------------------------

class TestBrowserCompliance(EnvCompliance):
    env_id = "browser"
    options = {"html": PAGE, "max_steps": "3", "settle_ms": "0", "width": "800", "height": "600"}
    valid_action = {"type": "click", "point": ADD}
    invalid_action = {"type": "click", "point": [900, 10]}  # outside the 800x600 viewport
    max_episode_steps = 3

    def test_concurrent_sessions(self, n: int = 4):
        super().test_concurrent_sessions(n)  # 4 contexts in one browser: shows sharing, and stays inside the
        # suite's 10 s RPC deadline on a busy 2-core box


# ---- observation -------------------------------------------------------------------------------------------------

def test_observation_has_screenshot_and_accessibility_text(env):
    r = env.observe()
    assert r.outcome == Outcome.RUNNING and (r.width, r.height) == (800, 600)
    (shot,) = r.images
    assert shot.mime == "image/png" and png_size(shot.data) == (800, 600)
    assert r.text.startswith("url: about:blank\ntitle: Test page\n")
    assert '- button "Add"' in r.text and '- textbox "Name"' in r.text and "count 0" in r.text


def test_jpeg_screenshots_and_bounded_text():
    e = BrowserEnv({"html": PAGE, "format": "jpeg", "quality": "40", "width": "320", "height": "240",
                    "max_text_chars": "256", "boxes": "1"})
    try:
        r = e.reset(0, {})
        assert r.images[0].mime == "image/jpeg" and r.images[0].data[:3] == b"\xff\xd8\xff"
        assert len(r.text) <= 256 and "cut at 256" in r.text and "[box=" in r.text
    finally:
        e.close()


# ---- actions -----------------------------------------------------------------------------------------------------

def test_click_changes_the_page(env):
    assert "count 1" in env.step(Action("click", point=ADD)).text
    assert "count 2" in env.step(Action("click", target="Add")).text  # by accessible name
    r = env.step(Action("click", target="Far"))  # off-screen: scrolled into view first
    assert "far" in r.text and "scroll 0" not in r.text


def test_type_into_an_input_and_submit_with_enter(env):
    r = env.step(Action("type", target="Name", content="alice"))
    assert '- textbox "Name": alice' in r.text and "not submitted" in r.text
    r = env.step(Action("type", content=" smith\n"))  # focus stays in the field; \n presses Enter
    assert "submitted alice smith" in r.text


def test_hotkeys(env):
    r = env.step(Action("hotkey", key="ctrl a"))
    r = env.step(Action("hotkey", key="shift tab"))
    r = env.step(Action("hotkey", key="Up"))
    assert "keys: Control+a Shift+Tab" in r.text
    env.step(Action("type", target="Name", content="old"))
    env.step(Action("hotkey", key="ctrl+a"))  # select all in the field, then overwrite it
    r = env.step(Action("type", content="new"))
    assert '- textbox "Name": new' in r.text


def test_drag_double_and_right_click(env):
    r = env.step(Action("drag", point=[20, 170], end_point=[300, 240]))
    assert "down@10,10 up@290,80" in r.text
    r = env.step(Action("left_double", point=[100, 200]))
    assert "dblclick" in r.text
    r = env.step(Action("right_single", point=[100, 200]))
    assert "contextmenu" in r.text


def test_scroll(env):
    r = env.step(Action("scroll", point=[400, 300], direction="down"))
    assert "scroll 400" in r.text
    r = env.step(Action("scroll", direction="up"))  # no point: the middle of the viewport
    assert "scroll 0" in r.text


def test_bad_actions_are_rejected_and_change_nothing(env):
    env.step(Action("click", point=ADD))
    before = env.observe().text
    for bad in ({"type": "teleport"}, {"type": "click", "point": [800, 10]}, {"type": "click"},
                {"type": "hotkey", "key": "ctrl warp"}, {"type": "click", "target": "No such button"},
                {"type": "click", "target": "Twin"}, {"type": "scroll", "direction": "inward"},
                {"type": "drag", "point": [1, 1]}, {"type": "type", "content": ""},
                # 20,000 keys ran past the 30 s call deadline: INFRA_ERROR, the session gone (MAX_TYPE is 4096)
                {"type": "type", "content": "x" * 20000}):
        with pytest.raises(ActionError):
            env.step(Action(**bad))
    assert env.observe().text == before and env.steps == 1
    assert "count 2" in env.step(Action("click", point=ADD)).text  # and the session still works


def test_wait_finished_call_user_and_truncation():
    e = BrowserEnv({"html": PAGE, "max_steps": "2", "wait_ms": "50", "settle_ms": "0"})
    try:
        e.reset(0, {})
        t0 = time.monotonic()
        assert e.step(Action("wait")).outcome == Outcome.RUNNING and time.monotonic() - t0 >= 0.05
        assert e.step(Action("wait")).outcome == Outcome.TRUNCATED
        e.reset(0, {})
        r = e.step(Action("finished", content="done it"))
        assert (r.outcome, r.reward, r.info["answer"]) == (Outcome.TERMINATED, 0.0, "done it")
        e.reset(0, {})
        assert e.step(Action("call_user")).outcome == Outcome.TERMINATED
    finally:
        e.close()


# ---- verifier ----------------------------------------------------------------------------------------------------

def test_verify_js_gives_reward_and_ends_the_episode():
    e = BrowserEnv({"html": PAGE, "settle_ms": "0",
                    "verify_js": "({reward: count === 2 ? 1 : 0, done: count >= 2, count})"})
    try:
        e.reset(0, {})
        r = e.step(Action("click", point=ADD))
        assert (r.reward, r.outcome, r.info["verify"]["count"]) == (0.0, Outcome.RUNNING, 1)
        r = e.step(Action("click", point=ADD))
        assert (r.reward, r.outcome) == (1.0, Outcome.TERMINATED)
    finally:
        e.close()


@pytest.mark.parametrize("js", ["nosuchthing.reward", "42", "({reward: 'lots'})", "({reward: Infinity})"])
def test_broken_verifier_is_a_bad_option(js):
    e = BrowserEnv({"html": PAGE, "verify_js": js})
    try:
        with pytest.raises(ValueError, match="verify_js"):
            e.reset(0, {})
    finally:
        e.close()


def test_a_refused_reset_leaves_no_half_reset_episode():
    """A Reset refused for a broken verifier (INVALID_ARGUMENT) leaves no episode: no page, the last good options,
    and envd answers the next Step with "Reset it first" (on main the new page and verifier were already in place
    while envd still showed the old episode running, so the next Step failed as INFRA_ERROR)."""
    good = {"html": "<button>Old</button>", "verify_js": "({reward: 0, done: false})"}

    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="browser", options=good))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid))
            await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.Reset(env_pb2.ResetRequest(
                session_id=sid, options={"html": "<button>New</button>", "verify_js": "undefinedVar.x"})))
            env = c.server.servicer.sessions[sid].env
            assert env.page is None and env.context is None and env._raw == good and env.opts.verify_js == good["verify_js"]
            e = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, c.Step(env_pb2.StepRequest(
                session_id=sid, action=env_pb2.Action(type="click", target="Old"))))
            assert "Reset it first" in e.details()
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid))  # the session itself is fine
            assert r.outcome == common_pb2.RUNNING and "Old" in r.observation.text
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", target="Old")))
            assert r.outcome == common_pb2.RUNNING
    run(body())


# ---- URLs, contexts, snapshots -----------------------------------------------------------------------------------

def test_navigation_off_loopback_is_blocked():
    page = '<a href="http://203.0.113.9/x" style="position:absolute;left:0;top:0">out</a>'
    e = BrowserEnv({"html": page, "settle_ms": "100"})
    try:
        e.reset(0, {})
        r = e.step(Action("click", target="out"))
        assert "ERR_BLOCKED_BY_CLIENT" in r.text, r.text  # the gate's abort, not a network failure
    finally:
        e.close()
    with pytest.raises(ValueError, match="loopback"):
        BrowserEnv({"url": "http://203.0.113.9/"})


def test_contexts_are_isolated_and_snapshots_carry_cookies_and_storage(site):
    a, b, c = BrowserEnv({"url": site}), BrowserEnv({"url": site}), BrowserEnv({})
    try:
        a.reset(0, {})
        t = a.step(Action("click", target="Set")).text
        assert "cookie sid=abc storage v" in t, t
        t = b.reset(0, {}).text
        assert "cookie (none) storage (none)" in t, t  # another session: none of a's state
        snap = a.snapshot()
        assert json.loads(snap)["url"] == site
        r = c.restore(snap)
        assert "cookie sid=abc storage v" in r.text and r.step == 1, r.text
        t = b.reset(0, {}).text
        assert "cookie (none)" in t, t  # restoring into c did not leak into b either
    finally:
        for e in (a, b, c):
            e.close()


def test_bad_snapshots_are_rejected(env):
    good = json.loads(env.snapshot())
    cases = [b"not json", json.dumps({"format": "other"}).encode(),
             json.dumps({**good, "env": "games/snake"}).encode(),
             json.dumps({**good, "options": {"url": "https://example.com/"}}).encode(),
             json.dumps({**good, "url": "https://example.com/", "options": {}}).encode(),
             json.dumps({**good, "step": -1}).encode(), json.dumps({**good, "outcome": "infra_error"}).encode()]
    for state in cases:
        with pytest.raises(ValueError):
            env.restore(state)
    assert "count 0" in env.observe().text  # the session is as it was


# ---- the browser process -----------------------------------------------------------------------------------------

def _gone(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_killed_browser_ends_sessions_as_infra_error_and_next_session_relaunches():
    async def body():
        async with envd_client(gc_interval_s=0.05) as c:
            create = env_pb2.CreateSessionRequest(env_id="browser", options={"html": PAGE, "settle_ms": "0"})
            sid = (await c.CreateSession(create)).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid))
            pid, gen = HOST.browser_pid, HOST.generation
            assert pid and not _gone(pid)
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(poll, lambda: _gone(pid), 10.0, "the killed Chromium to exit")
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", point=ADD)))
            assert r.outcome == common_pb2.INFRA_ERROR and r.reward == 0.0
            assert json.loads(r.info_json)["op"] == "step"
            await expect_code(grpc.StatusCode.NOT_FOUND, c.Step(env_pb2.StepRequest(
                session_id=sid, action=env_pb2.Action(type="wait"))))
            sid2 = (await c.CreateSession(create)).session_id  # a new session launches a new browser
            await c.Reset(env_pb2.ResetRequest(session_id=sid2))
            r = await c.Step(env_pb2.StepRequest(session_id=sid2, action=env_pb2.Action(type="click", point=ADD)))
            assert r.outcome == common_pb2.RUNNING and "count 1" in r.observation.text
            assert HOST.generation == gen + 1 and HOST.browser_pid != pid
            await asyncio.to_thread(poll, lambda: not process_group(pid), 10.0, "the old Chromium's group to empty")
    run(body())


def test_a_killed_playwright_driver_is_replaced_by_the_next_session():
    """The node driver dies (Chromium exits with it, yet Browser.is_connected() stays True): the session on it fails
    its next step as a dead browser, and the next session starts a new driver and browser (on main every later
    session failed with TargetClosedError until the daemon restarted)."""
    a = BrowserEnv({"html": PAGE, "settle_ms": "0"})
    try:
        a.reset(0, {})
        driver, pid, gen = HOST.driver_pid, HOST.browser_pid, HOST.generation
        assert driver and pid
        os.kill(driver, signal.SIGKILL)
        poll(lambda: _gone(driver) and not process_group(pid), 10.0, "the driver and its Chromium to exit")
        with pytest.raises(BrowserGone):
            a.step(Action("click", point=ADD))
    finally:
        a.close()
    b = BrowserEnv({"html": PAGE, "settle_ms": "0"})
    try:
        b.reset(0, {})
        assert "count 1" in b.step(Action("click", point=ADD)).text
        assert HOST.generation == gen + 1 and HOST.driver_pid not in (None, driver) and not _gone(HOST.driver_pid)
    finally:
        b.close()


def test_target_closed_on_a_new_context_counts_as_a_dead_browser(monkeypatch):
    """new_context failing with TargetClosedError (the browser went away under it) is BrowserGone, and the next
    session gets a new browser instead of the same dead one."""
    from playwright._impl._errors import TargetClosedError

    e = BrowserEnv({"html": PAGE})
    try:
        gen = e.generation

        async def closed(**_):
            raise TargetClosedError()

        monkeypatch.setattr(e.browser, "new_context", closed)
        with pytest.raises(BrowserGone):
            e.reset(0, {})
    finally:
        e.close()
    monkeypatch.undo()
    e2 = BrowserEnv({"html": PAGE})
    try:
        assert "count 0" in e2.reset(0, {}).text and e2.generation == gen + 1
    finally:
        e2.close()


def test_no_chromium_left_after_daemon_stop(monkeypatch):
    monkeypatch.setattr(HOST, "linger_s", 0.2)  # the idle close that follows the last session's close

    async def body():
        async with envd_client() as c:
            for _ in range(3):
                sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                    env_id="browser", options={"html": PAGE}))).session_id
                await c.Reset(env_pb2.ResetRequest(session_id=sid))
            return HOST.browser_pid, HOST.driver_pid

    pid, driver = run(body())  # the daemon stops with three sessions open
    assert pid and driver
    poll(lambda: not process_group(pid) and _gone(driver), 20.0, "Chromium and the driver to exit")
    assert HOST.users == 0


def test_no_chromium_left_when_the_daemon_process_is_killed():
    script = ("import time; from envd.browser import BrowserEnv, HOST\n"
              "e = BrowserEnv({'html': '<p>x</p>'}); e.reset(0, {})\n"
              "print(HOST.browser_pid, HOST.driver_pid, flush=True); time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        pid, driver = map(int, line.split())
        assert process_group(pid)
    finally:
        p.kill()
        p.wait(10)
    poll(lambda: not process_group(pid) and _gone(driver), 20.0, "Chromium and the driver to exit after SIGKILL")


def test_shutdown_closes_everything_and_a_later_session_starts_again():
    e = BrowserEnv({"html": PAGE})
    e.reset(0, {})
    pid = HOST.browser_pid
    HOST.shutdown()
    assert not process_group(pid)
    with pytest.raises(Exception):
        e.step(Action("click", point=ADD))  # the session's browser is gone: an infrastructure error
    e.close()
    e2 = BrowserEnv({"html": PAGE})
    try:
        assert "count 1" in (e2.reset(0, {}), e2.step(Action("click", point=ADD)))[1].text
    finally:
        e2.close()



def test_a_hung_page_call_frees_its_worker_at_envds_deadline():
    """A page call that hangs (a click runs an endless script) with the session's timeout_s far above envd's step
    deadline: envd answers INFRA_ERROR at its deadline, and the worker thread is back then too (it waited for the
    page up to timeout_s, 600 s here, keeping a worker from every other session)."""
    hang = ('<button style="position:absolute;left:0;top:0;width:100px;height:40px" '
            'onclick="while (true) {}">Hang</button>')

    async def body():
        async with envd_client(step_timeout_s=3.0, gc_interval_s=0.05) as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="browser", options={"html": hang, "timeout_s": "600", "settle_ms": "0"}))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid))
            t0 = time.monotonic()
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="click", point=[50, 20])))
            assert r.outcome == common_pb2.INFRA_ERROR and "took longer" in json.loads(r.info_json)["error"], r
            workers = c.server.servicer.workers
            deadline = time.monotonic() + 30.0
            while workers.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert workers.running == 0, f"a worker still waits on the hung page {time.monotonic() - t0:.0f}s later"
            # and the daemon serves new sessions
            sid2 = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="browser", options={"html": PAGE}))).session_id
            assert (await c.Reset(env_pb2.ResetRequest(session_id=sid2))).outcome == common_pb2.RUNNING
    run(body())
