"""`tars learner-stop PID`: SIGTERM to a launcher's ranks (children with LOCAL_RANK), never to its other children,
or to PID itself when it has no ranks; then it waits for PID to exit, with a deadline. (The real `accelerate launch`
job: tests/test_dist_lifecycle.py, slow.)"""
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

from core.proc import wait_for
from tars.cli import main

# A stand-in launcher: two "ranks" (LOCAL_RANK set) and one helper child without it (like a learner's WAL writer).
# Each child records the SIGTERM it gets; the launcher exits 0 once both ranks have returned, like torch elastic.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, pathlib
    d = pathlib.Path(sys.argv[1])
    child = ("import signal, sys, pathlib, time\\n"
             "def on(*_):\\n"
             "    pathlib.Path(sys.argv[1]).write_text('term')\\n"
             "    sys.exit(0)\\n"
             "signal.signal(signal.SIGTERM, on)\\n"
             "pathlib.Path(sys.argv[1] + '.up').write_text('up')\\n"
             "time.sleep(120)\\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    ranks = [subprocess.Popen([sys.executable, "-c", child, str(d / f"rank{i}")], env={**env, "LOCAL_RANK": str(i)})
             for i in range(2)]
    helper = subprocess.Popen([sys.executable, "-c", child, str(d / "helper")], env=env)
    rcs = [r.wait() for r in ranks]
    helper.kill()
    sys.exit(max(rcs))
""")


# A stand-in learner: `setup` is its SIGTERM handling; it writes sys.argv[1] once set up, then lives at most 120 s (a
# bounded life for a process the test stops or kills, not a wait of the test's).
STAND_IN = ("import signal, subprocess, sys, time, pathlib\n"
            "SETUP\n"
            "pathlib.Path(sys.argv[1]).write_text('up')\n"
            "time.sleep(120)\n")


@contextlib.contextmanager
def _running(code, arg, up, env=None):
    """Start `code` with argv[1] = arg in its own session; wait until up() says it is ready; kill its whole group
    afterwards."""
    p = subprocess.Popen([sys.executable, "-c", code, str(arg)], start_new_session=True, env=env)
    try:
        wait_for(up, 60, "the stand-in to start", every=0.05)
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _stand_in(tmp_path, setup, env=None):
    return _running(STAND_IN.replace("SETUP", setup), tmp_path / "up", (tmp_path / "up").exists, env)


def test_signals_the_ranks_only_and_waits_for_the_launcher(tmp_path, capsys):
    up = lambda: all((tmp_path / f"{n}.up").exists() for n in ("rank0", "rank1", "helper"))  # noqa: E731
    with _running(LAUNCHER, tmp_path, up) as p:
        assert main(["learner-stop", str(p.pid), "--timeout", "60"]) == 0
        assert p.poll() == 0  # exited (not merely signalled) before learner-stop returned, and cleanly
        assert (tmp_path / "rank0").read_text() == "term" and (tmp_path / "rank1").read_text() == "term"
        assert not (tmp_path / "helper").exists()  # not a rank: left to its parent
        assert "its ranks" in capsys.readouterr().out


def test_a_process_without_ranks_is_signalled_itself(tmp_path):
    with _stand_in(tmp_path, "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))") as p:
        assert main(["learner-stop", str(p.pid), "--timeout", "60"]) == 0
        assert p.poll() == 0


def test_a_learner_with_local_rank_set_is_signalled_itself_not_its_children(tmp_path):
    """A single learner started with LOCAL_RANK in its environment: its children (a WAL writer) inherit it, and must
    not be taken for ranks."""
    setup = ("kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
             "def on(*_):\n"
             "    kid.kill(); kid.wait(); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, on)")
    with _stand_in(tmp_path, setup, env={**os.environ, "LOCAL_RANK": "0"}) as p:
        assert main(["learner-stop", str(p.pid), "--timeout", "60"]) == 0
        assert p.poll() == 0


def test_a_process_that_does_not_exit_is_an_error_at_the_deadline(tmp_path, capsys):
    with _stand_in(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)") as p:
        assert main(["learner-stop", str(p.pid), "--timeout", "0.5"]) == 1
        assert "still running" in capsys.readouterr().err
        assert p.poll() is None  # not killed: that is the service manager's call


def test_no_such_process_and_a_bad_timeout(tmp_path, capsys):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)  # reaped: its pid names no process now (reuse within the test is vanishingly unlikely)
    assert main(["learner-stop", str(p.pid), "--timeout", "1"]) == 1
    assert f"no process {p.pid}" in capsys.readouterr().err
    try:
        main(["learner-stop", "1", "--timeout", "-1"])
        raise AssertionError("a negative timeout was accepted")
    except SystemExit as e:
        assert e.code == 2


def test_a_zombie_counts_as_exited(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: pathlib.Path(f"/proc/{p.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z", 30,
             "the child to exit (unreaped)", every=0.05)
    from tars import stop

    assert not stop._alive(p.pid)
    p.wait(10)
