"""`tars serve` as its own process for tests, through the launcher the benchmarks and `tars up` use
(tars.topology.daemon_spec + Process: its own session, a ready file, SIGTERM then SIGKILL of its group); and
episodes of the real actor code against a launched `tars envd` and `tars serve` (topology_episodes)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib

from tars.topology import LaunchError, Process, daemon_spec, pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def served(workdir: str | os.PathLike, *options: str, ready_s: float = 120.0):
    """`tars serve OPTIONS --ready-file WORKDIR/inference.json`, its output in WORKDIR/inference.log; yields its
    address and stops it on exit. A server that exits or is not ready within ready_s fails with its log's tail."""
    spec = daemon_spec("inference", list(options), pathlib.Path(workdir), {"PYTHONPATH": pythonpath(ROOT)}, ROOT)
    p = Process(spec)
    try:
        try:
            info = p.wait_ready(ready_s)
        except LaunchError as e:
            raise AssertionError(f"{e}\n{spec.log.read_text()[-3000:]}") from None
        yield info["address"]
    finally:
        p.stop()


def topology_episodes(cfg, out: pathlib.Path, ckpt, env_id: str, n: int, prefix: str, timeout_s: float = 30):
    """n episodes of env_id (seeds 0..n-1, ids PREFIX-0000...) by the actor's run_episode, against the `tars envd`
    and `tars serve` that tars.topology.plan launches for cfg and the checkpoint (no learner, no actors), with the
    run's own tokens; cfg is saved to out/config.yaml first. Returns the trajectories."""
    from actor.envclient import EnvClient
    from actor.episode import EpisodeContext, run_episode
    from core import config as C
    from core.chat import ChatTokenizer
    from core.inference_client import InferenceClient
    from tars.topology import Topology, plan

    out.mkdir(exist_ok=True)
    C.save(cfg, out / "config.yaml")
    tok = ChatTokenizer.load(ckpt)

    async def episodes(envd, inference):
        env = EnvClient(envd, cfg.envd.auth_token, timeout_s, 2)  # the run's tokens: plan() made them
        infer = InferenceClient([inference], cfg.inference.auth_token, timeout_s=timeout_s, retries=2)
        ctx = EpisodeContext(cfg.actor, tok, infer, "test")
        try:
            return await asyncio.gather(*(run_episode(ctx, env, f"{prefix}-{i:04d}", env_id, i, 0) for i in range(n)))
        finally:
            await infer.close()
            await env.close()

    with Topology(plan(cfg, out, ckpt, learner=False, n_actors=0)) as topo:
        topo.start()
        return asyncio.run(episodes(topo.envd, topo.inference))
