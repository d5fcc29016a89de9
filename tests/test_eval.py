"""`tars eval`: suites, scripted baselines, a real checkpoint through envd + inference, resume, infra-error
accounting, human-normalised scores, comparison, and clear errors for bad suites."""
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from envd import registry
from envd.base import Action, ActionError, Env, Outcome, StepResult
from core import config as C
from tars import eval as E
from tars import evalsuite as S
from tars import evalstats

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _suite(tmp_path, text: str, name: str = "suite.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def _run(suite, policy, out, **kw):
    return asyncio.run(E.evaluate(suite, policy, out, say=None, **kw))


# ---- a fake backend the tests register: succeeds on "click OK"; crashes on odd seeds; optional slowness -----

class FakeEnv(Env):
    actions: list = []
    lock = threading.Lock()

    def __init__(self, name: str, options: dict):
        self.mode = name
        self.delay = float(options.get("delay", 0))
        self.seed = 0

    def reset(self, seed, options=None):
        self.seed = seed
        return StepResult(text="[button OK]", instruction="click OK", width=100, height=50)

    def step(self, action):
        time.sleep(self.delay)
        with FakeEnv.lock:
            FakeEnv.actions.append(action)
        if (self.mode == "crashy" and self.seed % 2) or self.mode == "dead":
            raise RuntimeError("the browser died")
        if action.type != "click":
            raise ActionError("only clicks here")
        info = {"success": True}
        if self.mode == "game":  # a game that reports its score and a human reference
            info.update(score=float(self.seed % 10), human_score=20.0)
        return StepResult(text="done", instruction="click OK", reward=1.0, outcome=Outcome.TERMINATED, info=info)

    def oracle_action(self):
        return Action("click", target="OK")


@pytest.fixture
def fake_env():
    registry.register("evaltest", lambda name, opts: FakeEnv(name, opts), ["ok", "crashy", "game", "dead"])
    FakeEnv.actions = []
    yield
    registry.unregister("evaltest")


def _cfg():
    return C.load(None, None, [])


# ---- scripted baselines -----------------------------------------------------------------------------------

def test_builtin_suite_oracle_solves_and_random_does_not(tmp_path):
    suite = S.load_suite("builtin", episodes=10)
    assert [t.env_id for t in suite.tasks] == ["builtin/click", "builtin/menu", "builtin/form", "builtin/dialog"]
    cfg = _cfg()
    oracle = _run(suite, E.ScriptedPolicy("oracle", cfg), tmp_path / "oracle")
    rand = _run(suite, E.ScriptedPolicy("random", cfg), tmp_path / "random")
    assert oracle["overall"]["success_rate"] == 1.0 and oracle["overall"]["episodes"] == 40
    assert oracle["tasks"]["builtin/menu"]["mean_steps"] == 2.0
    assert rand["overall"]["success_rate"] < 0.4 and rand["overall"]["infra_errors"] == 0
    # both policies saw the same episodes (seeds depend on the suite, task and index only)
    seeds = lambda d: {(r["task"], r["episode"]): r["seed"] for r in _lines(d / "episodes.jsonl")}  # noqa: E731
    assert seeds(tmp_path / "oracle") == seeds(tmp_path / "random")
    for d in ("oracle", "random"):
        res = json.loads((tmp_path / d / "results.json").read_text())
        assert res["model"] == d and set(res["tasks"]) == {t.name for t in suite.tasks}
        assert "| builtin/click | 10 |" in (tmp_path / d / "results.md").read_text()
        assert (tmp_path / d / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_noisy_baseline_lies_between_the_oracle_and_random_and_bad_specs_are_refused(tmp_path):
    suite = S.load_suite("builtin", episodes=10)
    cfg = _cfg()
    runs = {p: _run(suite, E.make_policy(p, cfg), tmp_path / p.replace(":", "_"))
            for p in ("noisy:1", "noisy:0", "noisy:0.5")}
    assert runs["noisy:1"]["overall"]["success_rate"] == 1.0  # the oracle's every action
    assert runs["noisy:1"]["tasks"]["builtin/menu"]["mean_steps"] == 2.0
    assert runs["noisy:0"]["overall"]["success_rate"] < 0.4  # the random one's
    assert runs["noisy:0"]["overall"]["success_rate"] < runs["noisy:0.5"]["overall"]["success_rate"] < 1.0
    assert all(r["overall"]["infra_errors"] == 0 for r in runs.values())
    assert json.loads((tmp_path / "noisy_0.5" / "results.json").read_text())["model"] == "noisy:0.5"
    for bad in ("noisy:2", "noisy:x", "noisy:", "noisy:nan"):
        with pytest.raises(E.EvalError, match="hint_policy"):
            E.make_policy(bad, cfg)


def test_random_policy_clicks_inside_the_screen_of_a_backend_without_random_action(tmp_path, fake_env):
    suite = S.load_suite(_suite(tmp_path, "episodes: 5\ntasks: [evaltest/ok]\n"))
    res = _run(suite, E.ScriptedPolicy("random", _cfg()), tmp_path / "out")
    assert res["overall"]["success_rate"] == 1.0
    assert len(FakeEnv.actions) == 5
    for a in FakeEnv.actions:
        assert a.type == "click" and 0 <= a.point[0] < 100 and 0 <= a.point[1] < 50


# ---- infra errors -----------------------------------------------------------------------------------------

def test_infra_errors_are_counted_apart_and_excluded_from_rates(tmp_path, fake_env):
    suite = S.load_suite(_suite(tmp_path, "episodes: 12\ntasks: [evaltest/crashy, evaltest/ok]\n"))
    crashes = sum(suite.seed_of("evaltest/crashy", i) % 2 for i in range(12))
    assert 0 < crashes < 12  # the seeds exercise both paths
    res = _run(suite, E.ScriptedPolicy("oracle", _cfg()), tmp_path / "out")
    t = res["tasks"]["evaltest/crashy"]
    assert t["infra_errors"] == crashes and t["scored"] == 12 - crashes and t["episodes"] == 12
    assert t["success_rate"] == 1.0  # the crashes are not failures
    assert res["overall"]["infra_errors"] == crashes and res["overall"]["success_rate"] == 1.0
    bad = [r for r in _lines(tmp_path / "out" / "episodes.jsonl") if r["outcome"] == "infra_error"]
    assert len(bad) == crashes and all("the browser died" in r["error"] and not r["success"] for r in bad)


def test_overall_figures_say_which_tasks_they_cover_and_warn_about_infra_errors():
    """The issue's example: 7 of 12 episodes infra errors, two tasks without a scored episode. The overall rate
    averages the two scored tasks only and says so; results.json and results.md carry the warnings."""
    suite = S.Suite("s", "s.yaml", [S.TaskSpec(n, f"builtin/{n}", 3) for n in ("click", "menu", "form", "dialog")])
    rec = lambda task, i, outcome, ok=False: {"task": task, "episode": i, "outcome": outcome, "success": ok,  # noqa: E731
                                              "return": float(ok), "steps": 1}
    records = ([rec("click", i, "terminated", i == 0) for i in range(3)]
               + [rec("menu", 0, "infra_error")] + [rec("menu", i, "truncated") for i in (1, 2)]
               + [rec(t, i, "infra_error") for t in ("form", "dialog") for i in range(3)])
    res = S.summarise(suite, records)
    o = res["overall"]
    assert o["tasks"] == 4 and o["tasks_scored"] == 2 and o["tasks_unscored"] == ["form", "dialog"]
    assert o["infra_errors"] == 7 and o["scored"] == 5 and o["success_rate"] == pytest.approx((1 / 3 + 0) / 2)
    assert res["tasks"]["menu"]["infra_errors"] == 1 and res["tasks"]["form"]["success_rate"] is None
    # results.png: menu's success rate 0 is a bar of height 0; form and dialog (no scored episode) get no bar, an n/a
    import matplotlib.pyplot as plt

    fig = S.figure(res)
    ax = fig.axes[0]
    bars = {round(b.get_x() + b.get_width() / 2): b.get_height() for b in ax.patches}
    assert bars == {0: pytest.approx(1 / 3), 1: 0.0}
    assert sorted((round(t.get_position()[0]), t.get_text()) for t in ax.texts) == [(2, "n/a"), (3, "n/a")]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["click", "menu", "form", "dialog"]
    plt.close(fig)
    assert "over 2 of 4 tasks (2 with no scored episode)" in S.headline(o) and "7 unscored" in S.headline(o)
    assert len(res["warnings"]) == 2
    assert res["warnings"][0].startswith("7 of 12 episodes (58%) were infra errors")
    assert "2 of 4 task(s) had no scored episode" in res["warnings"][1] and "form, dialog" in res["warnings"][1]
    md = S.markdown(res)
    assert "| form | 3 | 0 | - |" in md and "## Warnings" in md and "over the 2 of 4 tasks" in md
    # below the 10 % rule (shared with tars up's report: tars.report.infra_warning) and every task scored: no warning
    quiet = S.summarise(suite, [rec(t, i, "terminated", True) for t in ("click", "menu", "form", "dialog")
                                for i in range(3)])
    assert quiet["warnings"] == [] and S.headline(quiet["overall"]).startswith("success 1.000 over 4 tasks,")
    # episodes beyond the plan (a directory run with --episodes 10, resumed with --episodes 4) are in no figure
    extra = S.summarise(S.Suite("s", "", [S.TaskSpec("a", "builtin/click", 4)]),
                        [rec("a", i, "terminated", i >= 4) for i in range(10)])["overall"]
    assert (extra["episodes"], extra["scored"], extra["success_rate"], extra["episode_success_rate"]) == (4, 4, 0.0, 0.0)
    from tars.report import infra_warning

    assert infra_warning(1, 10, "x", "y") is None and infra_warning(2, 10, "x", "y").startswith("2 of 10 episodes (20%)")


def test_eval_prints_the_warnings_on_screen(tmp_path, fake_env, capsys):
    suite = S.load_suite(_suite(tmp_path, "episodes: 2\ntasks: [evaltest/ok, evaltest/dead]\n"))
    assert asyncio.run(E._run(suite, E.ScriptedPolicy("oracle", _cfg()), str(tmp_path / "out"), 2, False)) == 0
    out = capsys.readouterr().out
    assert "success 1.000 over 1 of 2 tasks (1 with no scored episode), 2 scored episodes, 2 unscored" in out
    assert "[tars eval] warning: 2 of 4 episodes (50%) were infra errors" in out
    assert "[tars eval] warning: 1 of 2 task(s) had no scored episode (all infra errors) and are not in the overall " \
           "figures: evaltest/dead" in out
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(res["warnings"]) == 2 and "## Warnings" in (tmp_path / "out" / "results.md").read_text()


# ---- resume -----------------------------------------------------------------------------------------------

def test_interrupted_run_resumes_without_rerunning_finished_episodes(tmp_path, fake_env):
    suite = S.load_suite(_suite(tmp_path, "episodes: 6\noptions: {delay: 0.05}\ntasks: [evaltest/ok, evaltest/game]\n"))
    out = tmp_path / "out"
    log = out / "episodes.jsonl"

    async def interrupted():
        stop = asyncio.Event()

        async def stop_after_some():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 3):
                await asyncio.sleep(0.01)
            stop.set()

        s = asyncio.create_task(stop_after_some())
        res = await E.evaluate(suite, E.ScriptedPolicy("oracle", _cfg()), out, concurrency=2, stop=stop, say=None)
        await s
        return res

    res = asyncio.run(interrupted())
    first = _lines(log)
    assert 3 <= len(first) < 12 and res["complete"] is False
    assert res["overall"]["episodes"] == len(first)
    with open(log, "ab") as f:  # a crash in the middle of a write leaves half a line
        f.write(b'{"task": "evaltest/ok", "epis')
    FakeEnv.actions = []
    res = _run(suite, E.ScriptedPolicy("oracle", _cfg()), out, concurrency=2)
    after = _lines(log)
    assert res["complete"] is True and res["overall"]["episodes"] == 12
    assert len(after) == 12 and after[:len(first)] == first
    assert len({(r["task"], r["episode"]) for r in after}) == 12
    assert len(FakeEnv.actions) == 12 - len(first)  # only the missing episodes ran
    # a third run has nothing left to do
    FakeEnv.actions = []
    _run(suite, E.ScriptedPolicy("oracle", _cfg()), out)
    assert FakeEnv.actions == [] and len(_lines(log)) == 12


def test_resuming_into_a_directory_of_another_model_is_refused(tmp_path):
    suite = S.load_suite("builtin", episodes=1, only=["builtin/click"])
    _run(suite, E.ScriptedPolicy("oracle", _cfg()), tmp_path)
    with pytest.raises(E.EvalError, match="model 'oracle', not 'random'"):
        _run(suite, E.ScriptedPolicy("random", _cfg()), tmp_path)


def test_a_directory_of_other_seeds_or_task_settings_is_refused_and_foreign_records_are_left_out(tmp_path, fake_env):
    """eval.json names the seed rule and each task's settings: a rerun that would play other episodes is refused
    (saying what differs); another --episodes resumes. A record whose seed is not the suite's for its episode (a
    directory written before the seeds were recorded) is not counted and its episode is played again."""
    out = tmp_path / "out"
    suite = S.load_suite(_suite(tmp_path, "episodes: 2\nseed: 1\ntasks: [evaltest/ok]\n"))
    _run(suite, E.ScriptedPolicy("oracle", _cfg()), out)
    for text, why in (("episodes: 2\nseed: 2\ntasks: [evaltest/ok]\n", "seed 1, not 2"),
                      ("episodes: 2\nseed: 1\nmax_turns: 3\ntasks: [evaltest/ok]\n", "task 'evaltest/ok' settings")):
        with pytest.raises(E.EvalError, match=why):
            _run(S.load_suite(_suite(tmp_path, text)), E.ScriptedPolicy("oracle", _cfg()), out)
    FakeEnv.actions = []
    res = _run(S.load_suite(_suite(tmp_path, "episodes: 3\nseed: 1\ntasks: [evaltest/ok]\n")),
               E.ScriptedPolicy("oracle", _cfg()), out)
    assert len(FakeEnv.actions) == 1 and res["overall"]["episodes"] == 3      # only episode 2 was new
    meta = json.loads((out / "eval.json").read_text())
    assert meta["seed"] == 1 and meta["held_out"] is False and meta["policy"] == "oracle"
    assert meta["tasks"] == {"evaltest/ok": {"env_id": "evaltest/ok", "max_turns": None, "options": {}}}
    # a foreign record (wrong seed, failed) for episode 0: left out, episode 0 played again on its own seed
    lines = _lines(out / "episodes.jsonl")
    (ep0,) = [r for r in lines if r["episode"] == 0]
    (out / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines if r["episode"] != 0)
                                        + json.dumps({**ep0, "seed": 12345, "success": False}) + "\n")
    FakeEnv.actions = []
    res = _run(suite, E.ScriptedPolicy("oracle", _cfg()), out)
    assert len(FakeEnv.actions) == 1 and res["tasks"]["evaltest/ok"]["success_rate"] == 1.0
    assert {r["seed"] for r in _lines(out / "episodes.jsonl") if r["episode"] == 0} == {12345, suite.seed_of("evaltest/ok", 0)}


def test_an_unreadable_eval_json_or_a_record_without_its_fields_is_a_clear_error(tmp_path, fake_env, capsys,
                                                                                 monkeypatch):
    """An empty eval.json (a crash while an older version wrote it) and an episodes.jsonl record that is JSON but
    lacks a field are one-line errors naming the file (and the line), exit status 2, not tracebacks. eval.json is
    written whole: a write that fails leaves the one before."""
    from tars import evaldir

    suite = S.load_suite(_suite(tmp_path, "episodes: 1\ntasks: [evaltest/ok]\n"))
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / "eval.json").write_text("")
    assert asyncio.run(E._run(suite, E.ScriptedPolicy("oracle", _cfg()), str(tmp_path / "e1"), 1, False)) == 2
    assert f"{tmp_path / 'e1' / 'eval.json'} is not readable" in capsys.readouterr().err
    (tmp_path / "e2").mkdir()
    (tmp_path / "e2" / "episodes.jsonl").write_text(json.dumps({"task": "evaltest/ok", "episode": 0, "seed": 1,
                                                                "success": True}) + "\n")
    assert asyncio.run(E._run(suite, E.ScriptedPolicy("oracle", _cfg()), str(tmp_path / "e2"), 1, False)) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'e2' / 'episodes.jsonl'}:1: not an episode record (no outcome, return, steps)" in err
    before = (tmp_path / "e2" / "eval.json").read_text()

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(evaldir.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        evaldir.write_meta(tmp_path / "e2", {"suite": "other"})
    assert (tmp_path / "e2" / "eval.json").read_text() == before


# ---- human-normalised scores ------------------------------------------------------------------------------

def test_normalised_score_from_env_info_and_from_the_suite(tmp_path, fake_env):
    suite = S.load_suite(_suite(tmp_path, "episodes: 4\ntasks:\n  - evaltest/game\n"
                                          "  - {env: evaltest/ok, human_score: 4}\n  - builtin/click\n"))
    res = _run(suite, E.ScriptedPolicy("oracle", _cfg()), tmp_path / "out")
    game = res["tasks"]["evaltest/game"]
    agent = sum(suite.seed_of("evaltest/game", i) % 10 for i in range(4)) / 4  # the env's `score`, not the return
    assert game["agent_score"] == pytest.approx(agent) and game["human_score"] == 20.0
    assert game["normalised_score"] == pytest.approx(100 * agent / 20)
    ok = res["tasks"]["evaltest/ok"]  # no score in info: the return (1.0) against the suite's human score
    assert ok["normalised_score"] == pytest.approx(25.0)
    assert "normalised_score" not in res["tasks"]["builtin/click"]
    assert res["overall"]["normalised_tasks"] == 2
    assert res["overall"]["normalised_score"] == pytest.approx((100 * agent / 20 + 25.0) / 2)
    assert "| normalised |" in (tmp_path / "out" / "results.md").read_text()


# ---- compare ----------------------------------------------------------------------------------------------

def test_compare_prints_and_writes_per_task_differences(tmp_path):
    suite = S.load_suite("builtin", episodes=8)
    _run(suite, E.ScriptedPolicy("random", _cfg()), tmp_path / "a")
    _run(suite, E.ScriptedPolicy("oracle", _cfg()), tmp_path / "b")
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--compare", str(tmp_path / "a"), str(tmp_path / "b")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    row = next(x for x in r.stdout.splitlines() if x.startswith("| builtin/form |"))
    diff = 1.0 - a["tasks"]["builtin/form"]["success_rate"]
    assert f"{diff:+.3f}" in row and "| 1.000 |" in row
    assert (tmp_path / "b" / "compare.md").read_text() == r.stdout
    assert "**overall**" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--compare", str(tmp_path / "a"), str(tmp_path / "nope")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no results.json" in r.stderr


def test_compare_refuses_directories_that_played_other_episodes(tmp_path, capsys):
    """B - A only means something over the same episodes: two directories evaluated on other seeds, or with a shared
    task under other settings, are refused with what differs (they used to be set side by side without a word); a
    results.json that cannot be read is one line and exit 2, not a traceback."""
    from tars.cli import build_parser

    def compare(a, b):
        return E.main(build_parser().parse_args(["eval", "--compare", str(a), str(b)]), _cfg())

    _run(S.load_suite("builtin", episodes=2, only=["builtin/click"]), E.ScriptedPolicy("random", _cfg()), tmp_path / "a")
    other_seed = _suite(tmp_path, "name: builtin\nseed: 7\nmax_turns: 6\ntasks: [builtin/click]\n")
    _run(S.load_suite(other_seed, episodes=2), E.ScriptedPolicy("oracle", _cfg()), tmp_path / "b")
    other_turns = _suite(tmp_path, "name: builtin\nmax_turns: 3\ntasks: [builtin/click, builtin/menu]\n", "t.yaml")
    _run(S.load_suite(other_turns, episodes=2), E.ScriptedPolicy("oracle", _cfg()), tmp_path / "c")
    same = _suite(tmp_path, "name: mine\nmax_turns: 6\ntasks: [builtin/click, builtin/menu]\n", "s.yaml")
    _run(S.load_suite(same, episodes=2), E.ScriptedPolicy("oracle", _cfg()), tmp_path / "d")
    capsys.readouterr()
    assert compare(tmp_path / "a", tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a'} and {tmp_path / 'b'} did not play the same episodes (seed 0 and 7)" in err, err
    assert compare(tmp_path / "a", tmp_path / "c") == 2
    err = capsys.readouterr().err
    assert "task 'builtin/click' settings {'env_id': 'builtin/click', 'max_turns': 6, 'options': {}} and " \
           "{'env_id': 'builtin/click', 'max_turns': 3, 'options': {}}" in err, err
    assert not (tmp_path / "b" / "compare.md").exists() and not (tmp_path / "c" / "compare.md").exists()
    assert compare(tmp_path / "a", tmp_path / "d") == 0  # another suite, the same seeds and settings: compared
    assert "| builtin/click |" in capsys.readouterr().out
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "results.json").write_text('{"tasks": {')
    assert compare(tmp_path / "a", tmp_path / "e") == 2
    assert f"{tmp_path / 'e' / 'results.json'} is not readable (JSONDecodeError" in capsys.readouterr().err


def test_compare_overall_covers_only_the_tasks_both_scored(tmp_path):
    """A directory of the whole suite against one of a single task (--tasks): B - A overall set A's mean over four
    tasks against B's over one (+0.875 where the one shared task differed by +0.667). The overall row now averages
    the tasks both scored, and says so."""
    _run(S.load_suite("builtin", episodes=6), E.ScriptedPolicy("random", _cfg()), tmp_path / "a")
    _run(S.load_suite("builtin", episodes=6, only=["builtin/click"]), E.ScriptedPolicy("oracle", _cfg()), tmp_path / "b")
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    click = a["tasks"]["builtin/click"]
    assert a["overall"]["success_rate"] != click["success_rate"]  # A's own overall covers other tasks too
    text = S.compare(str(tmp_path / "a"), str(tmp_path / "b"))
    row = next(x for x in text.splitlines() if x.startswith("| **overall**"))
    ci = S.paired_dirs(tmp_path / "a", tmp_path / "b")["ci95"]   # the one task's 6 pairs
    assert row == (f"| **overall** (1 task(s) both scored) | {click['success_rate']:.3f} | 1.000 | "
                   f"{1 - click['success_rate']:+.3f} | {evalstats.interval(ci)} | {click['mean_return']:.3f} | "
                   "1.000 | 0 | 0 |"), row
    assert f"average the 1 task(s) both directories scored (builtin/click), not each one's own overall (A " \
           f"{a['overall']['success_rate']:.3f}, B 1.000)" in text


# ---- bad suites -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("tasks: []\n", "non-empty `tasks` list"),
    ("- builtin/click\n", "non-empty `tasks` list"),
    ("tasks: [builtin/click]\nepisodes: 0\n", "episodes must be a positive integer"),
    ("tasks: [{name: x}]\n", "tasks[0]: a task is an env id"),
    ("tasks: [{env: builtin/click, episods: 3}]\n", "unknown keys ['episods']"),
    ("tasks: [builtin/click, builtin/click]\n", "repeated: ['builtin/click']"),
    ("tasks: [builtin/click\n", "not valid YAML"),
    ("tasks: [{env: builtin/click, human_score: 0}]\n", "human_score must be a non-zero number"),
    ("episodes: 3\ntasks: [builtin/click]\nepisodes: 50\n", "key 'episodes' given twice in one mapping (line 3)"),
])
def test_bad_suite_files_give_clear_errors(tmp_path, text, message):
    with pytest.raises(S.SuiteError) as e:
        S.load_suite(_suite(tmp_path, text))
    assert message in str(e.value) and "suite.yaml" in str(e.value)


def test_unknown_suites_tasks_and_env_ids_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(S.SuiteError, match="shipped suites are .*builtin.*miniwob"):
        S.load_suite("no-such-suite")
    with pytest.raises(S.SuiteError, match=r"--tasks names \['builtin/nope'\]"):
        S.load_suite("builtin", only=["builtin/nope"])
    with pytest.raises(S.SuiteError, match="unknown env id 'nobackend/x'"):
        S.check_env_ids(S.load_suite(_suite(tmp_path, "tasks: [nobackend/x]\n")))
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--suite", _suite(tmp_path, "tasks: 3\n"),
                        "--model", "oracle", "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "tars eval:" in r.stderr and "tasks" in r.stderr
    assert not (tmp_path / "o").exists()


def test_shipped_suites_load_and_name_registered_backends():
    for name in S.available():
        suite = S.load_suite(name)
        S.check_env_ids(suite)
    from envd.miniwob_oracle import ORACLE_TASKS

    assert {t.env_id for t in S.load_suite("miniwob-oracle").tasks} == {f"miniwob/{t}" for t in ORACLE_TASKS}
    assert len(S.load_suite("miniwob").tasks) == 128
    from envd.games import game_info, names

    games = S.load_suite("games")  # every game, with the human reference stored beside it
    assert {t.env_id: t.human_score for t in games.tasks} == {f"games/{n}": game_info(n)["human_score"] for n in names()}


# ---- a real checkpoint through envd + inference + run_episode ---------------------------------------------

def _tiny_checkpoint(path: pathlib.Path) -> pathlib.Path:
    from core.chat import copy_tokenizer_files
    from core.model import CausalLM, DecoderConfig
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    dc = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=tok.eot_id, eos_token_id=tok.eot_id, pad_token_id=tok.pad_id)
    CausalLM(dc).init_weights(0, 0.02).save_hf(path)
    copy_tokenizer_files(tok.path, path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


def test_fresh_checkpoint_runs_through_envd_and_inference(tmp_path):
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--suite", "builtin", "--model", str(ckpt),
                        "--out", str(out), "--episodes", "2", "--tasks", "builtin/click,builtin/menu",
                        "--concurrency", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["model"] == str(ckpt.resolve()) and res["complete"] is True
    assert set(res["tasks"]) == {"builtin/click", "builtin/menu"}
    assert res["overall"]["episodes"] == 4 and res["overall"]["infra_errors"] == 0
    recs = _lines(out / "episodes.jsonl")
    # the model generated every turn (the suite's max_turns of 6 bounds them); an untrained model mostly writes
    # text that does not parse, which costs the format penalty per turn, exactly as in training
    assert len(recs) == 4 and all(1 <= r["steps"] <= 6 for r in recs)
    assert all(r["return"] >= 6 * C.load(None, None, []).actor.format_penalty - 1e-9 for r in recs)
    assert all(r["outcome"] in ("terminated", "truncated") for r in recs)
    # the envd and inference children announced themselves and are gone
    ready = [json.loads(p.read_text()) for p in sorted((out / "run").glob("*.json"))]
    assert {d["role"] for d in ready} == {"envd", "inference"}
    for d in ready:
        assert not _alive(d["pid"]), d


def test_ctrl_c_while_the_policys_daemons_start_stops_without_waiting_for_them(tmp_path):
    """Ctrl-C (the stop event) while the checkpoint's envd and inference server were starting did nothing until both
    were ready (a model load can take minutes, and the signal handler swallows further Ctrl-Cs); the start is now
    cancelled: the inference server never gets to announce itself, no episode runs, and the results say the
    evaluation is incomplete, to be resumed."""
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    suite = S.load_suite("builtin", episodes=1, only=["builtin/click"])

    async def interrupted_at_once():
        stop = asyncio.Event()
        stop.set()
        return await E.evaluate(suite, E.ModelPolicy(str(ckpt), _cfg()), out, stop=stop, say=None)

    res = asyncio.run(interrupted_at_once())
    assert res["complete"] is False and res["overall"]["episodes"] == 0
    assert not (out / "run" / "inference.json").exists()  # stopped before it was ready
    assert not (out / "episodes.jsonl").read_text()
    ready = [json.loads(p.read_text()) for p in (out / "run").glob("*.json")]
    assert all(not _alive(d["pid"]) for d in ready), ready  # whatever had started is gone


def test_a_context_too_small_for_the_episode_truncates_instead_of_infra_errors(tmp_path):
    """An episode whose next prompt would not fit the served context (eval's own `tars serve`, with the config's
    max_context) is scored as truncated (it counts in the rates), never as an infra error."""
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tars.cli", "eval", "--suite", "builtin", "--model", str(ckpt),
                        "--out", str(out), "--episodes", "2", "--tasks", "builtin/click", "--concurrency", "2",
                        "--set", "inference.max_context=160", "--set", "actor.max_new_tokens=16",
                        "--set", "actor.on_context_full=truncate"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["overall"]["infra_errors"] == 0 and res["overall"]["scored"] == 2
    recs = _lines(out / "episodes.jsonl")
    assert all(x["outcome"] == "truncated" and x["steps"] < 6 for x in recs), recs


def test_held_out_suites_draw_seeds_training_never_draws(tmp_path):
    """`held_out: true`: every seed is in [HELD_OUT_SEED_BASE, 2**31), stable, one per (task, episode); actors draw
    their training seeds below the base (actor/main.py), so no training episode had one of them."""
    (tmp_path / "h.yaml").write_text("name: h\nheld_out: true\nepisodes: 200\ntasks: [builtin/click, builtin/form]\n")
    (tmp_path / "p.yaml").write_text("name: p\nepisodes: 200\ntasks: [builtin/click, builtin/form]\n")
    held, plain = S.load_suite(str(tmp_path / "h.yaml")), S.load_suite(str(tmp_path / "p.yaml"))
    seeds = [held.seed_of(t.name, i) for t in held.tasks for i in range(200)]
    assert all(C.HELD_OUT_SEED_BASE <= s < 2 ** 31 for s in seeds) and len(set(seeds)) == len(seeds)
    assert seeds == [S.load_suite(str(tmp_path / "h.yaml")).seed_of(t.name, i) for t in held.tasks for i in range(200)]
    assert min(plain.seed_of(t.name, i) for t in plain.tasks for i in range(200)) < C.HELD_OUT_SEED_BASE  # a plain suite: anywhere
    (tmp_path / "bad.yaml").write_text("name: b\nheld_out: 1\ntasks: [builtin/click]\n")
    with pytest.raises(S.SuiteError, match="held_out must be true or false"):
        S.load_suite(str(tmp_path / "bad.yaml"))
    import inspect

    from actor import main as M
    assert "randrange(HELD_OUT_SEED_BASE)" in inspect.getsource(M.Actor)   # the actor's one draw of a training seed
