"""Containment of the terminal sandbox: network, filesystem, fork/memory/CPU bombs, output floods, timeouts.

Every test drives a real bubblewrap sandbox through TerminalEnv (and one through a real envd), then checks both the
attack's failure and that the session keeps working afterwards.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from envd.base import Action, Outcome
from envd.sandbox import missing_tools
from core.proc import wait_for
from envd.terminal import TerminalEnv
from envd_compliance import assert_untouched, occupy_pid, release

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"sandbox tools missing: {missing_tools()}")
REPO = pathlib.Path(__file__).resolve().parents[1]


def sh(env: TerminalEnv, cmd: str) -> tuple[str, int, str]:
    """Run one command line to its prompt (or timeout kill): (output, exit status, the [exit] line's note)."""
    before = len(env.transcript)
    r = env.step(Action("type", content=cmd + "\n"))
    deadline = time.monotonic() + 60
    while env.state == "running" and time.monotonic() < deadline:
        r = env.step(Action("wait"))
    assert env.state == "prompt", f"{cmd!r} did not finish: {r.text[-500:]}"
    new = env.transcript[before:]
    m = list(re.finditer(r"^\[exit (\d+)\](?: \((.*)\))?$", new, re.M))
    assert m, f"no exit line for {cmd!r}: {new[-500:]!r}"
    body = new.split("\n", 1)[1] if "\n" in new else ""
    return body[:body.rfind("[exit ")], int(m[-1].group(1)), m[-1].group(2) or ""


def make_env(**opts: str) -> TerminalEnv:
    options = {"timeout_s": "2", "wait_s": "5", "screen_chars": "100000", "max_steps": "1000"} | opts
    env = TerminalEnv(options=options)
    env.reset(1, {})
    return env


@pytest.fixture
def env():
    e = make_env()
    yield e
    e.close()


def test_no_network_to_host_loopback_or_outside(env):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        out, status, _ = sh(env, f"echo hi > /dev/tcp/127.0.0.1/{port}")
        assert status != 0 and "refused" in out.lower(), out
        with pytest.raises(socket.timeout):      # nothing reached the host's listener
            listener.accept()
        out, status, _ = sh(env, "echo hi > /dev/tcp/192.0.2.1/80")   # TEST-NET: an outside address
        assert status != 0 and "unreachable" in out.lower(), out
        out, _, _ = sh(env, "cat /proc/net/dev")
        interfaces = {line.split(":")[0].strip() for line in out.splitlines() if ":" in line}
        assert interfaces == {"lo"}, out
    finally:
        listener.close()


def test_writes_outside_workspace_fail(env):
    for path in ("/usr/evil", "/etc/evil", "/evil", "/bin/evil", "/proc/evil", "/dev/evil"):
        _, status, _ = sh(env, f"echo x > {path}")
        assert status != 0, path
    _, status, _ = sh(env, "echo inside > /workspace/ok.txt && echo t > /tmp/tars-sandbox-probe")
    assert status == 0
    assert (env.workspace / "ok.txt").read_text() == "inside\n"
    assert not pathlib.Path("/tmp/tars-sandbox-probe").exists()   # the sandbox's /tmp is its own tmpfs


def test_host_paths_are_not_visible(env):
    for path in ("/work", "/root", "/home", "/run", "/opt", "/var", "/sys", str(REPO), str(env.private_dir)):
        out, status, _ = sh(env, f"ls -d {path}")
        assert status != 0 and "No such file" in out, (path, out)
    out, _, _ = sh(env, "ls /")
    assert set(out.split()) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr",
                                "workspace"}, out
    out, _, _ = sh(env, "grep CapEff /proc/self/status")
    assert out.split()[-1] == "0000000000000000", out   # no capabilities inside


def test_fork_bomb_is_contained(env):
    _, status, _ = sh(env, ":(){ :|:& };:")          # background bomb: killed when the prompt comes back
    out, status, _ = sh(env, "unset -f :; echo ok; ps -e | wc -l")
    assert status == 0 and out.split()[0] == "ok" and int(out.split()[1]) <= 6, out
    # A bomb that keeps the command line in the foreground: the wall timeout kills it.
    out, status, note = sh(env, "bash -c ':(){ :|:& };:; sleep 100'")
    assert "timed out" in note
    out, status, _ = sh(env, "echo still-ok")
    assert (out.strip(), status) == ("still-ok", 0)


def test_nproc_limit_applies():
    env = make_env(nproc="20")
    try:
        out, _, _ = sh(env, "ulimit -u")
        assert int(out) >= 20 and (os.getuid() != 0 or int(out) == 20)
        forker = ["import os, time", "n = 0", "try:", " while n < 200:", "  if os.fork() == 0:",
                  "   time.sleep(3)", "   os._exit(0)", "  n += 1", "except OSError as e:", " print(\"stopped\", n, e.errno)"]
        sh(env, "printf '%s\\n' " + " ".join(f"'{line}'" for line in forker) + " > forker.py")
        out, _, _ = sh(env, "python3 forker.py")
        words = out.split()
        assert words[0] == "stopped" and int(words[1]) < 20 and int(words[2]) == 11, out   # EAGAIN
        out, status, _ = sh(env, "echo fine")
        assert (out.strip(), status) == ("fine", 0)
    finally:
        env.close()


def test_memory_bomb_is_contained():
    env = make_env(memory_mb="128")
    try:
        out, status, _ = sh(env, "python3 -c 'x = bytearray(1 << 30)' || head -c 400000000 /dev/zero | "
                                 "bash -c 'x=$(tr \"\\0\" x)'")
        assert status != 0 and ("MemoryError" in out or "allocate" in out), out
        # In the shell itself: bash dies of it; a new shell comes up on the same workspace.
        r = env.step(Action("type", content="x=$(head -c 400000000 /dev/zero | tr '\\0' x)\n"))
        while env.state == "running":
            r = env.step(Action("wait"))
        out, status, _ = sh(env, "echo alive")
        assert (out.strip(), status) == ("alive", 0), r.text[-800:]
    finally:
        env.close()


def test_busy_loop_in_the_shell_is_interrupted(env):
    out, status, note = sh(env, "while :; do :; done")
    assert "timed out" in note and status != 0
    out, status, _ = sh(env, "echo next")
    assert (out.strip(), status) == ("next", 0)


def test_shell_ignoring_sigint_is_replaced(env):
    env.step(Action("type", content="trap '' INT; while :; do :; done\n"))
    deadline = time.monotonic() + 60
    while "new shell started" not in env.transcript and time.monotonic() < deadline:
        env.step(Action("wait"))
    assert "new shell started" in env.transcript
    out, status, _ = sh(env, "echo fresh")
    assert (out.strip(), status) == ("fresh", 0)


def test_cpu_limit_kills_a_busy_child():
    env = make_env(cpu_s="1", timeout_s="60")
    try:
        out, status, note = sh(env, "bash -c 'while :; do :; done'")
        assert status in (128 + 9, 128 + 24) and not note, (out, status, note)   # SIGKILL / SIGXCPU, not the timeout
    finally:
        env.close()


def test_output_flood_is_capped():
    env = make_env(output_bytes="4096", screen_chars="3000")
    try:
        r = env.step(Action("type", content="head -c 200000 /dev/zero | tr '\\0' a; echo\n"))
        assert "bytes of output dropped" in r.text and len(r.text) <= 3000
        assert max(len(line) for line in env.transcript.splitlines()) < 8192
        out, status, note = sh(env, "yes")                       # endless: killed by the flood limit
        assert "output flood" in note or "timed out" in note, note
        out, status, _ = sh(env, "echo after")
        assert (out.strip(), status) == ("after", 0)
    finally:
        env.close()


def test_file_size_tmp_and_disk_limits():
    env = make_env(fsize_mb="1", tmp_mb="1", disk_mb="2")
    try:
        out, status, _ = sh(env, "head -c 3M /dev/zero > big")
        assert status != 0 and (env.workspace / "big").stat().st_size <= 1 << 20
        out, status, _ = sh(env, "head -c 900K /dev/zero > /tmp/a && head -c 900K /dev/zero > /tmp/b")
        assert status != 0 and "No space left" in out
        r = env.step(Action("type", content="for i in 1 2 3; do head -c 1000K /dev/zero > f$i; done\n"))
        assert r.outcome == Outcome.TRUNCATED and "quota" in r.text
    finally:
        env.close()


def _host_processes(prefix: bytes) -> list[str]:
    found = []
    for d in os.listdir("/proc"):
        try:
            if pathlib.Path(f"/proc/{d}/cmdline").read_bytes().startswith(prefix):
                found.append(d)
        except OSError:
            continue
    return found


def test_timeout_kills_children(env):
    t = str(os.getpid() % 100000 + 200000)  # sleeps of this run only (another test run may share the host)
    out, status, note = sh(env, f"sleep {t}1 & sleep {t}2 & bash -c 'sleep {t}3 & sleep {t}4'")
    assert "timed out" in note
    assert _host_processes(b"sleep\x00" + t.encode()) == []
    out, _, _ = sh(env, "ps -e -o comm=")
    assert "sleep" not in out and out.split().count("bash") == 1, out


def test_close_kills_everything():
    env = make_env(timeout_s="60", wait_s="0.3")
    tag = str(os.getpid() % 100000 + 100000)  # sleeps of this run only (another test run may share the host)
    env.step(Action("type", content=f"sleep {tag}1 & sleep {tag}2\n"))
    assert env.state == "running"
    mine = b"sleep\x00" + tag.encode()
    deadline = time.monotonic() + 10
    while len(_host_processes(mine)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_host_processes(mine)) == 2
    pid = env.sandbox.proc.pid
    env.close()
    assert not os.path.exists(f"/proc/{pid}")      # reaped, not a zombie
    assert _host_processes(mine) == []


def test_containment_over_a_real_envd():
    from envd_compliance import envd_client, run
    from core.v1 import common_pb2, env_pb2

    async def body():
        async with envd_client() as c:
            sid = (await c.CreateSession(env_pb2.CreateSessionRequest(
                env_id="terminal", options={"timeout_s": "2", "wait_s": "8"}))).session_id
            await c.Reset(env_pb2.ResetRequest(session_id=sid, seed=1))
            for cmd in (":(){ :|:& };:", "bash -c ':(){ :|:& };:; sleep 100'", "while :; do :; done", "yes"):
                r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(type="type",
                                                                                           content=cmd + "\n")),
                                 timeout=30)
                assert r.outcome == common_pb2.RUNNING
            r = await c.Step(env_pb2.StepRequest(session_id=sid, action=env_pb2.Action(
                type="type", content="echo daemon-ok\n")), timeout=30)
            assert "daemon-ok\n[exit 0]" in r.observation.text, r.observation.text[-1000:]
            assert (await c.Ping(env_pb2.PingRequest(payload=b"x"))).payload == b"x"
    run(body(), timeout=120)


def _with_tag(tag: bytes) -> list[str]:
    found = []
    for d in os.listdir("/proc"):
        try:
            if tag in pathlib.Path(f"/proc/{d}/cmdline").read_bytes():
                found.append(d)
        except OSError:
            continue
    return found


def test_stop_returns_only_once_every_process_of_the_sandbox_is_gone():
    """Killing bwrap does not wait for its pid namespace: 40 busy forks were seen alive ~9 ms after stop() returned,
    long enough for a symlink planted after Reset's clear to redirect a root daemon's seeding onto a host path.
    stop() now waits on a pidfd of the namespace's init (envd/sandbox_exit.py)."""
    env = make_env(timeout_s="60", wait_s="0.5")
    tag = f"tag{os.getpid()}x".encode()
    code = 'exec("import os\\nfor k in range(40):\\n  if os.fork() == 0: break\\nwhile True: os.getpid()")'
    try:
        for _ in range(3):
            env.step(Action("type", content=f"python3 -c '{code}' {tag.decode()}\n"))
            wait_for(lambda: len(_with_tag(tag)) == 41, 10, "41 busy processes in the sandbox", every=0.05)
            env.sandbox.stop()
            assert _with_tag(tag) == []  # at once: no wait, no retry
            env.reset(2, {})
    finally:
        env.close()


def test_seeding_never_writes_through_a_link_the_sandbox_left(tmp_path):
    from envd.base import ActionError
    from envd.workspace_archive import write_new

    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    os.symlink(outside / "pwned", ws / "data.csv")
    os.symlink(outside, ws / "sub")
    write_new(ws, "data.csv", b"seeded")  # the link is replaced by a file of the workspace, never followed
    assert not (ws / "data.csv").is_symlink() and (ws / "data.csv").read_bytes() == b"seeded"
    with pytest.raises(ActionError, match="non-directory"):  # a linked directory on the way: refused
        write_new(ws, "sub/data.csv", b"seeded")
    assert list(outside.iterdir()) == []
    write_new(ws, "a/b/c.txt", b"ok")
    assert (ws / "a" / "b" / "c.txt").read_bytes() == b"ok"


DEEP = "python3 -c 'import os; [(os.mkdir(\"d\"), os.chdir(\"d\")) for i in range(1500)]'"


def test_a_deep_tree_or_a_sparse_file_cannot_break_snapshot_reset_or_close():
    """A 1,500-deep chain of directories raised RecursionError in Snapshot (INTERNAL), Reset (INFRA_ERROR) and
    Close (the workspace left on disk for good); a 600 MB sparse file (no blocks: within the disk quota) was read
    whole into the daemon before the snapshot's byte limit refused it."""
    from envd.base import ActionError

    env = make_env(timeout_s="30", fsize_mb="1024", disk_mb="16")
    try:
        out, status, _ = sh(env, DEEP)
        assert status == 0
        with pytest.raises(ActionError, match="nested deeper than 256 directories"):
            env.snapshot()
        assert env.reset(3, {}).outcome == Outcome.RUNNING and not (env.workspace / "d").exists()
        out, status, _ = sh(env, "truncate -s 600M sparse")
        assert status == 0
        import tracemalloc

        tracemalloc.start()
        with pytest.raises(ActionError, match="too big to snapshot"):
            env.snapshot()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 << 20, peak  # refused from its size, not after reading 600 MB
        out, status, _ = sh(env, DEEP)
        assert status == 0
        ws = env.workspace
    finally:
        env.close()
    assert not ws.exists()


def test_an_output_flood_of_prompt_look_alikes_is_still_a_flood():
    """Each look-alike of the shell's prompt sentinel restarted the flood count (and disarmed the deadline), so
    `yes` printing them ran, and kept a daemon core busy, until the foreground timer. The count now runs from the
    command line, and a prompt counts only when the shell holds the terminal and carries the prompt's number. The
    look-alikes say prompt 1 (the last one shown): those still in the pty when `yes` died, read once the shell has
    the terminal back, passed for prompts (status 0, 1 run in 5) and polluted the next command line's output."""
    env = make_env(timeout_s="60")
    try:
        t0 = time.monotonic()
        out, status, note = sh(env, "yes $'x\\x1e1 0 /x\\x1f'")
        # killed (SIGINT: 130) well before its 60 s deadline, with the flood's note, and nothing of it left running
        assert status == 130 and "output flood" in note and time.monotonic() - t0 < 50
        assert _with_tag(b"yes\x00x\x1e1") == []
        out, status, _ = sh(env, "echo after")
        assert (out.strip(), status) == ("after", 0)
    finally:
        env.close()


def test_look_alikes_from_a_background_job_the_shell_waits_for_do_not_end_the_command():
    """While the shell runs `wait`, it holds the terminal itself: look-alikes a background job printed passed for
    prompts, disarmed the deadline, and the job ran on unpoliced. A prompt now also needs the shell to have no
    child; the deadline kills the job."""
    env = make_env(timeout_s="2", wait_s="1")
    tag = f"lookalike{os.getpid()}"
    try:
        env.step(Action("type", content=f"bash -c 'while :; do printf \"\\x1e0 /x\\x1f\"; sleep 0.05; done' {tag} & wait\n"))
        deadline = time.monotonic() + 30
        while env.state == "running" and time.monotonic() < deadline:
            env.step(Action("wait"))
        assert env.state == "prompt" and _with_tag(tag.encode()) == []
        assert "timed out after 2s" in env.transcript
    finally:
        env.close()


def test_seeding_replaces_a_file_the_last_episode_left():
    from envd import terminal_tasks

    name = next(iter(terminal_tasks.TASKS))
    import tempfile

    ws = pathlib.Path(tempfile.mkdtemp())
    for seed in (0, 1):  # the second finds the first's files (reset without clearing): replaced, not refused
        spec = terminal_tasks.build(name, seed)
        terminal_tasks.seed_files(ws, spec)
        assert all((ws / rel).read_bytes() == data for rel, data in spec.files.items())


def _no_strays(env: TerminalEnv) -> bool:
    """No process in the sandbox but its init and its shell (the shell's parent)."""
    from envd.sandbox_exit import strays
    shell = env.sandbox.shell_pgid
    init = int(pathlib.Path(f"/proc/{shell}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return strays(init, shell) == ({}, {})


@pytest.mark.parametrize("start", [
    "trap '[[ $BASH_COMMAND == \"builtin wait\"* ]] && (setsid sleep 1000 >/dev/null 2>&1 &)' DEBUG",
    "PS4='$( (setsid sleep 1000 >/dev/null 2>&1 &) )+ '; set -x",
], ids=["debug-trap", "ps4"])
def test_a_job_started_after_the_prompts_kill_still_ends_with_its_command_line(env, start):
    """bash runs a DEBUG trap (or expands PS4 under `set -x`) before PROMPT_COMMAND's `builtin wait`, after its
    `kill -9 -1`: a job started there outlived its command line and ran at the prompt with no timeout or quota. The
    daemon now kills every process but the shell and the init from the host when the prompt comes."""
    sh(env, start)
    sh(env, "true")
    wait_for(lambda: _no_strays(env), 20, "the job started after the prompt's kill to be killed", every=0.05)
    out, status, _ = sh(env, "trap - DEBUG; set +x; echo still-here")
    assert "still-here" in out and status == 0


def test_a_job_a_trap_starts_at_the_prompt_is_killed():
    """A trap run when the idle shell takes a signal started jobs nothing policed (the timeout and the quota watch
    command lines). Now one outside the shell dies at once, and one of the shell's own past the wall timeout."""
    env = make_env(timeout_s="1")
    try:
        sh(env, "trap '(setsid sleep 1000 >/dev/null 2>&1 &); : > fired1' USR1; trap 'sleep 1000 & : > fired2' USR2")
        for sig, marker in ((signal.SIGUSR1, "fired1"), (signal.SIGUSR2, "fired2")):
            os.kill(env.sandbox.shell_pgid, sig)
            wait_for(lambda: (env.workspace / marker).exists(), 10, f"the {sig.name} trap to run", every=0.05)
            wait_for(lambda: _no_strays(env), 10, f"the {sig.name} trap's job to be killed", every=0.05)
        out, status, _ = sh(env, "echo still-here")
        assert (out.strip(), status) == ("still-here", 0)
    finally:
        env.close()


def test_the_disk_quota_holds_between_command_lines():
    """The quota was checked only while a command line ran: a job of the shell's own started at the prompt (a
    trap's) could fill the workspace until the wall timeout. It is now checked while the sandbox lives."""
    env = make_env(timeout_s="120", disk_mb="1")
    try:
        sh(env, "trap '(for i in $(seq 200); do head -c 256K /dev/zero > f$i; sleep 0.05; done) & : > fired' USR1")
        os.kill(env.sandbox.shell_pgid, signal.SIGUSR1)
        wait_for(lambda: (env.workspace / "fired").exists(), 10, "the trap to run", every=0.05)
        wait_for(lambda: _no_strays(env), 20, "the job over the quota to be killed", every=0.05)
        assert len(list(env.workspace.glob("f*"))) < 150
    finally:
        env.close()


def test_a_directory_the_daemon_cannot_read_is_over_the_quota(tmp_path):
    """Under an unprivileged daemon the sandbox runs as the daemon's uid and may chmod 000 a directory: the quota
    walk skipped what it could not list, so 3 MiB under such a directory passed a 1 MiB quota unseen. Run without
    CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (what an unprivileged daemon lacks): the workspace is now over its quota."""
    code = ("import os, pathlib, sys\n"
            "from envd.sandbox_limits import Limits, quota_breach\n"
            "root = pathlib.Path(sys.argv[1]); d = root / 'hidden'; d.mkdir()\n"
            "for i in range(3): (d / f'f{i}').write_bytes(b'x' * (1 << 20))\n"
            "os.chmod(d, 0)\n"
            "print(repr(quota_breach(root, Limits(disk_mb=1))))\n"
            "os.chmod(d, 0o700)\n"
            "print(repr(quota_breach(root, Limits(disk_mb=1))))\n")
    drop = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
             "--inh-caps", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
    r = subprocess.run([*drop, sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    hidden, readable = r.stdout.splitlines()
    assert "cannot read ('hidden')" in hidden and "over its quota" in hidden, hidden
    assert "3 MiB, over its 1 MiB quota" in readable, readable


def test_a_stop_after_the_shell_exited_never_signals_its_freed_pid(monkeypatch):
    """A shell that exits (`exit`, or killed by the policing) has its bwrap reaped by the reader thread; the next
    start() (or a Reset, or Close) then stopped the old sandbox with killpg(bwrap's pid), a pid free by then. With
    pid_max 32768 it is soon another process group's: a host process given that pid (ns_last_pid, as root) was
    SIGKILLed by the stop. Now a reaped bwrap is never signalled."""
    import tempfile

    from envd import scratch
    from envd.sandbox import Limits, ShellSandbox
    from envd.workspace_archive import rmtree

    d = pathlib.Path(tempfile.mkdtemp(prefix="tars-terminal-", dir=scratch.root()))  # reachable by a sandbox uid
    (d / "ws").mkdir()
    sb = ShellSandbox(d / "ws", d, Limits())
    victim = None
    try:
        sb.start()
        stale = sb.proc.pid
        assert sb.submit("exit")
        assert [e.kind for e in sb.wait(time.monotonic() + 10)][-1] == "exit"
        assert sb.proc.returncode is not None               # reaped: `stale` is free
        victim = occupy_pid(stale)  # None (not root): the signals themselves are checked
        signalled = []
        real = os.killpg
        monkeypatch.setattr(os, "killpg", lambda pg, sig: (signalled.append(pg), real(pg, sig))[1])
        sb.stop()
        assert_untouched(victim)                            # still running: the stop did not kill it
        assert stale not in signalled
    finally:
        release(victim)
        sb.release()
        rmtree(d)


def test_a_dead_foreground_group_never_lets_the_daemon_signal_a_host_process(monkeypatch):
    """A job can make a process group of its own the terminal's foreground (tcsetpgrp) and let it die: the pty
    still names that group's number, free by then. The wall timeout, ctrl-c and the policing signalled whatever
    process group had that number: a host 'sleep 60' in its own session given it (ns_last_pid, as root) was
    SIGINTed by ctrl-c (and 5 s on by the command's timeout, in a run without it). Now only a group with a live process in the sandbox is signalled;
    the command still ends (its sandbox is replaced when nothing stops it)."""
    import tempfile

    from envd import scratch
    from envd.sandbox import Limits, ShellSandbox
    from envd.workspace_archive import rmtree

    d = pathlib.Path(tempfile.mkdtemp(prefix="tars-terminal-", dir=scratch.root()))
    (d / "ws").mkdir()
    (d / "ws" / "p.py").write_text("import os, signal, time\n"
                                   "signal.signal(signal.SIGTTOU, signal.SIG_IGN)\n"
                                   "pid = os.fork()\n"
                                   "if pid == 0:\n"
                                   "    os.setpgid(0, 0); os.tcsetpgrp(0, os.getpid()); os._exit(0)\n"
                                   "os.waitpid(pid, 0)\n"
                                   "time.sleep(60)\n")
    sb = ShellSandbox(d / "ws", d, Limits(timeout_s=2))
    victim = None
    signalled = []
    real = os.killpg
    monkeypatch.setattr(os, "killpg", lambda pg, sig: (signalled.append(pg), real(pg, sig))[1])
    try:
        sb.start()
        assert sb.submit("python3 p.py")
        wait_for(lambda: (pg := sb._foreground_pgrp()) not in (0, sb.shell_pgid) and not os.path.exists(f"/proc/{pg}"),
                 10, "the job's dead group to be the foreground", every=0.05)
        dead = sb._foreground_pgrp()
        victim = occupy_pid(dead)  # None (not root): the signals themselves are checked
        sb.interrupt()                                      # ctrl-c
        events = []
        deadline = time.monotonic() + 15                    # the timeout: SIGINT, SIGKILL, then a new sandbox
        while time.monotonic() < deadline and not any(e.kind in ("prompt", "exit") for e in events):
            events += sb.wait(time.monotonic() + 0.5)
        assert any(e.kind in ("prompt", "exit") for e in events), "the command was never ended"
        assert_untouched(victim)
        assert dead not in signalled
    finally:
        release(victim)
        sb.release()
        rmtree(d)
