"""Operator-facing paths: `tars up` with a fixed /metrics port (a port per role, checked at pre-flight), `tars ctl
sessions kill` across several envds, telemetry config errors as one line."""
import socket

import pytest

from core.config import ConfigError
from test_sglang_pool import _free_port_run  # a run of consecutive free ports, below the ephemeral range


def test_up_with_a_fixed_metrics_port_gives_each_role_its_own(tmp_path):
    from tars import cli
    from tars.topology import Plan, Topology

    base = _free_port_run(5)

    def preflight(port):
        a = cli.build_parser().parse_args(["up", "--preset", "quickstart", "--out", str(tmp_path / "run"),
                                           "--set", "actors=2", "--set", f"telemetry.prometheus_port={port}"])
        cli.preflight(a, cli._load(a))

    preflight(base)  # envd, inference, actor0, actor1, learner: base .. base+4, all free
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 3))
        taken.listen(1)
        with pytest.raises(ConfigError, match=rf"telemetry.prometheus_port={base}.*port {base + 3} \(actor 1\)"):
            preflight(base)
    with pytest.raises(ConfigError, match="> 65535"):
        preflight(65533)

    out = tmp_path / "topo"
    topo = Topology(Plan(out, out / "config.yaml", None, n_actors=2, metrics_port=base))
    topo.ready[("learner", 0)] = {"stream": "127.0.0.1:1", "address": "127.0.0.1:2"}
    ports = []
    for role, i in [("envd", 0), ("inference", 0), ("actor", 0), ("actor", 1), ("learner", 0)]:
        argv = topo.spec(role, i).argv
        ports.append([x for x in argv if x.startswith("telemetry.prometheus_port=")])
    assert ports == [[f"telemetry.prometheus_port={base + n}"] for n in range(5)]
    topo0 = Topology(Plan(out, out / "config.yaml", None, n_actors=1, metrics_port=0))  # 0: each picks a free one
    assert not any("prometheus_port" in x for x in topo0.spec("envd").argv)


def _ctl(monkeypatch, capsys, answers: dict, *argv):
    from tars import cli, ctl

    def fake_call(t, what, args, token, timeout):
        ok, msg = answers[t["address"]]
        return {"target": t["address"], "role": "envd", "ok": ok, "message": msg, "result": {}}

    monkeypatch.setattr(ctl, "_call", fake_call)
    targets = [x for addr in answers for x in ("--target", addr)]
    rc = cli.main(["ctl", *argv, *targets])
    return rc, capsys.readouterr().out


def test_kill_session_across_envds_succeeds_when_one_closed_it(monkeypatch, capsys):
    rc, out = _ctl(monkeypatch, capsys, {"h:1": (False, "unknown session 's1'"), "h:2": (True, "session s1 closed"),
                                         "h:3": (False, "unknown session 's1'")}, "sessions", "kill", "s1")
    assert rc == 0, out
    assert "FAILED" not in out and out.count("not here (closed on h:2)") == 2
    rc, out = _ctl(monkeypatch, capsys, {"h:1": (False, "unknown session 's1'"), "h:2": (False, "unknown session 's1'")},
                   "kill-session", "s1")
    assert rc == 1 and "no envd has session 's1' (2 asked)" in out


@pytest.mark.parametrize("bad", ["-1", "0", "nan", "inf", "abc"])
def test_ctl_timeout_must_be_positive_seconds(bad, capsys):
    from tars import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["ctl", "status", "--timeout", bad, "--target", "127.0.0.1:1"])
    assert e.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_deploy_files_do_not_set_a_service_name_tars_ignores():
    """service.name is the role (span files and the `role` label key on it): OTEL_SERVICE_NAME would be ignored."""
    import pathlib

    deploy = pathlib.Path(__file__).resolve().parent.parent / "deploy"
    assert not [str(f) for f in deploy.rglob("*") if f.is_file() and "OTEL_SERVICE_NAME" in f.read_text()]


def test_multi_gpu_learner_recipe_ports_clear_of_the_other_roles():
    """docs/deploy.md's accelerate recipe: rank n serves PORT + n; none may be a port of envd, inference, actors."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
    line = next(x for x in text.splitlines() if "accelerate launch --num_processes" in x and "learner" in x)
    n = int(re.search(r"--num_processes (\d+)", line).group(1))
    port = re.search(r"telemetry\.prometheus_port=(\S+)", line).group(1)
    assert port.isdigit(), f"the recipe must name its own base port, not {port}"
    ranks = set(range(int(port), int(port) + n))
    others = {9464, 9465, *range(9470, 9480)}  # envd, inference, actors 0-9 (deploy/systemd/env/*.env)
    assert not ranks & others, sorted(ranks & others)


def test_ctl_status_names_the_judge_server_apart_from_the_policys(tmp_path, capsys):
    """A run with a judge of its own has two inference servers (run/inference.json, run/judge.json): status says
    which is which (here both down: their pids are gone)."""
    import json
    import subprocess
    import sys

    from tars import cli

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "run").mkdir()
    (tmp_path / "config.yaml").write_text("{}\n")
    for name, port in (("inference", 7102), ("judge", 7103)):
        (tmp_path / "run" / f"{name}.json").write_text(json.dumps({"role": "inference", "address": f"127.0.0.1:{port}",
                                                                   "pid": int(dead)}))
    cli.main(["ctl", "status", "--run", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert any(x.startswith("inference ") and "127.0.0.1:7102" in x and "DOWN" in x for x in lines), lines
    assert any(x.startswith("inference (judge)") and "127.0.0.1:7103" in x for x in lines), lines
