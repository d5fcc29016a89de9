"""Checkpoints: run_dir/ckpt holds the policy (HF layout), the optimizers, the RNG states, the critic and a meta.json
(version, update count, scheduler state, the stream's consumed ids, ...), so a killed learner restarted with
--resume loses nothing and trains on nothing twice.

Layout of one checkpoint directory:

    policy/            the policy in HF layout (safetensors)
    train_state.pt     tensors only: optimizer state dicts, critic weights, torch / CUDA RNG states. Read with
                       torch.load(weights_only=True): a file that holds anything but tensors and plain containers
                       (a pickled callable, say) is refused, nothing in it runs.
    meta.json          everything else, as JSON: version, updates, entropy_coef, scheduler state, consumed ids, ...
    MANIFEST.json      written last: every other file with its size. A directory without it, or whose files do not
                       match it, is not a checkpoint (a save was interrupted, or the disk lied).

Saving (a kill at any point leaves one whole checkpoint, the new or the previous one):

    1. write ckpt.tmp/ (files, then MANIFEST.json), fsync every file and directory
    2. rename ckpt -> ckpt.old (only a whole ckpt; a broken one is removed, keeping ckpt.old), fsync run_dir
    3. rename ckpt.tmp -> ckpt, fsync run_dir
    4. remove ckpt.old

Loading takes ckpt if it is whole, else ckpt.old if that is whole (with a warning: the save after it was
interrupted). Neither there: `locate` returns None (the caller decides whether a fresh start is allowed); something
there but nothing whole: CheckpointError. Tensors are saved on the CPU whatever the device, so a checkpoint resumes
on another device (or none).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil

import torch
from safetensors import SafetensorError

from learner.device import to_cpu
from learner import fsdp as F
from learner.policy import TrainPolicy, read_weights

log = logging.getLogger("tars.learner")

MANIFEST = "MANIFEST.json"
FORMAT = 2  # 1: the format before MANIFEST.json (train_state.pt pickled with the scheduler in it); not read


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is required, or a checkpoint that is refused (broken, or not plain tensors)."""


def paths(run: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(ckpt, ckpt.old, ckpt.tmp) of a run directory."""
    return run / "ckpt", run / "ckpt.old", run / "ckpt.tmp"


def why_not_whole(d: pathlib.Path) -> str | None:
    """None if `d` is a whole checkpoint (its MANIFEST.json is there, every file it lists has its size), else why."""
    if not d.is_dir():
        return "missing"
    try:
        man = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (its save was interrupted, or an older tars wrote it)"
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST}: {e}"
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("files"), dict):
        return f"{MANIFEST} is not a format-{FORMAT} manifest"
    for rel, size in man["files"].items():
        p = d / rel
        if not p.resolve().is_relative_to(d.resolve()):
            return f"{MANIFEST} names {rel!r}, outside the checkpoint"
        try:
            actual = p.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if actual != size:
            return f"{rel} has {actual} bytes, its manifest says {size}"
    return None


def locate(run: pathlib.Path) -> pathlib.Path | None:
    """The checkpoint directory to resume from: ckpt if whole, else a whole ckpt.old (warned); None if neither exists.
    Raises CheckpointError when one exists but none is whole (resuming from nothing would silently lose training)."""
    cur, old, _ = paths(run)
    why = why_not_whole(cur)
    if why is None:
        return cur
    why_old = why_not_whole(old)
    if why_old is None:
        log.warning("checkpoint %s is not usable (%s): resuming from the previous one, %s", cur, why, old)
        return old
    if not cur.exists() and not old.exists():
        return None
    raise CheckpointError(f"no whole checkpoint in {run}: ckpt: {why}; ckpt.old: {why_old}")


class Checkpointer:
    """Saves and restores the training state of one learner: its models, its trainer's optimizers and the RNG."""

    def __init__(self, run: pathlib.Path, policy: TrainPolicy, critic: TrainPolicy | None, trainer, device: torch.device):
        self.dir, self.old, self.tmp = paths(run)
        self.run, self.policy, self.critic, self.trainer, self.device = run, policy, critic, trainer, device
        self.critic_restored = False  # load(): this learner's critic came from the checkpoint

    def gather(self) -> dict:
        """The models' and optimizers' state as one process holds it. Under learner.parallel=fsdp the shards are
        gathered whole (learner/fsdp.py): a collective, so EVERY rank calls it, then rank 0 passes it to save(); the
        checkpoint is the same files as a 1-process learner's and loads in one (or in several, sharded again)."""
        state = {"policy": self.policy.hf_state_dict(), "opt": F.full_optim_state(self.trainer.opt)}
        if self.critic is not None:
            state.update(critic=F.full_state(self.critic), critic_opt=F.full_optim_state(self.trainer.critic_opt))
        return state

    def save(self, meta: dict, state: dict | None = None) -> pathlib.Path:
        """Write the training state (gather()'s, or taken now: one process / data parallel) plus `meta` (the
        caller's: version, stream state, ...) and make it durable."""
        state = dict(state) if state is not None else self.gather()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        with F.gathered(self.policy, state.pop("policy")), write_failure("policy"):
            self.policy.save_hf(self.tmp / "policy")
        state["torch_rng"] = torch.get_rng_state()
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        with write_failure("train_state.pt"):
            torch.save(to_cpu(state), self.tmp / "train_state.pt")
        meta = {"updates": self.trainer.updates, "entropy_coef": self.trainer.entropy_coef,
                "sched": self.trainer.sched.state_dict(), **meta}
        (self.tmp / "meta.json").write_text(json.dumps(meta))
        fsync_tree(self.tmp)  # every file on disk before the manifest says the checkpoint is whole
        files = {p.relative_to(self.tmp).as_posix(): p.stat().st_size
                 for p in sorted(self.tmp.rglob("*")) if p.is_file()}
        write_durably(self.tmp / MANIFEST, json.dumps({"format": FORMAT, "version": meta.get("version"),
                                                        "files": files}, indent=1))
        fsync_tree(self.tmp, files=False)
        # The swap: at every point either ckpt or ckpt.old is whole (module docstring).
        if why_not_whole(self.dir) is None:
            shutil.rmtree(self.old, ignore_errors=True)  # a leftover of an interrupted step 4: ckpt is newer
            os.replace(self.dir, self.old)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)  # not a checkpoint; ckpt.old (if whole) stays the fallback
        fsync_tree(self.run, files=False)
        os.replace(self.tmp, self.dir)
        fsync_tree(self.run, files=False)
        shutil.rmtree(self.old, ignore_errors=True)
        return self.dir

    def discard_partial(self) -> None:
        """After save() failed: remove what it wrote of the new checkpoint (ckpt and ckpt.old are left as they are)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def load(self, src: pathlib.Path | None = None) -> dict:
        """Restore models, optimizers, RNG and the trainer's counters from `src` (default: locate()); returns
        meta.json for the caller's part. CheckpointError if there is none, or it is refused."""
        src = src if src is not None else locate(self.run)
        if src is None:
            raise CheckpointError(f"no checkpoint in {self.run}")
        why = why_not_whole(src)
        if why is not None:
            raise CheckpointError(f"{src} is not a whole checkpoint: {why}")
        meta = json.loads((src / "meta.json").read_text())
        # Plain tensors and containers only: a pickled object (code) in the file is refused before anything of it
        # runs. Loaded to the CPU: the RNG states must be CPU tensors, and load_state_dict moves the optimizer state
        # and the critic's weights onto their parameters' device.
        try:
            state = torch.load(src / "train_state.pt", weights_only=True, map_location="cpu")
        except Exception as e:  # pickle.UnpicklingError (not plain tensors), RuntimeError (not a torch file), ...
            raise CheckpointError(f"{src / 'train_state.pt'} refused: not a file of plain tensors "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
        if not isinstance(state, dict) or "opt" not in state or "torch_rng" not in state:
            raise CheckpointError(f"{src / 'train_state.pt'} refused: not a tars training state")
        try:  # a checkpoint of another model (--model, model.*) or optimiser layout: refused, not a traceback
            self.policy.load_weights(read_weights(src / "policy"))
            F.load_optim_state(self.trainer.opt, state["opt"])  # sharded again under learner.parallel=fsdp
            # A checkpoint without a critic (learner.algo=grpo, resumed under ppo): the critic starts fresh, and its
            # value pretraining with it (the caller reads critic_restored).
            self.critic_restored = self.critic is not None and "critic" in state
            if self.critic_restored:
                F.load_state(self.critic, critic_state(state["critic"]))
                F.load_optim_state(self.trainer.critic_opt, state["critic_opt"])
        except (ValueError, RuntimeError, KeyError, IndexError) as e:
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(f"{src} does not fit this learner's model: {msg}; resume with the --model and "
                                  "settings the run was started with") from e
        self.trainer.sched.load_state_dict(meta["sched"])
        configured_hyperparameters(self.trainer)
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.trainer.updates = int(meta["updates"])
        # The adapted coefficient is state (learner.ppo.target_entropy > 0); without adaptation it is a setting,
        # and the configured one wins (a restart with another entropy_coef trained on at the checkpoint's).
        p = self.trainer.cfg.ppo
        self.trainer.entropy_coef = float(meta.get("entropy_coef", p.entropy_coef)) if p.target_entropy > 0 \
            else p.entropy_coef
        return meta


def configured_hyperparameters(trainer) -> None:
    """After the optimizers' and the schedule's state dicts are loaded (they carry the checkpoint's lr, weight decay
    and base lr): the configured learner.lr, critic_lr, weight_decay and warmup_steps win, at the schedule's step, as
    a restarted run's other settings do. Before, a resume with another lr trained on at the checkpoint's, silently."""
    cfg, sched = trainer.cfg, trainer.sched
    sched.base_lrs = [cfg.lr] * len(trainer.opt.param_groups)
    for g in trainer.opt.param_groups:
        g.update(initial_lr=cfg.lr, lr=cfg.lr * sched.lr_lambdas[0](sched.last_epoch), weight_decay=cfg.weight_decay)
    sched._last_lr = [g["lr"] for g in trainer.opt.param_groups]
    for g in trainer.critic_opt.param_groups if trainer.critic_opt is not None else ():
        g.update(lr=cfg.critic_lr, weight_decay=cfg.weight_decay)


def critic_state(sd: dict) -> dict:
    """A critic's state dict as TrainPolicy names it: a checkpoint written before the learner trained transformers'
    model class (core.model.CausalLM: model.*, lm_head.*) has the transformers model's names without the `lm.`."""
    return {(f"lm.{k}" if k.startswith(("model.", "lm_head.")) else k): v for k, v in sd.items()}


@contextlib.contextmanager
def write_failure(what: str):
    """A write that fails (a full disk) raises OSError, as Python's own writes do: torch.save reports it as a
    RuntimeError ("unexpected pos ..."), safetensors as a SafetensorError ("I/O error: No space left on device")."""
    try:
        yield
    except (RuntimeError, SafetensorError) as e:
        raise OSError(f"cannot write {what}: {' '.join(str(e).split())[:300]}") from e


def write_durably(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
