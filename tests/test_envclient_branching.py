"""The actor's EnvClient branches an episode: snapshot, restore, fork and observe, through a real envd.

Restore and Fork make sessions, so their retries repeat one idempotency key (tests/test_envd_idempotency.py has the
lost-answer retry of each)."""
from __future__ import annotations

import json

import pytest

from actor.envclient import EnvActionError, EnvClient, EnvInfraError
from core.action import Action
from core.outcome import Outcome
from envd_compliance import envd_client, run


def _hint(obs) -> Action:
    return Action.from_dict(json.loads(obs.info_json)["hint_action"])


def test_fork_restore_and_snapshot_branch_an_episode():
    async def body():
        async with envd_client() as c:
            ec = EnvClient(c.server.address, timeout_s=10.0, retries=2)
            try:
                # builtin/menu takes two oracle steps: open the menu, then click the item
                sid, run_id, obs0 = await ec.open("builtin/menu", 3, {"hint_policy": "oracle"})
                snap = await ec.snapshot(sid, run_id)
                obs1 = await ec.step(sid, run_id, _hint(obs0))
                assert obs1.outcome == Outcome.RUNNING and obs1.text != obs0.text

                fid, frun = await ec.fork(sid, run_id)  # a second branch from the open menu
                assert fid != sid
                assert (await ec.observe(fid, frun)).text == obs1.text
                won = await ec.step(fid, frun, _hint(obs1))
                assert won.outcome == Outcome.TERMINATED and won.success
                here = await ec.observe(sid, run_id)  # the source did not move with its fork
                assert here.outcome == Outcome.RUNNING and here.text == obs1.text
                assert (await ec.step(sid, run_id, _hint(obs1))).success

                rid, rrun = await ec.restore("builtin/menu", snap)  # back to before the first step
                back = await ec.observe(rid, rrun)
                assert back.outcome == Outcome.RUNNING and back.text == obs0.text
                assert (await ec.step(rid, rrun, _hint(obs0))).text == obs1.text
                assert len(c.server.servicer.sessions) == 3 and ec.created == 3

                with pytest.raises(EnvActionError, match="seal"):  # a state the daemon did not seal
                    await ec.restore("builtin/menu", snap[:-1] + bytes([snap[-1] ^ 1]))
                with pytest.raises(EnvActionError):                # another env's state
                    await ec.restore("builtin/form", snap)
                await ec.close_session(sid)
                with pytest.raises(EnvInfraError, match="NOT_FOUND"):  # a closed session has nothing to fork
                    await ec.fork(sid, run_id)
                assert len(c.server.servicer.sessions) == 2
            finally:
                await ec.close()
    run(body())
