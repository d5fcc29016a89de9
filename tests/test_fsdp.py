"""learner.parallel=fsdp (learner/fsdp.py): two gloo processes with FSDP2-sharded policy and critic train like one
process on the same batches, skip the same non-finite steps, and write a checkpoint that one process loads."""
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from core.config import ConfigError, LearnerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
STEPS, NAN_AT = 3, 1  # update 1's batch holds a trajectory with NaN behaviour logprobs (one rank's chunk)
KL = 0.05  # a frozen reference policy too (sharded like the policy)


def _run(cmd, out, parallel):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "ACCELERATE_LOG_LEVEL": "error"}
    r = subprocess.run(cmd + ["-m", "learner.dist_check", str(out), str(STEPS), parallel, str(NAN_AT), str(KL)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


def _fresh():
    """dist_check's models and trainer in this (one) process."""
    from learner.dist_check import models

    return models(kl_coef=KL)


@pytest.mark.slow  # two runs, one of them two processes: ~25 s on 2 cores
def test_fsdp_two_processes_train_like_one_and_checkpoint_loads_in_one(tmp_path):
    one = _run([sys.executable], tmp_path / "one.pt", "ddp")
    two = _run(ACCELERATE, tmp_path / "two.pt", "fsdp")
    assert one["world"] == 1 and two["world"] == 2 and two["backend"] == "gloo"
    assert one["sharded"] == [False] * 3 and two["sharded"] == [True] * 3  # policy, critic, reference
    # Each run's checkpoint, loaded back on every rank (2 processes: sharded again), is what was written.
    assert one["reload_diff"] == 0.0 and two["reload_diff"] == 0.0
    # The same loss figures per update, and the poisoned batch's minibatches skipped alike (both epochs' minibatch
    # holding the NaN trajectory: 2 steps) on every rank.
    assert [m["nonfinite_steps"] for m in one["figures"]] == [m["nonfinite_steps"] for m in two["figures"]] == [0, 2, 0]
    for a, b in zip(one["figures"], two["figures"]):
        for k in ("pg_loss", "v_loss", "entropy", "clipfrac", "grad_norm", "is_ratio_mean", "kl_ref"):
            assert abs(a[k] - b[k]) < 1e-5 or (math.isnan(a[k]) and math.isnan(b[k])), (k, a[k], b[k])
    # The same weights (gathered whole from the shards), policy and critic, within 1e-5 (summation order only) ...
    assert one["params"].keys() == two["params"].keys()
    diff = max(float((one["params"][k] - two["params"][k]).abs().max()) for k in one["params"])
    assert diff < 1e-5, diff
    # ... while training moved them far more than that.
    pol0, critic0, _ = _fresh()
    init = {**{f"policy.{k}": v for k, v in pol0.state_dict().items()},
            **{f"critic.{k}": v for k, v in critic0.state_dict().items()}}
    moved = max(float((one["params"][k] - init[k]).abs().max()) for k in init)
    assert moved > 100 * max(diff, 1e-6), (moved, diff)

    # The checkpoint written under FSDP (gathered on rank 0) loads in a 1-process learner: the trained weights
    # exactly, and the optimizers' state as one process's own checkpoint has it (names, shapes, values).
    from learner.checkpoint import Checkpointer

    pol, critic, tr = _fresh()
    meta = Checkpointer(tmp_path, pol, critic, tr, torch.device("cpu")).load(tmp_path / "two.pt.run" / "ckpt")
    assert meta["version"] == STEPS
    for k, v in pol.state_dict().items():
        assert torch.equal(v, two["params"][f"policy.{k}"]), k
    for k, v in critic.state_dict().items():
        assert torch.equal(v, two["params"][f"critic.{k}"]), k
    pol1, critic1, tr1 = _fresh()
    Checkpointer(tmp_path, pol1, critic1, tr1, torch.device("cpu")).load(tmp_path / "one.pt.run" / "ckpt")
    for opt, ref in ((tr.opt, tr1.opt), (tr.critic_opt, tr1.critic_opt)):
        a, b = opt.state_dict()["state"], ref.state_dict()["state"]
        assert a.keys() == b.keys() and len(a) > 0
        for i in a:
            for k in a[i]:
                assert a[i][k].shape == b[i][k].shape and float((a[i][k] - b[i][k]).abs().max()) < 1e-5, (i, k)
    # and it trains on from there like the one-process checkpoint does
    from learner.dist_check import batch

    before = [p.detach().clone() for p in pol.parameters()]
    for t in (tr, tr1):
        torch.manual_seed(7)  # the same minibatch split (the RNG state saved is each run's rank 0's own)
        t.step(batch(50), STEPS)
    step = max(float((p.detach() - b).abs().max()) for p, b in zip(pol.parameters(), before))
    # (the two start ~3e-6 apart; Adam's normalised step can widen that a little, not to the step's size)
    apart = max(float((a - b).detach().abs().max()) for a, b in zip(pol.parameters(), pol1.parameters()))
    assert apart < 5e-5 and step > 100 * apart, (apart, step)


def test_parallel_setting_is_checked():
    assert LearnerConfig(parallel="fsdp").config_error() == ""
    assert "learner.parallel" in LearnerConfig(parallel="zero3").config_error()
    from core.config import load

    with pytest.raises(ConfigError, match="learner.parallel"):
        load(overrides=["learner.parallel=zero3"])
    assert load(overrides=["learner.parallel=fsdp"]).learner.parallel == "fsdp"
    assert load().learner.parallel == "ddp"


VL_STEPS = 2


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """A tiny Qwen2.5-VL checkpoint and its batches of trajectories with screenshots (value pretraining + VL_STEPS
    updates; trajectory 0 of each in two segments) and one text-only trajectory each."""
    from tars.bench.episodes import vl_episodes
    from tests.hf_dirs import make_vl_checkpoint

    d = tmp_path_factory.mktemp("vlfsdp")
    make_vl_checkpoint(d / "ckpt", arch="qwen2_5_vl", max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    torch.save([vl_episodes(d / "ckpt", 8, images=2, size=(160, 210), seed=s) + [_text_only(d / "ckpt", s)]
                for s in range(100, 101 + VL_STEPS)], d / "batches.pt")
    return d


def _text_only(d, seed):
    """A trajectory without a screenshot: its chunk has no image (the sharded model still runs the vision tower)."""
    import numpy as np

    from core.chat import ChatTokenizer
    from core.schema import Trajectory, Turn

    tok = ChatTokenizer.load(d)
    ids = tok.first_prompt("sys", "no screenshot this time")
    a = tok.answer("wait()")
    m = np.array([0] * len(ids) + [1] * len(a), np.uint8)
    return Trajectory(id=f"x{seed}", env_id="e", outcome="terminated", tokens=np.array(ids + a, np.int32),
                      logprobs=np.where(m, -1.0, 0.0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                      mask=m, turns=[Turn("", "", {}, 1.0, 0, len(m))], ret=1.0, success=True)


def _vl(cmd, d, name, parallel, *extra):
    out = d / name
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "ACCELERATE_LOG_LEVEL": "error"}
    r = subprocess.run(cmd + ["-m", "learner.dist_check", str(out), str(VL_STEPS), parallel, "-1", str(KL),
                              "--vl", str(d / "ckpt"), str(d / "batches.pt"), *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow  # four runs, two of them two processes
@pytest.mark.parametrize("freeze", [False, True])
def test_fsdp_trains_a_vl_checkpoint_like_one_process(vl_run, freeze):
    """Qwen2.5-VL under FSDP on 2 gloo processes (decoder layers and vision blocks sharded as their own units) trains
    on trajectories with screenshots like one process: the same losses, the same weights (checkpoint names, the vision
    tower's included); with model.freeze_vision the vision tower does not move."""
    from learner.policy import read_weights

    extra = ("--freeze-vision",) if freeze else ()
    one = _vl([sys.executable], vl_run, f"one{freeze}.pt", "ddp", *extra)
    two = _vl(ACCELERATE, vl_run, f"two{freeze}.pt", "fsdp", *extra)
    assert one["world"] == 1 and two["world"] == 2 and two["backend"] == "gloo"
    assert one["sharded"] == [False] * 3 and two["sharded"] == [True] * 3  # policy, critic, reference
    assert one["reload_diff"] == 0.0 and two["reload_diff"] == 0.0
    for a, b in zip(one["figures"], two["figures"]):
        assert a["nonfinite_steps"] == b["nonfinite_steps"] == 0
        for k in ("pg_loss", "v_loss", "entropy", "clipfrac", "grad_norm", "is_ratio_mean", "kl_ref"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a[k], b[k])
    init = read_weights(vl_run / "ckpt")
    # the checkpoint's names, gathered whole from the shards
    assert one["hf"].keys() == two["hf"].keys() == init.keys()
    assert any(k.startswith("visual.blocks.") for k in init) and any(k.startswith("model.layers.") for k in init)
    diff = max(float((one["hf"][k] - two["hf"][k]).abs().max()) for k in init)
    assert diff < 1e-5, diff
    assert one["params"].keys() == two["params"].keys()
    assert max(float((one["params"][k] - two["params"][k]).abs().max()) for k in one["params"]) < 1e-5
    moved = {k: float((two["hf"][k] - init[k]).abs().max()) for k in init}
    visual = [k for k in init if k.startswith("visual.")]
    assert max(moved[k] for k in init if k.startswith("model.layers.")) > 100 * max(diff, 1e-6)
    if freeze:
        assert max(moved[k] for k in visual) == 0.0
    else:  # a vision block's weight (sharded in its own unit) and the merger both trained
        for k in ("visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight"):
            assert moved[k] > 100 * max(diff, 1e-6), (k, moved[k], diff)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_sharded_vl_forward_runs_the_vision_tower_once_first(tmp_path, arch):
    """What a sharded VL policy's hidden() guarantees, checked in one process: the vision tower then the language model,
    once each per call, with or without screenshots in the chunk, and the same hidden states as without the guard."""
    from learner import fsdp as F
    from learner.batch import collate
    from learner.policy import TrainPolicy
    from tars.bench.episodes import vl_episodes
    from tests.hf_dirs import make_vl_checkpoint

    make_vl_checkpoint(tmp_path, arch=arch, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    pol = TrainPolicy.load(tmp_path)
    trajs = vl_episodes(tmp_path, 2, images=2, size=(160, 210)) + [_text_only(tmp_path, 0)]
    b = collate(trajs, pol.config.pad_token_id, pol.vl)
    order = []
    # (the first vision block and the first decoder layer: FSDP units, whose calls all-gather)
    pol.lm.model.visual.blocks[0].register_forward_pre_hook(lambda *_: order.append("visual"))
    pol.lm.model.language_model.layers[0].register_forward_pre_hook(lambda *_: order.append("language"))
    guarded = F._vl_hidden_once(pol, pol.hidden)
    pol.one_vl_forward = True
    for rows in (torch.arange(3), torch.tensor([2])):  # with screenshots (trajectory 0 in two segments); text only
        T = int(b.widths[rows].max())
        args = (b.tokens[rows, :T], b.valid[rows, :T])
        with torch.no_grad():
            want = pol.hidden(*args, vl=b.vl(rows))
            order.clear()
            got = guarded(*args, vl=b.vl(rows))
        assert order == ["visual", "language"], order
        assert torch.equal(got, want)
    pol.one_vl_forward = False  # segments packed into several forwards: refused, not a hang
    with pytest.raises(RuntimeError, match="once each expected"), torch.no_grad():
        rows = torch.arange(2)  # 3 segments of nearly a row's width each: two forwards
        T = int(b.widths[rows].max())
        guarded(b.tokens[rows, :T], b.valid[rows, :T], vl=b.vl(rows))
