"""Checkpoints: run_dir/ckpt holds the policy (HF layout), the optimizers, the RNG states, the critic and a meta.json
(version, update count, the stream's consumed ids, ...), so a killed learner restarted with --resume loses nothing
and trains on nothing twice.

A checkpoint is written to ckpt.tmp, fsynced, then renamed over ckpt: a kill at any point leaves the previous one
whole. Tensors are saved on the CPU whatever the device, so a checkpoint resumes on another device (or none).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import torch

from learner.device import to_cpu
from learner.policy import TrainPolicy, read_weights

log = logging.getLogger("tars.learner")


class Checkpointer:
    """Saves and restores the training state of one learner: its models, its trainer's optimizers and the RNG."""

    def __init__(self, run: pathlib.Path, policy: TrainPolicy, critic: TrainPolicy | None, trainer, device: torch.device):
        self.dir, self.tmp = run / "ckpt", run / "ckpt.tmp"
        self.run, self.policy, self.critic, self.trainer, self.device = run, policy, critic, trainer, device

    def exists(self) -> bool:
        return (self.dir / "meta.json").exists()

    def save(self, meta: dict) -> pathlib.Path:
        """Write the training state plus `meta` (the caller's: version, stream state, ...) and make it durable."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.policy.save_hf(self.tmp / "policy")
        state = {"opt": self.trainer.opt.state_dict(), "sched": self.trainer.sched.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_opt=self.trainer.critic_opt.state_dict())
        torch.save(to_cpu(state), self.tmp / "train_state.pt")
        meta = {"updates": self.trainer.updates, "entropy_coef": self.trainer.entropy_coef, **meta}
        (self.tmp / "meta.json").write_text(json.dumps(meta))
        fsync_tree(self.tmp)  # on disk before it replaces the old one, and before anything is acked against it
        shutil.rmtree(self.dir, ignore_errors=True)
        os.replace(self.tmp, self.dir)
        fsync_tree(self.run, files=False)
        return self.dir

    def load(self) -> dict:
        """Restore models, optimizers, RNG and the trainer's counters; returns meta.json for the caller's part."""
        meta = json.loads((self.dir / "meta.json").read_text())
        self.policy.load_weights(read_weights(self.dir / "policy"))
        # Loaded to the CPU: the RNG states must be CPU tensors, and load_state_dict moves the optimizer state
        # and the critic's weights onto their parameters' device.
        state = torch.load(self.dir / "train_state.pt", weights_only=False, map_location="cpu")
        self.trainer.opt.load_state_dict(state["opt"])
        self.trainer.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(critic_state(state["critic"]))
            self.trainer.critic_opt.load_state_dict(state["critic_opt"])
        self.trainer.updates = int(meta["updates"])
        self.trainer.entropy_coef = float(meta.get("entropy_coef", self.trainer.cfg.ppo.entropy_coef))
        return meta


def critic_state(sd: dict) -> dict:
    """A critic's state dict as TrainPolicy names it: a checkpoint written before the learner trained transformers'
    model class (core.model.CausalLM: model.*, lm_head.*) has the transformers model's names without the `lm.`."""
    return {(f"lm.{k}" if k.startswith(("model.", "lm_head.")) else k): v for k, v in sd.items()}


def fsync_tree(root: pathlib.Path, files: bool = True) -> None:
    """fdatasync every file under root (files=True) and every directory, root included, so names are durable."""
    for d, _, names in os.walk(root) if files else [(str(root), [], [])]:
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
