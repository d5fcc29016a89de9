"""The builtin GUI tasks: the oracle solves every task, random play mostly fails, snapshots restore exactly."""
import random

import pytest

from envd import builtin
from envd.base import Action, ActionError


@pytest.mark.parametrize("task", builtin.TASKS)
def test_oracle_solves_every_task(task):
    env = builtin.make(task)
    for seed in range(50):
        r = env.reset(seed)
        steps = 0
        while r.outcome == "running":
            r = env.step(env.oracle_action())
            steps += 1
        assert r.outcome == "terminated" and r.info["success"] and r.reward == 1.0, (task, seed, r.text)
        assert steps <= 2


def test_random_play_mostly_fails():
    env, rng, wins = builtin.make("mixed"), random.Random(0), 0
    for seed in range(300):
        r = env.reset(seed)
        while r.outcome == "running":
            r = env.step(env.random_action(rng))
        wins += r.info["success"]
    assert wins / 300 < 0.3


def test_layouts_and_labels_vary():
    env = builtin.make("click")
    texts = {env.reset(s).text for s in range(20)}
    goals = {env.reset(s).instruction for s in range(20)}
    assert len(texts) == 20 and len(goals) > 10


def test_wrong_click_fails_and_step_limit_truncates():
    env = builtin.make("menu", {"max_steps": "3"})
    r = env.reset(1)
    menus = [e["label"] for e in r.info["elements"] if e["kind"] == "menu"]
    for i in range(3):  # toggling menus never ends the task, so the step budget does
        r = env.step(Action("click", target=menus[i % len(menus)]))
    assert r.outcome == "truncated" and not r.info["success"]
    r = env.reset(2)
    wrong = [e["label"] for e in r.info["elements"] if e["kind"] == "button"][0]
    r = env.step(Action("click", target=wrong))
    assert r.outcome == "terminated" and r.reward == 0.0 and not r.info["success"]


def test_click_by_coordinates():
    env = builtin.make("click")
    r = env.reset(3)
    target = env.oracle_action().target
    box = next(e["box"] for e in r.info["elements"] if e["label"] == target)
    r = env.step(Action("click", point=[(box[0] + box[2]) / 2, (box[1] + box[3]) / 2]))
    assert r.info["success"]


def test_bad_actions():
    env = builtin.make("click")
    env.reset(0)
    with pytest.raises(ActionError):
        env.step(Action("teleport"))
    with pytest.raises(ActionError):
        env.step(Action("click"))
    r = env.step(env.oracle_action())  # the session still works
    assert r.info["success"]
    with pytest.raises(ActionError):
        env.step(env.oracle_action())  # the episode is over


def test_snapshot_restore():
    env = builtin.make("menu")
    env.reset(5)
    env.step(env.oracle_action())
    snap = env.snapshot()
    other = builtin.make("click")
    r = other.restore(snap)
    assert r.text == env.observe().text and other.env_id == "builtin/menu"
    assert other.step(other.oracle_action()).info["success"]
    with pytest.raises(ActionError):
        other.restore(b"not json")


def test_strict_targets_rejects_missing_labels_without_changing_state():
    env = builtin.make("click", {"strict_targets": "1"})
    env.reset(4)
    with pytest.raises(ActionError, match="no element labelled"):
        env.step(Action("click", target="NoSuchLabel"))
    assert env.observe().step == 0
    loose = builtin.make("click")
    loose.reset(4)
    assert loose.step(Action("click", target="NoSuchLabel")).outcome == "running"
