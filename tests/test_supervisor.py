"""The supervisor of `tars up` (tars/supervisor.py) over real processes: a killed envd daemon comes back on its old
port with backoff and serves again; a process that keeps dying ends the run once it has used up its restarts.
(The whole `tars up` under kills is tests/test_faults.py, in the slow set.)"""
import os
import signal
import time

import grpc

from core import config as C
from core import rpc
from core.v1 import control_pb2, control_pb2_grpc
from tars.supervisor import Supervisor, read_events
from tars.topology import Topology, plan


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
        sup = Supervisor(topo, max_restarts=2, backoff_s=0.2)
        assert sup.poll() is None and sup.counts() == {}
        os.killpg(pid0, signal.SIGKILL)
        _poll_until(sup, lambda end: sup.counts() == {"envd": 1}, 60)
        assert topo.envd == addr                               # the same address the actors already use
        assert topo.ready[("envd", 0)]["pid"] != pid0
        assert _serves(addr, cfg)
        events = [e["event"] for e in read_events(topo.plan.out)]
        assert events == ["died", "restarting", "up"], events


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
        # From now on envd cannot start: its config file is gone.
        (topo.plan.out / "config.yaml").rename(topo.plan.out / "config.yaml.away")
        os.killpg(topo.ready[("envd", 0)]["pid"], signal.SIGKILL)
        end = _poll_until(sup, lambda end: end is not None, 90)
        assert "envd died 4 times" in end
        ev = read_events(topo.plan.out)
        starts = [e["t"] for e in ev if e["event"] == "restarting"]
        deaths = [e["t"] for e in ev if e["event"] == "died"]
        assert len(starts) == 3 and len(deaths) == 4
        gaps = [s - d for d, s in zip(deaths, starts)]       # death -> next start: 0.3, 0.6, 1.2 s
        assert gaps[0] >= 0.3 and gaps[1] >= 0.6 and gaps[2] >= 1.2, gaps
