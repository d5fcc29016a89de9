"""`games/<name>` against real Chromium: compliance over envd, the game clock, verifiers, seeds, snapshots.

The game clock is checked on Snake, whose moves come only from timers: paused, nothing moves however long we
wait; a step runs exactly its budget of game time; and steps run much faster than the game time they simulate.
"""
from __future__ import annotations

import collections
import json
import os
import time

import pytest

from envd import registry
from envd.base import Action, ActionError, Outcome
from envd_compliance import EnvCompliance

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                reason="Debian's chromium is not installed (scripts/setup.sh --dev installs it)")

from envd import games  # noqa: E402
from envd.games import GameEnv  # noqa: E402


class TestSnakeCompliance(EnvCompliance):
    env_id = "games/snake"
    options = {"max_steps": "4"}
    valid_action = {"type": "hotkey", "key": "up"}
    invalid_action = {"type": "hotkey", "key": "warp"}
    max_episode_steps = 4

    def test_concurrent_sessions(self, n: int = 4):
        super().test_concurrent_sessions(n)


@pytest.fixture
def snake():
    e = GameEnv("snake", {})
    e.reset(3, {})
    yield e
    e.close()


def test_games_present_with_reference_scores():
    assert games.names() == ["2048", "puzzle", "snake"]
    assert {f"games/{n}" for n in games.names()} <= set(registry.list_env_ids())
    for name in games.names():
        info = games.game_info(name)
        assert info["human_score"] > 0 and info["instruction"] and info["max_steps"] > 0 and info["step_ms"] > 0
    with pytest.raises(KeyError):
        registry.make("games/chess")


@pytest.mark.parametrize("options, match", [
    ({"url": "http://127.0.0.1/"}, "do not apply to games"), ({"verify_js": "1"}, "do not apply"),
    ({"step_ms": "0"}, "step_ms"), ({"step_ms": "soon"}, "step_ms"), ({"width": "3"}, "width"),
])
def test_bad_game_options(options, match):
    with pytest.raises(ValueError, match=match):
        GameEnv("snake", options)


# ---- the clock ---------------------------------------------------------------------------------------------------

def test_paused_clock_freezes_the_game(snake):
    snake.step(Action("hotkey", key="down"))  # the snake is moving
    state, text = snake.game_state(), snake.observe().text
    time.sleep(0.5)  # real time passes; game time does not
    assert snake.game_state() == state and snake.observe().text == text


def test_a_step_runs_exactly_its_budget_of_game_time():
    e = GameEnv("snake", {"step_ms": "300"})
    try:
        e.reset(3, {})
        c0 = e.game_state()["clock_ms"]
        v1 = e.step(Action("wait")).info["verify"]
        v2 = e.step(Action("hotkey", key="up")).info["verify"]
        # 100 ms per tick at level 1: 3 ticks per step, each cell of the way
        assert (v1["clock_ms"] - c0, v1["ticks"], v1["head"]) == (300, 3, [13, 7])
        assert (v2["clock_ms"] - c0, v2["ticks"], v2["head"]) == (600, 6, [13, 4])
    finally:
        e.close()


def test_steps_run_faster_than_the_game_time_they_simulate():
    # Heading right from (10, 7), the snake hits the wall every 10 ticks (1 s); its third life ends at exactly 3 s.
    e = GameEnv("snake", {"step_ms": "1000"})
    try:
        e.reset(3, {})
        t0 = time.monotonic()
        rs = [e.step(Action("wait")) for _ in range(3)]
        wall = time.monotonic() - t0
        assert [r.info["verify"]["lives"] for r in rs] == [2, 1, 0]
        assert [r.outcome for r in rs] == [Outcome.RUNNING, Outcome.RUNNING, Outcome.TERMINATED]
        assert rs[-1].info["verify"]["clock_ms"] == 3000 and rs[-1].info["verify"]["ticks"] == 30
        assert wall < 3.0, f"3 s of game time took {wall:.2f} s of wall time"
    finally:
        e.close()


# ---- verifiers, seeds, snapshots ---------------------------------------------------------------------------------

def test_2048_is_seeded_and_step_rewards_sum_to_the_score():
    e = GameEnv("2048", {})
    try:
        first = e.reset(11, {}).text
        assert e.reset(11, {}).text == first and e.reset(12, {}).text != first
        e.reset(11, {})
        total, r = 0.0, None
        for k in range(24):
            if k % 8 == 7:  # now and then by clicking the on-screen button instead of a key
                r = e.step(Action("click", target="Up"))
            else:
                r = e.step(Action("hotkey", key=("left", "down", "right", "down")[k % 4]))
            total += r.reward
        v = r.info["verify"]
        assert total == v["score"] > 0 and v["moves"] > 0 and f"Score {v['score']}" in r.text
    finally:
        e.close()


def _solve_8_puzzle(tiles: list[int]) -> list[int]:
    """Breadth-first search: the tile values to slide into the gap, in order, to reach 1..8 with the gap last."""
    goal = tuple(list(range(1, 9)) + [0])
    start = tuple(tiles)
    prev: dict[tuple, tuple | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        s = queue.popleft()
        if s == goal:
            break
        gap = s.index(0)
        for j in (gap - 3, gap + 3, gap - 1 if gap % 3 else -1, gap + 1 if gap % 3 < 2 else -1):
            if 0 <= j < 9:
                t = list(s)
                t[gap], t[j] = t[j], 0
                t = tuple(t)
                if t not in prev:
                    prev[t] = s
                    queue.append(t)
    moves, s = [], goal
    while prev[s] is not None:
        p = prev[s]
        moves.append(p[s.index(0)])  # the tile that moved into p's gap
        s = p
    return moves[::-1]


def test_puzzle_solved_by_clicking_tiles_scores_100_and_levels_up():
    e = GameEnv("puzzle", {})
    try:
        e.reset(4, {})
        plan = _solve_8_puzzle(e.game_state()["g"]["tiles"])
        assert 0 < len(plan) <= 10
        rewards = [e.step(Action("click", target=str(tile))).reward for tile in plan]
        assert rewards == [0.0] * (len(plan) - 1) + [100.0]
        v = e.observe().info["verify"]
        assert (v["level"], v["score"]) == (2, 100) and "Level 2 of 3" in e.observe().text
        with pytest.raises(ActionError):
            e.step(Action("click", target="9"))  # no such tile
    finally:
        e.close()


def test_snapshot_replays_identically(snake):
    for k in ("down", "left", "wait"):
        snake.step(Action("hotkey", key=k) if k != "wait" else Action("wait"))
    snap = snake.snapshot()
    assert json.loads(snap)["env"] == "games/snake"
    copy = GameEnv("snake", {})
    try:
        r = copy.restore(snap)
        assert r.text == snake.observe().text and r.step == 3
        for a in (Action("hotkey", key="up"), Action("wait"), Action("hotkey", key="right")):
            assert snake.step(a).text == copy.step(a).text
        assert snake.game_state() == copy.game_state()
        with pytest.raises(ValueError, match="cannot be restored"):
            GameEnv.restore(copy, snap.replace(b'"games/snake"', b'"games/2048"'))
    finally:
        copy.close()


def test_max_steps_truncates():
    e = GameEnv("2048", {"max_steps": "2"})
    try:
        e.reset(1, {})
        assert [e.step(Action("wait")).outcome for _ in range(2)] == [Outcome.RUNNING, Outcome.TRUNCATED]
    finally:
        e.close()
