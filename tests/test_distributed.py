"""Data-parallel learner step: two processes under `accelerate launch` (gloo, CPU) end with the parameters of one."""
import os
import subprocess
import pathlib
import sys

import pytest
import torch

from core.model import DecoderConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, out):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "ACCELERATE_LOG_LEVEL": "error"}
    r = subprocess.run(cmd + ["-m", "learner.dist_check", str(out), "3"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow  # a whole multi-process run: > 20 s on 2 cores (CI runs the slow set after the default one)
def test_two_gloo_processes_train_like_one(tmp_path):
    one = _run([sys.executable], tmp_path / "one.pt")
    accelerate = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    two = _run(accelerate, tmp_path / "two.pt")
    assert one["world"] == 1 and two["world"] == 2 and two["backend"] == "gloo"
    assert one["params"].keys() == two["params"].keys()
    diff = max(float((one["params"][k] - two["params"][k]).abs().max()) for k in one["params"])
    assert diff < 1e-4, diff  # summation order differs across ranks; nothing else may
    # The check is only meaningful if training moved the weights far more than the tolerance.
    from learner.policy import TrainPolicy

    init = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2),
                                   seed=0)
    moved = max(float((one["params"][f"policy.{k}"] - v).abs().max()) for k, v in init.state_dict().items())
    assert moved > 100 * max(diff, 1e-6), (moved, diff)


def test_one_rank_shares_are_disjoint_and_cover_everything():
    from learner.distributed import Dist

    items = list(range(7))
    shares = [Dist(r, 3).shard(items) for r in range(3)]
    assert sorted(sum(shares, [])) == items
    assert Dist().shard(items) == items


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_tars_learner_runs_under_accelerate_with_two_processes(tmp_path, parallel):
    """The real learner process under `accelerate launch` (rank 0 streams, rank 1 follows) trains and exits; under
    learner.parallel=fsdp rank 1 gathers its shards with rank 0 for each published version, checkpoint and export."""
    import asyncio
    import json

    from test_dist_lifecycle import _send, _start  # the same launch as the lifecycle tests
    from test_learner_kill import wait_for  # tests/ is on sys.path (rootless test dir)

    p, port, run = _start(tmp_path, "max_versions=4", f"learner.parallel={parallel}", "learner.checkpoint.every=2")
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), 120, "learner did not start")

        asyncio.run(_send(port, 0, 32))
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)
    assert ("sharded over 2 ranks (FSDP2)" in (tmp_path / "out.log").read_text()) == (parallel == "fsdp")
    lines = [json.loads(x) for x in (run / "learner.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2, 3, 4]
    assert sorted(t for x in lines for t in x["ids"]) == sorted(f"t{i}" for i in range(32))
    # What rank 0 wrote is whole: the last published version and the final export equal the checkpoint's policy,
    # which a one-process learner loads.
    from learner.checkpoint import Checkpointer
    from learner.policy import TrainPolicy, read_weights
    from learner.ppo import PPOTrainer
    from core.config import LearnerConfig

    final, last = read_weights(run / "final"), read_weights(sorted((run / "weights").glob("v*"))[-1])
    start = read_weights(tmp_path / "model")
    assert final.keys() == last.keys() == start.keys()
    assert all(torch.equal(final[k], last[k]) for k in final)
    assert any(not torch.equal(final[k], start[k]) for k in final)  # trained
    pol = TrainPolicy.load(tmp_path / "model")
    critic = TrainPolicy.critic_from(pol)
    meta = Checkpointer(run, pol, critic, PPOTrainer(pol, critic, LearnerConfig(), 0), torch.device("cpu")).load()
    assert meta["version"] == 4
    assert all(torch.equal(v, final[k]) for k, v in pol.hf_state_dict().items())
