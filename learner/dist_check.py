"""A fixed PPO run for checking data parallelism: run it directly and under `accelerate launch`, compare the output.

    python -m learner.dist_check OUT.pt [steps]
    accelerate launch --multi_gpu --num_processes 2 -m learner.dist_check OUT.pt [steps]   (CPU: gloo)

(accelerate's `--cpu` flag alone starts ONE process unless mpirun is configured; `--multi_gpu` selects its
torch.distributed launcher, and Accelerator(cpu=True) in each process then picks gloo.)

Rank 0 builds the batches and broadcasts them (as the learner does with the stream's batches); every rank trains;
rank 0 writes the final policy and critic parameters and the world size to OUT.pt.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from learner.distributed import from_accelerate
from learner.policy import TrainPolicy
from learner.ppo import PPOTrainer
from core.config import LearnerConfig, PPOConfig, ValuePretrainConfig
from core.model import DecoderConfig
from core.outcome import Outcome
from core.schema import Trajectory, Turn

V = 40


def batch(seed: int, n: int = 12, max_len: int = 30) -> list[Trajectory]:
    """Trajectories of mixed lengths (6 to max_len - 1) with rewards at the end, groups of 4: several length chunks
    per minibatch, a critic and GRPO all have work."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(6, max_len))
        m = np.zeros(L, np.uint8)
        m[L - 3:] = 1
        r = float(rng.random() < 0.5)
        out.append(Trajectory(id=f"{seed}-{i}", env_id="x", outcome=Outcome.TERMINATED,
                              tokens=rng.integers(0, V, L).astype(np.int32),
                              logprobs=np.where(m, -1.5, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                              mask=m, turns=[Turn("", "", {}, r, L - 3, L)], ret=r, group=f"g{i // 4}"))
    return out


def run(steps: int, algo: str = "ppo") -> tuple[dict, int]:
    dist = from_accelerate(cpu=True)
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2),
                                  seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    cfg = LearnerConfig(algo=algo, lr=1e-2, warmup_steps=1, ppo=PPOConfig(epochs=2, minibatches=2),
                        value_pretrain=ValuePretrainConfig(steps=1))
    tr = PPOTrainer(pol, critic, cfg, 0, dist=dist)
    tr.chunk_tokens = 60  # several chunks per minibatch, so the ranks really split the work
    if critic is not None:
        tr.value_pretrain_step(dist.broadcast(batch(100) if dist.is_main else None))
    for v in range(steps):
        tr.step(dist.broadcast(batch(v) if dist.is_main else None), v)
    sd = {f"policy.{k}": t.detach().clone() for k, t in pol.state_dict().items()}
    if critic is not None:
        sd.update({f"critic.{k}": t.detach().clone() for k, t in critic.state_dict().items()})
    return sd, dist.world


def main(argv: list[str]) -> int:
    out, steps = argv[0], int(argv[1]) if len(argv) > 1 else 3
    sd, world = run(steps)
    import torch.distributed as td

    if not td.is_initialized() or td.get_rank() == 0:
        torch.save({"world": world, "backend": td.get_backend() if td.is_initialized() else "", "params": sd}, out)
    if td.is_initialized():
        td.barrier()
        td.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
