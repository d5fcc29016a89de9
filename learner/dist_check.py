"""A fixed PPO run for checking data parallelism: run it directly and under `accelerate launch`, compare the output.

    python -m learner.dist_check OUT.pt [steps] [ddp|fsdp] [nan_at] [kl_coef] [--vl DIR BATCHES.pt [--freeze-vision]]
    accelerate launch --multi_gpu --num_processes 2 -m learner.dist_check OUT.pt [steps] [ddp|fsdp] [nan_at] [kl_coef] [...]

--vl: the policy is the Qwen2-VL / Qwen2.5-VL checkpoint in DIR (its critic: TrainPolicy.critic_from), trained on the
trajectories with screenshots in BATCHES.pt (torch.save of [value-pretrain batch, update 0's batch, ...], built by
the caller: tests/test_fsdp.py with tars.bench.episodes.vl_episodes); --freeze-vision: model.freeze_vision first.
OUT.pt then also holds "hf": the policy's hf_state_dict() (checkpoint names, gathered whole).

(accelerate's `--cpu` flag alone starts ONE process unless mpirun is configured; `--multi_gpu` selects its
torch.distributed launcher, and Accelerator(cpu=True) in each process then picks gloo.)

Rank 0 builds the batches and broadcasts them (as the learner does with the stream's batches); every rank trains;
rank 0 writes the final policy and critic parameters (gathered whole under fsdp, learner/fsdp.py), the first
update's figures and the world size to OUT.pt, and a checkpoint (learner/checkpoint.py) to OUT.pt's name + ".run",
which every rank then loads into fresh models (sharded again under fsdp): "reload_diff" is how far the weights and
optimizer state read back are from what was written.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from learner import fsdp as F
from learner.checkpoint import Checkpointer
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


def poisoned(trajs: list[Trajectory]) -> list[Trajectory]:
    """The batch with one trajectory's behaviour logprobs NaN: the loss of the chunk holding it (on one rank) is NaN,
    and every rank must skip that minibatch's step, as one process does."""
    t = trajs[5]
    t.logprobs = np.where(t.mask, np.nan, 0).astype(np.float32)
    return trajs


def models(algo: str = "ppo", parallel: str = "ddp", kl_coef: float = 0.0, dist=None, vl: str | None = None,
           freeze_vision: bool = False):
    """The policy, critic and trainer of the check (the same initial weights everywhere); vl: a VL checkpoint dir."""
    torch.manual_seed(0)
    if vl is not None:
        pol = TrainPolicy.load(vl)
        if freeze_vision:  # before the critic copies it (learner/main.py's order)
            pol.freeze_vision()
        critic = TrainPolicy.critic_from(pol) if algo == "ppo" else None
        # The forward layout learner/fsdp.py gives a sharded VL model (all of a chunk's segments in one forward) in
        # one process too, so the comparison sees sharding alone: packing segments into several forwards changes the
        # padding, hence fp32 rounding, and AdamW turns the rounding of near-zero gradients (a key bias's, whose exact
        # gradient is 0) into steps of the learning rate's size.
        for m in (pol, critic):
            if m is not None:
                m.one_vl_forward = True
    else:
        pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2), seed=0)
        critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    # (VL: a smaller step: AdamW's first steps are ~lr per weight whatever the gradient's size, so the rounding of the
    # near-zero gradients alone moves weights apart by a share of lr; 1e-3 keeps that under the check's 1e-5)
    cfg = LearnerConfig(algo=algo, lr=1e-3 if vl is not None else 1e-2, warmup_steps=1, ppo=PPOConfig(epochs=2, minibatches=2, kl_coef=kl_coef),
                        value_pretrain=ValuePretrainConfig(steps=1), parallel=parallel)
    tr = PPOTrainer(pol, critic, cfg, pol.config.pad_token_id if vl is not None else 0, dist=dist)
    # several chunks per minibatch, so the ranks really split the work (a VL trajectory is ~100 tokens per image)
    tr.chunk_tokens = 400 if vl is not None else 60
    return pol, critic, tr


def run(steps: int, algo: str = "ppo", parallel: str = "ddp", run_dir=None, nan_at: int = -1, kl_coef: float = 0.0,
        vl: str | None = None, batches=None, freeze_vision: bool = False) -> tuple[dict, int, list, float | None, list, dict]:
    dist = from_accelerate(cpu=True)

    def data(v: int):  # update v's batch (-1: the value pretraining's), built on rank 0 and broadcast
        if not dist.is_main:
            return dist.broadcast(None)
        if batches is not None:
            return dist.broadcast(batches[v + 1])
        return dist.broadcast(batch(100) if v < 0 else poisoned(batch(v)) if v == nan_at else batch(v))

    mk = dict(dist=dist, vl=vl, freeze_vision=freeze_vision)
    pol, critic, tr = models(algo, parallel, kl_coef, **mk)
    if critic is not None:
        tr.value_pretrain_step(data(-1))
    sharded = [F.is_sharded(m) for m in (pol, critic, tr.ref) if m is not None]
    figures = [tr.step(data(v), v) for v in range(steps)]
    hf = pol.hf_state_dict()  # the checkpoint's names, gathered whole (collective)
    sd = {f"policy.{k}": t for k, t in F.full_state(pol).items()}  # every rank gathers (collective)
    if critic is not None:
        sd.update({f"critic.{k}": t for k, t in F.full_state(critic).items()})
    reload_diff = None
    if run_dir is not None:
        ck = Checkpointer(run_dir, pol, critic, tr, torch.device("cpu"))
        state = ck.gather()  # every rank: the whole state, in the same collective order
        if dist.is_main:
            ck.save({"version": steps}, state)
        dist.barrier()
        # Resume on every rank (sharded again under fsdp): the state must come back as it was written.
        pol2, critic2, tr2 = models(algo, parallel, kl_coef, **mk)
        Checkpointer(run_dir, pol2, critic2, tr2, torch.device("cpu")).load()
        back = {f"policy.{k}": t for k, t in F.full_state(pol2).items()}
        if critic2 is not None:
            back.update({f"critic.{k}": t for k, t in F.full_state(critic2).items()})
        opt_back = F.full_optim_state(tr2.opt)["state"]
        opt_was = state["opt"]["state"]
        reload_diff = float(max(
            [float((back[k] - sd[k]).abs().max()) for k in sd]
            + [float((opt_back[i][k] - opt_was[i][k]).abs().max()) for i in opt_was for k in opt_was[i]]))
    return sd, dist.world, figures, reload_diff, sharded, {k: v.detach().to("cpu") for k, v in hf.items()}


def main(argv: list[str]) -> int:
    import pathlib

    import torch.distributed as td

    vl = batches = None
    freeze = "--freeze-vision" in argv
    argv = [a for a in argv if a != "--freeze-vision"]
    if "--vl" in argv:
        i = argv.index("--vl")
        vl, batches = argv[i + 1], torch.load(argv[i + 2], weights_only=False)
        argv = argv[:i] + argv[i + 3:]
    out, steps = argv[0], int(argv[1]) if len(argv) > 1 else 3
    parallel = argv[2] if len(argv) > 2 else "ddp"
    nan_at = int(argv[3]) if len(argv) > 3 else -1  # this update's batch gets a NaN behaviour logprob
    kl_coef = float(argv[4]) if len(argv) > 4 else 0.0  # > 0: a frozen reference policy too (sharded under fsdp)
    run_dir = pathlib.Path(out + ".run")
    run_dir.mkdir(exist_ok=True)
    sd, world, figures, reload_diff, sharded, hf = run(steps, parallel=parallel, run_dir=run_dir, nan_at=nan_at,
                                                       kl_coef=kl_coef, vl=vl, batches=batches, freeze_vision=freeze)
    if not td.is_initialized() or td.get_rank() == 0:
        torch.save({"world": world, "backend": td.get_backend() if td.is_initialized() else "", "params": sd, "hf": hf,
                    "reload_diff": reload_diff, "sharded": sharded,
                    "figures": [{k: v for k, v in m.items() if isinstance(v, (int, float)) and k != "update_s"}
                                for m in figures]}, out)
    if td.is_initialized():
        td.barrier()
        td.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
