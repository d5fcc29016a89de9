"""The held-out evaluation at the end of `tars up` (tars/heldout.py), and MiniWoB++ demonstrations from the DOM
oracle (tars/demos.py): what the policy is taught to write, parsed back and executed, wins the task."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from core import config as C
from tars import heldout, report

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _res(rates: dict, infra: int = 0) -> dict:
    return {"tasks": {t: {"success_rate": r} for t, r in rates.items()}, "overall": {"infra_errors": infra},
            "complete": True}


def test_summary_gives_both_policies_per_task_the_means_and_names_a_task_that_got_worse():
    h = heldout.summary(_res({"a": 0.2, "b": 0.5, "c": 0.9, "d": None}), _res({"a": 0.6, "b": 0.5, "c": 0.8, "d": 0.3}),
                        "SFT", 50)
    assert h["tasks"]["a"] == {"start": 0.2, "final": 0.6, "delta": pytest.approx(0.4), "delta_ci95": None}
    assert h["tasks"]["d"]["delta"] is None                        # unscored on one side: out of the means
    assert h["mean_start"] == pytest.approx((0.2 + 0.5 + 0.9) / 3) and h["mean_final"] == pytest.approx((0.6 + 0.5 + 0.8) / 3)
    assert h["delta"] == pytest.approx(0.1) and h["worst_delta"] == pytest.approx(-0.1)
    (w,) = report.held_out_warnings(h)
    assert "c (-0.10)" in w and "a " not in w and "b " not in w
    md = heldout.markdown(h)
    assert "| a | 0.200 | 0.600 | +0.400 |" in md and "**mean**" in md
    ok = heldout.summary(_res({"a": 0.5}), _res({"a": 0.46}), "SFT", 50)
    assert report.held_out_warnings(ok) == []                               # within 0.05: not a drop worth a warning


def test_a_rerun_in_the_same_out_evaluates_its_own_policy_on_its_own_seeds(tmp_path, monkeypatch):
    """`tars up` again into the same --out: out/heldout/{start,final} hold the earlier run's episodes. A directory
    whose policy (its weights files) or seeds differ is started over, not resumed; one whose policy and seeds are
    the same resumes (nothing replayed)."""
    from tars import eval as E

    played = []

    class Fake(E.Policy):  # stands in for ModelPolicy: its name is the checkpoint's path, it wins iff "wins" is there
        def __init__(self, model, cfg, tokenizer="", envd=""):
            self.name = str(pathlib.Path(model).resolve())

        async def episode(self, task, i, seed):
            ok = (pathlib.Path(self.name) / "wins").exists()
            played.append((pathlib.Path(self.name).name, seed))
            return E._record(task, i, seed, "terminated", ok, float(ok), 1, "", 0.0, {})

    monkeypatch.setattr(E, "ModelPolicy", Fake)
    for d in ("model", "final"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(b"run 1")
    cfg = C.load("quickstart", overrides=["evaluation.episodes=4", "actor.env_ids=[builtin/click]"])
    say = []
    h1 = heldout.run(cfg, tmp_path, tmp_path / "model", "SFT", say.append)
    assert (h1["mean_start"], h1["mean_final"]) == (0.0, 0.0) and len(played) == 8
    # run 2, same seeds: a new final policy (rewritten weights) that wins; the start policy is the same files
    (tmp_path / "final" / "model.safetensors").write_bytes(b"run 2, other weights")
    (tmp_path / "final" / "wins").touch()
    played.clear()
    h2 = heldout.run(cfg, tmp_path, tmp_path / "model", "SFT", say.append)
    assert (h2["mean_start"], h2["mean_final"]) == (0.0, 1.0)
    assert [m for m, _ in played] == ["final"] * 4            # start resumed, final played again
    assert any("held another evaluation (policy " in m and "starting it over" in m for m in say)
    ok = lambda f: [json.loads(x)["success"] for x in f.read_text().splitlines()]  # noqa: E731
    assert ok(tmp_path / "heldout" / "final" / "episodes.previous.1.jsonl") == [False] * 4  # run 1's final
    assert any("episodes are now in episodes.previous.1.jsonl" in m for m in say)
    # run 3 with another seed: both are played again, on the new seeds, the same for both
    cfg7 = C.load("quickstart", overrides=["evaluation.episodes=4", "actor.env_ids=[builtin/click]", "seed=7"])
    played.clear()
    heldout.run(cfg7, tmp_path, tmp_path / "model", "SFT", say.append)
    want = sorted(heldout.suite(cfg7).seed_of("builtin/click", i) for i in range(4))
    assert sorted(s for m, s in played if m == "model") == want == sorted(s for m, s in played if m == "final")
    for key in ("start", "final"):
        eps = [json.loads(x) for x in (tmp_path / "heldout" / key / "episodes.jsonl").read_text().splitlines()]
        assert sorted(e["seed"] for e in eps) == want
        meta = json.loads((tmp_path / "heldout" / key / "eval.json").read_text())
        assert meta["seed"] == 7 and meta["held_out"] is True and meta["policy"].startswith("sha256:")
    # every earlier evaluation is kept: run 3 started final over again without overwriting run 1's episodes
    fin = tmp_path / "heldout" / "final"
    assert ok(fin / "episodes.previous.1.jsonl") == [False] * 4 and ok(fin / "episodes.previous.2.jsonl") == [True] * 4
    assert ok(tmp_path / "heldout" / "start" / "episodes.previous.1.jsonl") == [False] * 4


_SIGTERM_DURING_HELD_OUT = """
import os, pathlib, signal, sys, time
from core import config as C
from tars import heldout, up
out = pathlib.Path(sys.argv[1])
(out / "final").mkdir(parents=True)
for n in ("config.json", "model.safetensors"):
    (out / "final" / n).write_text("{}")
def run(*a, **k):  # the held-out evaluation, minutes long; a SIGTERM comes (systemd stop, `timeout`, a pod ending)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
heldout.run = run
cfg = C.load(None, None, ["evaluation.episodes=1"])
print(up._held_out(cfg, out, out / "final", False, "done", time.time() - 5, print), flush=True)
print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


def test_a_sigterm_during_the_held_out_evaluation_ends_it_as_ctrl_c_does(tmp_path):
    """SIGTERM is Ctrl-C to `tars up` while it runs, but during the held-out evaluation at its end the default action
    killed it at once (status 143): no report.json for a run whose training had finished. It now ends the
    evaluation as Ctrl-C does (status "interrupted"; the report follows), and the handler is put back."""
    r = subprocess.run([sys.executable, "-c", _SIGTERM_DURING_HELD_OUT, str(tmp_path / "run")], cwd=ROOT, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.splitlines()[-2:] == ["(None, 'interrupted')", "True"], r.stdout


@pytest.mark.timeout(400)
def test_tars_up_evaluates_the_start_and_the_final_policy_on_the_same_held_out_seeds(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tars.cli", "up", "--preset", "quickstart", "--out", str(out), "--quiet",
           "--set", "sft.steps=5", "--set", "learner.batch_size=16", "--set", "actor.concurrency=16",
           "--set", "max_versions=2", "--set", "wall_budget_s=120", "--set", "learner.value_pretrain.steps=0",
           "--set", "actor.env_ids=[builtin/click,builtin/form]", "--set", "evaluation.episodes=6"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    h = rep["held_out"]
    assert set(h["tasks"]) == {"builtin/click", "builtin/form"} and h["start_model"] == "SFT"
    for v in h["tasks"].values():
        assert 0.0 <= v["start"] <= 1.0 and 0.0 <= v["final"] <= 1.0
    seeds = {}
    for key in ("start", "final"):
        eps = [json.loads(x) for x in (out / "heldout" / key / "episodes.jsonl").read_text().splitlines()]
        assert len(eps) == 12
        seeds[key] = sorted((e["task"], e["episode"], e["seed"]) for e in eps)
        assert all(e["seed"] >= C.HELD_OUT_SEED_BASE for e in eps)
        rates = {t: sum(e["success"] for e in eps if e["task"] == t) / 6 for t in h["tasks"]}
        assert rates == {t: pytest.approx(v[key]) for t, v in h["tasks"].items()}   # the figures are these episodes'
    assert seeds["start"] == seeds["final"]
    meta = {k: json.loads((out / "heldout" / k / "eval.json").read_text())["model"] for k in ("start", "final")}
    assert meta == {"start": str(out / "model"), "final": str(out / "final")}
    md = (out / "heldout" / "summary.md").read_text()
    assert "| builtin/click |" in md and "| builtin/form |" in md and "**mean**" in md


def test_miniwob_oracle_demonstrations_parse_back_and_win_when_replayed():
    """The oracle's episodes as the text the policy is taught (actor.tiny.format_action), parsed by the actor's
    parser and replayed on a fresh env with the same seed, win: typing names its field (type(target=...)),
    several steps run in order, and only won episodes are kept."""
    pytest.importorskip("miniwob")
    from actor.parsing import parse_response
    from actor.tiny import format_action
    from envd import registry
    from tars import demos

    ids = ["miniwob/enter-text", "miniwob/login-user"]
    eps = demos.roll(ids, 4, "oracle", seed=3, max_turns=6)
    assert len(eps) == 4 and [len(e) for e in eps] == [2, 3, 2, 3]   # enter-text: type, submit; login: type x2, login
    seeds = {e: demos.episode_seeds(3, e) for e in ids}
    for i, ep in enumerate(eps):
        env_id = ids[i % 2]
        env = registry.make(env_id, {"max_steps": "6"})
        try:
            seed = next(seeds[env_id])
            assert seed < C.HELD_OUT_SEED_BASE
            r = env.reset(seed)
            assert r.instruction == ep[0][1] and r.text == ep[0][0]     # the demonstrated episode, replayed
            for text, _, action, _ in ep:
                assert r.text == text
                (a,) = parse_response(format_action(action))[1]
                assert a.target and (a.type != "type" or a.content)
                r = env.step(a)
            assert r.info["success"] is True
        finally:
            env.close()
