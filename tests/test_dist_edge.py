"""Edge cases of the data-parallel step: a minibatch with no trained token, a batch whose rows are all skipped."""
import numpy as np
import torch
import torch.multiprocessing as mp

from core.config import LearnerConfig, PPOConfig
from core.model import DecoderConfig
from core.outcome import Outcome
from core.schema import Trajectory, Turn
from learner.distributed import Dist
from learner.policy import TrainPolicy
from learner.ppo import PPOTrainer


def _no_grads_rank(rank, init, q):
    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        lin = torch.nn.Linear(3, 2)  # no backward ran on any rank: every grad is None
        Dist(rank, 2).allreduce_grads(lin.parameters())
        q.put((rank, all(p.grad is None for p in lin.parameters())))
        torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def test_allreduce_grads_with_no_trained_tokens_on_any_rank(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    ps = [ctx.Process(target=_no_grads_rank, args=(r, init, q)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = dict(q.get(timeout=60) for _ in ps)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: True, 1: True}, got


def _batch(n=11, V=40):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        L = int(rng.integers(6, 30))
        m = np.zeros(L, np.uint8)
        g = int(rng.integers(1, 5))
        m[L - g:] = 1
        out.append(Trajectory(id=f"t{i}", env_id="x", outcome=Outcome.TERMINATED,
                              tokens=rng.integers(0, V, L).astype(np.int32),
                              logprobs=np.where(m, -1.5 - rng.random(L), 0).astype(np.float32),
                              versions=np.where(m, 0, -1).astype(np.int32), mask=m,
                              turns=[Turn("", "", {}, 1.0, L - g, L)], ret=1.0, group=f"g{i // 4}"))
    return out


def test_all_rows_skipped_reports_empty_means_as_zero():
    """Every GRPO group has one reward: no row trained. The one-process fused pass reports the empty means as the
    ranks do (0), not a sum over rows that were never trained."""
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2), seed=0)
    cfg = LearnerConfig(algo="grpo", lr=1e-2, warmup_steps=1, ppo=PPOConfig(epochs=1, minibatches=1))
    m = PPOTrainer(pol, None, cfg, 0).step(_batch(), 0)
    assert m["rows_skipped"] == 11, m
    assert m["behav_prox_kl"] == 0.0 and m["is_ratio_mean"] == 0.0 and m["is_weight_mean"] == 0.0, m
