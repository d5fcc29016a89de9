"""`tars up` with a judge of its own (actor.judge_model): the topology serves it on an inference server of its own,
hands its address to the actors, and never gives it the learner's weights (tars/topology.py)."""
from __future__ import annotations

import pathlib

import pytest

from core import config as C
from tars.topology import STOP_TIERS, Plan, Topology, plan


def _topology(tmp_path, **sets) -> Topology:
    cfg = C.load("quickstart", None, [f"{k}={v}" for k, v in sets.items()])
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    C.save(cfg, out / "config.yaml")
    return Topology(plan(cfg, out, tmp_path / "model"))


def _announce(topo: Topology) -> None:
    """The ready files' addresses, as the roles would announce them."""
    topo.ready.update({("envd", 0): {"address": "127.0.0.1:7001"}, ("inference", 0): {"address": "127.0.0.1:7002"},
                       ("learner", 0): {"stream": "tcp://127.0.0.1:7004"}})
    if topo.plan.count("judge"):
        topo.ready[("judge", 0)] = {"address": "127.0.0.1:7003"}


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_a_judge_model_gets_a_server_of_its_own_that_the_learner_never_updates(tmp_path):
    judge = tmp_path / "judge"
    topo = _topology(tmp_path, **{"actor.judge_mode": "add", "actor.judge_model": str(judge), "actors": 2})
    assert topo.plan.judge == judge.resolve() and topo.plan.count("judge") == 1
    assert topo.plan.name("judge", 0) == "judge"
    _announce(topo)
    j = topo.spec("judge").argv
    assert j[3] == "serve" and _opt(j, "--model") == str(judge.resolve()) and "--version" not in j
    assert "inference.engine=local" in j  # never the policy's SGLang servers (attached or launched)
    assert _opt(topo.spec("learner").argv, "--inference") == "127.0.0.1:7002"  # publishes to the policy's only
    for i in range(2):
        a = topo.spec("actor", i).argv
        assert "actor.judge_inference=127.0.0.1:7003" in a and _opt(a, "--inference") == "127.0.0.1:7002"
    # a restarted inference server comes back with the newest published weights; the judge with its own model
    # (on its old port), whatever the learner has published
    topo._weights = (tmp_path / "weights" / "v9", 9)  # what relaunch("inference") sets from the newest published
    assert _opt(topo.spec("inference").argv, "--version") == "9"
    j = topo.spec("judge").argv
    assert _opt(j, "--model") == str(judge.resolve()) and "--version" not in j and _opt(j, "--port") == "7003"
    assert any("judge" in tier and "inference" in tier for tier in STOP_TIERS)


@pytest.mark.parametrize("sets", [
    {"actor.judge_mode": "add"},                                                  # the policy judges itself
    {"actor.judge_model": "/x/judge"},                                            # no judge at all
    {"actor.judge_mode": "add", "actor.judge_model": "/x/judge", "actor.judge_inference": "10.0.0.5:50051"},
])
def test_no_judge_server_unless_a_judge_model_has_none(tmp_path, sets):
    topo = _topology(tmp_path, **sets)
    assert topo.plan.judge is None and topo.plan.count("judge") == 0
    _announce(topo)
    a = topo.spec("actor", 0).argv
    assert not any(x.startswith("actor.judge_inference=") for x in a)  # the config's own, if any, stands


def test_the_judge_takes_a_metrics_port_after_the_inference_server(tmp_path):
    p = Plan(tmp_path, tmp_path / "config.yaml", None, n_actors=1, metrics_port=9400, judge=pathlib.Path("/j"))
    assert p.metrics_ports() == {("envd", 0): 9400, ("inference", 0): 9401, ("judge", 0): 9402, ("actor", 0): 9403,
                                 ("learner", 0): 9404}
