"""The supervisor of `tars up` (tars/supervisor.py) over real processes: a killed envd daemon comes back on its old
port with backoff and serves again; a process that keeps dying ends the run once it has used up its restarts.
(The whole `tars up` under kills is tests/test_faults.py, in the slow set.)"""
import json
import os
import signal
import time

import grpc
import pytest

from core import config as C
from core import rpc
from core.v1 import control_pb2, control_pb2_grpc
from tars.supervisor import Supervisor, read_events
from tars.topology import StartCancelled, Topology, plan


def _envd_only(tmp_path, **sets):
    cfg = C.load("quickstart", None, [f"{k}={v}" for k, v in sets.items()])
    out = tmp_path / "run"
    out.mkdir()
    C.save(cfg, out / "config.yaml")
    return cfg, Topology(plan(cfg, out, None, inference=False, learner=False, n_actors=0))


def _serves(addr: str, cfg) -> bool:
    ch = rpc.sync_channel(addr, cfg.control.auth_token)
    try:
        control_pb2_grpc.ControlServiceStub(ch).Status(control_pb2.StatusRequest(), timeout=5)
        return True
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def _poll_until(sup: Supervisor, pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = sup.poll()
        if pred(end):
            return end
        time.sleep(0.05)
    raise TimeoutError("supervisor did not get there")


def test_killed_envd_comes_back_on_its_port(tmp_path):
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        addr, pid0 = topo.envd, topo.ready[("envd", 0)]["pid"]
        said: list[str] = []
        sup = Supervisor(topo, max_restarts=2, backoff_s=0.2, say=said.append)
        assert sup.poll() is None and sup.counts() == {}
        with open(topo.procs[("envd", 0)].spec.log, "a") as f:
            f.write("the last words of envd\n")
        os.killpg(pid0, signal.SIGKILL)
        _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
        assert topo.envd == addr                               # the same address the actors already use
        assert topo.ready[("envd", 0)]["pid"] != pid0
        assert _serves(addr, cfg)
        events = [e["event"] for e in read_events(topo.plan.out)]
        assert events == ["died", "restarting", "up"], events
        # the reason is on screen: the death, then the end of the dead process's log
        i = next(i for i, m in enumerate(said) if "envd exited (rc -9); restarting in 0 s (1/2)" in m)
        assert any("envd| the last words of envd" in m for m in said[i + 1:i + 6]), said


def test_a_log_that_cannot_be_written_does_not_end_supervision(tmp_path, capsys):
    """On a full disk, recording a death in supervisor.jsonl raised OSError inside the watch loop and tore the
    whole run down with no report; the restart now goes on and the record goes to stderr."""
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        bad = tmp_path / "full"
        bad.mkdir()  # a directory: every append fails with an OSError, as on a full disk
        sup = Supervisor(topo, max_restarts=2, backoff_s=0.2, log=bad)
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)
        _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
        assert _serves(topo.envd, cfg)
    assert "cannot record envd died" in capsys.readouterr().err


def test_a_stopped_process_is_found_killed_and_restarted(tmp_path, monkeypatch):
    """A SIGSTOPped envd is up but serves nothing: the run stalled without a word. The supervisor's probe (its
    ControlService Status) finds it silent past hang_s, kills it and restarts it on its port."""
    from tars import supervisor as S

    monkeypatch.setattr(S, "PROBE_EVERY_S", 0.2)
    monkeypatch.setattr(S, "PROBE_DEADLINE_S", 0.5)
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        addr, pid0 = topo.envd, topo.ready[("envd", 0)]["pid"]
        sup = Supervisor(topo, max_restarts=2, backoff_s=0.2, hang_s=3.0, control_token=cfg.control.auth_token)
        try:
            t0 = time.monotonic()  # a healthy process answers and is left alone past hang_s
            _poll_until(sup, lambda end: ("envd", 0) in sup.answered and time.monotonic() - t0 > 4.0, 30)
            assert sup.counts() == {}
            os.kill(pid0, signal.SIGSTOP)
            _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
            assert topo.envd == addr and topo.ready[("envd", 0)]["pid"] != pid0 and _serves(addr, cfg)
            died = [e for e in read_events(topo.plan.out) if e["event"] == "died"]
            assert len(died) == 1 and "did not answer for 3 s (hung)" in died[0]["how"], died
        finally:
            sup.close()


def test_a_hang_s_below_the_probe_cadence_leaves_healthy_processes_alone(tmp_path):
    """supervisor.hang_s=3 with the probe's fixed 5 s cadence: a healthy envd had not answered for 3 s before it was
    asked, so it was killed as hung every 3 s (the run ended at max_restarts). The probe now asks at least three
    times per hang_s; a stopped process is still found."""
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        pid0 = topo.ready[("envd", 0)]["pid"]
        sup = Supervisor(topo, max_restarts=2, backoff_s=0.2, hang_s=3.0, control_token=cfg.control.auth_token)
        try:
            t0 = time.monotonic()
            _poll_until(sup, lambda end: time.monotonic() - t0 > 7.0, 30)
            assert sup.counts() == {} and not read_events(topo.plan.out)
            os.kill(pid0, signal.SIGSTOP)
            _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
            assert _serves(topo.envd, cfg)
        finally:
            sup.close()


def test_a_process_that_keeps_dying_ends_the_run(tmp_path):
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        sup = Supervisor(topo, max_restarts=1, backoff_s=0.2)
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)
        _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
        t0 = time.monotonic()
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)
        end = _poll_until(sup, lambda end: end is not None, 30)
        assert "envd died 2 times" in end and "max_restarts=1" in end
        assert time.monotonic() - t0 < 10                     # it did not try a second restart first
        deaths = [e for e in read_events(topo.plan.out) if e["event"] == "died"]
        assert [e["rc"] for e in deaths] == [-9, -9]


def test_backoff_doubles_for_a_process_that_fails_to_start(tmp_path):
    """A restart that dies before it is ready counts as a death: the next try waits twice as long."""
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        sup = Supervisor(topo, max_restarts=3, backoff_s=0.3)
        # From now on envd crashes as it announces itself (status 1): its ready file cannot be written.
        (topo.plan.out / "run" / "envd.json.tmp" / "x").mkdir(parents=True)
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)
        end = _poll_until(sup, lambda end: end is not None, 90)
        assert "envd died 4 times" in end
        ev = read_events(topo.plan.out)
        starts = [e["t"] for e in ev if e["event"] == "restarting"]
        deaths = [e["t"] for e in ev if e["event"] == "died"]
        assert [e["rc"] for e in ev if e["event"] == "died"] == [-9, 1, 1, 1]
        assert len(starts) == 3 and len(deaths) == 4
        gaps = [s - d for d, s in zip(deaths, starts)]       # death -> next start: 0.3, 0.6, 1.2 s
        assert gaps[0] >= 0.3 and gaps[1] >= 0.6 and gaps[2] >= 1.2, gaps


def test_a_user_error_ends_the_run_without_a_restart(tmp_path):
    """A role that exits with status 2 (a user error: here envd's config file is gone) is not restarted: the same
    start would be refused again. The run ends at its first such exit, with the role's one-line error as the reason
    (it used to be restarted supervisor.max_restarts times, with backoff, before the run gave up)."""
    cfg, topo = _envd_only(tmp_path)
    with topo:
        topo.start()
        said: list[str] = []
        sup = Supervisor(topo, max_restarts=5, backoff_s=0.3, say=said.append)
        (topo.plan.out / "config.yaml").rename(topo.plan.out / "config.yaml.away")
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)  # a death: restarted, and the restart exits 2
        end = _poll_until(sup, lambda end: end is not None, 90)
        config = topo.plan.out / "config.yaml"
        assert end == (f"envd exited before it was ready with status 2 (a user error: no restart can fix it): "
                       f"tars envd: config error: --config '{config}': no such file; see {topo.procs[('envd', 0)].spec.log}")
        ev = read_events(topo.plan.out)
        assert [(e["event"], e.get("rc")) for e in ev] == [("died", -9), ("restarting", None), ("died", 2)], ev
        assert "envd exited before it was ready (rc 2): a user error, not restarted" in said, said
        assert said[-1] == f"  envd| tars envd: config error: --config '{config}': no such file", said
        assert sup.poll() == end and sup.counts() == {}


def test_a_start_cancelled_starts_nothing_more_and_stops_what_it_started(tmp_path):
    """Topology.start(cancel): once cancel() is true (tars up's Ctrl-C / SIGTERM while starting), no further role is
    launched; StartCancelled, and stop() leaves nothing running."""
    cfg = C.load("quickstart", None, [])
    out = tmp_path / "run"
    out.mkdir()
    C.save(cfg, out / "config.yaml")
    topo = Topology(plan(cfg, out, tmp_path / "no-model", inference=False, n_actors=2))
    with topo:
        with pytest.raises(StartCancelled, match="before learner was started"):
            topo.start(cancel=lambda: ("envd", 0) in topo.ready)  # Ctrl-C as soon as envd is up
        assert list(topo.procs) == [("envd", 0)]  # neither the learner nor an actor was started
    assert topo.returncode("envd") is not None
    topo = Topology(plan(cfg, out, tmp_path / "no-model", inference=False, n_actors=2))
    with topo:
        with pytest.raises(StartCancelled, match="envd was starting"):
            topo.start(cancel=lambda: True)  # while waiting for envd's ready file
        assert list(topo.procs) == [("envd", 0)] and ("envd", 0) not in topo.ready
    assert topo.returncode("envd") is not None


def test_report_warns_of_infra_errors_no_update_and_restarts(tmp_path):
    """A run whose episodes were mostly infra errors, that made no update, and that restarted a process says so in
    report.json; its plot says "no data" where there is none instead of staying blank."""
    from tars import report

    eps = [{"id": f"e{i}", "outcome": "infra_error" if i < 3 else "success", "success": i >= 3, "return": 1.0,
            "vmax": 0, "vmin": 0, "t": float(i), "train_version": 0} for i in range(10)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    mon = report.Monitor(tmp_path)
    mon.poll()
    rep = report.write_report(tmp_path, mon, wall_s=1.0, sft_used=False, sft_s=None, status="done",
                              restarts={"envd": 2})
    w = rep["warnings"]
    assert any("3 of 10 episodes (30%) were infra errors" in x for x in w), w
    assert any("no policy update happened" in x for x in w), w
    assert any("envd x2" in x for x in w), w
    assert json.loads((tmp_path / "report.json").read_text())["warnings"] == w
    assert (tmp_path / "learning.png").stat().st_size > 0
    # a healthy run: none of these
    (tmp_path / "learner.jsonl").write_text(json.dumps({"version": 1, "success": 1.0, "ret": 1.0}) + "\n")
    eps = [dict(e, outcome="success") for e in eps]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    mon = report.Monitor(tmp_path)
    mon.poll()
    assert report.write_report(tmp_path, mon, 1.0, False, None, "done")["warnings"] == []


def test_report_counts_only_this_runs_episodes_when_the_directory_was_used_before(tmp_path):
    """`tars up` again into the same --out: the learner appends to episodes.jsonl / learner.jsonl, so the first
    10 % of the file are the earlier run's. The report's figures are those logged since this run started."""
    from tars import report

    eps = [{"id": f"e{i}", "outcome": "terminated", "success": i >= 10, "return": 1.0, "vmax": 0, "vmin": 0,
            "t": float(i if i < 10 else 100 + i), "train_version": 0} for i in range(20)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    (tmp_path / "learner.jsonl").write_text(json.dumps({"version": 9, "t": 5.0}) + "\n"
                                            + json.dumps({"version": 2, "t": 120.0}) + "\n")
    mon = report.Monitor(tmp_path)
    mon.poll()
    rep = report.write_report(tmp_path, mon, 1.0, False, None, "done", since=50.0)
    assert (rep["episodes"], rep["success_first"], rep["success_last"]) == (10, 1.0, 1.0)
    assert rep["policy_version"] == 2 and rep["rl_s"] == 9.0
    everything = report.write_report(tmp_path, mon, 1.0, False, None, "done")
    assert (everything["episodes"], everything["success_first"]) == (20, 0.0)


def test_report_counts_an_episode_replayed_after_a_learner_restart_once(tmp_path):
    """A restarted learner replays the trajectories it had not trained on: their arrivals are logged again (same ids,
    a later train_version). The report counts each episode once, at its first line, also across polls."""
    from tars import report

    first = [{"id": f"e{i}", "outcome": "terminated", "success": i < 2, "return": 1.0, "vmax": 0, "vmin": 0,
              "t": float(i), "train_version": 0} for i in range(4)]
    replayed = [dict(e, t=10.0 + i, train_version=3) for i, e in enumerate(first[:2])]  # the two successes again
    p = tmp_path / "episodes.jsonl"
    p.write_text("".join(json.dumps(e) + "\n" for e in first))
    mon = report.Monitor(tmp_path)
    mon.poll()
    with open(p, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in replayed + [dict(first[3], id="e4", t=12.0)]))
    mon.poll()
    assert [e["id"] for e in mon.eps] == ["e0", "e1", "e2", "e3", "e4"] and mon.eps[0]["train_version"] == 0
    rep = report.write_report(tmp_path, mon, 1.0, False, None, "done")
    assert rep["episodes"] == 5 and rep["scored_episodes"] == 5


def test_the_live_monitor_of_a_rerun_reads_only_its_own_records(tmp_path):
    """tars up's progress line and its target_success stop read a Monitor started at the end of the logs: an
    earlier run's successes in the same --out neither show as this run's nor end it at once."""
    from tars import report

    old = [{"id": f"o{i}", "outcome": "terminated", "success": True, "return": 1.0, "t": float(i)} for i in range(50)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    (tmp_path / "learner.jsonl").write_text(json.dumps({"version": 80, "t": 1.0}) + "\n")
    mon = report.Monitor(tmp_path).at_end()
    mon.poll()
    assert mon.episodes == 0 and mon.rolling_success() is None
    with open(tmp_path / "episodes.jsonl", "a") as f:
        f.write(json.dumps({"id": "n0", "outcome": "terminated", "success": False, "return": 0.0, "t": 99.0}) + "\n")
    mon.poll()
    assert mon.episodes == 1 and mon.rolling_success() == 0.0 and mon.steps == []
    assert report.Monitor(tmp_path / "nothing-yet").at_end().episodes == 0


def test_report_warns_when_the_context_cut_most_episodes(tmp_path):
    """Episodes cut by the context (a VL prompt with screenshots over inference.max_context) are named, with the
    settings to change, instead of a run that silently learns nothing."""
    from tars import report

    eps = [{"id": f"e{i}", "outcome": "truncated", "truncated_by": "context" if i < 4 else "max_turns",
            "success": False, "return": 0.0, "vmax": 0, "vmin": 0, "t": float(i), "train_version": 0}
           for i in range(10)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    (tmp_path / "learner.jsonl").write_text(json.dumps({"version": 1, "success": 0.0, "ret": 0.0}) + "\n")
    mon = report.Monitor(tmp_path)
    mon.poll()
    w = report.write_report(tmp_path, mon, 1.0, False, None, "done")["warnings"]
    assert w == ["4 of 10 episodes (40%) were cut by the context (prompt + actor.max_new_tokens > "
                 "inference.max_context): raise inference.max_context, or lower actor.image_history / "
                 "actor.max_obs_tokens"], w
    eps = [dict(e, truncated_by="max_turns") for e in eps]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    mon = report.Monitor(tmp_path)
    mon.poll()
    assert report.write_report(tmp_path, mon, 1.0, False, None, "done")["warnings"] == []


def test_report_warns_when_the_wall_backstop_cut_a_run_budgeted_by_versions(tmp_path):
    """A run budgeted by max_versions that the wall budget stopped early says so (a slow host's figures are not
    comparable); one that reached max_versions, or stopped for another reason, does not."""
    from tars import report

    eps = [{"id": f"e{i}", "outcome": "success", "success": True, "return": 1.0, "vmax": 0, "vmin": 0,
            "t": float(i), "train_version": 0} for i in range(10)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    (tmp_path / "learner.jsonl").write_text("".join(json.dumps({"version": v, "success": 1.0, "ret": 1.0}) + "\n"
                                                    for v in range(1, 8)))
    mon = report.Monitor(tmp_path)
    mon.poll()
    rep = report.write_report(tmp_path, mon, 1.0, False, None, "wall budget reached", max_versions=300)
    assert rep["max_versions"] == 300
    assert rep["warnings"] == ["the wall budget (wall_budget_s) stopped RL at policy version 7 of max_versions 300: "
                               "this host trained fewer updates than the run asked for, so its figures are not "
                               "comparable with a run that reached max_versions"], rep["warnings"]
    assert json.loads((tmp_path / "report.json").read_text())["warnings"] == rep["warnings"]
    assert report.write_report(tmp_path, mon, 1.0, False, None, "wall budget reached", max_versions=7)["warnings"] == []
    assert report.write_report(tmp_path, mon, 1.0, False, None, "done", max_versions=300)["warnings"] == []
    assert report.write_report(tmp_path, mon, 1.0, False, None, "wall budget reached")["warnings"] == []


def test_children_keep_the_parents_pythonpath_after_the_checkout(tmp_path, monkeypatch):
    """A dependency installed with --target (on the parent's PYTHONPATH) stays importable in a role started with
    tars.topology.pythonpath, and this checkout comes first."""
    import pathlib
    import subprocess
    import sys

    from tars.topology import pythonpath

    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_the_parents_path.py").write_text("X = 7\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    root = pathlib.Path(__file__).resolve().parent.parent
    assert pythonpath(root).split(os.pathsep) == [str(root), str(site)]
    probe = "import only_on_the_parents_path as m, tars, sys; print(m.X, tars.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": pythonpath(root)},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    x, tars_file = out.stdout.split()
    assert x == "7" and pathlib.Path(tars_file).resolve().is_relative_to(root)
    monkeypatch.delenv("PYTHONPATH")
    assert pythonpath(root) == str(root)


_PARENT_KILLED_AT_LAUNCH = """
import os, pathlib, signal, sys
from core import config as C
from tars.topology import Topology, plan
out = pathlib.Path(sys.argv[1])
cfg = C.load(None, None, [])
C.save(cfg, out / "config.yaml")
proc = Topology(plan(cfg, out, None, inference=False, learner=False, n_actors=0)).launch("envd")
(out / "child.pid").write_text(str(proc.pid))
os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or `kill -9` would, while envd is still importing
"""


def test_a_role_whose_parent_is_killed_while_it_starts_does_not_stay(tmp_path):
    """PDEATHSIG (core.proc.die_with_parent) is set by the role itself, seconds after its start (imports, config,
    checks): a `tars up` SIGKILLed in that window left the role running for good, reparented to init, its port
    bound (an envd was still listening 15 s later). The role now finds its parent gone and ends."""
    import pathlib
    import subprocess
    import sys

    from core.proc import pid_alive

    out = tmp_path / "run"
    out.mkdir()
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _PARENT_KILLED_AT_LAUNCH, str(out)], cwd=root, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    child = int((out / "child.pid").read_text())
    try:
        deadline = time.monotonic() + 60
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(child), (out / "logs" / "envd.log").read_text()[-2000:]
        assert not (out / "run" / "envd.json").exists()  # it never came up
    finally:
        try:
            os.killpg(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_parent_pid_a_role_checks_is_not_passed_on_to_its_children(tmp_path):
    """A role whose parent is there keeps running, and $TARS_PARENT_PID is gone from its environment (a process the
    role starts, whose parent is the role, must not take `tars up`'s pid for its own parent's)."""
    import pathlib
    import subprocess
    import sys

    from core.proc import PARENT_ENV

    probe = "import os; from core.proc import die_with_parent; die_with_parent(); print(os.environ.get('%s'))" % PARENT_ENV
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), PARENT_ENV: str(os.getpid())}
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "None"), r.stderr
