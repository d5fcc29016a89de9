"""The learner process, top to bottom: stream -> staleness filter -> update -> publish weights -> checkpoint.

Trajectories arrive on the acked ZMQ stream (core/stream/). infra_error episodes and trajectories past the
maximum lag are counted and never reach the loss. Each update bumps the policy version; the new weights are written
in HF layout to a versioned directory (write, then rename) and every inference server is told to load them.
A checkpoint stores the model, optimizers, RNG, version and the ids of every trajectory consumed, so a killed
learner restarted with --resume loses nothing and trains on nothing twice.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch

from learner.device import describe, resolve_device, resolve_precision, to_cpu
from learner.distributed import Dist, from_accelerate
from learner.ppo import PPOTrainer
from learner.staleness import StalenessManager
from core import proc, rpc, telemetry
from core.config import ConfigError, RunConfig
from core.control import ControlServicer, add_control
from core.model import CausalLM
from core.stream.receiver import TrajectoryReceiver
from core.stream.wal import WriteAheadLog
from core.v1 import inference_pb2, inference_pb2_grpc

EV_WINDOW = 10


def value_pretrain_done(evs: list[float], threshold: float, window: int = EV_WINDOW) -> bool:
    """Value pretraining stops early on the mean explained variance of the last `window` batches, not on one batch:
    a 64-trajectory batch's figure is noisy (one passed 0.5 at update 50 of a quickstart run whose last 10 batches
    averaged 0.28)."""
    return len(evs) >= window and sum(evs[-window:]) / window >= threshold

log = logging.getLogger("tars.learner")


def publish_weights(policy: CausalLM, wdir: pathlib.Path, version: int, stubs, keep: int, counters=None) -> float:
    """weights/v{version} in HF layout (write, then rename), every server told to load it, old versions pruned.

    Returns the seconds from the start of the write until the last server answered (it serves the new weights then).
    """
    t0 = time.perf_counter()
    wdir.mkdir(exist_ok=True)
    path = wdir / f"v{version:06d}"
    policy.save_hf(path)
    for stub in stubs:
        try:
            stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=version, path=str(path)), timeout=60.0)
        except Exception as e:  # a dead replica must not stop training; it reloads the latest on restart
            if counters is not None:
                counters["publish_failures"] += 1
            log.warning("publish v%d failed: %s", version, e)
    for old in sorted(wdir.glob("v*"))[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return time.perf_counter() - t0


class Learner:
    def __init__(self, cfg: RunConfig, run_dir: str, model_dir: str, inference: list[str], resume: bool = False,
                 dist: Dist | None = None):
        self.cfg, self.lcfg = cfg, cfg.learner
        # Under `accelerate launch` rank 0 does all I/O and broadcasts batches; other ranks only train (follow()).
        self.dist = dist if dist is not None else Dist()
        self.run = pathlib.Path(run_dir)
        self.model_dir = pathlib.Path(model_dir)
        torch.set_num_threads(max(1, self.lcfg.threads))
        # learner.device / learner.precision, checked before any model is built (ConfigError on a bad value).
        self.device = resolve_device(self.lcfg.device)
        self.amp_dtype = resolve_precision(self.lcfg.precision, self.device)
        torch.manual_seed(cfg.seed)
        self.policy = CausalLM.load_hf(model_dir)
        self.critic = None
        if self.lcfg.algo == "ppo":
            self.critic = CausalLM(self.policy.config, value_head=True)
            self.critic.load_state_dict(self.policy.state_dict(), strict=False)  # critic starts from the policy trunk
            torch.nn.init.zeros_(self.critic.score.weight)
            torch.nn.init.zeros_(self.critic.score.bias)
        # Built on the CPU (same initialisation on every device), then moved; weights stay fp32 (master weights).
        self.policy.to(self.device)
        if self.critic is not None:
            self.critic.to(self.device)
        log.info("learner trains on %s", describe(self.device, self.amp_dtype))
        self.trainer = PPOTrainer(self.policy, self.critic, self.lcfg, self.policy.config.pad_token_id, dist=self.dist,
                                  amp_dtype=self.amp_dtype)
        self.version = 0
        self.value_pretrain_left = self.lcfg.value_pretrain_steps
        self.value_pretrain_evs: collections.deque[float] = collections.deque(maxlen=EV_WINDOW)
        self.staleness = StalenessManager(self.lcfg.batch_size, self.lcfg.eta, max_lag=self.lcfg.max_lag)
        consumed: set[str] = set()
        if resume and (self.run / "ckpt" / "meta.json").exists():
            consumed = self._load_checkpoint()
        self.stop = threading.Event()
        if not self.dist.is_main:
            return
        self.receiver = TrajectoryReceiver(
            f"tcp://{self.lcfg.stream_host}:{self.lcfg.stream_port}", str(self.run / "stream.wal"), self.staleness,
            credits=self.lcfg.credits, queue_size=max(self.lcfg.stream_queue_size, 2 * self.lcfg.batch_size),
            max_frame_bytes=self.lcfg.max_frame_bytes, consumed_ids=consumed,
            ack_interval_s=self.lcfg.stream_ack_interval_s, fsync=self.lcfg.stream_fsync,
            curve_secret_key=self.lcfg.stream_curve_secret_key.encode() or None,
            durability=self.lcfg.stream_durability)
        self.inference = [inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(a, cfg.inference.auth_token, 512 << 20)) for a in inference]
        self.checkpoint_requested = threading.Event()
        self.counters = collections.Counter()
        self.pending_groups: dict[str, tuple[float, int, list]] = {}  # group -> (first arrival, arrived, kept)
        self.group_timeout_s = 120.0
        self.last_metrics: dict = {}
        self.last_checkpoint: dict = {}
        self.episodes = open(self.run / "episodes.jsonl", "a", buffering=1)
        self.archive = WriteAheadLog(self.run / "trajectories.twl", fsync=False).open() if self.lcfg.archive else None
        self.metrics_log = open(self.run / "learner.jsonl", "a", buffering=1)
        # Which trajectory ids each update trained on and which were masked (infra_error / too stale) before it:
        # {"resume": v} marks a (re)start from version v, so a reader can drop the records a kill rolled back
        # and check that every trajectory was trained on exactly once (tars/faults.py does).
        self.trained_log = open(self.run / "trained.jsonl", "a", buffering=1)
        self.masked_since_update: list[str] = []
        self._meters()

    def _meters(self) -> None:
        self.t_started = time.monotonic()
        self.staleness_hist = telemetry.histogram("tars.token_staleness", "", "per trained token: train version - "
                                                  "version that generated it")
        self.step_hist = telemetry.histogram("tars.learner.step.duration", "s", "one policy update (publish included)")
        telemetry.observe("tars.learner.trajectories", lambda: self.counters["received"], description="trajectories "
                          "received", kind="counter")
        telemetry.observe("tars.learner.trajectories_per_s", lambda: self.counters["received"] / max(
            1e-9, time.monotonic() - self.t_started), "1/s", "trajectories received per second since start")
        telemetry.observe("tars.learner.buffer_depth", self.receiver.qsize, description="trajectories waiting in the "
                          "learner's queue")
        telemetry.observe("tars.learner.version", lambda: self.version, description="policy version")
        telemetry.observe("tars.learner.eta", lambda: self.staleness.stats()["eta"], description="staleness bound eta")
        telemetry.observe("tars.learner.dropped", lambda: {k: self.counters[k] for k in ("infra_error", "too_stale")},
                          description="trajectories kept out of the loss, by reason", kind="counter", label="reason")

    # ---- the loop --------------------------------------------------------------------------------------------
    def train(self) -> None:
        self.trained_log.write(json.dumps({"resume": self.version, "t": time.time()}) + "\n")
        self.staleness.set_version(self.version)
        self._publish(self.version)  # after a resume: bring the servers to the checkpoint's weights
        while not self.stop.is_set() and self.version < self.cfg.max_versions:
            batch = self._collect(self.lcfg.batch_size)
            if batch is None:
                break
            links = [lk for lk in (telemetry.link_from(tr.traceparent) for tr in batch) if lk is not None]
            with telemetry.span("learner.step", attributes={"tars.version": self.version, "tars.batch": len(batch)},
                                links=links) as step_span:
                t0 = time.perf_counter()
                m = self._update(self.dist.broadcast(batch))
                for tr in batch:
                    gen = tr.versions[tr.mask.astype(bool)]
                    self.staleness.record_staleness(gen, self.version)
                    if telemetry.S.metrics:
                        for lag, n in zip(*np.unique(self.version - gen[gen >= 0], return_counts=True)):
                            for _ in range(int(n)):  # OTel histograms take one value per call
                                self.staleness_hist.record(int(lag))
                self.version += 1
                publish_s = self._publish(self.version)
                self.staleness.set_version(self.version)
                self.receiver.mark_consumed(tr.id for tr in batch)
                self.trained_log.write(json.dumps({"version": self.version, "ids": [tr.id for tr in batch],
                                                   "masked": self.masked_since_update}) + "\n")
                self.masked_since_update = []
                self.counters["trained"] += len(batch)
                m.update(version=self.version, t=time.time(), step_s=time.perf_counter() - t0, publish_s=publish_s,
                         success=float(np.mean([tr.success for tr in batch])), ret=float(np.mean([tr.ret for tr in batch])),
                         max_staleness=int(max(self.version - 1 - int(tr.versions[tr.mask.astype(bool)].min(initial=self.version - 1)) for tr in batch)),
                         queue=self.receiver.qsize(), ids=[tr.id for tr in batch])  # ids: audit of what each version trained on
                self.last_metrics = m
                self.metrics_log.write(json.dumps(m) + "\n")
                telemetry.set_attrs(step_span, **{"tars.new_version": self.version, "tars.step_s": m["step_s"],
                                                  "tars.max_staleness": m["max_staleness"]})
            self.step_hist.record(m["step_s"])
            if self.version % self.lcfg.checkpoint_every == 0 or self.checkpoint_requested.is_set():
                self.checkpoint()
        self.dist.broadcast(None)  # the other ranks stop too
        self.checkpoint()
        # Masked after the last update: covered by the final checkpoint, so recorded as a partial next version.
        self.trained_log.write(json.dumps({"version": self.version + 1, "ids": [], "partial": True,
                                           "masked": self.masked_since_update}) + "\n")
        self.export(self.run / "final")

    def _update(self, batch) -> dict:
        """One update on every rank (the same branch everywhere: explained variance is a whole-batch figure)."""
        if self.value_pretrain_left > 0:  # critic only; the policy (and so the behaviour) is unchanged
            m = self.trainer.value_pretrain_step(batch)
            self.value_pretrain_left -= 1
            self.value_pretrain_evs.append(m["explained_variance"])
            if value_pretrain_done(list(self.value_pretrain_evs), self.lcfg.value_pretrain_ev):
                self.value_pretrain_left = 0
            m["phase"] = "value_pretrain"
        else:
            m = self.trainer.step(batch, self.version)
            m["phase"] = "ppo" if self.critic is not None else "grpo"
        return m

    def follow(self) -> None:
        """Ranks > 0: train on each batch rank 0 broadcasts, until it broadcasts None."""
        while True:
            batch = self.dist.broadcast(None)
            if batch is None:
                return
            self._update(batch)
            self.version += 1

    def _collect(self, n: int):
        """The next batch of at least n trajectories, in whole groups when episodes are sampled in groups.

        Group members finish at different times (successes are often shorter), so a batch cut by arrival would
        split groups and normalise partial ones (all-success or all-failure halves get advantage 0). A group is
        released once all `group_size` members have arrived (infra_error members count as arrived, never trained);
        a group incomplete after group_timeout_s is released as it is, so a lost actor cannot stall training.
        """
        k = max(1, self.cfg.actor.group_size)
        batch: list = []
        while len(batch) < n:
            if self.stop.is_set():
                return None
            tr = self.receiver.get(timeout=0.5)
            now = time.monotonic()
            for g, (t0, arrived, members) in list(self.pending_groups.items()):
                if now - t0 > self.group_timeout_s:
                    del self.pending_groups[g]
                    self.counters["groups_timed_out"] += 1
                    batch += members
            if tr is None:
                if self.checkpoint_requested.is_set():  # asked for while no data flows (actors paused): now
                    self.checkpoint()
                continue
            keep = self._admit(tr)
            if k == 1 or not tr.group:
                batch += [tr] if keep else []
                continue
            t0, arrived, members = self.pending_groups.get(tr.group, (now, 0, []))
            arrived += 1
            members = members + ([tr] if keep else [])
            if arrived >= k:
                self.pending_groups.pop(tr.group, None)
                batch += members
            else:
                self.pending_groups[tr.group] = (t0, arrived, members)
        return batch

    def _admit(self, tr) -> bool:
        """Log one arrival; count and drop it (False) if it is an infra_error or too stale to train on."""
        self.counters["received"] += 1
        if self.archive is not None and tr.id not in self.archive:  # the data flywheel's raw material
            self.archive.append(tr.id, tr.encode())
        gen = tr.versions[tr.mask.astype(bool)]
        lag = self.version - int(gen.min()) if len(gen) else 0
        self.episodes.write(json.dumps({
            "t": time.time(), "id": tr.id, "env_id": tr.env_id, "outcome": tr.outcome, "success": tr.success,
            "return": tr.ret, "turns": len(tr.turns), "start_version": tr.start_version,
            "vmin": int(gen.min()) if len(gen) else -1, "vmax": int(gen.max()) if len(gen) else -1,
            "train_version": self.version, "group": tr.group, "error": tr.error,
            "outputs": [t.output[:80] for t in tr.turns[:8]]}) + "\n")
        if tr.outcome == "infra_error":  # never a reward of 0: kept out of the loss entirely
            self.counters["infra_error"] += 1
        elif lag > self.lcfg.max_lag:
            self.counters["too_stale"] += 1
        else:
            self.staleness.on_accepted(1)
            return True
        self.staleness.on_rejected(1)
        self.receiver.mark_consumed([tr.id])
        self.masked_since_update.append(tr.id)
        return False

    # ---- weights ---------------------------------------------------------------------------------------------
    def _publish(self, version: int) -> float:
        """Write weights/v{version} atomically and tell every inference server to load it."""
        if version == 0:
            return 0.0  # the servers started from model_dir at version 0
        return publish_weights(self.policy, self.run / "weights", version, self.inference, self.lcfg.keep_weights,
                               self.counters)

    def export(self, path: pathlib.Path) -> None:
        tok = (self.model_dir / "tars_tokenizer.json").read_text()
        self.policy.save_hf(path, extra_files={"tars_tokenizer.json": tok})

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        self.checkpoint_requested.clear()
        ck = self.run / "ckpt"
        tmp = self.run / "ckpt.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.policy.save_hf(tmp / "policy")
        state = {"opt": self.trainer.opt.state_dict(), "sched": self.trainer.sched.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_opt=self.trainer.critic_opt.state_dict())
        # On the CPU on disk, whatever the device: a checkpoint resumes on another device (or none).
        torch.save(to_cpu(state), tmp / "train_state.pt")
        meta = {"version": self.version, "updates": self.trainer.updates, "value_pretrain_left": self.value_pretrain_left,
                "entropy_coef": self.trainer.entropy_coef,
                "staleness": self.staleness.state_dict(), **self.receiver.checkpoint_state(), "t": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        fsync_tree(tmp)  # on disk before it replaces the old one, and before anything is acked against it
        shutil.rmtree(ck, ignore_errors=True)
        os.replace(tmp, ck)
        fsync_tree(self.run, files=False)
        self.receiver.compact_wal()
        self.receiver.commit(frozenset(meta["consumed_ids"]))  # checkpoint durability: actors may now forget these
        self.last_checkpoint = {"version": self.version, "t": meta["t"], "path": str(ck)}

    def _load_checkpoint(self) -> set[str]:
        ck = self.run / "ckpt"
        meta = json.loads((ck / "meta.json").read_text())
        self.policy.load_weights(CausalLM.load_hf(ck / "policy").hf_state_dict())
        # Loaded to the CPU: the RNG states must be CPU tensors, and load_state_dict moves the optimizer state
        # and the critic's weights onto their parameters' device.
        state = torch.load(ck / "train_state.pt", weights_only=False, map_location="cpu")
        self.trainer.opt.load_state_dict(state["opt"])
        self.trainer.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
            self.trainer.critic_opt.load_state_dict(state["critic_opt"])
        self.version = int(meta["version"])
        self.trainer.updates = int(meta["updates"])
        self.trainer.entropy_coef = float(meta.get("entropy_coef", self.trainer.cfg.entropy_coef))
        self.value_pretrain_left = int(meta.get("value_pretrain_left", 0))
        log.info("resumed from checkpoint at version %d (%d trajectories consumed)", self.version, len(meta["consumed_ids"]))
        return set(meta["consumed_ids"])

    # ---- control ---------------------------------------------------------------------------------------------
    def status(self) -> dict:
        return {"version": self.version, "counters": self.counters, "staleness": self.staleness.stats(),
                "staleness_histogram": self.staleness.histogram(), "stream": self.receiver.stats(),
                "queue": self.receiver.qsize(), "last": self.last_metrics, "last_checkpoint": self.last_checkpoint}

    def control(self) -> ControlServicer:
        c = ControlServicer("learner", self.status, lambda: self.version)
        c.on("set_eta", lambda a: (self.staleness.set_eta(int(a["eta"])), {"eta": int(a["eta"])})[1])
        c.on("checkpoint", lambda a: (self.checkpoint_requested.set(), {
            "requested": True, "version": self.version, "last_checkpoint": self.last_checkpoint,
            "when": "after the update in progress, or within 0.5 s if none is"})[1])
        c.on("stop", lambda a: (self.stop.set(), {"stopping": True})[1])
        return c


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


def _control_thread(learner: Learner, ready: dict, port: int = 0) -> threading.Thread:
    started = threading.Event()

    def run():
        async def main():
            server = rpc.make_server(auth_token=learner.cfg.envd.auth_token)
            add_control(server, learner.control())
            ready["control"] = f"127.0.0.1:{rpc.bind(server, '127.0.0.1', port)}"
            await server.start()
            started.set()
            while not learner.stop.is_set():
                await asyncio.sleep(0.2)
            await server.stop(0.5)

        asyncio.run(main())

    t = threading.Thread(target=run, name="learner-control", daemon=True)
    t.start()
    if not started.wait(10.0):
        raise TimeoutError("learner control server did not start")
    return t


def main(cfg: RunConfig, run_dir: str, model_dir: str, inference: list[str], ready_file: str | None = None,
         resume: bool = False) -> int:
    proc.die_with_parent()
    try:  # a bad learner.device / precision is a one-line error, before any process group or model
        device = resolve_device(cfg.learner.device)
        resolve_precision(cfg.learner.precision, device)
    except ConfigError as e:
        print(f"tars learner: {e}", file=sys.stderr)
        return 2
    # learner.device decides the backend: NCCL for CUDA (each rank on cuda:LOCAL_RANK), gloo on the CPU.
    dist = from_accelerate(device=device)
    learner = Learner(cfg, run_dir, model_dir, inference, resume=resume, dist=dist)
    if not dist.is_main:
        learner.follow()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: learner.stop.set())
    address = learner.receiver.start()
    info = {"role": "learner", "stream": address, "version": learner.version}
    ctl = _control_thread(learner, info)
    proc.write_ready(ready_file, {**info, "address": info["control"]})
    try:
        learner.train()
    finally:
        learner.stop.set()
        learner.receiver.stop()
        ctl.join(timeout=5.0)
    return 0
