"""Data-parallel learner step: two processes under `accelerate launch` (gloo, CPU) end with the parameters of one."""
import os
import subprocess
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, out):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "ACCELERATE_LOG_LEVEL": "error"}
    r = subprocess.run(cmd + ["-m", "learner.dist_check", str(out), "3"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


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
    from tars.model import CausalLM, DecoderConfig

    init = CausalLM(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2)).init_weights(0)
    moved = max(float((one["params"][f"policy.{k}"] - v).abs().max()) for k, v in init.state_dict().items())
    assert moved > 100 * max(diff, 1e-6), (moved, diff)


def test_one_rank_shares_are_disjoint_and_cover_everything():
    from learner.distributed import Dist

    items = list(range(7))
    shares = [Dist(r, 3).shard(items) for r in range(3)]
    assert sorted(sum(shares, [])) == items
    assert Dist().shard(items) == items
