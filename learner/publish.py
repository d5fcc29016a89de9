"""Weight publishing: each new policy version goes to every inference server, and to disk in HF layout.

learner.publish.mode picks how the weights reach the servers (see docs/benchmarks.md for the measured cost):
- shm: the state dict is written once into a segment in /dev/shm (core/weights_shm.py) and every server is told
  its name (UpdateWeights.shm); the server maps it, checks and installs, and the segment is unlinked here when all
  have answered. Same host only. Segments are named per run; a learner removes its run's leftovers when it starts.
  A segment that cannot be written (/dev/shm full) sends that version by disk (counted: publish_shm_fallbacks).
- stream: UpdateWeightsStream, raw tensor pieces over gRPC (core/weights_stream.py): no shared disk or memory needed.
- disk: weights/v{version} is written (temporary name, then a rename: a server never loads half a version) and
  every server is told its path.
- auto: shm when every server address is loopback and /dev/shm is writable, else disk.
With the policy on a GPU, one device-to-host copy per version serves the servers and the disk copy alike (HostCopy:
pinned buffers kept between publishes, learner.publish.host_copy; else one unpinned copy per publish).
Whatever the mode, weights/v{version} is written (after the servers answered in the memory modes) because a
restarted server loads the newest one, and all but the last `learner.publish.keep_versions` are pruned (with the
leftovers of saves a killed learner interrupted, never counted as versions: prune). A weights/vN that cannot be written
(a full disk) fails that publish, not the learner: counted (publish_write_failures), shown (status publish_error), its
partial directory removed, the previous versions left in place; in disk mode no server is told of it (they keep
serving the previous version), in the memory modes the servers still install it from memory. Training goes on, and
the next version is published as usual. Each
version carries the starting model directory's tokenizer files (core.chat.copy_tokenizer_files), so it is a model
directory of its own, as is the final export.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import pathlib
import re
import shutil
import time

import grpc
import torch

from core import auth, rpc, weights_shm
from core.model_files import newest_published
from core.proc import pid_alive
from core.weights_stream import chunks
from core.config_learner import PublishConfig
from core.v1 import inference_pb2, inference_pb2_grpc
from learner.checkpoint import write_failure
from learner.policy import TrainPolicy

log = logging.getLogger("tars.learner")

MAX_MESSAGE_BYTES = 512 << 20  # UpdateWeights may carry inline weights


def publish_weights(policy: TrainPolicy, wdir: pathlib.Path, version: int, stubs, keep: int, counters=None,
                    timeout_s: float = 60.0, tokenizer_from: pathlib.Path | None = None) -> float:
    """weights/v{version} in HF layout (write, then rename), every server told to load it, old versions pruned.

    Returns the seconds from the start of the write until the last server answered (it serves the new weights then).
    A failed write (a full disk) raises OSError, with no partial directory left and no server told.
    """
    t0 = time.perf_counter()
    wdir.mkdir(exist_ok=True)
    path = wdir / f"v{version:06d}"
    with write_failure(f"weights/{path.name}"):  # save_hf removes its temporary directory on the way out
        policy.save_hf(path, tokenizer_from=tokenizer_from)
    for stub in stubs:
        try:
            stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=version, path=str(path)), timeout=timeout_s)
        except Exception as e:  # a dead replica must not stop training; it reloads the latest on restart
            if counters is not None:
                counters["publish_failures"] += 1
            log.warning("publish v%d failed: %s", version, e)
    prune(wdir, keep)
    return time.perf_counter() - t0


_VERSION = re.compile(r"v(\d+)")
_LEFTOVER = re.compile(r"v\d+\.(?:tmp|old)(\d+)")  # a save in progress, or one interrupted (core save_hf)


def prune(wdir: pathlib.Path, keep: int) -> list[str]:
    """Keep the newest `keep` whole versions (vN, numerically) and remove the older ones, and the leftovers
    (vN.tmpPID, vN.oldPID) of saves whose process is gone or is this one (its save has ended when this runs); they are
    never counted as versions. Another live process's save in progress is left alone. Returns the names removed."""
    versions, gone = [], []
    for d in wdir.iterdir() if wdir.is_dir() else ():
        if m := _VERSION.fullmatch(d.name):
            versions.append((int(m[1]), d))
        elif (m := _LEFTOVER.fullmatch(d.name)) and (int(m[1]) == os.getpid() or not pid_alive(int(m[1]))):
            gone.append(d)
    gone += [d for _, d in sorted(versions)[: -max(1, keep)]]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [d.name for d in gone]


class HostCopy:
    """The policy's weights on the host for the length of one publish (`with host.of(policy):` makes hf_state_dict,
    so save_hf, the segment and the stream, answer host tensors): one device-to-host copy per version, not one per
    consumer. pinned: keep page-locked buffers between publishes (allocated at the first, reallocated if a shape
    changes), filled by non-blocking copies and one synchronise; else unpinned copies freed after the publish. A
    policy already on the CPU (unless always: tests), or gathered (FSDP's gathered(), which answers its own host
    dict), is left as is."""

    def __init__(self, pinned: bool = True, always: bool = False):
        self.pinned, self.always = pinned, always
        self.bufs: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def of(self, policy: TrainPolicy):
        sd = None if getattr(policy, "_gathered", None) is not None else policy.hf_state_dict()
        if sd is None or (not self.always and all(v.device.type == "cpu" for v in sd.values())):
            yield
            return
        host = {}
        for k, v in sd.items():
            if not self.pinned:
                host[k] = v.to("cpu", copy=True)
                continue
            b = self.bufs.get(k)
            if b is None or b.shape != v.shape or b.dtype != v.dtype:
                b = self.bufs[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=torch.cuda.is_available())
            host[k] = b.copy_(v, non_blocking=True)
        for dev in {v.device for v in sd.values() if v.device.type == "cuda"}:
            torch.cuda.synchronize(dev)  # the non-blocking copies have landed
        policy._gathered = host
        try:
            yield
        finally:
            policy._gathered = None


def _disk_mode_reason(inference: list[str]) -> str:
    """Why auto mode cannot use shared memory with these servers ("" when it can)."""
    if not weights_shm.available():
        return f"{weights_shm.SHM_DIR} is not writable"
    far = [a for a in inference if not auth.is_loopback(a.rsplit(":", 1)[0].strip("[]"))]
    return f"servers not on loopback: {far[:3]}" if far else ""


class Publisher:
    """The learner's publisher: its policy, run_dir/weights, one stub per inference server and the publish mode."""

    def __init__(self, policy: TrainPolicy, run: pathlib.Path, inference: list[str], auth_token: str, cfg: PublishConfig,
                 counters: collections.Counter, tokenizer_from: pathlib.Path | None = None):
        self.policy, self.wdir, self.cfg, self.counters = policy, run / "weights", cfg, counters
        self.tokenizer_from = tokenizer_from
        self.stubs = [inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(a, auth_token, MAX_MESSAGE_BYTES))
                      for a in inference]
        self.mode = cfg.mode
        if self.mode == "auto":
            why = _disk_mode_reason(inference)
            self.mode = "disk" if why else "shm"
            if why:
                log.info("learner.publish.mode=auto: disk (%s)", why)
        self.host = HostCopy(pinned=cfg.host_copy)
        self.error: dict | None = None  # the last failed weights/vN write, until one succeeds (status publish_error)
        if gone := [n for n in prune(self.wdir, cfg.keep_versions) if not _VERSION.fullmatch(n)]:
            log.warning("removed %d leftovers of interrupted weight saves: %s", len(gone), gone[:3])
        self.shm_prefix = weights_shm.run_prefix(run)
        if self.mode == "shm" or weights_shm.available():
            gone = weights_shm.clean_stale(self.shm_prefix)  # a learner killed mid-publish left these
            if gone:
                log.warning("removed %d stale weight segments of this run: %s", len(gone), gone[:3])

    def served_version(self, timeout_s: float = 10.0) -> int:
        """The highest version any inference server serves (GetVersion); -1 when none answers."""
        got = -1
        for stub in self.stubs:
            try:
                got = max(got, int(stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=timeout_s).version))
            except grpc.RpcError as e:
                log.warning("GetVersion: %s", e.details() if hasattr(e, "details") else e)
        return got

    def newest_written(self) -> int:
        """The highest version whose weights/vN this run wrote whole (a write in progress has a temporary name); -1
        when none."""
        w = newest_published(self.wdir)
        return w[1] if w else -1

    def publish(self, version: int) -> float:
        """Bring every inference server to `version` (self.mode) and write weights/v{version}; seconds until the
        last server answered (it serves the new weights then)."""
        if version == 0:
            return 0.0  # the servers started from model_dir at version 0
        t0 = time.perf_counter()
        with self.host.of(self.policy):
            return time.perf_counter() - t0 + self._publish(version)  # the device-to-host copy counts too

    def _write(self, version: int, stubs) -> None:
        """publish_weights to `stubs`; a write that fails (a full disk) is counted and shown, and training goes on."""
        try:
            publish_weights(self.policy, self.wdir, version, stubs, self.cfg.keep_versions, self.counters,
                            self.cfg.timeout_s, self.tokenizer_from)
        except OSError as e:
            self.counters["publish_write_failures"] += 1
            self.error = {"version": version, "t": time.time(), "error": f"{type(e).__name__}: {e}"}
            log.error("publish v%d: cannot write %s (%s); %s, training goes on and the next version is published",
                      version, self.wdir / f"v{version:06d}", e,
                      "the servers keep the previous version" if stubs else "a restarted server loads an older one")
        else:
            self.error = None

    def _publish(self, version: int) -> float:
        if self.mode == "disk":
            t0 = time.perf_counter()
            self._write(version, self.stubs)
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        sd = self.policy.hf_state_dict()
        name = ""
        if self.mode == "shm":
            try:
                name = weights_shm.write_segment(self.shm_prefix, version, sd)
            except OSError as e:  # /dev/shm full or gone: this version goes by disk, as the fallback
                self.counters["publish_shm_fallbacks"] += 1
                log.warning("publish v%d: cannot write the shared-memory segment (%s); publishing from disk", version, e)
                self._write(version, self.stubs)
                return time.perf_counter() - t0
        try:
            if name:
                req = inference_pb2.UpdateWeightsRequest(version=version, shm=name)
                calls = [stub.UpdateWeights.future(req, timeout=self.cfg.timeout_s) for stub in self.stubs]
            else:
                calls = [stub.UpdateWeightsStream.future(chunks(version, sd), timeout=self.cfg.timeout_s) for stub in self.stubs]
            done: list[float] = []
            for c in calls:
                c.add_done_callback(lambda _c: done.append(time.perf_counter()))
            # the copy a restarted server loads (tars/topology.py relaunch), written while the servers install
            self._write(version, [])
            for c in calls:
                try:
                    c.result(timeout=self.cfg.timeout_s + 5.0)  # the call has its own deadline too
                except Exception as e:  # as in publish_weights: a dead replica must not stop training
                    self.counters["publish_failures"] += 1
                    log.warning("publish v%d (%s) failed: %s", version, self.mode, e)
        finally:
            if name:
                weights_shm.unlink(name)
        deadline = time.perf_counter() + 1.0  # done callbacks may trail result() by a moment
        while len(done) < len(calls) and time.perf_counter() < deadline:
            time.sleep(0.001)
        return (max(done) if done else time.perf_counter()) - t0


def export(policy: TrainPolicy, model_dir: pathlib.Path, path: pathlib.Path) -> None:
    """The final policy in HF layout with the tokenizer files of the starting model: a model directory of its own."""
    policy.save_hf(path, tokenizer_from=model_dir)
