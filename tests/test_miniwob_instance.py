"""envd's MiniWoB instance (envd/miniwob_instance.py) reads a reset's and a step's result in one script where the
package runs three: the same results as the package's own SeleniumInstance.reset/step, in fewer WebDriver calls."""
from __future__ import annotations

import os
import types

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                reason="Debian's chromium is not installed (scripts/setup.sh --dev installs it)")

from core.action import Action  # noqa: E402
from envd import registry  # noqa: E402

OPTS = {"episode_time_s": "600"}


def _package_instance(env):
    from miniwob.selenium_instance import SeleniumInstance

    inst = env.gym.unwrapped.instance
    inst.reset = types.MethodType(SeleniumInstance.reset, inst)
    inst.step = types.MethodType(SeleniumInstance.step, inst)


def _counted(env) -> list[str]:
    drv = env.gym.unwrapped.instance.driver
    calls, real = [], drv.execute

    def execute(cmd, params=None):
        calls.append(cmd)
        return real(cmd, params)

    drv.execute = execute
    return calls


def _same(a, b) -> bool:
    # The time-decayed reward and the elapsed time depend on when each ran; everything else must be equal.
    return ((a.text.split("reward ")[0], a.instruction, a.outcome, a.info.get("success"), a.info.get("raw_reward"),
             [i.data for i in a.images], a.width, a.height) ==
            (b.text.split("reward ")[0], b.instruction, b.outcome, b.info.get("success"), b.info.get("raw_reward"),
             [i.data for i in b.images], b.width, b.height))


@pytest.mark.parametrize("task", ["login-user", "click-checkboxes"])
def test_the_same_results_as_the_packages_instance(task):
    ours, theirs = registry.make(f"miniwob/{task}", OPTS), registry.make(f"miniwob/{task}", OPTS)
    try:
        _package_instance(theirs)
        for seed in range(3):
            a, b = ours.reset(seed), theirs.reset(seed)
            assert _same(a, b)
            for _ in range(8):
                if a.outcome != "running":
                    break
                act = ours.oracle_action() if seed != 1 else Action("click", target="[4]")
                a, b = ours.step(act), theirs.step(act)
                assert _same(a, b), (a.text, b.text)
                assert set(a.info) == set(b.info)
            assert a.outcome != "running" or seed == 1
    finally:
        ours.close()
        theirs.close()


def test_fewer_webdriver_calls():
    """A Reset and 3 steps toggling a checkbox: 8 calls fewer (the two reads of a reset and of each step merged)."""
    ours, theirs = registry.make("miniwob/click-checkboxes", OPTS), registry.make("miniwob/click-checkboxes", OPTS)
    try:
        _package_instance(theirs)
        counts = []
        for env in (ours, theirs):
            env.reset(0)
            calls = _counted(env)
            env.reset(1)
            for _ in range(3):
                assert env.step(Action("click", target="[6]")).outcome == "running"
            counts.append(len(calls))
        assert counts[1] - counts[0] == 8, counts
    finally:
        ours.close()
        theirs.close()
