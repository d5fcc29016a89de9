"""The learner process, top to bottom: stream -> admission -> update -> publish weights -> checkpoint.

Trajectories arrive on the acked ZMQ stream (core/stream/). Admission (learner/admission.py) logs each one, keeps
infra_error episodes and trajectories past the maximum lag out of the loss, and assembles GRPO groups whole. Each
update (learner/update.py) bumps the policy version; the new weights are written in HF layout to a versioned
directory and every inference server is told to load them (learner/publish.py). A checkpoint
(learner/checkpoint.py) stores the model, optimizers, RNG, version and the ids of every trajectory consumed, so a
killed learner restarted with --resume loses nothing and trains on nothing twice (--resume-or-fresh: the same, or a
fresh start at version 0 when the run directory has no checkpoint yet). `tars ctl` talks to it through
its ControlService (learner/control.py).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time

import torch

from core import auth, proc, telemetry
from core.config import ConfigError, RunConfig
from core.outcome import Outcome
from core.stream.receiver import TrajectoryReceiver
from core.stream.wal import WriteAheadLog
from learner.admission import Admission
from learner.batch import binding_error
from learner.checkpoint import CheckpointError, Checkpointer, locate
from learner.control import CONTROL_HOST, learner_control, serve_control
from learner.device import describe, resolve_device, resolve_precision
from learner.distributed import Dist, from_accelerate
from learner.fsdp import gathered
from learner.policy import TrainPolicy
from learner.ppo import PPOTrainer
from learner.publish import Publisher, export
from learner.staleness import StalenessManager
from learner.update import Updater, batch_figures, record_staleness

log = logging.getLogger("tars.learner")

# What rank 0 broadcasts besides a batch (and None: stop) under learner.parallel=fsdp: "gather the sharded state with
# me now", before it publishes / exports the policy or writes a checkpoint (learner/fsdp.py). KEEPALIVE: no batch
# yet, sent every few seconds while rank 0 waits for one, so the other ranks' broadcast never waits out the process
# group's timeout however long the stream is idle (actors paused, servers restarting).
GATHER_POLICY, GATHER_CHECKPOINT, SET_VERSION, KEEPALIVE = "gather:policy", "gather:checkpoint", "version:", "keepalive"


class Learner:
    def __init__(self, cfg: RunConfig, run_dir: str, model_dir: str, inference: list[str], resume: bool = False,
                 dist: Dist | None = None, fresh_if_none: bool = False):
        """resume: continue from run_dir's checkpoint; CheckpointError if there is none, unless fresh_if_none (then
        version 0), and if there is one but it is broken or refused (never a silent fresh start over it)."""
        self.cfg, self.lcfg = cfg, cfg.learner
        # Under `accelerate launch` rank 0 does all I/O and broadcasts batches; other ranks only train (follow()).
        self.dist = dist if dist is not None else Dist()
        self.run = pathlib.Path(run_dir)
        ckpt = resume_from(self.run, resume, fresh_if_none)  # before any model is built: a missing one fails fast
        self.model_dir = pathlib.Path(model_dir)
        torch.set_num_threads(max(1, self.lcfg.threads))
        # learner.device / learner.precision, checked before any model is built (ConfigError on a bad value).
        self.device = resolve_device(self.lcfg.device)
        self.amp_dtype = resolve_precision(self.lcfg.precision, self.device)

        # ---- models and the update ----
        torch.manual_seed(cfg.seed)
        # The transformers model of the checkpoint (learner/policy.py); the critic starts from the policy's trunk
        # with a zero value head.
        self.policy = TrainPolicy.load(model_dir)
        if cfg.model.freeze_vision:  # before the critic copies it and the optimisers are built
            self.policy.freeze_vision()
        self.critic = TrainPolicy.critic_from(self.policy) if self.lcfg.algo == "ppo" else None
        # Built on the CPU (same initialisation on every device), then moved; weights stay fp32 (master weights).
        self.policy.to(self.device)
        if self.critic is not None:
            self.critic.to(self.device)
        log.info("learner trains on %s", describe(self.device, self.amp_dtype))
        self.trainer = PPOTrainer(self.policy, self.critic, self.lcfg, self.policy.config.pad_token_id, dist=self.dist,
                                  amp_dtype=self.amp_dtype, temperature=cfg.actor.temperature)
        if self.trainer.fsdp:
            log.info("learner.parallel=fsdp: policy%s sharded over %d ranks (FSDP2)",
                     " and critic" if self.critic is not None else "", self.dist.world)
        self.updater = Updater(self.trainer, self.lcfg)
        self.version = 0
        self.staleness = StalenessManager(self.lcfg.batch_size, self.lcfg.staleness.eta,
                                          max_lag=self.lcfg.staleness.max_lag)

        # ---- resume ----
        self.checkpointer = Checkpointer(self.run, self.policy, self.critic, self.trainer, self.device)
        consumed: set[str] = set()
        self._stream_ids: dict = {}  # the checkpoint's confirmed_ids and id_owners (core/stream/confirm.py)
        self._masked_unrecorded: list[str] = []  # (the checkpoint's: see checkpoint())
        if ckpt is not None:
            consumed = self._load_checkpoint(ckpt)
        self.stop = threading.Event()
        if not self.dist.is_main:
            return

        # ---- rank 0: the stream, admission, publishing, logs ----
        s = self.lcfg.stream
        self.receiver = TrajectoryReceiver(
            f"tcp://{s.host}:{s.port}", str(self.run / "stream.wal"), self.staleness,
            credits=s.credits, queue_size=max(s.queue_size, 2 * self.lcfg.batch_size),
            max_frame_bytes=s.max_frame_bytes, consumed_ids=consumed, ack_interval_s=s.ack_interval_s,
            confirmed_ids=self._stream_ids.get("confirmed_ids", ()), id_owners=self._stream_ids.get("id_owners"),
            fsync=s.fsync, curve_secret_key=s.curve_secret_key.encode() or None, durability=s.durability,
            grant_ttl_s=s.grant_ttl_s,
            wal_writer=s.wal_writer, curve_client_keys=auth.client_keys(s.curve_client_keys),
            keys_reload=functools.partial(auth.load_key_list, s.curve_client_keys_file,
                                          "learner.stream.curve_client_keys_file") if s.curve_client_keys_file else None,
            vocab_size=self.policy.config.vocab_size)  # token ids outside the model's vocabulary are NACKed
        self.counters = collections.Counter()
        self.publisher = Publisher(self.policy, self.run, inference, cfg.inference.auth_token, self.lcfg.publish,
                                   self.counters, tokenizer_from=self.model_dir)
        self.checkpoint_requested = threading.Event()
        self.last_metrics: dict = {}
        self.last_checkpoint: dict = {}
        self.checkpoint_error: dict | None = None  # the last checkpoint's failure, until one succeeds
        self.episodes = open(self.run / "episodes.jsonl", "a", buffering=1)
        archive = WriteAheadLog(self.run / "trajectories.twl", fsync=False).open() if self.lcfg.archive else None
        self.admission = Admission(self.receiver, self.staleness, self.lcfg.staleness.max_lag, self.lcfg.group,
                                   self.episodes, archive, self.counters,
                                   check=lambda tr: binding_error(tr, self.policy.vl),
                                   max_pending=self.receiver.queue_size)  # what the stream may hold, held here
        self.admission.masked = self._masked_unrecorded  # recorded with this learner's next update
        self.metrics_log = open(self.run / "learner.jsonl", "a", buffering=1)
        # Which trajectory ids each update trained on and which were masked (infra_error / too stale) before it:
        # {"resume": v} marks a (re)start from version v, so a reader can drop the records a kill rolled back
        # and check that every trajectory was trained on exactly once (tars/faults.py does).
        self.trained_log = open(self.run / "trained.jsonl", "a", buffering=1)
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
        telemetry.observe("tars.learner.nonfinite_updates", lambda: self.counters["nonfinite_updates"],
                          description="updates whose loss or gradient was not finite: no optimiser step taken",
                          kind="counter")
        telemetry.observe("tars.learner.checkpoint_failures", lambda: self.counters["checkpoint_failures"],
                          description="checkpoints that could not be written (a full disk...): training went on",
                          kind="counter")
        telemetry.observe("tars.learner.publish_write_failures", lambda: self.counters["publish_write_failures"],
                          description="published versions whose weights/vN could not be written (a full disk...): "
                          "training went on", kind="counter")
        telemetry.observe("tars.learner.dropped", lambda: {k: self.counters[k] for k in (Outcome.INFRA_ERROR, "too_stale",
                                                                                    "future_versions",
                                                                                    "no_generated_tokens",
                                                                                    "unbound_images")},
                          description="trajectories kept out of the loss, by reason", kind="counter", label="reason")

    # ---- the loop --------------------------------------------------------------------------------------------
    def train(self) -> None:
        self.trained_log.write(json.dumps({"resume": self.version, "t": time.time()}) + "\n")
        served = self.publisher.served_version()
        if self.publisher.stubs:  # or what a server restarted beside this learner will load (it may not answer yet:
            # tars up relaunches it with the newest weights/vN, written before any server is told of them)
            served = max(served, self.publisher.newest_written())
        done = self.version >= self.cfg.max_versions  # killed after its last update (in the final export, say)
        if served >= self.version and (served or self.version) and not done:
            # A resume behind what the servers serve (the killed learner published past its last checkpoint): its
            # weights go out as served + 1, so no version number names two sets of weights (the servers refused the
            # old numbers as not newer, and kept the dead learner's weights under labels the new one reused).
            log.warning("resuming at version %d behind the servers' %d: continuing at %d", self.version, served,
                        served + 1)
            self.staleness.skip_versions(served + 1 - self.version)
            self.version = served + 1
            if self.dist.world > 1:
                self.dist.broadcast(f"{SET_VERSION}{self.version}")  # the other ranks' losses read it too
        self.staleness.set_version(self.version)
        if not (done and served >= self.version):  # (served there: the last version, these weights)
            self._publish(self.version)  # after a resume: bring the servers to the checkpoint's weights
        while not self.stop.is_set() and self.version < self.cfg.max_versions:
            self._alive_t = time.monotonic()
            batch = self.admission.collect(self.lcfg.batch_size, self.version, self.stop, on_idle=self._idle,
                                           on_tick=self._keepalive)
            if batch is None:
                break
            links, unlinked = telemetry.links_from(tr.traceparent for tr in batch)  # sampled episodes only
            attrs = {"tars.version": self.version, "tars.batch": len(batch), "tars.links_dropped": unlinked or None}
            with telemetry.span("learner.step", attributes={k: v for k, v in attrs.items() if v is not None},
                                links=links) as step_span:
                t0 = time.perf_counter()
                m = self._update(self.dist.broadcast(batch))
                record_staleness(batch, self.version, self.staleness, self.staleness_hist)
                self.version += 1
                publish_s = self._publish(self.version)
                self.staleness.set_version(self.version)
                masked = self.admission.take_masked()  # (a GRPO group's are consumed with it, here)
                self.receiver.mark_consumed([*(tr.id for tr in batch), *masked])
                rec = {"version": self.version, "ids": [tr.id for tr in batch], "masked": masked}
                if m.get("nonfinite_steps"):  # the weights did not move: the batch is consumed, its update skipped
                    self.counters["nonfinite_updates"] += 1
                    rec["nonfinite_steps"] = m["nonfinite_steps"]
                self.trained_log.write(json.dumps(rec) + "\n")
                self.counters["trained"] += len(batch)
                m.update(version=self.version, t=time.time(), step_s=time.perf_counter() - t0, publish_s=publish_s,
                         **batch_figures(batch, self.version), queue=self.receiver.qsize(),
                         ids=[tr.id for tr in batch])  # ids: audit of what each version trained on
                self.last_metrics = m
                self.metrics_log.write(json.dumps(m) + "\n")
                telemetry.set_attrs(step_span, **{"tars.new_version": self.version, "tars.step_s": m["step_s"],
                                                  "tars.max_staleness": m["max_staleness"]})
            self.step_hist.record(m["step_s"])
            if self.version % self.lcfg.checkpoint.every == 0 or self.checkpoint_requested.is_set():
                self.checkpoint()
        try:  # (under fsdp the other ranks gather with the final checkpoint and export, then stop)
            self.checkpoint()
            # Masked after the last update: covered by the final checkpoint, so recorded as a partial next version.
            self.trained_log.write(json.dumps({"version": self.version + 1, "ids": [], "partial": True,
                                               "masked": self.admission.take_masked()}) + "\n")
            try:
                with self._gathered_policy():
                    export(self.policy, self.model_dir, self.run / "final")
            except OSError as e:  # a full disk, an unwritable or occupied path: said plainly, and the learner fails
                log.error("final export to %s failed: %s", self.run / "final", e)
                raise
            log.info("exported the final policy to %s", self.run / "final")
        finally:
            self.dist.broadcast(None)  # the other ranks stop too

    def _gathered_policy(self):
        """Where rank 0 writes the policy: under fsdp the other ranks gather its shards with it (collective)."""
        if not self.trainer.fsdp:
            return contextlib.nullcontext()
        self.dist.broadcast(GATHER_POLICY)
        return gathered(self.policy)

    def _publish(self, version: int) -> float:
        with self._gathered_policy():
            return self.publisher.publish(version)

    def _idle(self) -> None:
        """No arrival for a poll interval (actors paused, say): a checkpoint asked for meanwhile is taken now."""
        if self.checkpoint_requested.is_set():
            self.checkpoint()

    def _keepalive(self) -> None:
        """Waiting for a batch with other ranks: tell them so every few seconds (well inside learner.dist_timeout_s)."""
        if self.dist.world > 1 and time.monotonic() - self._alive_t >= min(5.0, self.lcfg.dist_timeout_s / 4):
            self.dist.broadcast(KEEPALIVE)
            self._alive_t = time.monotonic()

    def _update(self, batch) -> dict:
        return self.updater.update(batch, self.version)

    def follow(self) -> None:
        """Ranks > 0: train on each batch rank 0 broadcasts, until it broadcasts None."""
        while True:
            batch = self.dist.broadcast(None)
            if batch is None:
                return
            if batch == KEEPALIVE:  # rank 0 still waits for a batch
                continue
            if batch == GATHER_POLICY:  # learner.parallel=fsdp: rank 0 publishes, exports or checkpoints
                with gathered(self.policy):
                    pass
                continue
            if batch == GATHER_CHECKPOINT:
                self.checkpointer.gather()
                continue
            if isinstance(batch, str) and batch.startswith(SET_VERSION):  # rank 0 resumed behind the servers
                self.version = int(batch[len(SET_VERSION):])
                continue
            self._update(batch)
            self.version += 1

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        self.checkpoint_requested.clear()
        # The admission ledger without what Admission still holds (kept, not consumed: received again after a
        # restart and counted then), and the configured eta beside the live one (`tars ctl set eta`).
        ledger = self.staleness.state_dict()
        ledger.update(accepted=ledger["accepted"] - self.admission.held(), eta_config=self.lcfg.staleness.eta,
                      rejected=ledger["rejected"] - self.admission.unsettled())  # (counted again when they come)
        meta = {"version": self.version, "value_pretrain_left": self.updater.value_pretrain_left,
                "value_pretrain_evs": list(self.updater.evs),  # the early stop's window goes on after a resume
                "staleness": ledger, **self.receiver.checkpoint_state(), "t": time.time(),
                # Ids kept out of the loss, consumed (so not received again) but recorded in trained.jsonl only with
                # the next update, above this version: a resume here drops that record ({"resume": v}), so the
                # resumed learner records them again. Before, they were in no record of the lineage (lost).
                "masked_unrecorded": list(self.admission.masked)}
        state = None
        if self.trainer.fsdp:  # the other ranks gather the sharded models and optimizers with rank 0
            self.dist.broadcast(GATHER_CHECKPOINT)
            state = self.checkpointer.gather()
        try:
            path = self.checkpointer.save(meta, state)
        except OSError as e:  # a full disk, say: the last whole checkpoint stays, training goes on, the next one retries
            self.checkpointer.discard_partial()  # what it wrote of this one would keep the disk full
            self.counters["checkpoint_failures"] += 1
            self.checkpoint_error = {"version": self.version, "t": time.time(), "error": f"{type(e).__name__}: {e}"}
            log.error("checkpoint at version %d failed, training goes on from the last whole checkpoint %s and tries "
                      "again at the next one (learner.checkpoint.every): %s", self.version,
                      self.last_checkpoint.get("path", "(none)"), e)
            return
        self.checkpoint_error = None
        try:
            self.receiver.compact_wal()
        except OSError as e:  # a full disk: the checkpoint stands; the WAL keeps consumed entries (never replayed)
            self.counters["wal_compaction_failures"] += 1
            log.error("compacting the trajectory WAL after the checkpoint at version %d failed (tried again at the next "
                      "one): %s", self.version, e)
        self.receiver.commit(frozenset(meta["consumed_ids"]))  # checkpoint durability: actors may now forget these
        self.last_checkpoint = {"version": self.version, "t": meta["t"], "path": str(path)}

    def _load_checkpoint(self, src: pathlib.Path) -> set[str]:
        meta = self.checkpointer.load(src)
        self.version = int(meta["version"])
        if self.critic is not None and not self.checkpointer.critic_restored:  # a GRPO checkpoint resumed under ppo
            log.warning("checkpoint %s holds no critic (learner.algo was grpo): a fresh critic, %d value pretraining "
                        "updates first", src, self.updater.value_pretrain_left)  # (Updater: the configured steps)
        elif self.critic is not None:
            self.updater.value_pretrain_left = int(meta.get("value_pretrain_left", 0))
            self.updater.evs.extend(float(x) for x in meta.get("value_pretrain_evs", []))
        if "staleness" in meta:  # the admission bound stays where it was (accepted counts what was trained)
            ledger = dict(meta["staleness"], version=self.version)
            if ledger.get("eta_config", self.lcfg.staleness.eta) != self.lcfg.staleness.eta:
                ledger.pop("eta", None)  # the configured eta changed since: the new configuration wins
            self.staleness.load_state_dict(ledger)
        self._masked_unrecorded = [str(t) for t in meta.get("masked_unrecorded", [])]
        self._stream_ids = {k: meta[k] for k in ("confirmed_ids", "id_owners") if k in meta}  # (not in older ones)
        log.info("resumed from checkpoint %s at version %d (%d trajectories consumed)", src, self.version,
                 len(meta["consumed_ids"]))
        return set(meta["consumed_ids"])

    # ---- control ---------------------------------------------------------------------------------------------
    def status(self) -> dict:
        return {"version": self.version, "counters": dict(self.counters), "staleness": self.staleness.stats(),
                "staleness_histogram": self.staleness.histogram(), "stream": self.receiver.stats(),
                "queue": self.receiver.qsize(), "last": self.last_metrics, "last_checkpoint": self.last_checkpoint,
                "checkpoint_error": self.checkpoint_error, "publish_error": self.publisher.error}

    def control(self):
        return learner_control(self.status, lambda: self.version, self.staleness, self.checkpoint_requested,
                               lambda: self.last_checkpoint, self.stop)


def resume_from(run: pathlib.Path, resume: bool, fresh_if_none: bool) -> pathlib.Path | None:
    """The checkpoint directory a (re)start continues from, or None for a fresh start at version 0."""
    if not resume:
        return None
    ckpt = locate(run)  # CheckpointError: one is there but none is whole
    if ckpt is None and not fresh_if_none:
        raise CheckpointError(f"--resume: no checkpoint in {run} (no ckpt/ or ckpt.old/); use --resume-or-fresh to "
                              "start at version 0 when there is none")
    if ckpt is None:
        log.info("no checkpoint in %s yet: starting fresh at version 0 (--resume-or-fresh)", run)
    return ckpt


def check_bind(cfg: RunConfig) -> None:
    """core.auth.check_listener for the trajectory stream: off loopback only with CURVE and an allowlist of actor
    keys (or curve_allow_any_client). (The ControlService binds 127.0.0.1 and checks control.auth_token.)"""
    s = cfg.learner.stream
    if s.curve_client_keys and not s.curve_secret_key:
        raise ConfigError("learner.stream.curve_client_keys is set but learner.stream.curve_secret_key is not: the "
                          "allowlist authenticates CURVE clients, so the stream needs its CURVE keypair")
    allow = s.curve_client_keys or ("any" if s.curve_allow_any_client else "")
    auth.check_listener("learner", "the trajectory stream", s.host, {
        "learner.stream.curve_secret_key (CURVE)": s.curve_secret_key,
        "learner.stream.curve_client_keys (the actors' public keys; or curve_allow_any_client=true)": allow})
    auth.check_listener("learner", "the ControlService", CONTROL_HOST, {"control.auth_token": cfg.control.auth_token})


def main(cfg: RunConfig, run_dir: str, model_dir: str, inference: list[str], ready_file: str | None = None,
         resume: bool = False, fresh_if_none: bool = False) -> int:
    proc.die_with_parent()
    try:  # a bad learner.device / precision, an open stream off loopback, or no checkpoint to resume: one line,
        # before any model loads
        check_bind(cfg)
        device = resolve_device(cfg.learner.device)
        resolve_precision(cfg.learner.precision, device)
        resume_from(pathlib.Path(run_dir), resume, fresh_if_none)
    except (ConfigError, CheckpointError, auth.InsecureBind) as e:
        print(f"tars learner: {e}", file=sys.stderr)
        return 2
    # learner.device decides the backend: NCCL for CUDA (each rank on cuda:LOCAL_RANK), gloo on the CPU.
    dist = from_accelerate(device=device, timeout_s=cfg.learner.dist_timeout_s)
    if dist.accelerator is not None and dist.is_main:  # accelerate's --mixed_precision is not what decides
        want = "bf16" if resolve_precision(cfg.learner.precision, device) is not None else "no"
        if str(dist.accelerator.mixed_precision) != want:
            log.warning("accelerate --mixed_precision %s is ignored: learner.precision=%s decides (%s here)",
                        dist.accelerator.mixed_precision, cfg.learner.precision, want)
    try:
        learner = Learner(cfg, run_dir, model_dir, inference, resume=resume, dist=dist, fresh_if_none=fresh_if_none)
    except CheckpointError as e:  # train_state.pt refused (not plain tensors), say
        print(f"tars learner: {e}", file=sys.stderr)
        return 2
    if not dist.is_main:
        # SIGTERM / ctrl-c reach every rank (the launcher forwards them, a terminal signals the process group): rank 0
        # alone decides to stop, finishes the update, checkpoints and exports with these ranks (fsdp gathers need
        # them), then broadcasts None and they return. If rank 0 dies instead, their broadcast fails: they exit non-0.
        # The SIGTERM of die_with_parent (the launcher is gone) still ends them.
        parent = os.getppid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143) if os.getppid() != parent else None)
        learner.follow()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: learner.stop.set())
    address = learner.receiver.start()
    info = {"role": "learner", "stream": address, "version": learner.version}
    ctl = serve_control(learner.control(), cfg.control.auth_token, learner.stop, info)
    proc.write_ready(ready_file, {**info, "address": info["control"]})
    try:
        learner.train()
    finally:
        learner.stop.set()
        learner.receiver.stop()
        ctl.join(timeout=5.0)
    return 0
