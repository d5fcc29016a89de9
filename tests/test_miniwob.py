"""The miniwob backend: UI-TARS -> MiniWoB action mapping (pure), the envd compliance suite over a real server with
real Chromium, the DOM oracle solving tasks, bad actions leaving the page alone, a killed browser as infra_error,
and no browser processes left after close or daemon stop. Browsers are started sparingly (one per test at most,
module-scoped where tests can share one)."""
from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import grpc
import pytest

from envd import proctree, registry, scratch
from envd.base import Action, ActionError, Outcome
from envd_compliance import EnvCompliance, dir_left_by_a_killed_daemon, envd_client, expect_code, run
from core.v1 import common_pb2, env_pb2

pytest.importorskip("miniwob", reason="the miniwob package is not installed")
from envd import miniwob_chromium  # noqa: E402

if miniwob_chromium.missing():
    pytest.skip(f"{', '.join(miniwob_chromium.missing())} needed (scripts/setup.sh --dev)", allow_module_level=True)

from envd import miniwob_backend  # noqa: E402
from envd.miniwob_actions import Element, Translator, miniwob_key, render, resolve_target  # noqa: E402


def _session_gone(env, deadline_s: float = 30.0) -> set[int]:  # Chromium exiting on a loaded host
    """Poll until nothing of `env`'s browser runs; returns what is left at the deadline."""
    pid, workdir = env.browser.last_init_pid, env._dir
    deadline = time.monotonic() + deadline_s
    while True:
        left = proctree.session_processes(pid, {pid}, needle=workdir)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---- pure mapping -------------------------------------------------------------------------------------------

def _translator(preset: str = "all_supported") -> Translator:
    from miniwob.action import ActionSpaceConfig

    cfg = ActionSpaceConfig.get_preset(preset)
    cfg.screen_width, cfg.screen_height = 160, 210
    return Translator(cfg, cfg.get_action_space(), 160, 210)


PAGE = [
    Element(ref=4, tag="button", text="Ok", value=None, left=2, top=74, width=34, height=21),
    Element(ref=5, tag="input_text", text="", value="", left=17, top=100, width=128, height=21),
    Element(ref=6, tag="button", text="3", value=None, left=40, top=74, width=20, height=21),
    Element(ref=-1, tag="t", text="label text", value=None, left=10, top=150, width=50, height=11, parent=7),
    Element(ref=8, tag="div", text="", value=None, left=-5000, top=0, width=10, height=10, leaf=False),
]


def test_keys_map_to_miniwob_syntax():
    assert miniwob_key("ctrl c") == "C-c" and miniwob_key("Ctrl+A") == "C-A" and miniwob_key("enter") == "<Enter>"
    assert miniwob_key("shift a") == "A" and miniwob_key("pagedown") == "<PageDown>" and miniwob_key("x") == "x"
    for bad in ("", "ctrl", "hyper x", "notakey"):
        with pytest.raises(ActionError):
            miniwob_key(bad)


def test_targets_resolve_by_ref_then_text():
    assert resolve_target(PAGE, "[4]").ref == 4 and resolve_target(PAGE, "ref=5").ref == 5
    assert resolve_target(PAGE, "Ok").ref == 4
    assert resolve_target(PAGE, "3").ref == 6  # a bare number is text first: buttons labelled "3" exist
    assert resolve_target(PAGE, "5").ref == 5  # ... and a ref when no text matches
    assert resolve_target(PAGE, "label  text").ref == -1
    for bad in ("[99]", "Cancel", "  ", "[" + "1" * 5000 + "]", "9" * 5000):   # a ValueError of int() before
        with pytest.raises(ActionError):
            resolve_target(PAGE, bad)


@pytest.mark.parametrize("option, value", [("command_timeout_s", "inf"), ("command_timeout_s", "1e12"),
                                           ("command_timeout_s", "nan"), ("episode_time_s", "inf"),
                                           ("max_text_chars", "99999999999999999999")])
def test_unbounded_options_are_refused(option, value):
    """An infinite or huge time raised OverflowError in Selenium or in int() (INTERNAL at CreateSession), and a
    large finite command timeout let one hung WebDriver command hold an envd worker for days."""
    with pytest.raises(ValueError, match=option):
        miniwob_backend.parse_options({option: value})


def test_actions_translate_to_the_action_space():
    tr = _translator()
    kinds = lambda out: [tr.types[a["action_type"]] for a in out]  # noqa: E731
    assert kinds(tr.translate(Action("click", target="Ok"), PAGE)) == ["CLICK_ELEMENT"]
    click_text = tr.translate(Action("click", target="label text"), PAGE)  # a text run is clicked where it is
    assert kinds(click_text) == ["CLICK_COORDS"] and list(click_text[0]["coords"]) == [35.0, 155.5]
    assert kinds(tr.translate(Action("left_double", point=[3, 4]), PAGE)) == ["DBLCLICK_COORDS"]
    assert kinds(tr.translate(Action("drag", point=[1, 2], end_point=[50, 60]), PAGE)) == [
        "MOUSEDOWN_COORDS", "MOVE_COORDS", "MOUSEUP_COORDS"]
    typed = tr.translate(Action("type", content="a" * 70 + "\nb"), PAGE)  # 64-char chunks, Enter between lines
    assert kinds(typed) == ["TYPE_TEXT", "TYPE_TEXT", "PRESS_KEY", "TYPE_TEXT"]
    assert [a["text"] for a in typed if tr.types[a["action_type"]] == "TYPE_TEXT"] == ["a" * 64, "a" * 6, "b"]
    into = tr.translate(Action("type", target="[5]", content="hi\n"), PAGE)
    assert kinds(into) == ["FOCUS_ELEMENT_AND_TYPE_TEXT", "PRESS_KEY"] and into[0]["ref"] == 5
    assert kinds(tr.translate(Action("hotkey", key="ctrl a"), PAGE)) == ["PRESS_KEY"]
    assert kinds(tr.translate(Action("scroll", direction="down"), PAGE)) == ["SCROLL_DOWN_COORDS"]
    assert kinds(tr.translate(Action("wait"), PAGE)) == ["NONE"]
    for bad in ({"type": "right_single", "point": [1, 1]}, {"type": "finished"}, {"type": "teleport"},
                {"type": "click", "point": [161, 5]}, {"type": "click"}, {"type": "scroll", "direction": "left"},
                {"type": "hotkey", "key": "ctrl shift t"}, {"type": "type", "content": ""},
                {"type": "type", "target": "label text", "content": "x"}, {"type": "drag", "point": [1, 1]}):
        with pytest.raises(ActionError):
            tr.translate(Action(**bad), PAGE)
    # A type() is bounded: 20,000 characters took 35 s through Selenium, so a longer one ran past the step deadline
    # (INFRA_ERROR) and kept typing in its worker thread.
    assert len(tr.translate(Action("type", content="a" * 4096), PAGE)) == 64
    with pytest.raises(ActionError, match="4097 characters; at most 4096 per type"):
        tr.translate(Action("type", content="a" * 4097), PAGE)
    # A narrower preset rejects what it cannot express.
    liu = _translator("liu18")
    with pytest.raises(ActionError, match="no CLICK_COORDS"):
        liu.translate(Action("click", point=[5, 5]), PAGE)
    assert [liu.types[a["action_type"]] for a in liu.translate(Action("click", target="Ok"), PAGE)] == ["CLICK_ELEMENT"]


def test_render_is_bounded_and_skips_offscreen_and_containers():
    text = render(PAGE, 10_000)
    assert '[4] button "Ok" @(2,74 34x21)' in text and 't "label text"' in text and "[8]" not in text
    many = [Element(ref=i, tag="button", text=f"b{i}", value=None, left=0, top=0, width=5, height=5) for i in range(1, 500)]
    short = render(many, 300)
    assert len(short) <= 360 and "more elements not shown" in short


def test_a_long_real_page_is_pruned_to_what_is_visible_and_clipped_with_a_marker():
    """social-media's feed runs far below the 160x210 task area, with spacer decorations between the names: the
    listing keeps the visible, text-bearing and clickable elements (the tweets' icons) and counts the rest in one
    line; a character budget cuts it with a marker, and the actor's token budget clips the text with one too (on
    main the whole feed was listed, spacers included, ~2,600 characters)."""
    env = miniwob_backend.make("social-media")
    try:
        r = env.reset(3)
        elements = env._elements
    finally:
        env.close()
    body = r.text.split("\n")[1:]
    listed = [line for line in body if line.startswith("[")]
    tops = [int(m.group(1)) for line in listed if (m := re.search(r"@\(-?\d+,(-?\d+) ", line))]
    assert listed and len(tops) == len(listed) and max(tops) < 210, r.text          # only what is in view
    assert re.fullmatch(r"\((\d+) more elements outside the visible area: scroll to reach them\)", body[-1]), body[-1]
    assert ".spacer" not in r.text and ".more" in r.text and "@" in r.text          # decorations out, icons in
    assert len(r.text) < 1200 and sum(e.top >= 210 for e in elements) > 20
    short = render(elements, 300, 160, 210)
    assert len(short) <= 400 and re.search(r"\.\.\. \(\d+ more elements not shown\)", short)
    from actor.tiny import clip_observation
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    clipped = clip_observation(tok, r.text, 48)
    assert re.search(r"\[observation clipped: \d+ tokens, the first ~48 shown\]$", clipped), clipped
    assert len(tok.encode(clipped)) <= 56 and r.text.startswith(clipped.split("\n")[0])
    assert clip_observation(tok, r.text, 0) == r.text == clip_observation(tok, r.text, 10_000)


def test_all_tasks_are_listed():
    names = miniwob_backend.task_names()
    assert len(names) == 128 and "click-button" in names and "flight.AA" in names
    ids = registry.list_env_ids()
    assert sum(i.startswith("miniwob/") for i in ids) == 128 and "miniwob/click-button" in ids


def test_bad_ids_and_options_fail_before_a_browser_starts():
    with pytest.raises(KeyError):
        registry.make("miniwob/no-such-task", {})
    for opts in ({"action_space": "nope"}, {"max_steps": "x"}, {"data_mode": "dev"}):
        with pytest.raises(ValueError):
            registry.make("miniwob/click-button", opts)


# ---- real browser ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def enter_text():
    env = miniwob_backend.make("enter-text")
    yield env
    env.close()
    assert not _session_gone(env) and not os.path.exists(env._dir)


def test_coordinates_typing_and_rejected_actions(enter_text):
    env = enter_text
    r = env.reset(7)
    assert r.width == 160 and r.height == 210 and r.images[0].data.startswith(b"\x89PNG")
    word = re.search(r'"(.+)"', r.instruction).group(1)
    m = re.search(r"\[(\d+)\] input_text #tt @\((\d+),(\d+) (\d+)x(\d+)\)", r.text)
    assert m, r.text
    x, y = int(m.group(2)) + int(m.group(4)) // 2, int(m.group(3)) + int(m.group(5)) // 2
    r = env.step(Action("click", point=[x, y]))
    assert "focused" in r.text and r.outcome == "running"
    # Rejected actions change nothing: same page, same step count, and the episode goes on.
    for bad in ({"type": "right_single", "point": [x, y]}, {"type": "click", "point": [x, 999]},
                {"type": "hotkey", "key": "ctrl t"}, {"type": "click", "target": "[999]"}):
        with pytest.raises(ActionError):
            env.step(Action(**bad))
    assert env.observe().text == r.text and env.observe().step == 1
    r = env.step(Action("type", content=word))
    assert f'value="{word}"' in r.text
    r = env.step(Action("click", target="Submit"))
    assert r.outcome == "terminated" and r.info["success"] and r.info["raw_reward"] == 1.0
    assert 0 < r.reward <= 1.0  # MiniWoB's time-decayed reward
    with pytest.raises(ActionError, match="over"):
        env.step(Action("wait"))
    # The ended episode's page is parked on a blank page (no task timers run in an idle session); what comes after
    # the end is the last result, and the next Reset plays from the task page.
    assert _page(env) == "about:blank" and env.observe() is r


def _page(env) -> str:
    return env.gym.unwrapped.instance.driver.current_url


def test_wrong_answer_fails_and_max_steps_truncates(enter_text):
    env = enter_text
    env.reset(8)
    assert _page(env).endswith("enter-text.html")
    r = env.step(Action("type", target="[5]", content="definitely wrong"))
    r = env.step(Action("click", target="Submit"))
    assert r.outcome == "terminated" and not r.info["success"] and r.reward < 0
    assert _page(env) == "about:blank"
    r = env.reset(9, {"max_steps": "2"})
    r = env.step(Action("wait"))
    assert r.outcome == "running" and _page(env).endswith("enter-text.html")
    r = env.step(Action("wait"))
    assert r.outcome == "truncated" and r.reward == 0.0 and _page(env) == "about:blank"
    env.reset(10, {"max_steps": "0"})
    r = env.step(Action("type", target="[5]", content="x"))
    assert r.outcome == "running" and 'value="x"' in r.text  # a parked session plays its next episode as a new one


def _episode_ms(env) -> int:
    return env.gym.unwrapped.instance.driver.execute_script("return core.EPISODE_MAX_TIME;")


def test_episode_time_from_create_session_holds_for_every_reset():
    """episode_time_s given at CreateSession (how the actor passes env_options; its Resets carry no options) is the
    session's limit; one given to a Reset holds for that episode only (on main the CreateSession value was never
    applied, and a Reset's value stayed on the page for later Resets)."""
    env = miniwob_backend.make("click-test", {"episode_time_s": "600"})
    try:
        env.reset(1)
        assert _episode_ms(env) == 600_000
        env.reset(2, {"episode_time_s": "30"})
        assert _episode_ms(env) == 30_000
        env.reset(3)
        assert _episode_ms(env) == 600_000
        env.reset(4, {"episode_time_s": "0"})    # 0: the task's own limit
        assert _episode_ms(env) == 10_000
    finally:
        env.close()


def test_a_reused_session_starts_an_episode_like_a_new_one():
    """choose-date: an episode that opened the datepicker (which covers Submit), then a Reset to the same seed,
    shows exactly what a new session shows for that seed: element list and screenshot (on main the page was reused
    and the calendar stayed open)."""
    env = miniwob_backend.make("choose-date", {"episode_time_s": "600"})
    try:
        fresh = env.reset(7)
        field = next(e for e in env._elements if e.ref > 0 and e.tag.startswith("input_text"))
        opened = env.step(Action("click", target=f"[{field.ref}]"))
        assert "Prev" in opened.text and "Prev" not in fresh.text  # the calendar is open
        reused = env.reset(7)
        assert reused.text == fresh.text
        assert reused.images[0].data == fresh.images[0].data
    finally:
        env.close()


@pytest.mark.parametrize("task", ["click-button", "click-checkboxes", "login-user"])
def test_oracle_solves_tasks(task):
    env = miniwob_backend.make(task)
    try:
        for seed in range(3):
            r, steps = env.reset(seed), 0
            while r.outcome == "running" and steps < 10:
                r, steps = env.step(env.oracle_action()), steps + 1
            assert r.outcome == "terminated" and r.info["success"], (task, seed, r.instruction, r.info)
    finally:
        env.close()


def test_a_killed_daemons_session_dir_is_removed_by_the_next_sweep():
    """A SIGKILLed envd closes nothing: the session's private directory (profile, caches) stayed in /tmp for good.
    It now lives in the daemon's scratch root (envd/scratch.py), which the next daemon's start-up sweep removes."""
    d = dir_left_by_a_killed_daemon(
        "from envd import miniwob_backend\ne = miniwob_backend.make('click-test', {})\ne.reset(1)\npath = e._dir")
    assert d.is_dir() and d.parent.name.startswith(scratch.PREFIX)
    assert d.parent in scratch.sweep() and not d.exists()


# ---- over a real envd -----------------------------------------------------------------------------------------

def _click_asked_button(obs) -> dict:
    m = re.search(r'Click on the "(.+)" button', obs.instruction)
    return {"type": "click", "target": m.group(1)} if m else {"type": "wait"}


class TestMiniWoBCompliance(EnvCompliance):
    env_id = "miniwob/click-button"
    valid_action = staticmethod(_click_asked_button)
    invalid_action = {"type": "right_single", "point": [5, 5]}
    max_episode_steps = 3

    def client(self, **overrides):
        return envd_client(gc_interval_s=0.05, step_timeout_s=60.0, **overrides)

    def test_concurrent_sessions(self):
        super().test_concurrent_sessions(n=2)  # each session is a browser: keep the machine usable


def _chromium_main(env) -> int:
    for pid in proctree.descendants({env.browser.pid}):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"chromium") and not any(a.startswith(b"--type=") for a in argv):
            return pid
    raise AssertionError("no chromium under chromedriver")


def test_killed_browser_is_infra_error_and_nothing_outlives_the_daemon():
    async def body():
        async with envd_client(gc_interval_s=0.05) as c:
            # Starting Chromium is the slow part: a generous deadline, so a loaded machine does not fail the test.
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="miniwob/click-button"), timeout=60)).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1), timeout=60)
            env = c.server.servicer.sessions[sid].env
            os.kill(_chromium_main(env), signal.SIGKILL)
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="wait")))
            assert r.outcome == common_pb2.INFRA_ERROR and "error" in r.info_json
            await expect_code(grpc.StatusCode.NOT_FOUND, c.Step(env_pb2.StepRequest(
                session_id=sid, action=env_pb2.Action(type="wait"))))
            assert not await asyncio.to_thread(_session_gone, env)
            # The daemon keeps serving: a new session works, and is still open when the daemon stops.
            sid2 = (await c.CreateSession(env_pb2.CreateSessionRequest(env_id="miniwob/click-button"), timeout=60)).session_id
            r = await c.Reset(env_pb2.ResetRequest(session_id=sid2, seed=2), timeout=60)
            assert r.outcome == common_pb2.RUNNING and r.observation.width == 160
            return c.server.servicer.sessions[sid2].env
        # (leaving the block stops the daemon)

    live = run(body(), timeout=180)
    assert not _session_gone(live) and not os.path.exists(live._dir)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""   # gone since it was listed


def test_chromedriver_is_reachable_only_through_the_sessions_socket():
    """chromedriver has no authentication: on the host's loopback any local user could open a WebDriver session on
    it and start a program of their choice as envd's user. It listens in the sandbox's own network namespace, and the
    one way in is the session's Unix socket, which only the session's uid (and root) may open."""
    env = miniwob_backend.make("click-test")
    try:
        env.reset(1)
        table = proctree.snapshot()
        inside = proctree.descendants({env.browser.pid}, table)
        drivers = [p for p in inside if _comm(p) == "chromedriver"]
        assert len(drivers) == 1
        assert os.readlink(f"/proc/{drivers[0]}/ns/net") != os.readlink("/proc/self/ns/net")
        home, sock = env.browser.home, env.browser.socket_path
        assert stat.S_IMODE(os.stat(home).st_mode) == 0o700 and stat.S_ISSOCK(os.stat(sock).st_mode)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        if os.getuid() == 0:   # another local user (nobody) cannot connect to the socket
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "socat", "-u",
                                "OPEN:/dev/null", f"UNIX-CONNECT:{sock}"], capture_output=True, text=True, timeout=30)
            assert r.returncode != 0 and "Permission denied" in r.stderr, r
        else:
            assert os.stat(home).st_uid == os.getuid()
    finally:
        env.close()
    assert not os.path.exists(env._dir)


def test_a_chromedriver_that_cannot_start_says_why(monkeypatch):
    """A chromedriver that exits at start ends its sandbox: the start fails at once with what it printed, not at
    the deadline with Selenium's bare message."""
    from selenium.common.exceptions import WebDriverException

    from envd.miniwob_chromium import ChromiumProcess

    d = tempfile.mkdtemp(prefix="tars-test-driver-", dir="/tmp")   # a directory a root daemon's sandbox uid reaches
    try:
        os.chmod(d, 0o755)
        fake = os.path.join(d, "chromedriver")
        with open(fake, "w") as f:
            f.write("#!/bin/bash\necho 'error while loading shared libraries: libnss3.so'\nexit 1\n")
        os.chmod(fake, 0o755)
        monkeypatch.setenv("MINIWOB_CHROMEDRIVER", fake)
        work = os.path.join(d, "session")
        os.mkdir(work, 0o700)
        browser = ChromiumProcess(work, 600)
        with pytest.raises(WebDriverException, match="exited at start; chromedriver said: error while loading shared"):
            browser.start((160, 210))
        assert browser.pid == 0 and not proctree.session_processes(0, set(), needle=work)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_root_daemons_sandbox_reads_a_copy_of_pages_it_cannot_reach(monkeypatch):
    """A root daemon's sandbox runs as a uid that may not pass the directories above the package (a venv under
    /root): it then gets a world-readable copy of the pages in the daemon's scratch, made once."""
    from miniwob.selenium_instance import HTML_DIR

    assert miniwob_chromium.pages_dir(None) == str(HTML_DIR)
    monkeypatch.setattr(miniwob_chromium, "unreachable", lambda path: "/root")
    copy = miniwob_chromium.pages_dir(2_000_000_123)
    assert copy != str(HTML_DIR) and pathlib.Path(copy).parent == scratch.root()
    assert miniwob_chromium.pages_dir(2_000_000_123) == copy
    want = sorted(str(p.relative_to(HTML_DIR)) for p in pathlib.Path(HTML_DIR).rglob("*"))
    got = list(pathlib.Path(copy).rglob("*"))
    assert sorted(str(p.relative_to(copy)) for p in got) == want
    assert all(stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644) for p in got)
    page = "miniwob/click-button.html"
    assert (pathlib.Path(copy) / page).read_bytes() == (pathlib.Path(HTML_DIR) / page).read_bytes()


def test_flight_pages_are_served_to_sandboxes_only():
    """FlightWoB pages come from envd's page server on a Unix socket (mode 0666, as a root daemon's sandbox uids must
    connect): a flight session's sandbox gets its page through it, and another local user's connection is closed
    unanswered (SO_PEERCRED), where before it was served."""
    env = miniwob_backend.make("flight.AA")
    try:
        r = env.reset(1)
        assert r.outcome == Outcome.RUNNING and "[" in r.text and len(r.text) > 200, r.text[:500]
        sock, request = miniwob_backend.flight_socket(), "GET /flight/AA/wrapper.html HTTP/1.0\r\n\r\n"
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(sock)
            s.sendall(request.encode())
            assert s.recv(64).startswith(b"HTTP/1.0 200")
        if os.getuid() == 0:
            out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "socat", "-t", "5",
                                  "-", f"UNIX-CONNECT:{sock}"], input=request, capture_output=True, text=True,
                                 timeout=30)
            assert out.stdout == "", out.stdout[:200]
    finally:
        env.close()
