"""The terminal backend: actions, transcript, tasks and their verifiers, snapshots, and the compliance suite."""
from __future__ import annotations

import io
import json
import os
import pathlib
import random
import tarfile
import time

import pytest

from envd import terminal_tasks, workspace_archive
from envd.base import Action, ActionError, Outcome
from envd.sandbox import missing_tools
from envd.terminal import TerminalEnv, clean_terminal_text
from envd_compliance import EnvCompliance

needs_sandbox = pytest.mark.skipif(bool(missing_tools()), reason=f"sandbox tools missing: {missing_tools()}")


def typed(env: TerminalEnv, content: str):
    return env.step(Action("type", content=content))


def finish_running(env: TerminalEnv):
    r = None
    deadline = time.monotonic() + 30
    while env.state == "running" and time.monotonic() < deadline:
        r = env.step(Action("wait"))
    return r


@pytest.fixture
def env():
    e = TerminalEnv(options={"timeout_s": "10", "wait_s": "5", "max_steps": "200"})
    e.reset(3, {})
    yield e
    e.close()


def test_clean_terminal_text():
    assert clean_terminal_text("\x1b[31mred\x1b[0m plain") == "red plain"
    assert clean_terminal_text("10%\r50%\r100%\ndone") == "100%\ndone"
    assert clean_terminal_text("abc\b\bX") == "aX"
    assert clean_terminal_text("a\x07b\x00c\tt") == "abc\tt"


@needs_sandbox
def test_command_transcript_and_line_buffer(env):
    r = typed(env, "echo one; false")
    assert r.text.endswith("/workspace$ echo one; false") and env.state == "prompt"   # typed, not submitted
    r = typed(env, "\n")
    assert "/workspace$ echo one; false\none\n[exit 1]\n/workspace$ " in r.text
    assert r.info["exit_status"] == 1 and r.outcome == Outcome.RUNNING and r.step == 2
    r = typed(env, "mkdir -p sub && cd sub\npwd\n")
    assert "/workspace/sub\n[exit 0]\n/workspace/sub$ " in r.text and r.info["cwd"] == "/workspace/sub"
    r = typed(env, "for i in 1 2\ndo echo n$i\ndone\n")        # a construct over several lines (PS2)
    assert "> do echo n$i\n> done\nn1\nn2\n[exit 0]" in r.text
    r = env.step(Action("hotkey", key="enter"))           # an empty line is a command too
    assert r.text.endswith("/workspace/sub$ ")


@needs_sandbox
def test_running_command_wait_input_and_interrupt(env):
    r = typed(env, "sleep 1.5; echo late\n")                    # within wait_s: the step returns at the prompt
    assert "late\n[exit 0]" in r.text
    env.close()
    env = TerminalEnv(options={"wait_s": "0.3"})
    env.reset(0, {})
    r = typed(env, "sleep 3; echo slow\n")                      # still running when the 0.3 s wait ends, on any host
    assert env.state == "running" and r.text.endswith("echo slow\n[running: wait() for more output, "
                                                      "hotkey(key='ctrl c') to interrupt; killed after 30s]")
    assert finish_running(env) and "slow\n[exit 0]" in env.render()
    r = typed(env, "read name; echo hello $name\n")
    assert env.state == "running"
    r = typed(env, "ada\n")                                      # goes to the program waiting for input
    finish_running(env)
    assert "hello ada\n[exit 0]" in env.render()
    typed(env, "cat\n")
    r = typed(env, "abc\n")
    assert r.text.endswith("abc\nabc\n[running: wait() for more output, hotkey(key='ctrl c') to interrupt; killed "
                           "after 30s]")                        # typed (echoed by us), then cat's copy
    r = env.step(Action("hotkey", key="ctrl d"))           # end of input: cat exits
    assert env.state == "prompt" and r.text.endswith("abc\n[exit 0]\n/workspace$ ")
    assert env.step(Action("hotkey", key="ctrl l")).text == "/workspace$ "
    typed(env, "sleep 30\n")
    r = env.step(Action("hotkey", key="Ctrl+C"))
    assert env.state == "prompt" and "^C" in r.text and "[exit 130]" in r.text
    r = typed(env, "partial text")
    r = env.step(Action("hotkey", key="ctrl c"))
    assert r.text.endswith("/workspace$ ") and "partial text^C" in r.text
    env.close()


@needs_sandbox
def test_bad_actions_leave_the_session_unchanged(env):
    typed(env, "echo before\n")
    before = env.observe()
    for bad in ({"type": "click", "point": [3, 4]}, {"type": "type"}, {"type": "type", "content": ""},
                {"type": "type", "content": "echo \x1b[A\n"}, {"type": "type", "content": "x" * 5000 + "\n"},
                {"type": "type", "content": "y" * 20000}, {"type": "hotkey", "key": "alt f4"},
                {"type": "scroll", "direction": "down"}, {"type": "teleport"}):
        with pytest.raises(ActionError):
            env.step(Action(**bad))
        after = env.observe()
        assert (after.text, after.step) == (before.text, before.step), bad
    assert "ok\n[exit 0]" in typed(env, "echo ok\n").text


@needs_sandbox
def test_lines_queued_behind_a_running_command_are_bounded():
    """Lines typed while a command runs and others wait are queued for the shell. The queue had no bound: 100 steps
    of 8192 short lines each queued 819,202 lines in the daemon (10,000 steps, the max_steps ceiling, would hold
    gigabytes). At most MAX_CONTENT characters may now wait; more is an ActionError and the session is unchanged."""
    e = TerminalEnv(options={"timeout_s": "60", "wait_s": "1", "max_steps": "1000"})
    try:
        e.reset(3, {})
        typed(e, "sleep 60\necho first\n")
        assert e.state == "running" and e.queued == ["echo first"]
        typed(e, "true\n" * 1000)                    # 5,011 characters wait: fine
        assert len(e.queued) == 1001
        before = e.observe()
        with pytest.raises(ActionError, match="would wait for the shell; at most 16384"):
            typed(e, "x\n" * 6000)
        after = e.observe()
        assert (after.text, after.step, len(e.queued)) == (before.text, before.step, 1001)
        e.step(Action("hotkey", key="ctrl c"))         # the queue goes with the interrupted command line
        finish_running(e)
        assert e.queued == []
        typed(e, "echo hi\n")
        finish_running(e)
        assert "echo hi\nhi\n[exit 0]" in e.transcript
    finally:
        e.close()


@needs_sandbox
def test_exit_starts_a_new_shell_in_the_same_workspace(env):
    typed(env, "mkdir d; cd d; echo kept > f\n")
    r = typed(env, "exit 7\n")
    assert "[the shell exited (status 7); a new shell started]" in r.text and r.outcome == Outcome.RUNNING
    r = typed(env, "pwd; cat f\n")
    assert "/workspace/d\nkept\n[exit 0]" in r.text


@needs_sandbox
def test_a_shell_leaving_its_cwd_or_workspace_unenterable_is_replaced_not_an_infra_error(env):
    """bwrap could not chdir into a directory the shell had chmod 000'ed before it exited: the new shell did not start
    (SandboxError: the session ended as INFRA_ERROR), and with the workspace itself so, a Reset failed too."""
    typed(env, "mkdir d && cd d\n")
    r = typed(env, "chmod 000 . && exit\n")
    assert "a new shell started]" in r.text and r.outcome == Outcome.RUNNING and r.info["cwd"] == "/workspace"
    r = typed(env, "chmod 000 /workspace && exit\n")
    assert "a new shell started]" in r.text and r.outcome == Outcome.RUNNING
    assert "/workspace\n[exit 0]" in typed(env, "pwd\n").text
    typed(env, "chmod 000 /workspace\n")
    r = env.reset(4, {})
    assert r.outcome == Outcome.RUNNING and "/workspace\n[exit 0]" in typed(env, "pwd\n").text


@needs_sandbox
def test_open_shell_ends_on_finished_or_max_steps():
    e = TerminalEnv(options={"max_steps": "2"})
    try:
        r = e.reset(0, {})
        assert r.instruction == "" and r.outcome == Outcome.RUNNING
        r = typed(e, "true\n")
        r = typed(e, "true\n")
        assert r.outcome == Outcome.TRUNCATED and r.reward == 0.0
        with pytest.raises(ActionError):
            typed(e, "true\n")
        e.reset(1, {})
        r = e.step(Action("finished"))
        assert (r.outcome, r.reward) == (Outcome.TERMINATED, 0.0)
    finally:
        e.close()


SOLUTIONS = {
    "hello": "echo hi > hello.txt",
    "count_lines": "wc -l < data.csv > count.txt",
    "sum_column": "tail -n +2 sales.csv | cut -d, -f2 | paste -sd+ | bc > total.txt || "
                  "awk -F, 'NR>1{s+=$2} END{print s}' sales.csv > total.txt",
    "largest_file": "ls -S files | head -1 > largest.txt",
}


@needs_sandbox
@pytest.mark.parametrize("task", terminal_tasks.TASKS)
def test_tasks_pass_with_a_solution_and_fail_without(task):
    e = TerminalEnv(options={"task": task})
    try:
        r = e.reset(11, {})
        assert r.instruction and r.info["success"] is False
        r = e.step(Action("finished"))                      # nothing done: no reward
        assert (r.outcome, r.reward, r.info["success"]) == (Outcome.TERMINATED, 0.0, False)
        e.reset(12, {})
        r = typed(e, "awk -F, 'NR>1{s+=$2} END{print s}' sales.csv > total.txt\n" if task == "sum_column"
                  else SOLUTIONS[task] + "\n")
        assert "[exit 0]" in r.text, r.text
        r = e.step(Action("finished"))
        assert (r.outcome, r.reward, r.info["success"]) == (Outcome.TERMINATED, 1.0, True), r.info
    finally:
        e.close()


@needs_sandbox
def test_tasks_are_drawn_from_the_seed():
    a, b = terminal_tasks.build("count_lines", 1), terminal_tasks.build("count_lines", 2)
    assert a.files != b.files and terminal_tasks.build("count_lines", 1).files == a.files


@needs_sandbox
def test_verify_each_step_and_verifier_ignores_symlinks():
    e = TerminalEnv(options={"task": "hello", "verify": "step"})
    try:
        e.reset(0, {})
        r = typed(e, "printf hi > /tmp/h && ln -s /tmp/h hello.txt\n")   # a link, even to the right text
        assert r.outcome == Outcome.RUNNING and r.info["success"] is False
        r = typed(e, "rm hello.txt && mkfifo hello.txt\n")              # a FIFO must not hang the verifier
        assert r.outcome == Outcome.RUNNING
        r = typed(e, "rm hello.txt; echo hi > hello.txt\n")
        assert (r.outcome, r.reward) == (Outcome.TERMINATED, 1.0)
    finally:
        e.close()


@needs_sandbox
def test_injected_workspace_is_shared_and_kept(tmp_path):
    parent = tmp_path / "reachable"
    parent.mkdir()
    for p in (parent, *parent.parents):      # pytest's tmp dirs are 0700: let the sandbox uid through
        if p.owner() == "root" and os.getuid() == 0 and p != pathlib.Path("/"):
            os.chmod(p, os.stat(p).st_mode | 0o001)
    shared = parent / "shared"
    shared.mkdir()
    (shared / "from_gui.txt").write_text("hello from the GUI\n")
    e = TerminalEnv(workspace=shared, reset_clears_workspace=False)
    try:
        e.reset(0, {})
        r = typed(e, "cat from_gui.txt; echo from-shell > out.txt\n")
        assert "hello from the GUI" in r.text
        assert e.workspace == shared.resolve()
    finally:
        e.close()
    assert (shared / "out.txt").read_text() == "from-shell\n"


@needs_sandbox
@pytest.mark.skipif(os.getuid() != 0, reason="the sandbox has a uid of its own only under a root daemon")
def test_injected_workspace_must_be_reachable(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    (hidden / "ws").mkdir()
    with pytest.raises(ValueError, match="reachable"):
        TerminalEnv(workspace=hidden / "ws")


@needs_sandbox
def test_snapshot_restore_keeps_files_cwd_and_task():
    e = TerminalEnv(options={"task": "count_lines"})
    e2 = TerminalEnv()
    try:
        e.reset(5, {})
        typed(e, "mkdir -p a/b && cd a && echo x > b/f && ln -s b/f link && ln -s /workspace/data.csv abs\n")
        typed(e, "half-typed")
        snap = e.snapshot()
        r2 = e2.restore(snap)
        want = e.observe()
        assert (r2.text, r2.instruction, r2.step) == (want.text, want.instruction, want.step)
        r = typed(e2, " no more\n")
        assert "half-typed no more" in r.text        # the line buffer came along
        r = typed(e2, "pwd; cat link; head -1 abs; wc -l < ../data.csv > ../count.txt\n")
        assert "/workspace/a\nx\nid,name,score\n[exit 0]" in r.text
        assert e2.step(Action("finished")).reward == 1.0
        assert e.step(Action("finished")).reward == 0.0   # the original did not change
    finally:
        e.close()
        e2.close()


@needs_sandbox
def test_snapshot_refused_while_running_or_with_escaping_links():
    env = TerminalEnv(options={"wait_s": "0.2"})
    env.reset(0, {})
    typed(env, "sleep 5\n")
    with pytest.raises(ActionError, match="running"):
        env.snapshot()
    env.step(Action("hotkey", key="ctrl c"))
    typed(env, "ln -s /etc/passwd leak\n")
    with pytest.raises(ActionError, match="outside the workspace"):
        env.snapshot()
    env.close()


def _tar(members: list[tuple[tarfile.TarInfo, bytes]], meta: dict | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        if meta is not None:
            data = json.dumps(meta).encode()
            info = tarfile.TarInfo("meta.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    return m


BAD_ARCHIVES = {
    "absolute path": [(_member("/etc/evil"), b"x")],
    "dot-dot": [(_member("workspace/../evil"), b"x")],
    "outside workspace": [(_member("other/file"), b"x")],
    "absolute symlink": [(_member("workspace/l", tarfile.SYMTYPE, "/etc/passwd"), b"")],
    "escaping symlink": [(_member("workspace/l", tarfile.SYMTYPE, "../../etc"), b"")],
    "hard link": [(_member("workspace/h", tarfile.LNKTYPE, "workspace/a"), b"")],
    "device": [(_member("workspace/dev", tarfile.CHRTYPE), b"")],
    "fifo": [(_member("workspace/p", tarfile.FIFOTYPE), b"")],
    "duplicate": [(_member("workspace/a"), b"1"), (_member("workspace/a"), b"2")],
    # each link stays inside on paper, but s/.. through s -> . leaves the workspace
    "link chain": [(_member("workspace/s", tarfile.SYMTYPE, "."), b""),
                   (_member("workspace/t", tarfile.SYMTYPE, "s/.."), b"")],
    "write through a link": [(_member("workspace/d", tarfile.SYMTYPE, "sub"), b""),
                             (_member("workspace/d/f"), b"x")],
    # restoring it would work, but every later walk of the tree (chown at start, snapshot) recurses per level
    "too deep": [(_member("workspace/" + "d/" * 300 + "f"), b"x")],
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_unpack_rejects_bad_archives(tmp_path, case):
    dest = tmp_path / "ws"
    dest.mkdir()
    with pytest.raises(ActionError):
        workspace_archive.unpack(_tar(BAD_ARCHIVES[case], meta={"version": 1}), dest)
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()
    if case != "link chain" and case != "write through a link":   # rejected before anything is written
        assert list(dest.iterdir()) == []


def test_unpack_rejects_junk_oversize_and_missing_meta(tmp_path):
    for data in (b"", b"not a tar at all", b"\x1f\x8b\x08\x00garbage"):
        with pytest.raises(ActionError):
            workspace_archive.unpack(data, tmp_path)
    with pytest.raises(ActionError, match="meta.json"):
        workspace_archive.unpack(_tar([(_member("workspace/a"), b"x")]), tmp_path)
    big = _tar([(_member("workspace/a"), b"x" * 5000)], meta={})
    with pytest.raises(ActionError, match="more than"):
        workspace_archive.unpack(big, tmp_path, max_bytes=4096)
    assert list(tmp_path.iterdir()) == []


def test_the_quota_walk_never_follows_a_link_swapped_in_for_a_directory(tmp_path):
    """The quota walk runs while the sandbox writes. It listed a directory, then scandir'ed it by path: a sandbox
    swapping that directory for a symlink to `/` in between made the daemon walk the host's tree (19 to 64 of
    ~20,000 walks in 3 s counted the 2,000 entries of a host directory, here `host`). Now never."""
    import threading

    from envd.sandbox_limits import workspace_usage

    ws, host = tmp_path / "ws", tmp_path / "host"
    ws.mkdir()
    host.mkdir()
    for i in range(2000):
        (host / f"h{i}").touch()
    (ws / "d").mkdir()
    stop = threading.Event()

    def swap():   # what a sandboxed loop can do: d is a directory, then briefly a link to a host directory
        while not stop.is_set():
            os.rename(ws / "d", ws / "x")
            os.symlink(host, ws / "d")
            os.unlink(ws / "d")
            os.rename(ws / "x", ws / "d")

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    try:
        deadline, counts = time.monotonic() + 3, set()
        while time.monotonic() < deadline and max(counts, default=0) <= 2:
            counts.add(workspace_usage(ws, 100_000)[1])
    finally:
        stop.set()
        t.join(5)
    assert max(counts) <= 2, f"the walk counted {max(counts)} entries of a 2-entry workspace"


def test_pack_counts_names_and_link_targets_against_its_byte_limit(tmp_path):
    """Only file bytes counted: empty files 255 directories of 255-byte names deep put ~65 KB of header each into
    the archive, so 20,000 of them (within the default quotas) made a ~1.3 GB snapshot in the daemon's memory
    against its 256 MiB limit (1,000 took 54 MB and 2.5 s). 100 made a 7.5 MB snapshot under a 1 MiB limit."""
    src = tmp_path / "src"
    src.mkdir()
    names = [f"{random.Random(i).getrandbits(1020):0255x}" for i in range(355)]   # gzip does not shrink them much
    fd = os.open(src, os.O_RDONLY)
    for name in names[:255]:
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    for name in names[255:]:
        os.close(os.open(name, os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    with pytest.raises(ActionError, match="too big to snapshot"):
        data = workspace_archive.pack(src, {}, max_bytes=1 << 20)
        pytest.fail(f"a snapshot of {len(data)} bytes passed a limit of {1 << 20}")
    links = tmp_path / "links"
    links.mkdir()
    for i in range(300):                                    # 300 links of 4,000-byte targets: 1.2 MB of headers
        os.symlink("./" * 2000, links / f"l{i}")
    with pytest.raises(ActionError, match="too big to snapshot"):
        workspace_archive.pack(links, {}, max_bytes=1 << 20)
    workspace_archive.rmtree(src)


def test_pack_unpack_round_trip(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f.txt").write_bytes(b"data")
    (src / "x.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "x.sh", 0o755)
    os.symlink("d/e/f.txt", src / "rel")
    os.mkfifo(src / "fifo")                                 # not workspace content: skipped
    dest.mkdir()
    meta = workspace_archive.unpack(workspace_archive.pack(src, {"k": 1}), dest)
    assert meta == {"k": 1}
    assert (dest / "d" / "e" / "f.txt").read_bytes() == b"data" and os.readlink(dest / "rel") == "d/e/f.txt"
    assert os.stat(dest / "x.sh").st_mode & 0o111 and not (dest / "fifo").exists()


@needs_sandbox
def test_restore_of_a_bad_snapshot_is_an_action_error():
    e = TerminalEnv()
    try:
        with pytest.raises(ActionError):
            e.restore(_tar([(_member("workspace/a"), b"x")], meta={"version": 99}))
        with pytest.raises(ActionError):
            e.restore(b"\x80\x03 pickle-ish bytes")
        meta = {"version": 1, "task": "hello", "limits": {"memory_mb": 10 ** 9}, "max_steps": 5, "screen_chars": 6000,
                "verify": "finished", "spec": None, "steps": 0, "transcript": "", "cwd": "/workspace", "pending": "",
                "state": "prompt", "outcome": "running", "success": False, "last_status": 0}
        with pytest.raises(ActionError, match="outside"):   # limits from a snapshot obey the option bounds
            e.restore(_tar([], meta=meta))
    finally:
        e.close()


def test_options_are_validated():
    for bad in ({"timeout_s": "-1"}, {"memory_mb": "1e12"}, {"nproc": "lots"}, {"verify": "sometimes"},
                {"workspace": "/"}, {"task": "no-such-task"}):
        with pytest.raises(ValueError):
            TerminalEnv(options=bad).close()


@needs_sandbox
class TestTerminalCompliance(EnvCompliance):
    env_id = "terminal"
    options = {"max_steps": "3", "wait_s": "5"}
    valid_action = {"type": "type", "content": "echo hi\n"}
    invalid_action = {"type": "click", "point": [10, 10]}
    max_episode_steps = 5


@needs_sandbox
class TestTerminalTaskCompliance(EnvCompliance):
    env_id = "terminal/count_lines"
    options = {"max_steps": "4"}
    valid_action = {"type": "type", "content": "wc -l < data.csv > count.txt\n"}
    invalid_action = {"type": "hotkey", "key": "f13"}
    max_episode_steps = 6


def test_a_killed_daemons_session_files_are_removed_by_the_next_daemon():
    """A SIGKILLed envd closes nothing: its sandboxes die with it, but their workspaces stayed in /tmp for good.
    Sessions now live in a scratch root per process whose lock the process holds while it lives; a daemon starting
    removes the roots nobody holds, and never a live process's."""
    import signal
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal; from envd.terminal import TerminalEnv\n"
        "e = TerminalEnv(options={})\n(e.workspace / 'big').write_bytes(b'x' * 4096)\n"
        "print(e.private_dir, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")],
        cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = pathlib.Path(killed.stdout.strip())
    assert (left / "workspace" / "big").exists()
    live = subprocess.Popen([sys.executable, "-c", (
        "import sys; from envd.terminal import TerminalEnv\n"
        "print(TerminalEnv(options={}).private_dir, flush=True)\nsys.stdin.read()")],
        cwd=repo, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        alive = pathlib.Path(live.stdout.readline().strip())
        started = subprocess.run([sys.executable, "-c", (
            "import asyncio; from core.config import EnvdConfig; from envd.server import EnvServer\n"
            "async def main():\n"
            "    s = EnvServer(EnvdConfig(host='127.0.0.1', port=0))\n    await s.start()\n    await s.stop(grace=0)\n"
            "asyncio.run(main())")], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr[-2000:]
        assert not left.exists()
        assert alive.is_dir()
    finally:
        live.stdin.close()
        live.wait(timeout=30)
